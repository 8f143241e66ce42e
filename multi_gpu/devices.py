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
import multi_gpu.flags as flags  # first: THEANO_FLAGS onto PyTensor's flags

import functools
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import warnings

import numpy as np

from multi_gpu.xla_cache import keep_compiled_programs


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
    builds the model in seconds where Numba takes tens of seconds, keeps its
    programs for the next run (``keep_compiled_programs``), and steps about
    as fast (bench/first_run.py measures all three)."""
    return "JAX" if flags.MODE in CPU_DEFAULT_MODES else "flags"


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


# -- which GPUs there are, asked without starting CUDA here ----------------------------------

# Run in a process of its own: a launcher that started CUDA could not fork
# workers that use it (CUDA does not survive a fork), as 2014's launcher did not either.
GPU_PROBE = """
import json, pycuda.driver as drv
drv.init()
n = drv.Device.count()
print(json.dumps([[a == b or drv.Device(a).can_access_peer(drv.Device(b)) for b in range(n)]
                  for a in range(n)]))
"""


def cpu_notices(devices, float_x):
    """Notices for a run on the CPU that will be slower than it need be:
    more CPU workers than the cores this process may use (``taskset``, a
    cgroup's cpuset), each then a part of a core; float64, which the demo's
    models are not written for (2014's and the GPUs' float32)."""
    workers, cores = devices.count("cpu"), len(os.sched_getaffinity(0))
    if workers > cores:
        yield (f"notice: {workers} CPU workers on {cores} core{'s' * (cores > 1)} (those this "
               "process may use): each gets a part of one, and together they run no faster than "
               f"{cores} worker{'s' * (cores > 1)} would")
    if workers and float_x == "float64":
        yield ("notice: floatX=float64: the demo's models are written for float32 (2014's, "
               "and the GPUs'); float64 takes twice the memory and runs slower")


@functools.cache
def gpu_probe():
    """(which GPUs can read which one's memory, a matrix; why there are none)."""
    if importlib.util.find_spec("jax") is None:
        return [], "JAX is not installed"
    if importlib.util.find_spec("pycuda") is None:
        return [], "PyCUDA is not installed"
    try:
        out = subprocess.run([sys.executable, "-c", GPU_PROBE], capture_output=True, text=True,
                             timeout=120)
    except subprocess.TimeoutExpired:
        return [], "CUDA did not start within 120 s"
    if out.returncode:  # pycuda.driver.Error: no driver, no device
        last = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        return [], f"CUDA does not start ({last})"
    return json.loads(out.stdout), "no GPU found"


def usable_gpus():
    """(number of GPUs the GPU path can use, why none); starts no CUDA here."""
    peers, why = gpu_probe()
    return len(peers), why


def peer_access(a, b):
    """Can GPU a read GPU b's memory directly (NVLink or PCIe peer-to-peer)?"""
    return gpu_probe()[0][a][b]
