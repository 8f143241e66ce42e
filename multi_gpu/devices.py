"""Where a worker's arrays live, and how its compiled step is called there.

``JaxDevice``
    PyTensor's JAX backend on the one JAX device this process sees: its GPU,
    or the CPU (the CPU's default: ``cpu_backend``).
``HostDevice``
    the CPU with the backend the flags' mode names (``mode=NUMBA``): NumPy
    arrays.
``CudaDevice``
    a GPU.  PyCUDA works on the same memory as JAX, through the device's
    primary context (the one JAX uses): pointers from JAX arrays are valid
    in PyCUDA, and the reverse.

A PyTensor shared variable holds its array in ``container.storage[0]``.
``storage`` reads it and ``place`` sets it without ``set_value``'s copy
back to NumPy, so that data and weights stay on the device: a shared
variable holding a NumPy array is sent to the GPU again at every call.
"""
from multi_gpu import flags  # first: THEANO_FLAGS onto PyTensor's flags
import collections
import contextlib
import math
import os
import platform
import resource
import shutil
import warnings

import numpy as np


def storage(shared):
    """The array a shared variable holds now (a jax.Array under JAX)."""
    return shared.container.storage[0]


def place(shared, value):
    """Set a shared variable's array without a copy back to NumPy (set_value
    would make one), so device arrays stay on the device."""
    shared.container.storage[0] = value


# Modes that leave the CPU's backend to us: none named, or Theano's "the fast one"
CPU_DEFAULT_MODES = (None, "FAST_RUN", "JAX")


def cpu_backend():
    """The backend a CPU worker compiles with: PyTensor's JAX backend, unless
    the flags name another mode (``THEANO_FLAGS=mode=NUMBA``, ``DebugMode``,
    ...).  JAX by default because a newcomer's first run is a compile: XLA
    builds the model in seconds where Numba takes half a minute, keeps its
    programs for the next run (``keep_compiled_programs``), and steps about
    as fast (bench/first_run.py measures all three)."""
    return "JAX" if flags.MODE in CPU_DEFAULT_MODES else "flags"


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


def open_device(dev, jax_on_cpu=False):
    """The device of ``dev`` (a GPU index as a string, or 'cpu')."""
    if dev != "cpu":
        return CudaDevice(int(dev))
    return JaxDevice() if jax_on_cpu or cpu_backend() == "JAX" else HostDevice()


class HostDevice:
    """A worker on the CPU: PyTensor's default backend, NumPy arrays."""

    name = "cpu"
    mode = None  # the mode of PYTENSOR_FLAGS / THEANO_FLAGS
    spin = 0.0
    description = platform.processor() or platform.machine()

    def put(self, array):
        return np.array(array)

    def alias(self, host):
        return host

    def to_host(self, value):
        return np.asarray(value)

    def wait(self, values):
        pass  # NumPy work is done when the call returns

    def close(self):
        pass


class JaxDevice:
    """A worker whose graph PyTensor compiles with its JAX backend, on the one
    JAX device this process sees (its GPU, or the CPU for ``--exchange xla``
    on CPUs)."""

    mode = "JAX"
    spin = 0.0

    def __init__(self):
        import jax
        self.jax = jax
        # PyTensor's JAX backend drops shape assertions and float64 casts (JAX
        # runs 32-bit); it says so once per compiled graph, harmlessly
        warnings.filterwarnings("ignore", "Skipping Assert")
        warnings.filterwarnings("ignore", "Explicitly requested dtype")
        # full float32 matrix products (JAX may otherwise round them to TF32),
        # so that the GPU path follows the CPU path's numbers
        jax.config.update("jax_default_matmul_precision", "highest")
        keep_compiled_programs(jax)
        (self.jax_device,) = jax.local_devices()  # creates JAX's context on our GPU
        platform = self.jax_device.platform
        self.name = "cpu" if platform == "cpu" else f"{platform}{self.jax_device.id}"
        self.description = self.jax_device.device_kind

    def put(self, array):
        return self.jax.device_put(np.asarray(array), self.jax_device)

    def alias(self, host):
        """A JAX array on the CPU that reads ``host`` (a ``host_buffer``) in
        place, as PyCUDA's copies into a GPU's receive buffer are read: what
        the host writes there, the next compiled call sees, with no copy."""
        view = self.jax.dlpack.from_dlpack(host)
        if view.unsafe_buffer_pointer() != host.ctypes.data:
            raise RuntimeError("JAX copied a host buffer it should read in place")
        return view

    def to_host(self, value):
        return np.array(value)

    def wait(self, values):
        self.jax.block_until_ready(values)

    def close(self):
        pass


class CudaDevice(JaxDevice):
    """A worker bound to one GPU.

    The launcher started this process with ``CUDA_VISIBLE_DEVICES`` naming
    only its GPU, so JAX and PyCUDA both see it as device 0 and this process
    takes no memory on any other GPU.  (A CUDA IPC handle still opens memory
    of a GPU the process cannot see.)
    """

    spin = 0.002

    def __init__(self, index):
        super().__init__()
        import pycuda.driver as drv
        from pycuda.compiler import SourceModule

        self.drv, self.name = drv, f"cuda{index}"
        drv.init()
        self.description = drv.Device(0).name()
        self.context = drv.Device(0).retain_primary_context()
        self.context.push()
        self.stream = drv.Stream()
        # One small kernel, launched once per parameter: mine = the mean of
        # every worker's, in rank order (all: n_workers rows of ``stride``).
        self._average = SourceModule(nvcc=nvcc(), source="""
            __global__ void average(float *mine, const float *all, unsigned n,
                                    unsigned stride, unsigned n_workers) {
                for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
                     i += blockDim.x * gridDim.x) {
                    float sum = all[i];
                    for (unsigned w = 1; w < n_workers; ++w) sum += all[w * stride + i];
                    mine[i] = sum / n_workers;
                }
            }""").get_function("average")
        self._average.prepare("PPIII")

    def to_host(self, value):
        """A fresh host copy.  Not np.asarray: a jax.Array caches its first host
        copy, and PyCUDA writes the receive buffer behind JAX's back."""
        self.jax.block_until_ready(value)
        host = np.empty(value.shape, value.dtype)
        self.drv.memcpy_dtoh(host, self.pointer(value))
        return host

    @staticmethod
    def pointer(array):
        return array.unsafe_buffer_pointer()

    def alias(self, recv):
        return recv  # already on the GPU

    def average_in_place(self, params, received, layout):
        """``--avg pycuda``: the kernel, in place on the buffers JAX handed
        back; safe because nothing else holds them and we wait for it."""
        (recv,) = received
        n_workers = recv.size // layout.size
        base, itemsize = self.pointer(recv), layout.dtype.itemsize
        for mine, offset in zip([storage(p) for p in params], layout.offsets):
            n = mine.size
            self._average.prepared_async_call((min((n + 255) // 256, 1024), 1), (256, 1, 1),
                                              self.stream, self.pointer(mine),
                                              base + offset * itemsize, np.uint32(n),
                                              np.uint32(layout.size), np.uint32(n_workers))
        self.stream.synchronize()

    def close(self):
        self.context.pop()
        self.context.detach()


def host_buffer(size, dtype):
    """``size`` zeros in host memory, 64-byte aligned: XLA's CPU client reads
    such a buffer in place (``JaxDevice.alias``); NumPy's own may be less."""
    dtype = np.dtype(dtype)
    raw = np.zeros(size * dtype.itemsize + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + size * dtype.itemsize].view(dtype)


def jax_cache_folder():
    """Where JAX keeps what it compiled: beside PyTensor's own cache."""
    import pytensor
    return os.path.join(pytensor.config.base_compiledir, "jax_cache")


# what XLA's persistent cache did in this process: programs it served ("hits"),
# programs it had not ("misses", compiled then), and the seconds its reads took
CACHE = collections.Counter()
CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "hits",
                "/jax/compilation_cache/cache_misses": "misses"}


def keep_compiled_programs(jax):
    """JAX's persistent compilation cache, for every program (not only the
    slow ones): a second run loads its programs instead of compiling them,
    and ``CACHE`` counts which it did."""
    folder = jax_cache_folder()
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    if not CACHE:  # listen once per process
        CACHE["listening"] = 1
        # an empty cache serves only what this run (another worker, or this
        # process, compiling the same program twice) has just put there
        CACHE["empty_at_start"] = int(not (os.path.isdir(folder) and os.listdir(folder)))
        jax.monitoring.register_event_listener(
            lambda event, **_: CACHE.update([CACHE_EVENTS[event]] if event in CACHE_EVENTS
                                            else []))

        def loading(event, seconds, **_):
            if event == "/jax/compilation_cache/cache_retrieval_time_sec":
                CACHE["loading_s"] += seconds
        jax.monitoring.register_event_duration_secs_listener(loading)
        global CACHE_PROBLEM
        CACHE_PROBLEM = every_cpu_process_keeps_its_programs(jax)


CACHE_PROBLEM = None  # why not every CPU process keeps its own programs, where they do not


def cache_problem():
    """What XLA's cache cannot do for this process, in words, where it
    matters: a CPU worker of JAX's distributed runtime (None elsewhere)."""
    if CACHE_PROBLEM is None:
        return None
    from jax._src import distributed
    return CACHE_PROBLEM if distributed.global_state.client is not None else None


def cache_writer_problem(jax):
    """Why JAX's private writer of its persistent cache is not one
    ``every_cpu_process_keeps_its_programs`` can wrap, in words (None where
    it is: its arguments are JAX 0.10's, or 0.12's, which dropped the
    program's host callbacks)."""
    import inspect

    from jax._src import compiler
    write = getattr(compiler, "_cache_write", None)
    known = ["cache_key", "compile_time_secs", "module_name", "backend", "executable"]
    if write is not None and list(inspect.signature(write).parameters) in (
            known, known + ["host_callbacks"]):
        return None
    return (f"JAX {jax.__version__}'s private jax._src.compiler._cache_write is not the "
            "writer this demo wraps: under --exchange xla on CPUs every worker but the first "
            "compiles its programs again on every run")


def every_cpu_process_keeps_its_programs(jax):
    """JAX writes its persistent cache from process 0 alone, so that a cache
    on shared storage does not take every process's copy of the same
    programs.  A GPU program's key is the same in every process; a CPU
    program's is not (the CPU topology's fingerprint names the process), so
    under ``--exchange xla`` on CPUs every worker but the first found nothing
    of its own and compiled all its programs again on every run (a
    two-worker run on two cores: 7.4 s, and 4.6 s once each keeps its own).
    Here each CPU process writes its own, by a wrapper around JAX's private
    writer; where that is not the writer expected (``cache_writer_problem``:
    another JAX), they compile as before, and this returns why, in words."""
    from jax._src import compilation_cache, compiler, distributed
    problem = cache_writer_problem(jax)
    if problem:
        return problem
    write = compiler._cache_write

    def own_programs_too(cache_key, compile_time_secs, module_name, backend, executable,
                         *host_callbacks):  # JAX 0.10: one more, the program's callbacks
        if distributed.global_state.process_id == 0 or backend.platform != "cpu" or \
                any(host_callbacks) or \
                compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs:
            return write(cache_key, compile_time_secs, module_name, backend, executable,
                         *host_callbacks)
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable,
                                                      backend, int(compile_time_secs))
        except Exception as e:  # as JAX's own writer: a cache that fails costs a compile
            warnings.warn(f"XLA's cache kept no copy of {module_name}: {e}", stacklevel=2)
    compiler._cache_write = own_programs_too
    return None


@contextlib.contextmanager
def not_kept(jax):
    """Compile without writing to the persistent cache: a program with a
    Python callback in it (the GPU-ordered exchange) would come back from
    the cache without its callback."""
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def nvcc():
    """The CUDA compiler PyCUDA builds the kernels with."""
    return shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"


def jax_train_step(model, gradients=False):
    """The model's PyTensor-compiled training step as a JAX function
    ``train(index, data, params) -> cost, new_params``, and the ``data`` it
    reads (the training set, on the device); with ``gradients``, the same
    step without its update, ``-> cost, gradients`` (``gradient_model``).

    PyTensor's JAX backend jits the whole graph; its jitted callable
    (``Function.vm.jit_fn``) takes the inputs of the function's graph in
    their order (the index, the data the ``givens`` read, the shared
    weights) and returns the outputs, then the updated shared values.  Called
    inside another jitted program, it lets the exchange and several steps
    join the tutorial's own step in one compiled program."""
    f = model.gradient_model if gradients else model.train_model
    inputs = [i.variable for i in f.maker.inputs]          # index, data, params, in its order
    updated = [i.variable for i in f.maker.inputs if i.update is not None]
    data_vars = [v for v in inputs[1:] if v not in model.params]

    def train(index, data, params):
        value = dict(zip(data_vars, data)) | dict(zip(model.params, params))
        cost, *more = f.vm.jit_fn(index, *[value[v] for v in inputs[1:]])
        if gradients:
            return cost, more
        new = dict(zip(updated, more))
        return cost, [new[p] for p in model.params]
    return train, [storage(v) for v in data_vars]
