"""The 2014 exchange, ordered by the GPUs instead of the host (``--sync gpu``).

In 2014 the host ordered every step: it waited for its GPU, published,
passed a zmq barrier, copied, passed another, averaged.  Each wait stopped
the host from queueing the next step while the GPU ran this one, and on a
modern GPU that lost overlap costs more than the step itself.  Here the same
buffers and the same copies are enqueued on the GPU's own stream, from inside
the compiled training step, and the two GPUs order them between themselves:
within a step the host waits for nothing.

Each worker allocates with PyCUDA, once, and shares by CUDA IPC, once:

* ``send``: two slots of the flat weights, used by step parity, so that a
  worker can publish step t+1 while its peer still copies step t;
* ``flags``: the counters of ``struct Flags`` (in ``KERNELS``): ``begun``,
  the steps begun here, which only this GPU writes; ``peer_published`` and
  ``peer_copied``, the last step the peer has published and the last it has
  copied from our send buffer, which the PEER writes, over NVLink, into
  this GPU's memory.

The weights travel as one flat buffer (``exchange.Layout``).  After the
training step of step t, five small kernels run on XLA's stream::

    begin        t = ++begun; wait until peer_copied >= t - 2
                 (the peer read send[t % 2] then; we are about to overwrite it)
    publish      my new weights -> send[t % 2]
    signal_wait  fence; peer's peer_published = t; wait until peer_published >= t
    fetch        peer's send[t % 2] -> this step's output
    copied       fence; peer's peer_copied = t; done = t   (``done``: in host memory)

and the average, (mine + peer's) / 2, is the first thing the next step
computes (``dual_mlp.py`` folds it into the compiled step).

The kernels' arguments never change (the step number lives in GPU memory), so
XLA may capture the launches into a CUDA graph once and replay them
(``command_buffer_compatible``): then the Python callback below runs at
capture only, not every step.  ``callbacks`` counts how often it ran.  The
host learns how far the GPU has got from ``done``, a counter the GPU writes
into mapped host memory, so that the step needs no output of its own to be
waited on (a fresh output buffer every step would make XLA update its
recorded step every step, which costs the host more than the step).

The driver calls go through ``cuda.bindings`` (NVIDIA's maintained Python
binding of the CUDA driver API): PyCUDA launches only on its own stream
objects, while XLA hands the callback a raw stream handle.  PyCUDA compiles
the kernels, allocates the buffers and opens the IPC handles.
"""
import ctypes
import functools

import numpy as np

KERNELS = r"""
extern "C" {
// One worker's counters, in its GPU's memory.
struct Flags {
    int begun;           // steps begun here; only this GPU writes it
    int peer_published;  // the last step the peer has published   (the peer writes it)
    int peer_copied;     // the last step the peer has copied from our send buffer (likewise)
};
__device__ Flags flags_size;  // never used: its size, read at load, sizes the allocation

__device__ int read(const int *p) { return *(volatile const int *)p; }

// t = ++begun; wait until the peer has copied step t-2 out of send[t % 2]: we overwrite it next
__global__ void begin(Flags *mine) {
    int t = mine->begun + 1;
    mine->begun = t;
    while (read(&mine->peer_copied) < t - 2) __nanosleep(64);
}

__device__ void copy(const float *src, float *dst, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x)
        dst[i] = src[i];
}

// my new weights -> send[t % 2]
__global__ void publish(const Flags *mine, const float *weights, float *send, long long n) {
    copy(weights, send + (mine->begun & 1) * n, n);
}

// "published t" into the peer's counter; wait until the peer's says the same to us
__global__ void signal_wait(const Flags *mine, Flags *peer) {
    int t = mine->begun;
    __threadfence_system();  // our published weights before the signal
    *(volatile int *)&peer->peer_published = t;
    while (read(&mine->peer_published) < t) __nanosleep(64);
}

// the peer's send[t % 2] -> this step's output (a peer-to-peer read, over NVLink)
__global__ void fetch(const Flags *mine, const float *peer_send, float *received, long long n) {
    copy(peer_send + (mine->begun & 1) * n, received, n);
}

// "copied t" into the peer's counter, and into host memory for our host
__global__ void copied(const Flags *mine, Flags *peer, int *done) {
    __threadfence_system();  // our reads of the peer's slot before the signal
    *(volatile int *)&peer->peer_copied = mine->begun;
    *(volatile int *)done = mine->begun;
}
}
"""
COPY_GRID, COPY_BLOCK = 264, 256  # two blocks per multiprocessor of an H200


class StreamExchange:
    """One worker's side of the GPU-ordered exchange (see the module's text).

    ``handle()`` / ``connect(peer_handle)`` swap the IPC handles once, over
    the zmq link; ``__call__(new, received)``, inside a jitted function,
    takes this step's new weights (flat) and returns the peer's, written
    over ``received`` (the previous step's), so that with the step's inputs
    donated their buffers, and the captured launches, stay the same."""

    def __init__(self, device, layout):
        import pycuda.driver as drv
        from cuda.bindings import driver as cu
        from pycuda.compiler import compile as compile_cuda

        from devices import nvcc

        self.cu, self.drv, self.layout = cu, drv, layout
        major, minor = drv.Device(0).compute_capability()
        cubin = compile_cuda(KERNELS, nvcc=nvcc(), arch=f"sm_{major}{minor}")
        self._image = np.frombuffer(cubin, np.uint8)  # must outlive the module
        self._module = self._check(cu.cuModuleLoadData(self._image.ctypes.data))
        self._kernel = {name: self._check(cu.cuModuleGetFunction(self._module, name.encode()))
                        for name in ("begin", "publish", "signal_wait", "fetch", "copied")}
        _, flags_bytes = self._check(cu.cuModuleGetGlobal(self._module, b"flags_size"))
        self.send = drv.mem_alloc(2 * layout.nbytes)
        self.flags = drv.mem_alloc(flags_bytes)
        drv.memset_d8(self.flags, 0, flags_bytes)
        self.done = drv.pagelocked_zeros(1, np.int32, mem_flags=drv.host_alloc_flags.DEVICEMAP)
        self.peer_send = self.peer_flags = None
        self.callbacks = 0

    def _check(self, result):
        error, *value = result
        if error != self.cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver: {self.cu.cuGetErrorName(error)[1].decode()}")
        return (value[0] if len(value) == 1 else value) if value else None

    def steps_done(self):
        """The last step whose exchange this GPU has finished."""
        return int(self.done[0])

    def handle(self):
        return self.drv.mem_get_ipc_handle(self.send), self.drv.mem_get_ipc_handle(self.flags)

    def connect(self, handle):
        self.peer_send, self.peer_flags = (self.drv.IPCMemoryHandle(h) for h in handle)

    def __call__(self, new, received):
        from jax.experimental.buffer_callback import buffer_callback
        (peers,) = buffer_callback(self._enqueue, [self._shape_dtype(received)],
                                   has_side_effect=True, input_output_aliases={1: 0},
                                   command_buffer_compatible=True)(new, received)
        return peers

    @staticmethod
    def _shape_dtype(value):
        import jax
        return jax.ShapeDtypeStruct(value.shape, value.dtype)

    def _launch(self, stream, name, *args):
        """Enqueue kernel ``name`` on XLA's stream; ``args`` are pointers (int)
        and element counts (``np.int64``).  The copies spread over the GPU,
        the signals are one thread each."""
        grid, block = (COPY_GRID, COPY_BLOCK) if name in ("publish", "fetch") else (1, 1)
        types = [ctypes.c_longlong if isinstance(a, np.int64) else ctypes.c_void_p for a in args]
        self._check(self.cu.cuLaunchKernel(self._kernel[name], grid, 1, 1, block, 1, 1, 0,
                                           self.cu.CUstream(stream), (args, tuple(types)), 0))

    def _enqueue(self, ctx, out, new, _received):  # _received: the same buffer as out[0]
        """XLA's callback: enqueue the exchange of one step on ``ctx.stream``.
        Runs once per step, or only when XLA captures it anew (new buffers)."""
        self.callbacks += 1
        mine, peer, n = int(self.flags), int(self.peer_flags), np.int64(self.layout.size)
        launch = functools.partial(self._launch, ctx.stream)
        launch("begin", mine)
        launch("publish", mine, address(new), int(self.send), n)
        launch("signal_wait", mine, peer)
        launch("fetch", mine, int(self.peer_send), address(out[0]), n)
        launch("copied", mine, peer, int(self.done.base.get_device_pointer()))

    def close(self):
        for handle in (self.peer_send, self.peer_flags):
            if handle is not None:
                handle.close()
        self.send.free()
        self.flags.free()
        self.done.base.free()
        self._check(self.cu.cuModuleUnload(self._module))


def address(buffer):
    """The device address of a buffer XLA hands a callback."""
    return buffer.__cuda_array_interface__["data"][0]
