"""The 2014 exchange, ordered by the GPUs instead of the host (``--sync gpu``).

In 2014 the host ordered every step: it waited for its GPU, published,
passed a zmq barrier, copied, passed another, averaged.  Each wait stopped
the host from queueing the next step while the GPU ran this one, and on a
modern GPU that lost overlap costs more than the step itself.  Here the same
buffers and the same copies run on the GPU's own stream, as one kernel at
the end of the compiled training step, and the GPUs order them among
themselves: within a step the host waits for nothing.

Each of the N workers allocates with PyCUDA, once, and shares by CUDA IPC,
once:

* ``send``: two slots of the flat weights (``exchange.Layout``), used by step
  parity, so that a worker can publish step t+1 while the others still read
  step t;
* ``flags``: its ``struct Flags`` (in ``KERNELS``), counters that the OTHER
  workers write into this GPU's memory, over NVLink, to say how far they are.

The kernel, ``exchange``, is the one-shot all-reduce of vLLM's
``custom_all_reduce.cuh`` with the 2014 demo's steps inside.  Every GPU runs
it with the same grid, and block b of every GPU handles the same elements,
so block b waits only for the blocks b of the others (per-block flags, no
barrier across a GPU's own blocks).  For step t, block b::

    begin    t = ++step[b]; wait until every worker's block b has reduced t-2
             (it read send[t % 2] then; we are about to overwrite it)
    publish  my new weights -> my send[t % 2]                    (local)
    signal   fence; published[b][rank] = t in every worker's flags;
             wait until every worker's published[b][w] = t here
    reduce   weights = (send_0[t % 2] + ... + send_N-1[t % 2]) / N, summed in
             rank order on every GPU, so the replicas stay bit-identical
             (N - 1 of the N reads over NVLink)
    copied   fence; reduced[b][rank] = t in every worker's flags; the last
             block to finish writes t into ``done``, in host memory

Why nothing can deadlock or be overwritten while read: a worker one step
ahead (t+1) publishes into the other slot, send[(t+1) % 2], which nobody
reads at step t; to publish t+2 into send[t % 2] again it waits for every
block b to have reduced step t.  A worker two steps ahead is impossible: at
t+2 it waits in ``begin`` for the slow one's ``reduced`` of t.  The fences:
``publish``'s stores are made visible to every GPU (``__threadfence_system``
after the block's barrier) before the flag that says they are there; the
waiting side reads the flag with acquire semantics before the data; and the
reads of ``reduce`` are complete (their values used) before ``copied``'s
flag releases the buffer.

The kernel's arguments never change (the step number lives in GPU memory),
so XLA captures its launch into a CUDA graph once and replays it
(``command_buffer_compatible``): the Python callback below runs at capture
only.  ``callbacks`` counts how often it ran.  The host learns how far the
GPU has got from ``done``, so that the step needs no output of its own to be
waited on (a fresh output buffer every step would make XLA update its
recorded step every step, which costs the host more than the step).

The callback is declared without side effects: XLA cannot drop it, because
its output (the average, written over the new weights) is the next step's
input, and a callback declared with side effects sends every call of the
program down JAX's slow dispatch path (120-280 us of host time per call on
an H200 host, more than the whole step at small batches).  ``done`` counts
the steps the GPU has exchanged: a run's count equals its steps, which the
tests check.

One worker alone (``loopback``, ``bench/step_cost.py``) runs every phase on
its own buffers: the exchange's own cost, on one GPU.

The launch goes through ``cuda.bindings`` (NVIDIA's maintained Python
binding of the CUDA driver API): PyCUDA launches only on its own stream
objects, while XLA hands the callback a raw stream handle.  PyCUDA compiles
the kernel, allocates the buffers and opens the IPC handles.
"""
import ctypes

import numpy as np

MAX_WORKERS = 8
GRID, BLOCK = 128, 512  # the same on every GPU: block b handles the same elements everywhere

KERNELS = r"""
#define MAX_WORKERS %(max_workers)d
#define GRID %(grid)d

extern "C" {
// One worker's counters, in its GPU's memory; the other workers write
// published and reduced, over NVLink, block by block.
struct Flags {
    int step[GRID];                          // the steps block b has begun here
    int published[GRID][MAX_WORKERS];        // [b][w]: the last step worker w's block b published
    int reduced[GRID][MAX_WORKERS];          // [b][w]: the last step worker w's block b reduced
    unsigned finished;                       // blocks that have finished a step, all steps
};

// Every worker's buffers, as this GPU addresses them (its own included):
// written once, after the handshake.
struct Peers {
    float *send[MAX_WORKERS];
    Flags *flags[MAX_WORKERS];
};

__device__ Flags flags_size;  // never used: its size, read at load, sizes the allocation
__device__ Peers peers_size;  // likewise

__device__ int load_acquire(const int *p) {
    int v;
    asm volatile("ld.acquire.sys.global.b32 %%0, [%%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ void store_release(int *p, int v) {
    asm volatile("st.release.sys.global.b32 [%%0], %%1;" :: "l"(p), "r"(v) : "memory");
}

// Thread 0 waits until counter[w * stride] >= t for every worker w: a spin on
// this GPU's own memory (~1 us once the last write has crossed NVLink).
__device__ void wait_all(const int *counter, int stride, int n_workers, int t) {
    for (int w = 0; w < n_workers; ++w)
        while (load_acquire(counter + w * stride) < t) __nanosleep(32);
}

__global__ void __launch_bounds__(%(block)d)
exchange(const Peers *peers, int rank, int n_workers, float *weights, long long n,
         unsigned *done) {
    const int b = blockIdx.x;
    Flags *mine = peers->flags[rank];
    __shared__ int t;
    if (threadIdx.x == 0) {                                       // begin
        t = mine->step[b] + 1;
        mine->step[b] = t;
        wait_all(&mine->reduced[b][0], 1, n_workers, t - 2);
    }
    __syncthreads();
    const long long slot = (t & 1) * n, first = b * (long long)blockDim.x + threadIdx.x,
                    stride = (long long)gridDim.x * blockDim.x;
    float *send = peers->send[rank] + slot;
    for (long long i = first; i < n; i += stride) send[i] = weights[i];   // publish
    __syncthreads();
    if (threadIdx.x == 0) {                                       // signal: "published t"
        __threadfence_system();
        for (int w = 0; w < n_workers; ++w)                       // a 4-byte store over NVLink each
            store_release(&peers->flags[w]->published[b][rank], t);
        wait_all(&mine->published[b][0], 1, n_workers, t);
    }
    __syncthreads();
    for (long long i = first; i < n; i += stride) {               // reduce, in rank order
        float sum = peers->send[0][slot + i];
        for (int w = 1; w < n_workers; ++w) sum += peers->send[w][slot + i];
        weights[i] = sum / n_workers;
    }
    __syncthreads();
    if (threadIdx.x == 0) {                                       // copied: "reduced t"
        __threadfence_system();
        for (int w = 0; w < n_workers; ++w)
            store_release(&peers->flags[w]->reduced[b][rank], t);
        if (atomicAdd(&mine->finished, 1u) == (unsigned)t * gridDim.x - 1)
            *(volatile unsigned *)done = t;                       // the last block: host memory
    }
}
}
"""


class StreamExchange:
    """One worker's side of the GPU-ordered exchange (see the module's text).

    ``handle()`` / ``connect(handles)`` swap the IPC handles once, over the
    zmq link; ``__call__(new)``, inside a jitted function, takes this step's
    new weights (flat) and returns the average of every worker's, written
    over them, so that with the step's inputs donated its buffers, and the
    captured launch, stay the same."""

    def __init__(self, rank, n_workers, layout):
        import pycuda.driver as drv
        from cuda.bindings import driver as cu
        from pycuda.compiler import compile as compile_cuda

        from devices import nvcc

        if n_workers > MAX_WORKERS:
            raise ValueError(f"the GPU-ordered exchange joins at most {MAX_WORKERS} workers")
        self.cu, self.drv, self.layout = cu, drv, layout
        self.rank, self.n_workers = rank, n_workers
        major, minor = drv.Device(0).compute_capability()
        source = KERNELS % dict(max_workers=MAX_WORKERS, grid=GRID, block=BLOCK)
        cubin = compile_cuda(source, nvcc=nvcc(), arch=f"sm_{major}{minor}")
        self._image = np.frombuffer(cubin, np.uint8)  # must outlive the module
        self._module = self._check(cu.cuModuleLoadData(self._image.ctypes.data))
        self._kernel = self._check(cu.cuModuleGetFunction(self._module, b"exchange"))
        sizes = {name: self._check(cu.cuModuleGetGlobal(self._module, name))[1]
                 for name in (b"flags_size", b"peers_size")}
        self.send = drv.mem_alloc(2 * layout.nbytes)
        self.flags = drv.mem_alloc(sizes[b"flags_size"])
        drv.memset_d8(self.flags, 0, sizes[b"flags_size"])
        self.peers = drv.mem_alloc(sizes[b"peers_size"])
        self.done = drv.pagelocked_zeros(1, np.uint32, mem_flags=drv.host_alloc_flags.DEVICEMAP)
        self._opened = ()  # the others' buffers, opened by IPC
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

    def connect(self, handles):
        """Every worker's handles, in rank order (ours as well, unused)."""
        self._opened = [(self.drv.IPCMemoryHandle(send), self.drv.IPCMemoryHandle(flags))
                        for w, (send, flags) in enumerate(handles) if w != self.rank]
        others = iter(self._opened)
        self._write_peers([(self.send, self.flags) if w == self.rank else next(others)
                           for w in range(self.n_workers)])

    def loopback(self):
        """A world of one: every phase runs, every counter is written and
        waited for, on this GPU's own buffers."""
        self.n_workers = 1
        self._write_peers([(self.send, self.flags)])

    def _write_peers(self, buffers):
        pointers = np.zeros(2 * MAX_WORKERS, np.uint64)
        for w, (send, flags) in enumerate(buffers):
            pointers[w], pointers[MAX_WORKERS + w] = int(send), int(flags)
        self.drv.memcpy_htod(self.peers, pointers)

    def __call__(self, new):
        import jax
        from jax.experimental.buffer_callback import buffer_callback
        (mean,) = buffer_callback(self._enqueue, [jax.ShapeDtypeStruct(new.shape, new.dtype)],
                                  has_side_effect=False, input_output_aliases={0: 0},
                                  command_buffer_compatible=True)(new)
        return mean

    def _enqueue(self, ctx, out, _new):  # _new: the same buffer as out[0]
        """XLA's callback: enqueue one step's exchange on ``ctx.stream``.
        Runs only when XLA captures the launch (once per program)."""
        self.callbacks += 1
        self.launch(ctx.stream, address(out[0]))

    def launch(self, stream, weights, n=None):
        """Enqueue the kernel on ``stream`` (a raw handle) for the ``n``
        floats at ``weights`` (default: the layout's; at most that)."""
        c = ctypes
        args = (int(self.peers), self.rank, self.n_workers, weights,
                self.layout.size if n is None else n, int(self.done.base.get_device_pointer()))
        types = (c.c_void_p, c.c_int, c.c_int, c.c_void_p, c.c_longlong, c.c_void_p)
        self._check(self.cu.cuLaunchKernel(self._kernel, GRID, 1, 1, BLOCK, 1, 1, 0,
                                           self.cu.CUstream(stream), (args, types), 0))

    def close(self):
        for handles in self._opened:
            for handle in handles:
                handle.close()
        for buffer in (self.send, self.flags, self.peers):
            buffer.free()
        self.done.base.free()
        self._check(self.cu.cuModuleUnload(self._module))


def address(buffer):
    """The device address of a buffer XLA hands a callback."""
    return buffer.__cuda_array_interface__["data"][0]
