"""The Quick start's first run, cold and warm, and its step speed, per CPU backend.

    python -m bench.first_run                                    # out/first_run_cpu.json
    python -m bench.first_run --backends jax --cold-runs 1 --warm-runs 1 --speed-runs 1
    python -m bench.first_run --out bench/results/first_run_cpu  # a result to commit

A newcomer's first ``python dual_mlp.py`` is mostly a compile.  For each of
PyTensor's two CPU backends, the default (JAX: XLA compiles the graph) and
the one a flag away (``THEANO_FLAGS=mode=NUMBA``), this runs the Quick start
as a newcomer would, and times it from outside, interpreter start-up included:

* cold: in a private, empty ``HOME`` (PyTensor's and JAX's caches live
  there) with private Numba and temporary folders, as on a fresh machine;
* warm: the same command again, ``--warm-runs`` times, the caches now full;
* step speed: ``--speed-epochs`` epochs, warm, the backends taking turns
  ``--speed-runs`` times: microseconds per step of the pair of workers, from
  each run's ``--json`` summary (the median is the figure).

Every figure is the median of its runs; the JSON keeps each run.  No GPU is
used (the launcher is asked for ``cpu cpu``).  ``--tables-from JSON``
regenerates the README tables from such a file.
"""
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import OUT, ROOT, measured_by, parse_args, prog, record, show
from multi_gpu.cli import Parser, positive_int

BACKENDS = {"jax": ("JAX (the default)", {}),
            "numba": ("Numba (THEANO_FLAGS=mode=NUMBA)", {"THEANO_FLAGS": "mode=NUMBA"})}


def private_folders(tmp, name):
    """A fresh HOME, Numba cache and TMPDIR under ``tmp``: a machine that never ran the demo."""
    folders = {key: os.path.join(tmp, name, key.lower()) for key in ("HOME", "NUMBA_CACHE_DIR",
                                                                     "TMPDIR")}
    for folder in folders.values():
        os.makedirs(folder)
    return folders


def quick_start(env, json_path, epochs=None):
    """One ``python dual_mlp.py cpu cpu`` as the Quick start runs it: its
    wall seconds from outside, the compile seconds it printed, its summary."""
    cmd = [sys.executable, "dual_mlp.py", "cpu", "cpu", "--json", json_path]
    if epochs:
        cmd += ["--epochs", str(epochs)]
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, **env))
    wall = time.perf_counter() - start
    if out.returncode != 0:
        sys.exit(f"{prog()}: error: {' '.join(cmd)} failed ({out.returncode}):\n"
                 f"{out.stderr[-2000:]}")
    compiled = re.search(r"\.\.\. (?:compiled|loaded from .*?) in ([\d.]+) s", out.stdout)
    with open(json_path) as f:
        summary = json.load(f)
    return dict(wall_s=round(wall, 3), compile_s=float(compiled.group(1)) if compiled else None,
                step_us=round(summary["step_us"]["step"], 1), backend=summary["backend"],
                test_error=summary["test_error"])


def measure(args, tmp):
    backends = dict(BACKENDS[b] for b in args.backends)
    homes, runs = {}, {name: dict(cold=[], warm=[], speed=[]) for name in backends}
    for b, (name, flags) in enumerate(backends.items()):
        for i in range(args.cold_runs):  # each cold run in folders of its own
            homes[name] = private_folders(tmp, f"cold{b}-{i}")
            runs[name]["cold"].append(quick_start(dict(homes[name], **flags),
                                                  os.path.join(tmp, "run.json")))
            print(f"{name}: cold {runs[name]['cold'][-1]['wall_s']:.1f} s", flush=True)
        env = dict(homes[name], **flags)  # the last cold run's folders: its caches are full
        for _ in range(args.warm_runs):
            runs[name]["warm"].append(quick_start(env, os.path.join(tmp, "run.json")))
            print(f"{name}: warm {runs[name]['warm'][-1]['wall_s']:.1f} s", flush=True)
    for _ in range(args.speed_runs):  # the backends take turns: a busy moment hits both
        for name, flags in backends.items():
            runs[name]["speed"].append(quick_start(dict(homes[name], **flags),
                                                   os.path.join(tmp, "run.json"),
                                                   args.speed_epochs))
            print(f"{name}: {runs[name]['speed'][-1]['step_us']:.0f} us per step", flush=True)
    figures = []
    for name, r in runs.items():
        figures.append(dict(
            backend=name, linker=r["cold"][0]["backend"],
            cold_wall_s=statistics.median(x["wall_s"] for x in r["cold"]),
            cold_compile_s=statistics.median(x["compile_s"] for x in r["cold"]),
            warm_wall_s=statistics.median(x["wall_s"] for x in r["warm"]),
            step_us=statistics.median(x["step_us"] for x in r["speed"]),
            test_error=r["cold"][0]["test_error"], runs=r))
    base = {f["backend"]: f["step_us"] for f in figures}.get(BACKENDS["numba"][0])
    for f in figures:  # against Numba's step, the CPU default before JAX, where it ran
        f["speed_vs_numba"] = base and round(base / f["step_us"], 3)
    return figures


def table(document):
    lines = [f"{measured_by(document)} "
             f"({document['machine']['cpu']}, {document['cores']} cores, Python "
             f"{document['machine']['python']}); each figure the median of "
             f"{document['cold_runs']} cold, {document['warm_runs']} warm and "
             f"{document['speed_runs']} timed runs of {document['speed_epochs']} epochs.", "",
             "| CPU backend | first run (cold caches) | of which compiling | second run | "
             "time per step | step speed against Numba |",
             "| --- | --- | --- | --- | --- | --- |"]
    for f in document["figures"]:
        against = f"{f['speed_vs_numba']:.2f}x" if f["speed_vs_numba"] else "(Numba not run)"
        lines.append(f"| {f['backend']} | {f['cold_wall_s']:.1f} s | {f['cold_compile_s']:.1f} s "
                     f"| {f['warm_wall_s']:.1f} s | {f['step_us'] / 1e3:.2f} ms | {against} |")
    return "\n".join(lines)


def main():
    p = Parser(about=__doc__)
    p.set_defaults(cpu=True)  # a CPU benchmark: no GPU asked for
    p.add_argument("--cold-runs", type=positive_int, default=2,
                   help="first runs per backend, each in fresh private folders (default: "
                        "%(default)s)")
    p.add_argument("--warm-runs", type=positive_int, default=3,
                   help="second runs per backend (default: %(default)s)")
    p.add_argument("--speed-runs", type=positive_int, default=3,
                   help="timed runs per backend, taking turns (default: %(default)s)")
    p.add_argument("--speed-epochs", type=positive_int, default=30,
                   help="epochs of each timed run (default: %(default)s)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                   help="which CPU backends (default: %(default)s); Numba's first compile takes "
                        "tens of seconds")
    p.add_argument("--out", default=OUT, help="folder for first_run_cpu.json")
    args = parse_args(p, table)
    try:
        with tempfile.TemporaryDirectory(prefix="first-run-") as tmp:
            figures = measure(args, tmp)
    except KeyboardInterrupt:  # its medians need every run: a run cut short has none
        sys.exit(f"{prog()}: interrupted: nothing was recorded (its figures are medians of "
                 "runs it had not finished)")
    path = record("first_run_cpu", args.out, cpu=True, block="first_run.py", cores=os.cpu_count(),
                  cold_runs=args.cold_runs, warm_runs=args.warm_runs, speed_runs=args.speed_runs,
                  speed_epochs=args.speed_epochs, figures=figures)
    show(path, table)


if __name__ == "__main__":
    main()
