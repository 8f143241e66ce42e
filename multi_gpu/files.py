"""The files the demo writes: its run's private folder, safe from other
users, and its outputs, written whole or not at all.

A run's sockets, weight buffers, heartbeats and request live in one folder
in ``/dev/shm`` (or on disk).  Other people may have accounts on the same
machine, so the folder follows the rule OpenSSH and PostgreSQL keep for
their private files: its owner makes it, exclusively (``mkdir`` fails if
the name is taken), mode 0700, before its name is shown anywhere; and every
process that uses it first checks that it is what it should be: a
directory, not a symbolic link, owned by this user, mode 0700
(``check_folder``).  Once it is, nobody else can make, replace or link
anything inside; the files in it are still opened without following links
and checked as they are opened (``new_file``, ``open_file``).

An output (a checkpoint, a summary) is written into a temporary file of
this process's own beside it and renamed into place once complete
(``atomic_write``): a crash leaves the previous file as it was.
"""
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import contextlib
import errno
import math
import os
import re
import secrets
import shutil
import stat
import sys
import tempfile
import time

import numpy as np


class NoRunFolder(Exception):
    """No place for the run's folder: why, in one line."""


class NotPrivate(Exception):
    """The run folder, or a file in it, is not this user's alone: one line."""


def make_folder(path):
    """Make the private folder ``path``: fails if anything is there already
    (another user's folder, file or link of that name), never reuses it."""
    os.mkdir(path, 0o700)  # umask only takes bits away: 0700 or less
    os.chmod(path, 0o700, follow_symlinks=False)
    check_folder(path)


def check_folder(path):
    """Refuse a run folder that is not this user's alone (``NotPrivate``)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NotPrivate(f"{path} is not a folder (a symbolic link?): not this run's folder")
    if st.st_uid != os.geteuid():
        raise NotPrivate(f"{path} belongs to uid {st.st_uid}, not to this user "
                         f"({os.geteuid()}): not this run's folder")
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise NotPrivate(f"{path} has mode {stat.S_IMODE(st.st_mode):o}, not 700: other "
                         "users could reach into it")


NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def no_room(error, folder):
    """The one line for a write into the run folder that found no room."""
    return (f"no room left in the run folder {folder} ({error.strerror}): is its file "
            "system full? (another process may have filled /dev/shm after the run's check)")


def full(folder):
    """Has the file system of ``folder`` no room left (less than 1 MB)?"""
    try:
        return shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def remove_folder(path):
    """Remove the run folder ``path`` and all in it, where it is this user's
    alone (``check_folder``); another user's, or a link, is left as it is.
    Returns why what was ours is still there, or None."""
    try:
        check_folder(path)
    except (OSError, NotPrivate):
        return None
    while SPARE:  # the descriptors removing it needs, where the process has no others left
        os.close(SPARE.pop())
    failed = []

    def note(function, name, e):  # onexc's exception, or onerror's (type, value, traceback)
        failed.append(e if isinstance(e, BaseException) else e[1])
    shutil.rmtree(path, **{"onexc" if sys.version_info >= (3, 12) else "onerror": note})
    return next((e.strerror or str(e) for e in failed if not isinstance(e, FileNotFoundError)),
                None)


SPARE = []  # descriptors held for the run folder's removal (``keep_descriptors``)


def keep_descriptors(n=4):
    """Hold ``n`` descriptors (of /dev/null) for ``remove_folder``: where this
    process's open files fill up while it runs (a stranger's connections held
    open to its listening socket, ``ulimit -n`` lowered under it), removing
    the run folder still finds the few it needs."""
    while len(SPARE) < n:
        SPARE.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))


def _checked(fd, path):
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise NotPrivate(f"{path} is not a regular file of this user's")
    return fd


FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


def new_file(path, size=0, text=False):
    """A new file in the run folder, made here and only here (``O_EXCL``, no
    link followed, mode 0600), ``size`` bytes of zeros, open for writing."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | FLAGS, 0o600)
    try:
        if size:  # taken for real: a file mapped into memory on a full disk would end in SIGBUS
            os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise OSError(e.errno, e.strerror, path) from None
    return os.fdopen(fd, "w" if text else "r+b")


def open_file(path, text=False, write=False):
    """A file of the run folder, opened for reading (and ``write``: writing)
    without following a link, and only if it is a regular file of this user's."""
    fd = _checked(os.open(path, (os.O_RDWR if write else os.O_RDONLY) | FLAGS), path)
    return os.fdopen(fd, ("r+" if write else "r") + ("" if text else "b"))


def temporary_prefix(path):
    """The start of the names of this process's temporaries for ``path``:
    ``.NAME.PID.`` (then 8 random characters and ``.tmp``), so that one
    run's temporaries cannot be taken for another's or for a user's file."""
    return f".{os.path.basename(path)}.{os.getpid()}."


# how much longer than NAME a temporary's name is: ".NAME.PID.XXXXXXXX.tmp", pids to 7 digits
TEMPORARY_LONGER = len("..") + 7 + len(".") + 8 + len(".tmp")


def is_temporary_of(entry, name):
    """The pid in ``entry`` if it is a temporary ``atomic_write`` made for ``name``, else None."""
    found = re.fullmatch(rf"\.{re.escape(name)}\.(\d+)\.[a-z0-9_]{{8}}\.tmp", entry)
    return int(found.group(1)) if found else None


@contextlib.contextmanager
def atomic_write(path):
    """Open a temporary file beside ``path`` for writing and move it into
    place only once it is complete: a crash leaves the old file intact.  The
    temporary is this process's own (created ``O_EXCL``, named by
    ``temporary_prefix``), and only a regular file, or nothing, is replaced."""
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                   prefix=temporary_prefix(path), suffix=".tmp")
    except OSError as e:  # the folder went, or went read-only: name the file asked for
        raise OSError(e.errno, e.strerror, path) from None
    WRITING.add(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~umask())  # as open() would have made it: the user's umask
        if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
            raise OSError(errno.EEXIST, "not a regular file, left as it is", path)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:  # a write into the file: name ours
            raise OSError(e.errno, e.strerror, path) from None
        raise
    finally:
        WRITING.discard(tmp)


WRITING = set()  # the temporaries ``atomic_write`` is writing now


def umask():
    """This process's umask, read where it does not change it (Linux's
    /proc): setting it to read it back would, for a moment, change the mode
    of what another thread makes."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def drop_unfinished_writes():
    """Remove the temporaries of the writes still in progress: for a process
    that must end now, mid-write (its launcher killed), and leave nothing."""
    for tmp in list(WRITING):
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def mapped(path, layout, mode):
    """A run-folder file of ``layout``'s floats mapped into memory
    (``np.memmap``): ``new`` (made here, exclusively), ``r`` or ``r+``."""
    with (new_file(path, layout.nbytes) if mode == "new" else
          open_file(path, write=mode == "r+")) as f:
        return np.memmap(f, layout.dtype, mode="r" if mode == "r" else "r+",
                         shape=(layout.size,))


# -- the run folder: where, and the dead runs' left there ----------------------------------

def private_coordinator(rundir):
    """Where JAX's coordinator listens on one machine: a Unix socket in the
    run's private folder, which no other user can reach (gRPC takes
    ``unix:`` addresses), not a TCP port on the loopback, which any can."""
    return "unix:" + os.path.join(rundir, COORDINATOR_SOCKET)


COORDINATOR_SOCKET = "coordinator.sock"


SOCKET_PATH_MAX = 107  # an ipc:// socket's path, in bytes (Linux's sun_path, less its NUL)


def folder_name(launcher, tail):
    """A private folder of a run's, named after its ``launcher`` (a pid): the
    run folder (``run_folder``) and node 0's door's (``lobby.Lobby``, which
    names it for the door): whoever finds one left (the launcher and its door
    killed at once) knows whose it was (``drop_folders_of_dead_runs``)."""
    return f"dual_mlp-{launcher}-{tail}"


DOOR_TAIL = "door-"  # the door's folder's, before mkdtemp's 8 characters
RUN_FOLDER_NAME = re.compile(folder_name(r"(\d+)",
                                         rf"(?:[0-9a-f]{{16}}|{DOOR_TAIL}[a-z0-9_]{{8}})"))
STALE_AFTER = 60  # seconds without a heartbeat: a run folder nobody is left to remove


def drop_folders_of_dead_runs(parent):
    """Remove the run folders of this user's earlier runs in ``parent`` that
    nobody was left to remove (the launcher SIGKILLed with its workers, a
    machine's processes killed at once): its launcher is gone and nothing in
    it changed for ``STALE_AFTER`` s.  /dev/shm is memory."""
    with contextlib.suppress(OSError), os.scandir(parent) as entries:
        for entry in entries:
            found = RUN_FOLDER_NAME.fullmatch(entry.name)
            if not found or alive(int(found.group(1))):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                if not entry.is_dir(follow_symlinks=False) or st.st_uid != os.getuid():
                    continue
                last = max([st.st_mtime] + [os.lstat(os.path.join(entry.path, f)).st_mtime
                                            for f in os.listdir(entry.path)])
            except OSError:  # another run removed it meanwhile
                continue
            if time.time() - last > STALE_AFTER:
                shutil.rmtree(entry.path, ignore_errors=True)


def running_beside():
    """A notice where other launchers of this user run on this machine now
    (their run folders, their processes alive): their workers share its
    cores, and each run is slower than alone."""
    pids = set()
    for parent in {"/dev/shm", tempfile.gettempdir()}:
        with contextlib.suppress(OSError), os.scandir(parent) as entries:
            pids |= {int(found.group(1)) for found in map(RUN_FOLDER_NAME.fullmatch,
                                                          (entry.name for entry in entries))
                     if found}
    mine = sorted(pid for pid in pids - {os.getpid()} if alive(pid) and owned(f"/proc/{pid}"))
    if not mine:
        return None
    many = len(mine) > 1
    return (f"notice: {len(mine)} other dual_mlp.py launcher{'s' * many} of yours "
            f"run{'s' * (not many)} on this machine now (pid {', '.join(map(str, mine))}): "
            f"{'their' if many else 'its'} workers share the cores, and each run is slower "
            "than alone")


def owned(path):
    """Whether ``path`` is this user's (False where it is gone)."""
    try:
        return os.stat(path).st_uid == os.getuid()
    except OSError:
        return False


def run_folder(args, shapes):
    """Where the run's private folder for its sockets, buffers and heartbeats
    will be (``Supervisor.start`` makes it): in shared memory where it has
    room for them, else on disk; named after this launcher, so that nobody
    mistakes it for another run's, and unguessable.  Dead runs' folders
    there go."""
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    for parent in {shm, tempfile.gettempdir()} - {None}:
        drop_folders_of_dead_runs(parent)
    n_params = sum(math.prod(s) for s in shapes)
    data = sum(a.nbytes for split in getattr(args, "checked_data", ()) for a in split)
    needed = 4 * len(args.devices) * n_params * 4 + data + (1 << 20)  # weights, data, room
    notice = None
    if shm and shutil.disk_usage(shm).free < needed:
        notice = (f"notice: /dev/shm has {shutil.disk_usage(shm).free >> 20} MB free, the run "
                  f"needs {needed >> 20} MB there: its buffers go to a folder on disk")
        shm = None
    folder = shm or tempfile.gettempdir()
    name = folder_name(os.getpid(), secrets.token_hex(8))
    n = len(args.devices)
    socket = os.path.join(folder, name, max(f"peer-{n - 2}-{n - 1}.sock", COORDINATOR_SOCKET,
                                            key=len))  # the longest path
    if len(socket.encode()) > SOCKET_PATH_MAX:
        if folder == "/tmp" or not os.access("/tmp", os.W_OK):
            raise NoRunFolder(f"{folder} is too deep a folder for the run's sockets (a path of "
                             f"{len(socket.encode())} bytes; Linux takes {SOCKET_PATH_MAX}): "
                             "set TMPDIR to a shorter one")
        notice = (f"notice: {folder} is too deep a folder for the run's sockets: its "
                  "buffers and sockets go to /tmp")
        folder = "/tmp"
    if shutil.disk_usage(folder).free < needed:
        raise NoRunFolder(f"{folder} has {shutil.disk_usage(folder).free >> 20} MB free, the "
                         f"run needs {needed >> 20} MB for its buffers")
    return os.path.join(folder, name), notice


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True
