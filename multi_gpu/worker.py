"""The worker's side of dual_mlp.py: stop signals, orphans, the watchdog.

``run_worker`` reads the request the launcher leaves in the run folder,
asks Linux to end the worker with its launcher, and turns every way a
worker can end into an exit code and at most one line.  A signal only sets
``hooks.stopping``; the worker stops where it may (``hooks.stop_point``),
and the ``Watchdog`` ends it where it cannot notice (inside a call into XLA,
behind a GPU that waits on a peer that is gone).
"""
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import contextlib
import ctypes
import json
import os
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
import types

from multi_gpu import cli, elastic, files
from multi_gpu.hooks import fault_point, request_stop, stopping


def forget_the_launchers_state():
    """In a worker just forked: what the launcher's process held or was
    doing is not its own (its descriptors are closed already)."""
    cli.ON_QUIT.clear()  # the launcher's to undo
    files.SPARE.clear()
    files.WRITING.clear()  # the launcher's temporaries, for it to remove
    stopping.signum = 0


class Watchdog:
    """A thread that ends this worker where its main thread cannot notice:
    when the launcher is gone (an orphan exits at once), when a stop request
    goes unheeded for a second, and, while armed (in an epoch), when no step
    finishes for ``timeout`` seconds.  Where the devices order the steps, a
    GPU waiting for ever on a peer that stalled or died can hold the main
    thread inside a call into XLA: no check of ours runs there, and Python
    runs a signal handler only once that call returns, so the signals reach
    this thread through a wake-up file descriptor.  Every 0.1 s it also
    stamps this worker's heartbeat file in the run folder, so that a stall
    names the worker that stopped running (one machine)."""

    def __init__(self, rank, world, rundir, parent, timeout):
        self.rank, self.world, self.rundir, self.parent = rank, world, rundir, parent
        self.timeout, self.last, self.armed = timeout, time.monotonic(), False
        self.wakeup, writer = os.pipe()
        os.set_blocking(writer, False)
        signal.set_wakeup_fd(writer)
        # The heartbeat file is made once, here, and only touched after: made
        # again while another worker removes the run folder, it would leave
        # the folder there when the last worker goes without removing it
        # (JAX's runtime ends the others once one has gone).
        # It holds where the worker is, "EPOCH STEP" (``follow``), for its
        # launcher to say where a run failed.
        self.beat, self.trainer, self.where = None, None, ""
        try:
            self.beat = files.new_file(heartbeat_path(rundir, rank))
        except FileNotFoundError:
            pass  # the folder is gone already: the watch below ends us
        threading.Thread(target=self._watch, daemon=True).start()

    def follow(self, trainer, epoch):
        """From now on the heartbeat names the step ``trainer`` began last
        (a device-ordered one queues calls ahead), from ``epoch`` on."""
        self.trainer, self.first_epoch = trainer, epoch

    def alive(self):
        self.last = time.monotonic()

    def __enter__(self):
        self.alive()
        self.armed = True

    def __exit__(self, *exc):
        self.armed = False

    def _watch(self):
        stop_seen = None
        beat = heartbeat_path(self.rundir, self.rank)
        while True:
            if select.select([self.wakeup], [], [], 0.1)[0]:
                signum = os.read(self.wakeup, 1)[0]
                stopping.signum = stopping.signum or signum
            now = time.monotonic()
            self.say_where()
            try:
                os.utime(beat, follow_symlinks=False)
            except OSError:  # the run folder is gone: ours, on the way out, or someone's doing
                if not (stopping.is_set() or os.getppid() != self.parent):
                    folder_vanished(self.rank, self.rundir)
            if os.getppid() != self.parent:
                quit_now(128 + signal.SIGTERM)  # the launcher is gone
            if stopping.is_set():
                stop_seen = stop_seen or now
                if now - stop_seen > 1.0:
                    quit_now(128 + stopping.signum)
            elif self.armed and now - self.last > self.timeout:
                late = stopped_workers(self.rundir, self.world, self.rank)
                who = (f"worker {', '.join(map(str, late))} stopped running" if late
                       else "another worker stalled")
                print(f"worker {self.rank}: error: no step finished within {self.timeout:g} s: "
                      f"{who} (see --timeout)", file=sys.stderr, flush=True)
                quit_now(1)

    def finished(self):
        """Trained and written: what follows is the exit, whose heartbeat its
        launcher does not watch."""
        self.trainer = None
        with contextlib.suppress(OSError, AttributeError):
            os.pwrite(self.beat.fileno(), b"done".ljust(32), 0)

    def say_where(self):
        if not (self.trainer and self.beat):
            return
        begun, n = self.trainer.steps_run, self.trainer.n_steps
        where = f"{self.first_epoch + (begun - 1) // n + 1} {(begun - 1) % n + 1}"
        if begun and where != self.where:
            with contextlib.suppress(OSError):
                os.pwrite(self.beat.fileno(), where.ljust(32).encode(), 0)
            self.where = where


def folder_vanished(rank, rundir):
    """The run folder went while the run lives (a temporary-file cleaner,
    systemd's RemoveIPC): its sockets and buffers with it, so the run
    cannot go on; say so, rather than wait on a peer that cannot answer."""
    print(f"worker {rank}: error: the run folder {rundir} was removed while the run was using "
          "it (a cleaner of temporary files?): the run cannot go on", file=sys.stderr,
          flush=True)
    quit_now(1)


def heartbeat_path(rundir, rank):
    return os.path.join(rundir, f"alive-{rank}")


def stopped_workers(rundir, world, me):
    """The other workers of this machine whose heartbeat (``Watchdog``) has
    stopped, by rank: the ones a stall is about, where the worker that
    noticed it may be waiting on one that only waits for them.  A worker
    stopped within the last second does not show yet, so look for a second
    more; none where no worker keeps a heartbeat (or on other machines)."""
    for _ in range(12):
        now, late = time.time(), []
        for rank in range(world):
            try:
                if rank != me and now - os.path.getmtime(heartbeat_path(rundir, rank)) > 1.0:
                    late.append(rank)
            except OSError:
                pass  # on another machine
        if late:
            return late
        time.sleep(0.1)
    return []


class Unwatched:
    """A trainer's watchdog outside a launcher (tests, benchmarks): none."""

    def alive(self):
        pass

    def follow(self, trainer, epoch):
        pass

    def __enter__(self):
        pass

    def __exit__(self, *exc):
        pass


def die_with_parent():
    """Ask Linux to SIGTERM this worker if the launcher dies, even by SIGKILL."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


RUN_FOLDER = None  # this worker's run folder, and its launcher's pid
LAUNCHER = None


def quit_now(code):
    """Exit without Python's clean-up: a GPU may wait for ever on a peer that
    is gone, and freeing its memory, or JAX's own exit, would wait with it.
    Told to stop, or orphaned, it removes the run folder first: the launcher
    may be gone, and the others, stopping too, have their files open.  Else
    the launcher is there to stop the others and remove it (the others may
    still be opening their sockets in it)."""
    if RUN_FOLDER and (stopping.is_set() or os.getppid() != LAUNCHER):
        files.remove_folder(RUN_FOLDER)  # only where it is ours: never a stranger's
    files.drop_unfinished_writes()  # a checkpoint being written when the end came
    release_stdout()
    with contextlib.suppress(OSError):  # the launcher's end is closed
        sys.stderr.flush()
    os._exit(code)


FORWARD = None  # worker 0's thread that passes its standard output on


def keep_stdout_clean(rank, speaks, rundir):
    """One process a machine speaks (``speaks``: worker 0 for the run, the
    first worker of each other node for its node): its standard output
    reaches the terminal without the lines gloo's C++ writes there on every
    rank, and every other worker's goes to a file in the run folder."""
    global FORWARD
    if not speaks:
        with files.new_file(os.path.join(rundir, f"worker-{rank}.out")) as f:
            os.dup2(f.fileno(), 1)
        return
    terminal = os.dup(1)
    reader, writer = os.pipe()
    os.dup2(writer, 1)
    os.close(writer)

    def forward():
        for line in os.fdopen(reader, "rb"):
            if not line.startswith(b"[Gloo]"):
                try:
                    os.write(terminal, line)
                except BrokenPipeError:  # python dual_mlp.py | head: end as head expects
                    files.drop_unfinished_writes()  # a checkpoint being written just then
                    os._exit(128 + signal.SIGPIPE)
    FORWARD = threading.Thread(target=forward, daemon=True)
    FORWARD.start()


def release_stdout():
    """Everything worker 0 wrote is on the terminal before it exits."""
    sys.stdout.flush()
    if FORWARD:
        os.close(1)  # the pipe's last writer: the thread reads to its end
        FORWARD.join(timeout=2)


def the_request(rundir):
    """What the launcher asks (its ``config.json``), once it has left it in
    the run folder; None if the launcher is gone, or asks us to stop, first.
    The folder is checked first: this user's alone (``files.check_folder``),
    or the worker stops in one line and leaves it as it is."""
    made = False
    while not stopping.is_set() and os.getppid() == LAUNCHER:
        try:
            files.check_folder(rundir)
            with files.open_file(os.path.join(rundir, "config.json"), text=True) as f:
                return types.SimpleNamespace(**json.load(f))
        except FileNotFoundError:  # not yet: it starts every worker before it writes it
            there = os.path.isdir(rundir)
            if made and not there:
                folder_vanished("?", rundir)
            made = made or there
            time.sleep(0.005)
        except files.NotPrivate as e:
            print(f"worker ?: error: {e}: the run stops, and leaves it as it is", file=sys.stderr,
                  flush=True)
            quit_now(1)
    return None


def run_worker(work, index, launcher_pid, rundir, one_line_errors):
    """Worker ``index`` of the launcher ``launcher_pid``, forked from it:
    ``work(args, rank, world, device, rundir, watchdog)`` with the request
    the launcher leaves in the run folder ``rundir``.  An error of
    ``one_line_errors`` is said in one line, any other with its traceback.
    Returns never: the process ends here (``quit_now``)."""
    global RUN_FOLDER, LAUNCHER
    RUN_FOLDER, LAUNCHER = rundir, launcher_pid
    # Our error output is a pipe to the launcher: once it is gone, a write
    # there (JAX's runtime logs as its peers go) must not end us by SIGPIPE
    # before we have removed the run folder.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    cli.install_stop_handler(request_stop)  # first: Linux's SIGTERM must find us able to clean
    die_with_parent()
    args = the_request(rundir)
    if args is None:  # the launcher went (or stopped us) before its request came
        return quit_now(128 + signal.SIGTERM)
    rank, world = elastic.first_worker(args) + index, elastic.workers(args)
    # PyTensor writes every compiled graph's Python source to a temporary file
    # it never removes: this worker's go into the run folder, which goes with the run
    tempfile.tempdir = os.path.join(rundir, f"tmp-{index}")
    os.mkdir(tempfile.tempdir)
    fault_point(rank, "compile")
    keep_stdout_clean(rank, index == 0, rundir)
    watchdog = Watchdog(rank, world, rundir, LAUNCHER, args.timeout)
    code = 0
    try:
        work(args, rank, world, args.devices[index], rundir, watchdog)
    except SystemExit as e:  # it said its last word itself (a summary it could not write)
        code = e.code or 0
    except Exception as e:
        if stopping.is_set():  # asked to stop: what broke on the way out is no news
            code = 128 + stopping.signum
        elif isinstance(e, one_line_errors):
            print(f"worker {rank}: error: {e}", file=sys.stderr)
            code = 1
        elif isinstance(e, RuntimeError) and "can't start new thread" in str(e):
            print(f"worker {rank}: error: it could not start a thread: is the user's process "
                  "limit (ulimit -u) too low?", file=sys.stderr)
            code = 1
        elif isinstance(e, OSError) and e.errno in files.NO_ROOM and (
                str(e.filename).startswith(rundir) or e.filename is None and files.full(rundir)):
            # (PyTensor's compiled sources, written into the run folder, name no file)
            print(f"worker {rank}: error: {files.no_room(e, rundir)}", file=sys.stderr)
            code = 1
        else:
            traceback.print_exc()
            code = 1
    if code or os.getppid() != LAUNCHER:
        quit_now(code)
    if args.exchange == "xla":
        # JAX's distributed runtime ends with a barrier the other workers wait
        # for: its heartbeat may stop now
        watchdog.finished()
        import jax
        jax.distributed.shutdown()
    # Done and written: Python's own clean-up of JAX's and PyTensor's modules
    # would take half a second of every run and free nothing the system does not.
    quit_now(0)
