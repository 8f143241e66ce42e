"""Run the GPU tests (pytest -m gpu) on this machine and record the outcome.

    python -m bench.gpu_tests [--out FOLDER]

Writes gpu_tests.json (date, machine, command, pass/fail counts, each test's
outcome and seconds) and gpu_tests.log (pytest's own output)."""
import os
import re
import signal
import subprocess
import sys

from bench.common import OUT, ROOT, record, require_gpus
from multi_gpu.cli import Parser


def main():
    parser = Parser(about=__doc__)
    parser.add_argument("--out", default=OUT, help="folder for the results")
    parser.add_argument("-k", metavar="EXPRESSION",
                        help="only the tests pytest's -k selects (a device call has ten minutes)")
    args = parser.parse_args()
    require_gpus()  # before anything is written: the committed record stays as it was
    # one test at a time, whatever pytest.ini says: they share the GPUs
    pytest = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-s", "-rA", "-p",
              "no:cacheprovider", "-o", "timeout=240", "-o", "addopts=", "--durations=0"]
    pytest += ["-k", args.k] if args.k else []
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "gpu_tests.log")
    # A time limit's SIGTERM reaches pytest too (one process group): it stops
    # its runs and exits, and what ran so far is still recorded here.
    signal.signal(signal.SIGTERM, lambda *_: None)
    with open(log_path, "w") as f:  # as it runs: a run cut short keeps its log
        out = subprocess.run(pytest + ["tests/test_gpu.py"], cwd=ROOT, stdout=f,
                             stderr=subprocess.STDOUT, text=True)
    with open(log_path) as f:
        log = f.read()
    # pytest's closing summary (-rA): one "OUTCOME test-id" line per test
    outcomes = {test: outcome for outcome, test in
                re.findall(r"^(PASSED|FAILED|SKIPPED|ERROR) (tests/\S+)", log, re.M)}
    # and its last line's counts ("13 passed, 2 skipped"): -rA names a skip by
    # its reason, not by its test
    last = dict((kind, int(n)) for n, kind in
                re.findall(r"(\d+) (passed|failed|skipped|error)", log.strip().splitlines()[-1]))
    counts = {k: last.get(k, 0) for k in ("passed", "failed", "skipped", "error")}
    # --durations=0: "12.34s call     tests/...", what each test's body took
    seconds = {test: float(s) for s, test in
               re.findall(r"^([\d.]+)s call\s+(tests/\S+)", log, re.M)}
    record("gpu_tests", args.out, pytest=" ".join(pytest[1:]), returncode=out.returncode,
           counts=counts, tests=outcomes, seconds=seconds,
           notes=re.findall(r"^.*launcher stopped .*$", log, re.M))
    print(log[-2000:])
    sys.exit(out.returncode)


if __name__ == "__main__":
    main()
