"""Shared helpers: the tests run the real scripts as real processes."""
import atexit
import contextlib
import fcntl
import gzip
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# One compile cache for the whole test run, this process's and every process
# it starts (xdist's workers too: they inherit it), so that a graph compiled
# once is loaded after, and no test touches the user's own ~/.pytensor.  A
# test that gives a run a HOME of its own (a first run, caches empty) gets
# the user's PyTensor flags back instead (``environment``).
USER_FLAGS = os.environ.get("DUAL_MLP_TESTS_USER_FLAGS", os.environ.get("PYTENSOR_FLAGS", ""))
if "DUAL_MLP_TESTS_CACHE" not in os.environ:
    os.environ["DUAL_MLP_TESTS_CACHE"] = tempfile.mkdtemp(prefix="dual_mlp-tests-cache-")
    os.environ["DUAL_MLP_TESTS_USER_FLAGS"] = USER_FLAGS
    atexit.register(shutil.rmtree, os.environ["DUAL_MLP_TESTS_CACHE"], True)
os.environ["PYTENSOR_FLAGS"] = ",".join(filter(None, (
    USER_FLAGS, f"base_compiledir={os.environ['DUAL_MLP_TESTS_CACHE']}")))

import numpy as np
import psutil
import pytest

import mlp
from multi_gpu import datasets, records

ROOT = Path(__file__).resolve().parents[1]
FASHION = Path(os.environ.get("FASHION_MNIST", "/usr/share/datasets/fashion-mnist"))

SHAPES = mlp.parameter_shapes(784, 500, 10)  # the demo's model: its checkpoints hold these


# Every run the tests start carries this token in its environment, and its
# launcher's pid is kept: the tests look only at the processes and folders
# they started, so that a demo running beside them (another user's, say)
# neither fails them nor is touched by them.
TOKEN = f"{os.getpid()}-{time.time_ns()}"
LAUNCHERS = set()


@pytest.fixture(scope="session", autouse=True)
def compiled_sources_in_the_test_cache(tmp_path_factory):
    """The graphs this process compiles leave their Python sources in
    temporary files (PyTensor never removes them): into the test run's own
    folder, once pytest has placed its own (kept for failed tests)."""
    tmp_path_factory.getbasetemp()
    tempfile.tempdir = tempfile.mkdtemp(dir=os.environ["DUAL_MLP_TESTS_CACHE"])
    yield
    tempfile.tempdir = None


@pytest.fixture(scope="session")
def clone(tmp_path_factory):
    """A fresh clone of the tree under test as it is, what is not committed
    yet too (a commit of it, made through an index of its own: the tree's
    own index and branch stay as they were): where the READMEs' commands run
    as a new user types them (``unchanged`` after)."""
    folder = tmp_path_factory.mktemp("clone")
    env = dict(os.environ, GIT_INDEX_FILE=str(folder / "index"), **{
        f"GIT_{who}_{what}": value for who in ("AUTHOR", "COMMITTER")  # no identity needed
        for what, value in (("NAME", "the tests"), ("EMAIL", "tests@localhost"))})

    def git(*args, cwd=ROOT, env=None):
        return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True,
                              check=True).stdout.strip()
    git("add", "-A", env=env)
    tree = git("commit-tree", git("write-tree", env=env), "-p", "HEAD", "-m",
               "the tree under test", env=env)
    git("clone", "-q", "--no-checkout", str(ROOT), str(folder / "dual_mlp"))
    git("checkout", "-q", "--detach", tree, cwd=folder / "dual_mlp")
    return folder / "dual_mlp"


def head_of(tree):
    """The commit ``tree`` has checked out, as results files name it."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True,
                          text=True, check=True).stdout.strip()


def unchanged(clone):
    """Is ``clone`` as git checked it out: nothing changed, nothing new that git does not ignore?"""
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=clone,
                          capture_output=True, text=True, check=True).stdout == ""


def environment(env=None):
    own_home = {"PYTENSOR_FLAGS": USER_FLAGS} if "HOME" in (env or {}) else {}
    return dict(os.environ, DUAL_MLP_TESTS=TOKEN, **{**own_home, **(env or {})})


def script(name, *args, env=None, timeout=600, cwd=None, tree=ROOT):
    """Run one of the scripts of ``tree`` (this repository, or a ``clone``:
    a file, or a benchmark's module: bench.compare) to completion, from
    ``cwd`` (default: ``tree``); returns CompletedProcess."""
    target = [str(tree / name)] if name.endswith(".py") else ["-m", name]
    proc = subprocess.Popen([sys.executable, *target, *map(str, args)], cwd=cwd or tree,
                            env=environment(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    LAUNCHERS.add(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def as_a_terminal_starts(argv):
    """``argv`` with Ctrl-C's signals at their defaults, as a terminal starts
    a command (a test runner's worker may ignore them, and an ignored signal
    stays ignored across exec): a fresh interpreter sets them and becomes
    ``argv``, so that no Python runs in a child forked from a test's process,
    where JAX's threads may hold a lock."""
    return [sys.executable, "-c", "import os, signal, sys; "
            "signal.signal(signal.SIGINT, signal.SIG_DFL); "
            "signal.signal(signal.SIGQUIT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])",
            *map(str, argv)]


def dual(*args, **kw):
    return script("dual_mlp.py", *args, **kw)


def refused(capsys, *args, name="dual_mlp.py", typed=False):
    """``dual_mlp.py args`` (or another script's, ``name``) for a request it
    refuses before it starts anything, run by the script's own ``main()`` in
    this process (a new interpreter for each of a test's many such requests
    would add only its start, 0.8 s each); it goes by its name
    (``sys.argv``) as the script does, and the signal handlers ``main`` sets
    are put back.  ``typed``: by the script as typed instead, a process of
    its own (a family's first request: the way out the user sees).  Returns
    CompletedProcess (the exit code, what it printed)."""
    if typed:
        return script(name, *args, timeout=60)
    import importlib

    from multi_gpu import cli
    main = importlib.import_module(name.removesuffix(".py")).main
    handlers = {s: signal.getsignal(s) for s in (*cli.STOP_SIGNALS, signal.SIGPIPE)}
    argv, sys.argv = sys.argv, [str(ROOT / name), *map(str, args)]
    capsys.readouterr()
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:  # argparse's errors
        code = e.code
    finally:
        sys.argv = argv
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([name, *args], code, out, err)


def start_dual(*args, env=None, cwd=ROOT, mine=True, host=None):
    """Start dual_mlp.py in its own process group, without waiting; ``mine``:
    as one of the tests' runs (else as a run of someone else's); ``host``:
    in that test host (``bench.testhosts.Host``), with gloo on its interface."""
    env = environment(env) if mine else dict(os.environ, **(env or {}))
    command = [sys.executable, "-c", AS_FROM_A_TERMINAL, str(ROOT / "dual_mlp.py"),
               *map(str, args)]
    proc = subprocess.Popen(host.runs(command) if host else command,
                            cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    STARTED.append(proc)
    if mine:
        LAUNCHERS.add(proc.pid)
    return proc


# A run's SIGHUP as a terminal's shell leaves it, though the tests run under nohup (as CI's
# may): the launcher keeps a SIGHUP it finds ignored.  Set in a Python that then becomes the
# run (exec: the same process), not in a preexec_fn: Python code between fork and exec, in
# a process where JAX's threads run, may deadlock (JAX warns of each such fork).
AS_FROM_A_TERMINAL = ("import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
                      "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


SECRET = "a secret of the tests' own runs"  # what their nodes share (DUAL_MLP_SECRET)


def start_node(port, rank, *args, devices=("cpu",), env=None, **kw):
    """Start node ``rank`` of a two-node run whose node 0 listens at
    127.0.0.1:``port``, on ``devices`` (one CPU worker, as on a cluster of
    one-GPU machines), holding the tests' secret unless ``env`` says
    otherwise (``start_dual``'s keywords)."""
    return start_dual(*devices, "--nodes", 2, "--node-rank", rank, "--coordinator",
                      f"127.0.0.1:{port}", *args, env=dict({"DUAL_MLP_SECRET": SECRET},
                                                          **(env or {})), **kw)


# Runs started in their own process group outlive a pytest that is killed
# (a device call's time limit): one left training for 100000 epochs shared
# the GPUs with the next benchmark and made its figures wrong.
STARTED = []


def stop_started(started=STARTED):
    for proc in started:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass


def stop_started_and_exit(signum, _frame):
    stop_started()
    sys.exit(128 + signum)


atexit.register(stop_started)
signal.signal(signal.SIGTERM, stop_started_and_exit)


WORKER_NAME = "dual_mlp w"  # a worker's process name (ps, pgrep): "dual_mlp w0" is rank 0's


def workers_of(launcher):
    """The launcher's workers now (a child that ends meanwhile is none)."""
    found = []
    for p in psutil.Process(launcher.pid).children():
        try:
            if p.name().startswith(WORKER_NAME):
                found.append(p)
        except psutil.Error:
            pass
    return found


def child_running(parent, name):
    """The child of ``parent`` whose command line names ``name``, if one runs
    now (a child that ends meanwhile, a zombie too, is none)."""
    for p in psutil.Process(parent.pid).children():
        try:
            if name in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            pass
    return None


def run_folder_of(launcher):
    """The run folder of a launcher (named after its pid, as its lobby's door's
    folder is), once it is there."""
    return wait_for(lambda: next((str(p) for p in run_folders()
                                  if p.name.startswith(f"dual_mlp-{launcher.pid}-")
                                  and "-door-" not in p.name), None),
                    60, "the run folder")


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def leftover_workers():
    """The tests' dual_mlp worker processes still alive (zombies included)."""
    found = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.name().startswith(WORKER_NAME) and \
                    p.environ().get("DUAL_MLP_TESTS") == TOKEN:
                found.append(p)
        except psutil.Error:
            pass
    return found


def run_folders():
    """Every run folder of the demo's that exists now, whoever made it."""
    return {p for folder in ("/dev/shm", "/tmp") for p in Path(folder).glob("dual_mlp-*-*")}


OLDER_FOLDERS = run_folders()  # another run's, or a dead one's, whose pid a test launcher may get


def run_directories():
    """The run folders of the tests' launchers that exist now."""
    return {p for p in run_folders() - OLDER_FOLDERS
            if p.name.split("-")[1].isdigit() and launched_here(int(p.name.split("-")[1]))}


def launched_here(pid):
    """Was ``pid`` one of this process's tests' launchers, and, while it
    lives, is it still?  Beside two other suites the machine's 32768 pids
    come round in minutes: another suite's launcher may get one of ours."""
    if pid not in LAUNCHERS:
        return False
    try:
        return psutil.Process(pid).environ().get("DUAL_MLP_TESTS") == TOKEN
    except psutil.NoSuchProcess:  # ended (a zombie too): its folder was ours to remove
        return True
    except psutil.Error:
        return False


@pytest.fixture(autouse=True)
def runs_end_with_their_test():
    """A test that fails midway leaves nothing running for the next ones to
    trip on (a worker a failed test left stopped once failed the next four):
    after each test, the launchers it started and this process's tests'
    workers are killed.  ``no_leftovers``' own check comes first."""
    started = len(STARTED)
    yield
    stop_started(STARTED[started:])
    for worker in leftover_workers():
        with contextlib.suppress(psutil.Error):
            worker.kill()


@pytest.fixture
def no_leftovers():
    """Fail the test if it leaves a worker process or a run directory behind."""
    before = run_directories()
    yield
    time.sleep(0.2)
    assert leftover_workers() == []
    assert run_directories() - before == set(), "run directory not removed"


# -- runs: wait for them, stop them

def made_once(name, make):
    """(a folder, what ``make(folder)`` returned there: JSON), made once for
    the whole test run.  Each xdist worker sets up its own fixtures, and a
    module's tests may be shared out between the two: the first to ask makes
    it, holding the folder's lock, and the other waits for the lock and
    reads what the first left."""
    folder = Path(os.environ["DUAL_MLP_TESTS_CACHE"]) / "made-once" / name
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        made = folder / ".made.json"
        if not made.exists():  # or its maker failed: the test that asks again fails as it did
            made.write_text(json.dumps(make(folder)))
        return folder, json.loads(made.read_text())


def run_once(name, *args, by="dual_mlp.py"):
    """``dual_mlp.py args`` (or another script's, ``by``) run once for the
    whole test run (``made_once``), in the folder it returns, which ``args``
    name as ``{folder}``; with what it printed (CompletedProcess)."""
    def make(folder):
        out = script(by, *(str(a).format(folder=folder) for a in args))
        assert out.returncode == 0, out.stderr
        return dict(stdout=out.stdout, stderr=out.stderr)
    folder, printed = made_once(name, make)
    return folder, subprocess.CompletedProcess(args, 0, printed["stdout"], printed["stderr"])


def mlp_one_epoch():
    """(The folder of one ``mlp.py --epochs 1 --save m.npz`` run, made once
    (``run_once``) for the tests that start from it or set another run
    against it; what it printed.)  A test copies ``m.npz`` before it changes it."""
    return run_once("mlp_one_epoch", "--epochs", 1, "--save", "{folder}/m.npz", by="mlp.py")


def two_epochs():
    """The folder of one uninterrupted ``cpu cpu --epochs 2`` run, made once
    (``run_once``) for the tests that start from it or set another run
    against it: its summary ``run.json`` and its checkpoint ``m.npz``, which
    a test copies before it changes it."""
    return run_once("two_epochs", "cpu", "cpu", "--epochs", 2, "--json", "{folder}/run.json",
                    "--save", "{folder}/m.npz")[0]


@pytest.fixture(scope="session")
def one_epoch_checkpoint():
    """Copies of one checkpoint of ``cpu cpu --epochs 1``, made once for the
    tests that only need one to resume from: each test gets a copy of its
    own to change, at the path it names."""
    folder, _ = run_once("one_epoch", "cpu", "cpu", "--epochs", 1, "--save", "{folder}/m.npz")

    def copy(path):
        shutil.copyfile(folder / "m.npz", path)
        return path
    return copy


# A run that a test stops (``--epochs 1000``) trains at a test's pace: worker 0
# sleeps 0.1 s at each call's start (the fault hook's slow worker) and its
# peers wait for it at the exchange, which leaves the cores to the other tests
# (a live run at full speed took two cores for as long as its test ran); an
# epoch still ends within 2 s, so a checkpoint comes soon.
PACED = {"DUAL_MLP_FAULT": "0:train:slow=0.1"}


def wait_until_training(proc, timeout=120):
    """Read the launcher's output until worker 0 says it is training."""
    for line in proc.stdout:
        if line.startswith("... training"):
            return
    raise AssertionError(f"run ended before training: {proc.stderr.read()}")


def start_checkpointing(ckpt, *args, env=None):
    """A long run that keeps ``--save ckpt``, once it has written a first checkpoint."""
    proc = start_dual(*args, "--save", ckpt, env=env)
    wait_until_training(proc)
    wait_for(ckpt.exists, 60, "a first checkpoint")
    return proc


def interrupted(err, signame, ckpt):
    """The one line of a run stopped by ``signame`` whose last checkpoint is
    ``ckpt``: it says so, and the command that resumes."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"interrupted ({signame}); resume (epoch ") and \
        "python dual_mlp.py " in lines[0] and lines[0].endswith(f" --resume {ckpt}"), err


# How long a stop may take: its own deadlines (SIGTERM, 2 s, SIGKILL, 2 s) and its
# clean-up, which a busy machine stretches (full suites saw 5.2 and 6.4 s; beside two other
# suites, 11.5 s); a stop that waited out a worker's --timeout (120 s) takes longer.
STOPS_WITHIN = 30


def finish(proc, timeout):
    """Wait for the launcher; returns (exit code, seconds it took, stderr);
    what it printed on stdout is left in ``proc.out``."""
    start = time.monotonic()
    try:
        proc.out, err = proc.communicate(timeout=timeout)
    except Exception:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"launcher still running after {timeout} s") from None
    return proc.returncode, time.monotonic() - start, err


def kill_one_worker(proc, index, device, timeout=10):
    """SIGKILL worker ``index`` of a training run: the launcher must stop within
    ``timeout`` naming it, and every other worker must be gone.  Returns the
    seconds the launcher took."""
    workers = workers_of(proc)
    workers[index].send_signal(signal.SIGKILL)
    code, took, err = finish(proc, timeout)
    assert code == 1 and f"worker {index} (device {device}) failed: killed by SIGKILL" in err
    wait_for(lambda: not any(w.is_running() and w.status() != "zombie" for w in workers), 5,
             "the other workers to exit")
    return took


# -- data sets, good and bad

def splits(n=(30, 20, 20), seed=0):
    rng = np.random.RandomState(seed)
    return tuple((rng.rand(k, 784).astype(np.float32), rng.randint(0, 10, k)) for k in n)


def idx_folder(folder, n_train=10050, n_test=40):
    rng = np.random.RandomState(0)
    images = {"train": rng.randint(0, 256, (n_train, 28, 28)),
              "t10k": rng.randint(0, 256, (n_test, 28, 28))}
    labels = {"train": rng.randint(0, 10, n_train), "t10k": rng.randint(0, 10, n_test)}
    for kind in ("train", "t10k"):
        datasets.write_idx(str(folder / f"{kind}-images-idx3-ubyte.gz"), images[kind])
        datasets.write_idx(str(folder / f"{kind}-labels-idx1-ubyte.gz"), labels[kind])
    return images, labels


def corrupt_cases(tmp_path):
    """(path, words the error must contain) for each kind of bad data set."""
    good = gzip.compress(pickle.dumps(splits(), protocol=2))
    cases = {}

    def file(name, content):
        path = tmp_path / name
        path.write_bytes(content)
        return str(path)
    cases["not gzip"] = (file("plain.pkl.gz", pickle.dumps(splits())), "not a gzip file")
    cases["truncated"] = (file("cut.pkl.gz", good[:len(good) // 2]), "truncated")
    cases["structure"] = (file("two.pkl.gz", gzip.compress(pickle.dumps(splits()[:2]))),
                          "expected ((train_x")
    bad = list(splits())
    bad[1] = (bad[1][0], bad[1][1] + 10)
    cases["labels"] = (file("labels.pkl.gz", gzip.compress(pickle.dumps(tuple(bad)))),
                       "labels must be integers in 0..9")
    bad = list(splits())
    bad[0] = (bad[0][0], bad[0][1][:-1])
    cases["counts"] = (file("counts.pkl.gz", gzip.compress(pickle.dumps(tuple(bad)))),
                       "30 images but 29 labels")
    bad = list(splits())
    bad[2] = (np.full_like(bad[2][0], np.nan), bad[2][1])
    cases["nan"] = (file("nan.pkl.gz", gzip.compress(pickle.dumps(tuple(bad)))),
                    "test images hold NaN or infinite values")
    folder = tmp_path / "idx"
    folder.mkdir()
    idx_folder(folder)
    raw = gzip.decompress((folder / "t10k-images-idx3-ubyte.gz").read_bytes())
    (folder / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(raw[:-784]))
    cases["idx header"] = (str(folder), "IDX header says")
    cases["missing"] = (str(tmp_path / "nothing-here"), "not found")
    return cases


def assert_identical_checkpoints(path, other, state=("epoch",)):
    """Two ``--save`` checkpoints hold the same weights, best weights and
    training ``state`` entries, bit for bit (a resumed run against an
    uninterrupted one); only the run that wrote each differs."""
    weights, best, mine = records.load_checkpoint(str(path), SHAPES, state)
    others, other_best, theirs = records.load_checkpoint(str(other), SHAPES, state)
    for a, b in zip(weights + best, others + other_best):
        np.testing.assert_array_equal(a, b)
    mine.pop("run", None), theirs.pop("run", None)
    assert mine == theirs
