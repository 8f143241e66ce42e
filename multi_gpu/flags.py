"""Honour ``THEANO_FLAGS`` by mapping it onto PyTensor's ``PYTENSOR_FLAGS``.

PyTensor reads its flags once, when it is first imported, so every module
of the package that uses PyTensor imports this one first, and so does each
script: whichever is imported first, the flags reach PyTensor.  The seed
was run as::

    THEANO_FLAGS=mode=FAST_RUN,floatX=float32 python dual_mlp.py 0 1

* Flags PyTensor shares with Theano (``mode``, ``floatX``, ``optimizer``,
  ``compiledir``, ...) pass through; ``PYTENSOR_FLAGS`` wins where both set one.
* Theano's old mode names become PyTensor's (``DEBUG_MODE`` -> ``DebugMode``).
* ``device=cuda0`` is kept in ``DEVICE`` for the scripts to honour:
  ``mlp.py`` and ``logistic_sgd.py`` then run on that GPU through PyTensor's
  JAX backend, as Theano's flag did; ``dual_mlp.py`` takes its devices as
  arguments and says it ignores the flag.
* Theano's other GPU flags (``gpuarray__*``, ``dnn__*``, ...) are warned
  about and dropped.
* ``floatX`` defaults to float32, the seed's setting and what GPUs need
  (float64 is the other choice).

Flags PyTensor would reject (an unknown mode, a bad value) end the script
here, on one line with exit code 2, instead of in a traceback at import.

The mapped flags are written back to the environment and ``THEANO_FLAGS`` is
removed, so child processes inherit the result without warning again.
"""
import os
import re
import subprocess
import sys
import tempfile
from warnings import catch_warnings, showwarning

THEANO_ONLY = ("init_gpu_device", "contexts", "force_device", "print_active_device",
               "gpuarray__", "dnn__", "lib__cnmem", "nvcc__", "cuda__", "pycuda__",
               "enable_initial_driver_test")
MODES = {"DEBUG_MODE": "DebugMode", "PROFILE_MODE": "FAST_RUN"}
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                    "NUMBA_NUM_THREADS")


FLOATX = ("float32", "float64")  # what the demo's models are written for
DEVICE = None  # THEANO_FLAGS' device, e.g. 'cuda0'; None for the CPU
DEVICE_ASKED = None  # the same as the user typed it, e.g. 'gpu'; for messages
MODE = None  # the mode the flags name, as PyTensor knows it (None: none named)


class FlagError(ValueError):
    """A flag string that cannot be used, with a one-line message."""


def parse(flags, name="THEANO_FLAGS"):
    """'a=1,b=2' -> {'a': '1', 'b': '2'} (Theano's syntax; '.' in names is '__')."""
    parsed = {}
    for item in filter(str.strip, flags.split(",")):
        if "=" not in item:
            raise FlagError(f"{name}: '{item.strip()}' is not of the form name=value")
        key, value = item.split("=", 1)
        parsed[key.strip().replace(".", "__")] = value.strip()
    return parsed


def to_pytensor(theano_flags, pytensor_flags=""):
    """The PYTENSOR_FLAGS string for these flag strings, the warnings, and
    the device asked for (None for the CPU)."""
    flags, warnings, device = {}, [], None
    for key, value in parse(theano_flags).items():
        if key == "device":
            gpu = re.fullmatch(r"(?:cuda|gpu)(\d*)", value)
            if not (gpu or value == "cpu"):
                raise FlagError(f"THEANO_FLAGS: device={value}: expected cpu or cudaN")
            device = gpu and f"cuda{gpu.group(1) or 0}"
        elif key.startswith(THEANO_ONLY):
            warnings.append(f"THEANO_FLAGS: '{key}={value}' is a Theano-only flag, ignored "
                            "(dual_mlp.py takes its devices as arguments: dual_mlp.py 0 1)")
        elif key == "mode":
            flags[key] = MODES.get(value, value)
            if value == "PROFILE_MODE":
                flags["profile"] = "True"
        else:
            flags[key] = value
    flags.update(parse(pytensor_flags, "PYTENSOR_FLAGS"))
    if flags.get("floatX", FLOATX[0]) not in FLOATX:
        raise FlagError(f"floatX={flags['floatX']}: the models here run in float32 or float64")
    return ",".join(f"{k}={v}" for k, v in flags.items()), warnings, device


def culprit(message, given):
    """'THEANO_FLAGS: mode=NOPE' for the flag whose value ``message`` names,
    from the variables as the user gave them (``given``: name -> flags)."""
    for name, flags in given.items():
        for key, value in flags.items():
            if value and (value in message or MODES.get(value, value) in message):
                return f"{name}: {key}={value}"
    return "a flag"


def check_threads(environ, script):
    """The thread variables are numbers, and the user may start a thread a
    core (NumPy's BLAS does, as it loads): else one line, exit 2."""
    threads = next((f"{v}={environ[v]}" for v in THREAD_VARIABLES
                    if not re.fullmatch(r"[1-9]\d{0,4}", environ.get(v, "1").strip())), None)
    if threads:  # PyTensor, NumPy's BLAS and XLA would each fail on it in their own way
        print(f"{script}: error: {threads}: not a number of threads (a positive integer): "
              "set it to one, or unset it", file=sys.stderr)
        sys.exit(2)
    too_few = threads_problem((os.cpu_count() or 2) + 8, script)
    if too_few:
        print(f"{script}: error: {too_few}", file=sys.stderr)
        sys.exit(2)


def check_compiledir(pytensor, pytensor_flags, script):
    """PyTensor makes its cache folder at the first compile, deep in a
    worker: where it cannot, say so now, in one line, and exit 2."""
    try:
        with tempfile.TemporaryFile(dir=pytensor.config.compiledir):
            pass
    except (OSError, ValueError) as e:
        named = next((f"{k}={v} (PYTENSOR_FLAGS)" for k, v in parse(pytensor_flags).items()
                      if "compiledir" in k), None)
        where = named or f"{os.path.join(os.path.expanduser('~'), '.pytensor')}, under HOME"
        why = e.strerror if isinstance(e, OSError) else "it cannot be created"
        hint = "" if named else ": set HOME, or PYTENSOR_FLAGS=base_compiledir=FOLDER"
        print(f"{script}: error: PyTensor cannot keep its compiled code in {where} ({why}){hint}",
              file=sys.stderr)
        sys.exit(2)


NEEDED = ("numpy", "pytensor", "jax", "zmq")  # requirements.txt's, which every script imports


def check_interpreter(script):
    """Python 3.11 or later, with the packages of requirements.txt, or one
    line that says what to do (another Python, a venv not activated),
    instead of the traceback of an import; exit 2."""
    import importlib.util
    import platform
    if sys.version_info < (3, 11):
        print(f"{script}: error: Python 3.11 to 3.13 runs it, and this is Python "
              f"{platform.python_version()} ({sys.executable}): make the venv with one of "
              "those: python3.13 -m venv .venv && . .venv/bin/activate && pip install -r "
              "requirements.txt", file=sys.stderr)
        sys.exit(2)
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if not missing:
        return
    names = ", ".join(missing[:-1]) + " and " * (len(missing) > 1) + missing[-1]
    print(f"{script}: error: {names} {'is' if len(missing) == 1 else 'are'} not installed "
          f"for this Python ({sys.executable}): activate the project's venv (. .venv/bin/"
          "activate), or make one: python3 -m venv .venv && . .venv/bin/activate && pip "
          "install -r requirements.txt", file=sys.stderr)
    sys.exit(2)


def apply(environ=os.environ):
    """Map the flags, then import PyTensor, which reads them: a flag it
    rejects ends the script in one line (exit 2); one it does not know is a
    one-line warning that names the variable it came from."""
    global DEVICE, DEVICE_ASKED, MODE
    script = os.path.basename(sys.argv[0]) or "python"
    check_interpreter(script)
    given = {"THEANO_FLAGS": environ.pop("THEANO_FLAGS", ""),
             "PYTENSOR_FLAGS": environ.get("PYTENSOR_FLAGS", "")}
    check_threads(environ, script)
    try:
        pytensor_flags, warnings, DEVICE = to_pytensor(*given.values())
        DEVICE_ASKED = parse(given["THEANO_FLAGS"]).get("device")
        MODE = parse(pytensor_flags).get("mode")
        folders = {k: v for k, v in parse(pytensor_flags).items() if "compiledir" in k}
        empty = next((k for k, v in folders.items() if not v.strip()), None)
        if empty:  # PyTensor would take the current folder, and write its files there
            raise FlagError(f"{empty} is empty: name a folder for PyTensor's compiled code, "
                            "or leave the flag out")
        home = environ.get("HOME")
        if "base_compiledir" not in folders and home is not None and not os.path.isabs(home):
            raise FlagError(f"HOME={environ.get('HOME', '')!r} is not a folder's full path, "
                            "and PyTensor keeps its compiled code in $HOME/.pytensor: set "
                            "HOME, or PYTENSOR_FLAGS=base_compiledir=FOLDER")
        environ["PYTENSOR_FLAGS"] = pytensor_flags
        with catch_warnings(record=True) as unknown:  # the filters as they are, recorded
            import pytensor  # reads the flags
    except ValueError as e:  # FlagError, or PyTensor's own check of a value
        message = str(e).splitlines()[0]
        if not isinstance(e, FlagError):  # name the flag PyTensor refused, as it was typed
            message = f"{culprit(message, {k: parse(v) for k, v in given.items()})}: {message}"
        print(f"{script}: error: {message}", file=sys.stderr)
        sys.exit(2)
    for w in unknown:
        key = re.fullmatch(r"PyTensor does not recognise this flag: (\S+)", str(w.message))
        if key is None:
            showwarning(w.message, w.category, w.filename, w.lineno)
            continue
        source = next((n for n, v in given.items() if key.group(1) in parse(v, n)), "a flag")
        warnings.append(f"{source}: '{key.group(1)}' is not a PyTensor flag: ignored")
    check_compiledir(pytensor, pytensor_flags, script)
    if "floatX" not in parse(pytensor_flags):
        # the default, set here rather than in the flags that child
        # processes inherit, where it would override their own THEANO_FLAGS
        pytensor.config.floatX = FLOATX[0]
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)


# the threads a process that trains starts: NumPy's BLAS and XLA's pools, one a core and more
THREADS_PER_PROCESS = 32 + 2 * (os.cpu_count() or 2)


def threads_problem(needed, who):
    """Why the user's limit of processes (``ulimit -u``, which counts threads)
    leaves too little room for ``needed`` more threads, or None (root is held
    to no limit): a thread that cannot start ends a process deep in a
    library, in its words (XLA's abort, or BLAS's lines)."""
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft == resource.RLIM_INFINITY or os.geteuid() == 0:
        return None
    running = threads_of(os.getuid())
    if running + needed <= soft:
        return None
    return (f"ulimit -u {soft}: this user runs {running} threads already, and {who} needs "
            f"about {needed} more (ulimit -u counts threads)")


def threads_of(uid):
    """How many threads the processes of ``uid`` run now (Linux's /proc)."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            if int(status["Uid"].split()[0]) == uid:
                count += int(status["Threads"])
        except (OSError, KeyError, ValueError):
            pass
    return count


def keep_a_stdout():
    """Started with stdout closed (``>&-``), the run goes on, its words
    unread: /dev/null takes descriptor 1 before any file PyTensor opens
    does, and the workers inherit it."""
    try:
        os.fstat(1)
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)  # the lowest free descriptor: 1
        if devnull != 1:
            os.dup2(devnull, 1)
            os.close(devnull)
        os.set_inheritable(1, True)  # os.open's are not


keep_a_stdout()
# Too late once PyTensor is imported (e.g. by a notebook): its flags are read.
if "pytensor" not in sys.modules:
    apply()


def xla_flags_problem(environ=os.environ):
    """What XLA says of XLA_FLAGS, in one line, where it refuses a flag: it
    reads them only as its first backend starts, and then ends the process
    (glog's fatal line, exit 1, its temporaries left), so a process of its
    own asks first (a second, only where XLA_FLAGS is set).  None where they
    are unset or taken."""
    if not environ.get("XLA_FLAGS", "").strip():
        return None
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"],
                           env=dict(environ, JAX_PLATFORMS="cpu"), capture_output=True,
                           text=True, timeout=120)
    refused = re.search(r"Unknown flags? in XLA_FLAGS: *(.*)", probe.stderr)
    return refused and f"XLA_FLAGS: XLA does not know {refused.group(1).strip()[:200]}"
