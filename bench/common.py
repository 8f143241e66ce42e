"""What every benchmark script records beside its figures: when, where, how.

The benchmarks are modules of this folder, run from the repository's root
as ``python -m bench.NAME``: they import the demo's scripts and its package
``multi_gpu`` by their names."""
import atexit
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")  # the committed ones, which the READMEs cite
OUT = os.path.join(ROOT, "out")  # a user's, by default: git ignores it
STARTED = time.monotonic()  # the benchmark's start, near enough: it imports this first
LOAD_AT_START = os.getloadavg()[0]  # what else ran here as it started (1 minute's average)
SCRIPT = os.path.basename(sys.argv[0])  # the benchmark that runs, for its messages: accuracy.py


def machine():
    """The CPU and the cores this process may use; the GPUs (nvidia-smi) and
    their link matrix."""
    def ask(*cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except OSError:
            return None
    return dict(host=platform.node(), cpu=platform.processor() or platform.machine(),
                cores=len(os.sched_getaffinity(0)),
                python=platform.python_version(), gpus=ask("nvidia-smi", "-L"),
                topology=ask("nvidia-smi", "topo", "-m"),
                driver=ask("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"))


def busy_gpus():
    """The processes that hold a GPU now (nvidia-smi; none without it)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except OSError:
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def require_gpus():
    """Stop in one line, exit 2, where no GPU is here (``nvidia-smi -L`` lists
    none): a run that measures nothing must not replace a committed result.
    (Asks nvidia-smi, not CUDA: CUDA started here would see every GPU.)"""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                timeout=30).stdout
    except OSError:
        listed = ""
    if "GPU" not in listed:
        print(f"{prog()}: error: no GPU here (nvidia-smi lists none): "
              "nothing was measured and no result was written; on a CPU, the benchmarks "
              "that have one take --cpu", file=sys.stderr)
        sys.exit(2)


def refuse_busy_gpus():
    """Stop before measuring beside another process on the GPUs: its figures
    would not be this system's (seen: a test run left training made every
    reference several times slower)."""
    busy = busy_gpus()
    if busy:
        sys.exit(f"{prog()}: error: the GPUs are busy (pid, name, "
                 f"memory: {'; '.join(busy)}): stop those processes first; figures measured "
                 "beside them would be wrong")


def keep_to_one_device(cpu):
    """JAX kept to the CPU or GPU 0 (before JAX starts) and PyTensor's flags
    set as the demo's scripts set them."""
    if cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    else:
        os.environ.update(CUDA_VISIBLE_DEVICES="0", JAX_PLATFORMS="cuda")
    import multi_gpu.flags as flags  # noqa: F401  (first: float32, as the scripts run)


def one_device(cpu):
    """The one device of a one-device benchmark, the CPU or GPU 0 (see
    ``keep_to_one_device``); JAX starts here."""
    keep_to_one_device(cpu)
    from multi_gpu.devices import CudaDevice, JaxDevice
    return JaxDevice() if cpu else CudaDevice(0)


def prog():
    """The running benchmark as typed, for its messages: ``python -m bench.compare``."""
    return f"python {' '.join(invocation())}"


def invocation():
    """How the running script was started: ``-m bench.compare``, say."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return ["-m", spec.name] if spec else [os.path.relpath(sys.argv[0], ROOT)]


def record(name, out_dir, **results):
    """Write ``<out_dir>/<name>.json`` with the date, machine, commit and command
    line, the seconds the benchmark has run so far (what its command costs),
    and the machine's load (1 minute's average) as it started and now, where
    the benchmark records none of its own (``results`` win)."""
    from multi_gpu.records import code_commit, write_json
    os.makedirs(out_dir, exist_ok=True)
    document = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    command=shlex.join(["python", *invocation(), *sys.argv[1:]]),
                    commit=code_commit(), machine=machine(),
                    wall_s=round(time.monotonic() - STARTED, 1),
                    load=dict(start=round(LOAD_AT_START, 2), end=round(os.getloadavg()[0], 2)))
    document.update(results)
    path = os.path.join(out_dir, f"{name}.json")
    write_json(path, document)  # whole, or the file as it was
    print(f"wrote {path}")
    return path


def load(path):
    """A results file, with where it lies (``source``: its path in the
    repository where it is one of its files)."""
    with open(path) as f:
        document = json.load(f)
    where = os.path.relpath(os.path.abspath(path), ROOT)
    document["source"] = where if not where.startswith("..") else os.path.abspath(path)
    return document


DEBIAN_FASHION = "/usr/share/datasets/fashion-mnist"  # apt install dataset-fashion-mnist


def as_typed(document):
    """The command that wrote ``document``, as a newcomer types it from the
    root of a fresh clone to measure it again: ``python -m bench.NAME``
    (older scripts ran as files), Fashion-MNIST at the path Debian's package
    gives it (the runs read a copy of those files), and no ``--out`` where it
    named the committed results' folder: typed, it writes into ``out/``,
    which git ignores, and leaves the clone as it was."""
    words = shlex.split(document["command"])
    if len(words) > 1 and re.fullmatch(r"bench/\w+\.py", words[1]):
        words[1:2] = ["-m", "bench." + words[1][len("bench/"):-len(".py")]]
    for i, word in enumerate(words[:-1]):
        if word == "--dataset" and "fashion" in words[i + 1].lower():
            words[i + 1] = DEBIAN_FASHION
    if "--out" in words[:-1]:
        at = words.index("--out")
        del words[at:at + 2]
    return shlex.join(words)


def measured_by(document):
    """The start of every table's first line: the command, the date, the
    commit where it was recorded, the results file (``--out`` its folder,
    a maintainer's refresh, which rewrites the README tables too)."""
    at = f" at commit {document['commit']}" if document.get("commit") else ""
    source = document.get("source", "?")
    return (f"Measured by `{as_typed(document)}` on {document['date'][:10]}{at}, "
            f"kept with `--out {os.path.dirname(source)}` in `{source}`")


def dual_mlp(*args, json_path, env=None):
    """Run dual_mlp.py to completion and return its --json summary."""
    cmd = [sys.executable, os.path.join(ROOT, "dual_mlp.py"), *map(str, args), "--json", json_path]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, **(env or {})))
    if out.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{out.stderr[-3000:]}")
    with open(json_path) as f:
        return json.load(f)


def needed(name, install="pip install -r requirements-test.txt"):
    """The module ``name``, or, where it is not installed, one line that says
    how to install it, and exit 2 (a benchmark, not a traceback)."""
    import importlib
    try:
        return importlib.import_module(name)
    except ImportError:
        print(f"{prog()}: error: it needs {name}, which is not installed: {install}",
              file=sys.stderr)
        sys.exit(2)


def pyplot():
    """matplotlib's pyplot for a plot, or None, said in one line, where it
    is not installed: the figures are in the JSON all the same."""
    try:
        import matplotlib
    except ImportError:
        print(f"{prog()}: no plot: matplotlib is not installed "
              "(pip install -r requirements-test.txt); the figures are in the JSON")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def rate_unit(figures):
    """The unit for a table of samples/s: M where some reach a million (GPUs), else k."""
    return "M" if max(f["samples_per_s"] for f in figures) >= 1e6 else "k"


def rate(samples_per_s, unit):
    """Samples/s in ``unit`` (M or k)."""
    return f"{samples_per_s / 1e6:.2f} M" if unit == "M" else f"{samples_per_s / 1e3:.1f} k"


def duration(us):
    """Microseconds per step in the unit that fits: us, or ms past 10 ms."""
    return f"{us / 1e3:.1f} ms" if us >= 10000 else f"{us:.0f} us"


def write_block(name, text):
    """Put ``text`` between ``<!-- NAME: begin -->`` and ``<!-- NAME: end -->`` in
    README.md and bench/README.md, where they have such a block: the tables
    there are generated from results files, never typed."""
    begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    for doc in (os.path.join(ROOT, "README.md"), os.path.join(ROOT, "bench", "README.md")):
        with open(doc) as f:
            content = f.read()
        if begin not in content:
            continue
        updated = re.sub(re.escape(begin) + ".*?" + re.escape(end),
                         lambda m: f"{begin}\n{text}\n{end}", content, flags=re.S)
        if updated == content:
            print(f"the {name} table in {os.path.relpath(doc, ROOT)} is unchanged")
            continue
        from multi_gpu.files import atomic_write
        with atomic_write(doc) as f:  # the README whole, or as it was
            f.write(updated.encode())
        print(f"updated the {name} table in {os.path.relpath(doc, ROOT)}")


def tables_from(path, table):
    """``--tables-from JSON``: regenerate the running script's README tables
    (the block named after it, ``NAME.py --cpu`` for a CPU run's, or the
    one its results file names) from a results file."""
    try:
        document = load(path)
        table(document)  # another script's results fail here, in one line
    except (OSError, ValueError) as e:
        sys.exit(f"{prog()}: error: --tables-from {path}: {getattr(e, 'strerror', None) or e}")
    except (KeyError, TypeError, AttributeError):
        sys.exit(f"{prog()}: error: --tables-from {path}: not a results file of {SCRIPT}")
    write_tables(document, table)


def write_tables(document, table):
    """The blocks a results file makes: its table (``block_name``), and,
    where its script has a ``summary`` (one line, for README.md's page),
    that too, as the block ``NAME summary``."""
    name = block_name(document, SCRIPT)
    write_block(name, table(document))
    summary = getattr(sys.modules[table.__module__], "summary", None)
    if summary:
        write_block(f"{name} summary", summary(document))


def show(path, table):
    """Print the table of the results file at ``path``.  Where the file is
    one of the committed results (``--out bench/results``: a maintainer's
    refresh), the README tables made from it are rewritten too, so that the
    two never disagree."""
    document = load(path)
    text = table(document)
    print(text)
    if os.path.abspath(path).startswith(RESULTS + os.sep):
        write_tables(document, table)


def block_name(document, script):
    """The README block a results file's tables go into: the one it names,
    else its script's (``NAME.py``, or ``NAME.py --cpu`` for a CPU run's)."""
    return document.get("block", f"{script} --cpu" if document.get("cpu") else script)


def keep_temporaries_here():
    """This benchmark's temporary files (PyTensor writes each compiled graph's
    source into one and never removes it) go into a folder of its own,
    removed at its end, a SIGTERM's too (``timeout``, a killed job); so do
    those of the runs it starts (TMPDIR), which a SIGTERM here kills
    (``subprocess.run``) before they can remove theirs."""
    folder = tempfile.mkdtemp(prefix=f"{SCRIPT[:-3]}-")
    tempfile.tempdir = os.environ["TMPDIR"] = folder
    atexit.register(shutil.rmtree, folder, True)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def parse_args(parser, table):
    """``parser.parse_args()`` with the option every benchmark has:
    ``--tables-from JSON`` only regenerates its README tables (``table(document)``)
    from a results file, and exits."""
    results = os.path.splitext(os.path.basename(sys.argv[0]))[0] + ".json"
    parser.prog = prog()
    parser.add_argument("--tables-from", metavar="JSON",
                        help=f"only regenerate the README tables from this {results}")
    out = next((a for a in parser._actions if a.dest == "out"), None)
    if out and out.default == OUT:
        out.help = (out.help or "the folder for the results") + \
            " (default: out/, which git ignores; bench/results holds the committed results, " \
            "and writing there rewrites the README tables made from them too)"
    args = parser.parse_args()
    keep_temporaries_here()
    if args.tables_from:
        tables_from(args.tables_from, table)
        sys.exit(0)
    if getattr(args, "dataset", None):
        from multi_gpu import datasets
        try:
            datasets.resolve(args.dataset)
        except datasets.DatasetError as e:
            parser.error(str(e))
    # a run on GPUs (no --cpu, or --devices naming GPUs) where there are none: one line,
    # and nothing written
    if not getattr(args, "cpu", False) or getattr(args, "devices", ["cpu"])[0] != "cpu":
        require_gpus()
    out = getattr(args, "out", None)
    if out:  # before anything runs: a measurement must not be lost at its end
        if os.path.exists(out) and not os.path.isdir(out):
            parser.error(f"--out {out} is a file: it names the folder the results go into")
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as e:
            parser.error(f"--out {out}: cannot make that folder ({e.strerror})")
    return args
