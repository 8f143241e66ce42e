"""The launcher's side of dual_mlp.py: its worker processes.

Once ``request.py`` has checked the request, ``fork_workers`` forks one
worker process per local device, each seeing its own GPU only, whose error
output passes through a ``Worker``; ``stop`` ends them (SIGTERM, then
SIGKILL after two seconds), and a failed one names the line of its output
that says what went wrong.  ``supervisor.py`` runs the run's life with
them; ``worker.py`` is the other side of the process boundary.
"""
import multi_gpu.flags as flags  # first: THEANO_FLAGS onto PyTensor's flags, before PyTensor

import collections
import contextlib
import ctypes
import dataclasses
import functools
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings

from multi_gpu import cli, datasets, elastic, files
from multi_gpu.nodes import LOST_AFTER
from multi_gpu.worker import forget_the_launchers_state, heartbeat_path


def worker_environment(dev, n_local, one_machine=True):
    env = dict(os.environ)
    if one_machine:  # NCCL's bootstrap sockets on the loopback, where nobody else reaches
        env["NCCL_SOCKET_IFNAME"] = "lo"
    if dev == "cpu":
        # the workers share the cores: each gets its part, or they fight over all of them
        threads = str(max(1, (os.cpu_count() or 2) // n_local))
        env.update(dict.fromkeys(flags.THREAD_VARIABLES, threads), JAX_PLATFORMS="cpu")
        if threads == "1":  # a core each: XLA would split every op over all of them
            env["XLA_FLAGS"] = " ".join(filter(None, (env.get("XLA_FLAGS"),
                                                      "--xla_cpu_multi_thread_eigen=false")))
    else:
        # the worker sees its own GPU only; JAX takes memory as it needs it,
        # not 75% up front, so that two workers can share a GPU
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpu = visible.split(",")[int(dev)] if visible else dev
        env.update(CUDA_VISIBLE_DEVICES=gpu, JAX_PLATFORMS="cuda",
                   XLA_PYTHON_CLIENT_PREALLOCATE="false")
    return env


def limit_blas_threads(env):
    """NumPy's BLAS took its number of threads as the launcher imported it:
    a forked CPU worker sets its own part of the cores (``env``'s, from
    ``worker_environment``), or two workers' BLAS threads fight over every
    core (Numba's step, which calls BLAS, ran 4 to 10 times slower)."""
    if env.get("OPENBLAS_NUM_THREADS"):
        from threadpoolctl import threadpool_limits
        threadpool_limits(int(env["OPENBLAS_NUM_THREADS"]), user_api="blas")


def preload():
    """Import, once, what every worker imports: each is forked from the
    launcher and finds it loaded (a second of CPU a worker).  JAX is
    imported, not started: no backend, so none of its threads, and no CUDA
    (JAX itself warns at a fork once a backend runs)."""
    import jax  # noqa: F401
    import pytensor.link.jax.dispatch  # noqa: F401


class Forked:
    """A worker process, forked from the launcher as 2014's
    ``multiprocessing.Process`` children were, with the part of
    ``subprocess.Popen``'s interface the launcher uses.  The child runs
    ``start()`` as a new process would: its error output a pipe to the
    launcher, no descriptor, signal handler or clean-up of the launcher's,
    the environment ``env``, and fresh standard streams (a lock of the
    launcher's threads' is not its)."""

    def __init__(self, start, env, name):
        reader, writer = os.pipe()
        for stream in filter(None, (sys.stdout, sys.stderr)):  # or the child writes it again
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        # no stop signal's handler of the launcher's may run in the child
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, cli.STOP_SIGNALS)
        try:
            with warnings.catch_warnings():
                # Python warns at any fork beside threads: here NumPy's BLAS's, idle,
                # (and the lobby's, on several nodes), whose locks the child never takes
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:
                self._become_worker(start, env, name, writer, blocked)
        except OSError:  # no worker came: its end of the pipe is not wanted
            os.close(reader)
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            os.close(writer)
        with contextlib.suppress(OSError):  # set on both sides: no signal finds it between
            os.setpgid(pid, pid)
        self.pid, self.returncode = pid, None
        self.stderr = os.fdopen(reader, errors="replace")

    @staticmethod
    def _become_worker(start, env, name, writer, blocked):
        code = 1
        try:
            # A process group of its own: a terminal's Ctrl-C reaches the launcher
            # alone, which stops every worker, whatever each is doing just then.
            os.setpgid(0, 0)
            os.dup2(writer, 2)
            os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            for signum in cli.STOP_SIGNALS:
                signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            forget_the_launchers_state()
            os.environ.clear()
            os.environ.update(env)
            limit_blas_threads(env)
            import jax  # JAX read JAX_PLATFORMS as the launcher imported it
            jax.config.update("jax_platforms", env.get("JAX_PLATFORMS"))
            if env.get("JAX_PLATFORMS") == "cpu":  # one device a worker, whatever
                jax.config.update("jax_num_cpu_devices", 1)  # JAX_NUM_CPU_DEVICES says
            # (descriptor 1 is open: /dev/null where the launcher started without, flags.py)
            sys.stdout, sys.stderr = cli.text_stream(1, sys.stdout), cli.text_stream(2, sys.stderr)
            with contextlib.suppress(OSError, AttributeError):  # ps, top and pgrep show it
                ctypes.CDLL(None).prctl(15, name.encode()[:15])  # PR_SET_NAME
            code = start()
        except SystemExit as e:  # sys.exit(): a number, or words for the error output
            if not (e.code is None or isinstance(e.code, int)):
                print(e.code, file=sys.stderr)
            code = e.code if e.code is None or isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os._exit(code or 0)

    def poll(self):
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, signum):
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


class Worker:
    """A worker process seen from the launcher.  One process speaks: worker
    0's warnings and notices pass through to the terminal; every other line
    of error output is kept, to say why a worker failed (with its traceback
    where it failed unexpectedly), and nothing passes once the run is being
    stopped (JAX's runtime logs pages of fatal lines as its peers go)."""

    # what names a failure: our own one-line errors, a Python exception, a
    # fatal log line of JAX's runtime (glog: F1130 12:00:00.000 123 file.cc:80] ...,
    # whose words are told as XLA's)
    FATAL = re.compile(r"F\d{4} \S+ +\d+ \S+\] (.*)")
    # XLA reads XLA_FLAGS only as a worker starts: a flag it does not know is bad input all the same
    BAD_INPUT = "XLA's runtime: Unknown flag in XLA_FLAGS"
    ERROR = re.compile(rf"(worker \d+: error: .*|[\w.]*(Error|Exception)\b.*|{FATAL.pattern})")
    SPOKEN = re.compile(r"worker 0: (warning|notice): .*")
    quiet = False  # set for every worker once the run is being stopped

    def __init__(self, start, index, rank, dev, rundir, n_local, one_machine):
        """Fork the worker: ``start(index, launcher's pid, rundir)`` in it.  The
        run folder's name is passed in memory: a command line is every user's
        to read in /proc."""
        self.rank, self.dev = rank, dev
        self.proc = Forked(functools.partial(start, index, os.getpid(), rundir),
                           worker_environment(dev, n_local, one_machine), f"dual_mlp w{rank}")
        self.tail = collections.deque(maxlen=200)
        self.last_word = 0.0  # when its last line of error output came (monotonic)
        self.pump = threading.Thread(target=self._pass_stderr, daemon=True)

    def _pass_stderr(self):
        with self.proc.stderr:  # read to its end: the worker is gone
            for line in self.proc.stderr:
                self.last_word = time.monotonic()
                if not Worker.quiet and self.SPOKEN.fullmatch(line.rstrip()):
                    cli.say(line, end="", file=sys.stderr)
                self.tail.append(line.rstrip())

    def stalled(self, rundir, patience, since):
        """Has its heartbeat (``worker.Watchdog``) been still for ``patience``
        seconds while it trains (its heartbeat names a step), counted from
        ``since`` at the earliest (the wall-clock time the launcher last woke
        from a wait of its own: a machine stopped whole stopped the worker's
        heartbeat with it)?  Before its first step --timeout governs, as it
        does meeting and compiling, where a call into JAX may hold Python's
        lock for seconds; after its last, it only exits."""
        path = heartbeat_path(rundir, self.rank)
        try:
            if time.time() - max(os.stat(path).st_mtime, since) < patience:
                return False
            with open(path) as f:
                return len(f.read(32).split()) == 2  # "EPOCH STEP", not "done" or nothing
        except OSError:
            return False

    def finished(self, rundir):
        """Has it trained and written all it had to (its heartbeat says
        "done"), or ended well?  What is left is its exit."""
        if self.proc.poll() == 0:
            return True
        try:
            with open(heartbeat_path(rundir, self.rank)) as f:
                return f.read(4) == "done"
        except OSError:
            return False

    def said_why(self):
        """Did it end with one of our own one-line errors?"""
        self.pump.join(timeout=2)
        return any(line.startswith(f"worker {self.rank}: error: ") for line in self.tail)

    def cause(self):
        """The line of its error output that says what went wrong, how it
        ended, and before them its traceback where it failed unexpectedly."""
        self.pump.join(timeout=2)
        code = self.proc.returncode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        lines = [line for line in self.tail if line.strip()]
        errors = [line.strip() for line in lines if self.ERROR.fullmatch(line.strip())]
        last = (errors or [line.strip() for line in lines] or [None])[-1]
        fatal = last and self.FATAL.fullmatch(last)
        last = f"XLA's runtime: {fatal.group(1)}" if fatal else last
        trace = lines[max(i for i, line in enumerate(lines) if line.startswith("Traceback")):-1] \
            if any(line.startswith("Traceback") for line in lines) else []
        return "".join(line + "\n" for line in trace), f"{last} ({how})" if last else how


def stop(workers, grace=2.0):
    """SIGTERM every worker still running, SIGKILL what is left after
    ``grace``, and wait ``grace`` more for those; returns the ones that would
    not die even so (frozen: ``docker pause``, a freezer cgroup, a stall in
    the kernel), which the launcher names and leaves instead of waiting for
    them without a word."""
    Worker.quiet = True
    for w in workers:
        if w.proc.poll() is None:
            w.proc.terminate()
    deadline = time.monotonic() + grace
    for w in workers:
        try:
            w.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
    deadline = time.monotonic() + grace
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(max(0.0, deadline - time.monotonic()))
    return [w for w in workers if w.proc.poll() is None]


def unkillable(left):
    """What the launcher adds to its last line about workers it could not stop."""
    return "".join(f"; worker {w.rank} (pid {w.proc.pid}) cannot be stopped (frozen?) and is "
                   "left as it is" for w in left)


def fork_workers(args, start, rundir):
    """A worker for each of this node's devices, forked from here."""
    preload()
    n_local, workers = len(args.devices), []
    for i, dev in enumerate(args.devices):
        workers.append(Worker(start, i, elastic.first_worker(args) + i, dev, rundir, n_local,
                              args.one_machine))
    for w in workers:  # once every fork is done: no thread of ours to fork beside
        w.pump.start()
    return workers


def leave_the_request(plan, rundir):
    """The run's request in its folder, for the workers: the checkpoint to
    resume and the data set as ``check_request`` read and checked them
    (whatever the files hold now), and ``config.json`` (the ``plan``, and
    where those two are), whole or not at all.  Returns what went wrong, in
    one line, or None."""
    request = os.path.join(rundir, "config.json")
    written = {field.name: getattr(plan, field.name) for field in dataclasses.fields(plan)
               if field.name not in ("checked_resume", "checked_data")}
    written.update(resume_copy=os.path.join(rundir, "resume.npz"),
                   dataset_copy=os.path.join(rundir, datasets.RUN_COPY))
    try:
        if plan.resume:
            with files.new_file(written["resume_copy"]) as f:
                f.write(plan.checked_resume)
        with files.new_file(written["dataset_copy"]) as f:
            datasets.write_run_copy(f, plan.checked_data)
        with files.new_file(request + ".part", text=True) as f:
            json.dump(written, f)
        os.replace(request + ".part", request)
    except FileNotFoundError:
        return f"the run folder {rundir} was removed as the run started (a cleaner of " \
            "temporary files?)"
    except OSError as e:
        if e.errno not in files.NO_ROOM:
            raise
        return files.no_room(e, rundir)
    return None


def by_cause(failed):
    """The failed workers, the cause first: one killed by a signal, then one
    that said what went wrong in our own words, then the one whose error came
    first; the others' errors may only follow from theirs (a peer's socket
    gone between its poll and its send)."""
    return sorted(failed, key=lambda w: (w.proc.returncode > 0, not w.said_why(), w.last_word))


def stall_patience(timeout):
    """Seconds a worker's heartbeat may stop before its launcher calls it
    stopped (SIGSTOP, a frozen container): ``LOST_AFTER``; where --timeout
    is shorter, a little more than it, so that the worker waiting for it
    names it first."""
    return LOST_AFTER if timeout >= LOST_AFTER else timeout + 3


def position(rundir, rank):
    """' at epoch E, step S': the step worker ``rank`` began last, by its
    heartbeat (``worker.Watchdog``); empty before its first."""
    try:
        with open(heartbeat_path(rundir, rank)) as f:
            epoch, step = map(int, f.read(64).split())
    except (OSError, ValueError):
        return ""
    return f" at epoch {epoch}, step {step}" if epoch else ""
