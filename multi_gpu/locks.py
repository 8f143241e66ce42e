"""A run's outputs held: a lock file beside each (``.NAME.lock``), which a
second run asking for the same output finds taken and is refused by, so that
no run writes over another live run's checkpoint or summary; and the room
for each set aside before the run starts (``hold``).
"""
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import argparse
import contextlib
import errno
import fcntl
import os
import stat
import sys
import tempfile

from multi_gpu import cli, files
from multi_gpu.records import CheckpointError

LOCK_TAG = b"dual_mlp lock, pid "  # what a lock file this demo made starts with


@contextlib.contextmanager
def hold(*paths, room=0):
    """Hold each output in ``paths`` (None: no output) for this run: a lock
    file beside it (``.NAME.lock``), which a second run finds taken and is
    refused by, so that no run writes over another live run's checkpoint or
    summary.  The lock is a regular file this run made or a lock of an
    earlier one (opened ``O_NOFOLLOW``; a symlink or a user's file of that
    name is refused, never truncated), and it is removed only if it is
    still the one this run holds.  Once held, an earlier run's temporaries
    (``files.is_temporary_of``) go, only where the run that made them is
    gone; and ``room`` bytes are set aside once, for real, beside each
    output: a full disk is found before training, not after.  Every path
    is first checked as an option's output is (``cli.writable``): one the
    run derives (a trace's picture, a node's trace) too."""
    paths = [os.path.abspath(p) for p in paths if p]
    for path in paths:
        try:
            cli.writable(path)
        except argparse.ArgumentTypeError as e:
            raise CheckpointError(str(e)) from None
    locks = {path: lock_name(path) for path in paths}
    for path in paths:
        check_not_a_lock(path, locks)
    with contextlib.ExitStack() as held:
        for path in paths:
            held.enter_context(lock(path, locks[path], room))
        yield


def lock_name(path):
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.lock")


def check_not_a_lock(path, locks):
    """An output may not be a lock file, this run's or another's."""
    other = next((p for p, lock in locks.items() if cli.same_file(path, lock)), None)
    if other:
        raise CheckpointError(f"{path} is the lock file of {other}: choose another name")
    try:
        with open(path, "rb") as f:
            start = f.read(len(LOCK_TAG))
    except OSError:
        return
    if start == LOCK_TAG:
        raise CheckpointError(f"{path} is the lock file of a run's checkpoint: choose another name")


@contextlib.contextmanager
def lock(path, lock_path, room):
    fd = take_lock(path, lock_path)
    with cli.on_quit(lambda: release(fd, lock_path)):
        try:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, LOCK_TAG + str(os.getpid()).encode(), 0)
            except OSError as e:  # a full disk takes an empty file, not its first bytes
                raise CheckpointError(f"cannot write {path}: {e.strerror.lower()}") from None
            drop_temporaries_of_the_dead(path)
            if room:
                set_aside(path, room)
            yield
        finally:
            drop_temporaries_of_the_dead(path)  # a worker killed as it wrote: this run's own
            release(fd, lock_path)


def drop_temporaries_of_the_dead(path):
    """Remove the temporaries of ``path`` (``files.is_temporary_of``) whose
    writer is gone: only the run holding ``path``'s lock calls this."""
    folder, name = os.path.split(path)
    with contextlib.suppress(OSError):  # the folder went: nothing to tidy there
        for entry in os.listdir(folder):
            pid = files.is_temporary_of(entry, name)
            if pid is not None and pid != os.getpid() and not files.alive(pid):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, entry))


def release(fd, lock_path):
    """Remove the lock file where it is still the one ``fd`` holds, then close it."""
    try:
        if os.path.samestat(os.fstat(fd), os.lstat(lock_path)):
            os.unlink(lock_path)
    except FileNotFoundError:
        pass
    except OSError as e:  # its folder went read-only, or the descriptor is closed already
        if e.errno != errno.EBADF:
            print(f"warning: could not remove the lock {lock_path} ({e.strerror}); a later run "
                  "takes it over", file=sys.stderr)
    with contextlib.suppress(OSError):
        os.close(fd)


def take_lock(path, lock_path):
    """The open, locked descriptor of ``path``'s lock file (see ``hold``)."""
    how = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    while True:
        try:
            fd, made = os.open(lock_path, how | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            try:
                fd, made = os.open(lock_path, how), False
            except FileNotFoundError:  # a finishing run removed it just now
                continue
            except OSError as e:
                raise CheckpointError(f"{lock_path}, where {path}'s lock goes, cannot be used "
                                      f"({e.strerror}; a symbolic link?): move it away") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointError(f"{lock_path}, where {path}'s lock goes, is not a regular "
                                  "file: move it away")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 64, 0)[len(LOCK_TAG):].decode(errors="replace").strip() or "?"
            os.close(fd)
            raise CheckpointError(f"{path} is being written by another run (pid {owner}): "
                                  "choose another name, or wait for it") from None
        if not made and os.pread(fd, len(LOCK_TAG), 0) != LOCK_TAG:
            os.close(fd)
            raise CheckpointError(f"{lock_path} exists and is not a lock this demo made: it "
                                  f"is left as it is; move it away to write {path}")
        try:  # the lock file still there, not one a finishing run has just removed
            if os.path.samestat(os.fstat(fd), os.lstat(lock_path)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def set_aside(path, nbytes):
    """Take ``nbytes`` beside ``path`` for real, then give them back: a full
    disk says so now (ENOSPC), not once training has run."""
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=files.temporary_prefix(path), suffix=".tmp")
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        raise CheckpointError(f"cannot write {path}: {e.strerror.lower()} (it needs about "
                              f"{nbytes / 1e6:.1f} MB)") from None
    finally:
        os.close(fd)
        os.unlink(tmp)
