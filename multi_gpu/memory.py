"""How much memory a worker may still take, counted before a model is built.

A model too big for the machine ends in the kernel's OOM killer (exit 137,
no word), or past a container's or ``ulimit -v``'s limit long before the
machine is full: ``memory_problem`` says so in one line first, from what
Linux tells of the machine (``/proc/meminfo``), of each memory cgroup this
process is in (v1 and v2) and of its own address space.
"""
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import math
import os
import resource


def memory_problem(shapes, workers=1, data_values=0):
    """Why this machine's memory cannot hold the MLP of parameter ``shapes``
    in ``workers`` processes beside ``data_values`` float32 values of data
    each, or None (also where nothing tells: not Linux).  Said before any
    process builds it, for a model too big ends in the kernel's OOM killer
    (exit 137, no word), not in a MemoryError: each process keeps its
    replica about 8 times over (weights, gradients, updated weights, best
    weights, the exchange's buffers, its checkpoint's copies)."""
    available = available_memory()
    if available is None:
        return None
    each = 8 * 4 * sum(math.prod(s) for s in shapes) + 4 * data_values
    if workers * each <= available:
        return None
    needs = f"{each / 2**30:.1f} GiB"
    if workers > 1:
        needs += f" a worker, {workers * each / 2**30:.1f} GiB for {workers}"
    return (f"the model with --n-hidden {shapes[0][1]} needs about {needs}; this machine has "
            f"{available / 2**30:.1f} GiB available: a smaller --n-hidden" +
            (", or fewer workers" if workers > 1 else ""))


def available_memory():
    """Bytes this process may still take, or None where nothing tells: the
    machine's available memory, or less where a container's limit (a memory
    cgroup, v1 or v2, this process's and its parents') leaves less: there
    the kernel's OOM killer ends a process long before the machine is full;
    or less where the process's own ``ulimit -v`` (what batch schedulers
    set) leaves less, past which an allocation is a MemoryError."""
    available = proc_bytes("/proc/meminfo", "MemAvailable")
    if available is None:
        return None
    for headroom in (*cgroup_headrooms(), address_space_left()):
        if headroom is not None:
            available = min(available, headroom)
    return max(0, available)


def address_space_left():
    """Bytes this process may still map under its ``ulimit -v`` (RLIMIT_AS),
    or None where it has none."""
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    mapped = None if limit == resource.RLIM_INFINITY else proc_bytes("/proc/self/status",
                                                                       "VmSize")
    return None if mapped is None else limit - mapped


def proc_bytes(path, key):
    """The bytes a line ``KEY: N kB`` of Linux's ``path`` gives, or None."""
    try:
        with open(path) as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith(key + ":"))
    except (OSError, StopIteration, ValueError):
        return None


def cgroup_headrooms():
    """For each memory cgroup this process is in, and each parent: its limit
    less what its members use (file pages that could be dropped aside)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return
    for _, controllers, path in lines:
        if controllers == "":      # v2: limit memory.max, use memory.current
            root, limit, use = "/sys/fs/cgroup", "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1
            root, limit, use = ("/sys/fs/cgroup/memory", "memory.limit_in_bytes",
                                "memory.usage_in_bytes")
        else:
            continue
        folder = os.path.join(root, path.lstrip("/"))
        if not os.path.isdir(folder):  # a container sees its own cgroup as the root
            folder = root
        while folder.startswith(root):
            room = headroom(folder, limit, use)
            if room is not None:
                yield room
            if folder == root:
                break
            folder = os.path.dirname(folder)


def headroom(folder, limit, use):
    """One cgroup's limit less what its members use (its file pages that
    could be dropped aside), or None where it has no limit."""
    try:
        with open(os.path.join(folder, limit)) as f:
            cap = f.read().strip()
        with open(os.path.join(folder, use)) as f:
            used = int(f.read())
        with open(os.path.join(folder, "memory.stat")) as f:
            stat = dict(line.split() for line in f if len(line.split()) == 2)
    except (OSError, ValueError):
        return None
    if not cap.isdigit() or int(cap) >= 1 << 60:
        return None
    return int(cap) - used + int(stat.get("inactive_file", stat.get("total_inactive_file", 0)))
