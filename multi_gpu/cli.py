"""What the three scripts share at the command line: argument checks that
fail in one line, quiet signals and pipes, a heartbeat for long compiles.

Importing this module changes nothing: a script's ``main`` calls
``quiet_start_up()`` first, so that from then on Ctrl-C or SIGTERM ends it
quietly instead of with a traceback, and a closed stdout pipe (``python
mlp.py | head -3``) ends it as ``head`` expects; it replaces that handler
once it can stop cleanly.  (Before ``main``, while PyTensor loads, each
script gives SIGINT back its system default, which ends a process without
a word.)
"""
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import argparse
import contextlib
import difflib
import gc
import io
import math
import os
import signal
import stat
import sys
import tempfile
import threading
import time

from multi_gpu import files, xla_cache


class UsageError(Exception):
    """A request that cannot run; the launcher prints it on one line, exit 2."""


def quit_quietly(signum, frame):
    """A signal during start-up (a tutorial script's whole run): one word, no
    traceback, and what ``on_quit`` was given undone first."""
    for undo in reversed(ON_QUIT):
        with contextlib.suppress(Exception):
            undo()
    if signum != signal.SIGPIPE:  # a closed pipe ends a process as it ends ``cat``: silently
        with contextlib.suppress(OSError):
            os.write(2, b"interrupted\n")
    os._exit(128 + signum)


ON_QUIT = []  # what a quiet quit must undo: temporary folders, locks


@contextlib.contextmanager
def on_quit(undo):
    """Within the block, a signal that ends the script runs ``undo`` first
    (the exit skips the blocks' own clean-up)."""
    ON_QUIT.append(undo)
    try:
        yield
    finally:
        ON_QUIT.remove(undo)


def say(*words, file=None, **kw):
    """``print``, flushed, that survives a reader gone (``| head``, a ``| tee``
    that a Ctrl-C ended first): what could not be said is dropped, and the
    stream goes to /dev/null from then on, so that a launcher still stops
    its workers and releases what it holds (SIGPIPE is ignored meanwhile:
    ``keep_going_without_readers``).  A closed standard output stops the
    process as SIGPIPE would have, through its stop handler: nobody reads
    the run any more (and workers forked later would write to /dev/null)."""
    file = file or sys.stdout
    try:
        print(*words, file=file, flush=True, **kw)
    except (BrokenPipeError, OSError):
        with contextlib.suppress(OSError, ValueError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, file.fileno())
            os.close(null)
        handler = signal.getsignal(signal.SIGTERM)
        if file is sys.stdout and callable(handler):
            handler(signal.SIGPIPE, None)


def text_stream(fd, like):
    """A new, unbuffered text stream on ``fd``, written as ``like`` was."""
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), line_buffering=True,
                            write_through=True, encoding=getattr(like, "encoding", None),
                            errors=getattr(like, "errors", None))


def keep_going_without_readers():
    """From now on a closed stdout or stderr does not end the process
    (SIGPIPE ignored): it holds something to release first.  Write with ``say``."""
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)


def quiet_start_up():
    """From now on SIGINT and SIGTERM end the script quietly, and a closed
    pipe ends it as it ends ``cat``."""
    install_stop_handler(quit_quietly)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)


class Parser(argparse.ArgumentParser):
    """argparse, with errors on one line and no usage block, no abbreviated
    options (``--epoch 2`` is not ``--epochs 2``: a typo should not train),
    and, for an option it does not know, the closest one it does."""

    def __init__(self, *args, about=None, **kw):
        """``about``: a module's docstring, whose first paragraph describes
        it (None under ``python -OO``, which drops docstrings)."""
        if about is not None:
            kw.setdefault("description", about.split("\n\n")[0])
        super().__init__(*args, allow_abbrev=False, **kw)

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        unknown = next((a for a in extras if a.startswith("-")), None)
        if unknown:
            option = unknown.split("=")[0]
            near = closest_option(option, [o for action in self._actions
                                           for o in action.option_strings
                                           if action.help != argparse.SUPPRESS])
            self.error(f"unrecognized argument {option}"
                       + (f": did you mean {near}?" if near else ""))
        return parsed, extras

    def error(self, message):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def closest_option(typed, options):
    """The option ``typed`` most likely meant: one it begins (``--epoch``),
    one whose words' initials it is (``--lr``: --learning-rate), or the one
    nearest in spelling (``--batchsize``); None where none is near."""
    long = [o for o in options if o.startswith("--")]
    word = typed.lstrip("-").lower()
    starts = [o for o in long if o[2:].startswith(word)] if len(word) > 1 else []
    initials = [o for o in long if len(word) > 1 and
                "".join(w[0] for w in o[2:].split("-")) == word]
    near = difflib.get_close_matches("--" + word, long, n=1, cutoff=0.6)
    found = starts or initials or near
    return found[0] if found else None


def _number(kind, test, wanted):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text}") from None
        if not (math.isfinite(value) and test(value)):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


positive_int = _number(int, lambda v: v > 0, "a positive integer")


class NodeRange(argparse.Action):
    """``--nodes N``, or ``MIN:MAX``: ``nodes`` the most, ``min_nodes`` the
    fewest a run goes on with (None: N, a plain ``--nodes``)."""

    def __call__(self, parser, namespace, text, option_string=None):
        low, elastic, high = text.partition(":")
        try:
            low, high = positive_int(low), positive_int(high if elastic else low)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        if low > high:
            raise argparse.ArgumentError(self, f"MIN:MAX needs MIN <= MAX, got {text}")
        namespace.nodes, namespace.min_nodes = high, low if elastic else None


seed = _number(int, lambda v: 0 <= v < 2 ** 32, "an integer from 0 to 2**32 - 1")
positive = _number(float, lambda v: v > 0, "a positive, finite number")
seconds = _number(float, lambda v: 0 < v <= 1e6, "a number of seconds above 0, at most 1e6")
non_negative = _number(float, lambda v: v >= 0, "a finite number >= 0")
non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
fraction = _number(float, lambda v: 0 < v < 1, "a number above 0 and below 1")


def dataset(path):
    """--dataset: a path, never an empty one (that would read as none given)."""
    if not path.strip():
        raise argparse.ArgumentTypeError("empty: name a data set, or leave the option out for "
                                         "the default")
    return path


def tutorial_parser(description, epochs, batch_size, learning_rate):
    """The parser of the tutorial's two scripts, with their training options."""
    parser = Parser(description=description)
    add_training_options(parser, epochs, batch_size, learning_rate)
    return parser


def add_training_options(p, epochs, batch_size, learning_rate, shipped_batch_size=None):
    """What to train on, and how long: the tutorial's options.  With
    ``shipped_batch_size`` (dual_mlp.py), a minibatch is each worker's, that
    size on the shipped digits, and a checkpoint may say the epochs."""
    workers = shipped_batch_size is not None
    p.add_argument("--epochs", type=positive_int, default=None if workers else epochs,
                   help=f"passes over the training set (default: {epochs}"
                        + ("; with --resume, those the checkpoint's run asked for)" if workers
                           else ")"))
    p.add_argument("--batch-size", type=positive_int, default=None if workers else batch_size,
                   help=f"minibatch size{' per worker' if workers else ''} (default: {batch_size}"
                        + (f"; {shipped_batch_size} on the shipped digits)" if workers else ")"))
    p.add_argument("--learning-rate", type=positive, default=learning_rate,
                   help="SGD step size (default: %(default)s)")
    p.add_argument("--dataset", metavar="PATH", type=dataset,
                   help="mnist.pkl.gz or a folder of MNIST-format IDX files, e.g. "
                        "/usr/share/datasets/fashion-mnist (default: ./mnist.pkl.gz if "
                        "present, else the 5,000 digits shipped in data/)")


def add_model_options(p, n_hidden, l1, l2, weights_seed):
    """The MLP's own options, which the tutorial's script and dual_mlp.py share."""
    p.add_argument("--n-hidden", type=positive_int, default=n_hidden,
                   help="hidden units (default: %(default)s)")
    p.add_argument("--l1", type=non_negative, default=l1,
                   help="L1 weight penalty (default: %(default)s)")
    p.add_argument("--l2", type=non_negative, default=l2,
                   help="squared L2 weight penalty (default: %(default)s)")
    p.add_argument("--seed", type=seed, default=weights_seed,
                   help="weight initialisation seed, 0 to 2**32 - 1 (default: %(default)s)")


def writable(path):
    """Check, before any work, that ``path`` can be written as a file: a
    regular file or nothing yet (never a device, a FIFO or a socket, which a
    rename would replace for everyone), not a folder, and its folder exists
    and takes a new file (tried for real: permission bits say nothing to
    root on a read-only mount)."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a folder, not a file")
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        raise argparse.ArgumentTypeError(f"{path} is not a regular file (a device, FIFO or "
                                         "socket): an output goes only to a regular file")
    # /dev/stdout, /proc/self/fd/1: a descriptor of a process, whatever it holds now (as
    # root, the write beside it and the rename would replace /dev's own link)
    if any(p.startswith("/proc/") or p.startswith("/dev/") and not p.startswith("/dev/shm/")
           for p in (path, os.path.realpath(path))):
        raise argparse.ArgumentTypeError(f"{path} is a device's or a process's descriptor, not "
                                         "a file of its own: an output goes only to a regular "
                                         "file")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {path}: folder {folder} does not exist")
    longest = os.pathconf(folder, "PC_NAME_MAX") - files.TEMPORARY_LONGER
    if len(os.path.basename(path).encode()) > longest:
        raise argparse.ArgumentTypeError(f"{os.path.basename(path)[:40]}...: the name is too "
                                         f"long: at most {longest} bytes in {folder} (the "
                                         "temporary file a write goes through has a longer one)")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write into {folder}: "
                                         f"{e.strerror.lower()}") from None
    return path


def same_file(a, b):
    """Are ``a`` and ``b`` one file, through any path or link (or both to be made)?"""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def clash(inputs, outputs, allowed=()):
    """The first output that would overwrite an input, or another output of
    the same run, as a one-line message, or None.  ``inputs`` and
    ``outputs`` map an option to the files it names; ``allowed`` holds the
    (output, input) pairs that may be one file (continuing a checkpoint in
    place: --save beside --resume)."""
    outs = [(option, path) for option, paths in outputs.items() for path in paths if path]
    for i, (option, path) in enumerate(outs):
        for other, paths in inputs.items():
            if (option, other) not in allowed and any(p and same_file(path, p) for p in paths):
                return f"{option} {path} is {other}'s file: an output never overwrites an input"
        for other, other_path in outs[i + 1:]:
            if same_file(path, other_path):
                return f"{option} and {other} name one file ({path}): give each its own"
    return None


# every signal whose default ends a process and that a handler may take: each ends
# a run as Ctrl-C does (workers stopped, lock released, one line), none silently
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                signal.SIGUSR2, signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF,
                signal.SIGXCPU)


# SIGHUP as the process found it: ignored under nohup, whose run must outlive its terminal
HANGUP_IGNORED = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


def install_stop_handler(handler):
    """From now on the signals that would end the process (Ctrl-C, SIGTERM, a
    closed terminal's SIGHUP, SIGUSR1/2) call ``handler``, which stops it the
    way it can clean up (start-up is over); SIGHUP stays ignored where the
    process started with it ignored (``nohup``)."""
    for signum in STOP_SIGNALS:
        ignored = signum == signal.SIGHUP and HANGUP_IGNORED
        signal.signal(signum, signal.SIG_IGN if ignored else handler)


@contextlib.contextmanager
def heartbeat(what, say=print, every=10.0):
    """Say ``what`` now, and how long it has been taking every ``every``
    seconds until the block ends: a first compile can take a minute, and
    silence that long looks like a hang.  Python's cycle collector waits
    meanwhile: a compile makes hundreds of thousands of graph objects, most
    of them kept, and the collector's passes over them cost a tenth of it."""
    say(f"... {what}")
    start, done, cache = time.perf_counter(), threading.Event(), dict(xla_cache.CACHE)

    def beat():
        while not done.wait(every):
            say(f"... still {what.split(' (')[0]}: {time.perf_counter() - start:.0f} s")
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
        done.set()
        thread.join()
    say(f"... {compiled(time.perf_counter() - start, cache)}")


def compiled(seconds, before):
    """How the block of ``heartbeat`` ended: compiled, or loaded from XLA's
    persistent cache (``xla_cache.CACHE`` against its counts ``before``)."""
    hits, misses = (xla_cache.CACHE[k] - before.get(k, 0) for k in ("hits", "misses"))
    if hits and not misses:
        return (f"loaded from XLA's cache ({tilde(xla_cache.jax_cache_folder())}) in "
                f"{seconds:.1f} s, nothing compiled ({counted(hits, 'program')} read in "
                f"{xla_cache.CACHE['loading_s'] - before.get('loading_s', 0):.1f} s)")
    # On a cache empty at the start, the workers compile at once, and one reads what
    # another has just written: the counts change from run to run, and say nothing
    cached = "" if not hits else \
        " (XLA's cache was empty: it holds this run's programs now, for the next run)" \
        if xla_cache.CACHE["empty_at_start"] else \
        f" ({hits} of {counted(hits + misses, 'program')} from XLA's cache)"
    problem = xla_cache.cache_problem()
    return f"compiled in {seconds:.1f} s{cached}" + (f"; note: {problem}" if problem else "")


def counted(n, one, many=None):
    """'1 step', '15 steps': a count and its noun, in the number it takes."""
    return f"{n} {one if n == 1 else many or one + 's'}"


def tilde(path):
    """``path`` with the home folder written ``~``, as a user would type it."""
    home = os.path.expanduser("~")
    return "~" + path[len(home):] if path.startswith(home + os.sep) else path


def backend_name(mode=None):
    """Which PyTensor backend a mode compiles with, in words."""
    import pytensor
    linker = type(pytensor.compile.mode.get_mode(mode).linker).__name__
    return {"NumbaLinker": "Numba", "JAXLinker": "JAX", "CLinker": "C", "VMLinker": "C",
            "PerformLinker": "Python"}.get(linker, linker)


def add_exchange_options(p, choices, steps_per_call):
    """How the replicas average: the options of dual_mlp.py's exchange, their
    defaults by hardware from ``choices`` (its ``CHOICES``)."""
    def by_hardware(option):
        return ", ".join(f"{value} on {kind.upper()}s" for kind, value in choices[option].items())
    p.add_argument("--exchange", choices=("p2p", "xla"),
                   help="how the replicas average: 'p2p' the 2014 exchange among the workers "
                        "of one machine (PyCUDA peer-to-peer copies, or host memory on CPUs); "
                        "'xla' a pmean inside the compiled step, through JAX's distributed "
                        "runtime (default: " + "; ".join(
                            f"{value} for {case}" for case, value in choices["exchange"].items())
                   + ")")
    p.add_argument("--sync", choices=("gpu", "host"),
                   help="p2p: who orders the exchange; 'gpu' the GPUs, on their streams, "
                        "the host never waiting within a step; 'host' the 2014 loop, the host "
                        "waiting for each phase (default: " + by_hardware("sync") + "; workers "
                        "sharing a GPU run 'gpu' only when asked, time-sliced)")
    p.add_argument("--avg", choices=("theano", "pycuda", "shared", "cpu"),
                   help="--sync host: how to average; 'theano' a compiled PyTensor function "
                        "whose updates are the means (as in 2014); 'pycuda' a CUDA kernel, in "
                        "place on the GPU's buffers (as in 2014); 'shared' (CPUs) the mean the "
                        "workers sum into one shared buffer, each its share, read where it "
                        "lies; 'cpu' through host memory (as in 2014) (default: "
                        + by_hardware("avg") + ")")
    p.add_argument("--average-every", type=positive_int, default=1, metavar="H",
                   help="average the replicas every H steps (local SGD): each worker takes H "
                        "SGD steps on its own minibatches, then all average; an epoch always "
                        "ends on an average (default: 1, the 2014 demo: after every step)")
    p.add_argument("--staged", action="store_true",
                   help="GPUs: copy the weights through host memory, the fallback used "
                        "where the two GPUs cannot reach each other's memory")
    p.add_argument("--steps-per-call", type=positive_int, metavar="K",
                   help="--sync gpu and --exchange xla: K steps in one compiled call, so that "
                        "the host queues a call, not a step, and a small step is not bound by "
                        "the host (default: " + str(steps_per_call) + ", at most an epoch); the "
                        "host-ordered loop takes one step per call")


def add_run_options(p, timeout):
    """A run's own options, beside what it trains and how it exchanges: its
    records (checkpoint, summary, trace, the replica check), its patience and
    restarts, and its machines (``timeout``: --timeout's default)."""
    p.add_argument("--save", metavar="PATH", type=writable,
                   help="checkpoint (.npz) written after every epoch, atomically: current "
                        "and best-validation weights, training state and configuration; the "
                        "run holds it, and a second run asking for it is refused")
    p.add_argument("--resume", metavar="PATH", help="continue from a --save checkpoint, with "
                   "the options it was trained with (--save may name the same file)")
    p.add_argument("--json", metavar="PATH", type=writable,
                   help="write a summary of the run as JSON")
    p.add_argument("--trace", metavar="PATH.json", type=writable,
                   help="record every worker's phases, step by step, for a window of steps, "
                        "as a Chrome trace (open it in ui.perfetto.dev or chrome://tracing), "
                        "and draw PATH.png beside it (with matplotlib); each node its own "
                        "workers, node R > 0 into PATH.nodeR.json")
    p.add_argument("--trace-from", type=positive_int, metavar="EPOCH",
                   help="--trace: the epoch whose first step the window starts at (default: "
                        "the second this run trains, after compiling and warming up)")
    p.add_argument("--trace-steps", type=positive_int, metavar="N",
                   help="--trace: steps in the window (default: 50)")
    p.add_argument("--check", action="store_true", help="after every average, measure how "
                   "far the replicas differ (max_replica_diff; slow: the host waits)")
    p.add_argument("--timeout", type=seconds, default=timeout,
                   help="seconds a worker waits for the others (to meet, or to finish a "
                        "step) before it reports them stalled (default: %(default)s)")
    p.add_argument("--max-restarts", type=non_negative_int, default=0, metavar="N",
                   help="where a worker fails or stops, start every worker (of every node) "
                        "again from this run's last --save checkpoint (else from where it "
                        "began), at most N times, as torchrun's --max-restarts; where a node is "
                        "lost, node 0 too, the others wait for its command to be started "
                        "again (--rejoin-timeout), and each return is a restart "
                        "(default: %(default)s)")
    p.add_argument("--rejoin-timeout", type=seconds, default=300, metavar="SECONDS",
                   help="--max-restarts on several machines: how long the other nodes wait "
                        "for a lost node to come back (default: %(default)s)")
    p.add_argument("--nodes", action=NodeRange, default=1, metavar="N|MIN:MAX",
                   help="machines taking part, each running this launcher with its own "
                        "devices, the same number on each (default: %(default)s); MIN:MAX, "
                        "with --max-restarts: where a node is lost for good, the run goes on "
                        "with the others from its last checkpoint while MIN remain, as "
                        "torchrun's --nnodes MIN:MAX")
    p.set_defaults(min_nodes=None)
    p.add_argument("--node-rank", type=int, default=0,
                   help="this machine's number, 0..nodes-1; node 0 hosts the coordinator")
    p.add_argument("--secret-file", metavar="PATH",
                   help="--nodes > 1: a file (mode 600) holding the run's secret, which every "
                        "node must hold to join (else DUAL_MLP_SECRET; node 0 makes one and "
                        "prints it where neither is given)")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="several machines: node 0's address, where its lobby listens (the "
                        "nodes prove they hold the run's secret there, and learn where JAX's "
                        "coordinator is); one machine, --exchange xla: JAX's coordinator's own "
                        "address (default: a socket in the run's private folder)")
