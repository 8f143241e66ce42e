"""The 2014 exchange, ordered by the GPUs instead of the host (``--sync gpu``).

In 2014, as under ``--sync host``, the host ordered every step: it waited
for its GPU after each phase, passed a barrier, copied, passed another,
averaged (``dual_mlp.HostOrdered.epoch``).  Each wait stopped
the host from queueing the next step while the GPU ran this one, and on a
modern GPU that lost overlap costs more than the step itself.  Here the same
buffers and the same copies run on the GPU's own stream, as one kernel at
the end of the compiled training step, and the GPUs order them among
themselves: within a step the host waits for nothing.

Each of the N workers allocates with PyCUDA, once, and shares by CUDA IPC,
once:

* ``send``: two slots of the flat weights (``transports.Layout``), used by step
  parity, so that a worker can publish step t+1 while the others still read
  step t;
* ``flags``: its ``struct Flags`` (in ``stream_exchange.cu``), counters that the OTHER
  workers write into this GPU's memory, over NVLink, to say how far they are.

The kernel, ``exchange``, is the one-shot all-reduce of vLLM's
``custom_all_reduce.cuh`` with the 2014 demo's steps inside.  Every GPU runs
it with the same grid, and block b of every GPU handles the same elements,
so block b waits only for the blocks b of the others (per-block flags, no
barrier across a GPU's own blocks).  A thread moves 16 bytes at a time and,
at the MLP's size, one such chunk a phase: each phase costs one memory
round trip, not one per element.  Thread w of a block speaks for worker
w: it writes this block's flag into worker w's memory and waits on worker
w's flag in ours, all N at once.  For step t, block b::

    begin    t = ++step[b]                                     (local)
    publish  my weights w - rate * g -> my send[t % 2]            (local)
    signal   published[b][rank] = t in every worker's flags (a release store);
             wait until every worker's published[b][w] = t here
    reduce   weights = (send_0[t % 2] + ... + send_N-1[t % 2]) / N, summed in
             rank order on every GPU, so the replicas stay bit-identical
             (N - 1 of the N reads over NVLink)
    end      done[b] = t, in host memory

``publish`` applies the tutorial's SGD update on its way: the step hands
the kernel the weights it began with and their gradients
(``mlp.Model.gradient_model``), and a worker publishes ``w - rate * g``,
rounded as PyTensor's graph rounds it.  The mean is then the 2014 demo's:
each worker's weights after its own step.  Left to XLA, the update is a
kernel of its own per parameter that writes every weight once more just
before the exchange reads it (with no exchange between two steps, XLA fuses
the update into the next step's first kernels; an exchange stands in the
way): 1 us a step at batch 100 on an H200.  Without gradients
(``bench/exchange.py``) the kernel is an all-reduce of the weights as
they are.

The 2014 loop's second signal, "copied", is not needed: why nothing can
deadlock or be overwritten while read.  Each GPU runs its kernels in stream
order, so a worker publishes step t+1 only after its whole kernel of step t
has ended: when the others see its "published t+1", its reads of step t's
slots are done.  A worker one step ahead (t+1) publishes into the other
slot, send[(t+1) % 2], which nobody reads at step t.  To publish t+2 into
send[t % 2] again, it must have ended its kernel of t+1, which waited for
every worker's "published t+1": every worker has read send[t % 2] of step
t.  So a worker is never two steps ahead, and the wait for "published" is
the kernel's only one.  Its step number and its first chunk of weights are
read at once (the number is needed only to store the chunk): each phase
costs one memory round trip.  The memory order, as in vLLM's kernels: the
block's ``__syncthreads()``, then a store with release semantics at system
scope, make ``publish``'s stores visible to every GPU before the flag that
says they are there; the waiting side reads the flag with acquire
semantics, then ``__syncthreads()``, before it reads the data.  That flag
is the only one with a fence (a system-wide memory barrier, the dearest
instruction here).

The kernel's arguments never change (the step number lives in GPU memory),
so XLA captures its launch into a CUDA graph once and replays it
(``command_buffer_compatible``): the Python callback below runs at capture
only.  ``callbacks`` counts how often it ran.  The host learns how far the
GPU has got from ``done`` (the least of the blocks' counts), so that the
step needs no output of its own to be waited on (a fresh output buffer
every step would make XLA update its recorded step every step, which costs
the host more than the step).

The callback is declared without side effects: XLA cannot drop it, because
its output (the average, written over the new weights) is the next step's
input, and a callback declared with side effects sends every call of the
program down JAX's slow dispatch path (120-280 us of host time per call on
an H200 host, more than the whole step at small batches).  ``done`` counts
the steps the GPU has exchanged: a run's count equals its steps, which the
tests check.

With ``--trace``, block 0 of the kernel stamps each step's phases with the
GPU's clock (``%globaltimer``) into a ring of ``struct Stamp`` in host
memory (``trace``; a fence, then the step number, so that the host never
reads half a stamp): when it began, when its weights were published, when
its own flag was stored and when every worker's was seen (naming the worker
seen last), when the mean was written: the trace's ``publish``, ``signal``,
``waiting for a later worker`` (naming it) and ``copy + average`` (``reduce`` above).
``read_clock`` measures how that clock stands to the host's.  Without
``--trace`` the kernel pays one test of a null pointer.

One worker alone (``loopback``, ``bench/step_cost.py``) runs every phase on
its own buffers: the exchange's own cost, on one GPU.

The launch goes through ``cuda.bindings`` (NVIDIA's maintained Python
binding of the CUDA driver API): PyCUDA launches only on its own stream
objects, while XLA hands the callback a raw stream handle.  PyCUDA compiles
the kernel, allocates the buffers and opens the IPC handles.
"""
import multi_gpu.flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import ctypes
import os

import numpy as np

from multi_gpu import trace

MAX_WORKERS, MAX_SEGMENTS = 8, 8
GRID, BLOCK = 128, 1024  # the same on every GPU: block b handles the same elements everywhere
WIDTH = 4                # floats a thread moves at once (one 16-byte load or store)


class Peers(ctypes.Structure):
    """``struct Peers`` of ``KERNELS``: every worker's send slots and flags,
    as this GPU addresses them."""
    _fields_ = [("send", ctypes.c_void_p * MAX_WORKERS), ("flags", ctypes.c_void_p * MAX_WORKERS)]


class Segments(ctypes.Structure):
    """``struct Segments`` of ``KERNELS``: the weights' buffers, where each
    starts in the flat layout, and how they are cut into chunks."""
    _fields_ = [("data", ctypes.c_void_p * MAX_SEGMENTS),
                ("gradient", ctypes.c_void_p * MAX_SEGMENTS),
                ("start", ctypes.c_longlong * MAX_SEGMENTS),
                ("length", ctypes.c_longlong * MAX_SEGMENTS),
                ("width", ctypes.c_int * MAX_SEGMENTS),
                ("chunks_end", ctypes.c_longlong * MAX_SEGMENTS), ("count", ctypes.c_int)]

    @classmethod
    def of(cls, buffers, gradients=()):
        """From [(device address, number of floats)] in the layout's order,
        and the device addresses of their gradients (none: no update, an
        all-reduce of the weights as they are).  The chunks depend on the
        layout only, never on an address, so that block b of every GPU
        handles the same elements."""
        segments = cls(count=len(buffers))
        start = chunks = 0
        for i, (address, n) in enumerate(buffers):
            width = WIDTH if start % WIDTH == 0 else 1  # a 16-byte chunk must start on 16 bytes
            chunks += -(-n // width)
            segments.data[i], segments.start[i], segments.length[i] = address, start, n
            segments.gradient[i] = gradients[i] if gradients else None
            segments.width[i], segments.chunks_end[i] = width, chunks
            start += n
        return segments


# struct Stamp of KERNELS
STAMP = np.dtype([("begin", np.uint64), ("published", np.uint64), ("signalled", np.uint64),
                  ("seen", np.uint64), ("written", np.uint64), ("last", np.int32),
                  ("step", np.int32)])


def mirror_layouts():
    """[(what, bytes)]: each mirrored struct's size, then each field's
    offset, as the host's mirrors have them, in ``layouts[]``'s order (the
    same struct as compiled: ``KERNELS``)."""
    layouts = []
    for name, struct in (("Peers", Peers), ("Segments", Segments)):
        layouts += [(f"sizeof({name})", ctypes.sizeof(struct))] + [
            (f"{name}.{field}", getattr(struct, field).offset) for field, _ in struct._fields_]
    return layouts + [("sizeof(Stamp)", STAMP.itemsize)] + [
        (f"Stamp.{field}", STAMP.fields[field][1]) for field in STAMP.names]


def mirror_problem(compiled):
    """Where the host's mirrors differ from the structs as compiled
    (``compiled``: the module's ``layouts[]``), in words, or None: a field
    changed on one side alone would be memory corrupted, not an error."""
    mirrors = mirror_layouts()
    if len(compiled) != len(mirrors):
        return (f"{KERNELS} lays out {len(compiled)} sizes and offsets, its mirrors here "
                f"{len(mirrors)}: a field added or removed on one side")
    for (what, here), there in zip(mirrors, compiled):
        if int(there) != here:
            return f"{what} is {int(there)} bytes in {KERNELS} and {here} in its mirror here"
    return None


def slot_floats(n):
    """Floats in one send slot: the weights, rounded up to 128 bytes so that
    both slots start aligned."""
    return -(-n // 32) * 32


KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stream_exchange.cu")


def kernel_options():
    """The sizes ``KERNELS`` is compiled with, as nvcc's -D options."""
    return [f"-D{name}={value}" for name, value in dict(
        MAX_WORKERS=MAX_WORKERS, MAX_SEGMENTS=MAX_SEGMENTS, GRID=GRID, BLOCK=BLOCK).items()]


class StreamExchange:
    """One worker's side of the GPU-ordered exchange (see the module's text).

    ``handle()`` / ``connect(handles)`` swap the IPC handles once, over the
    zmq link; ``__call__(params, gradients)``, inside a jitted function,
    takes the step's parameters and their gradients and returns the average
    of every worker's ``params - rate * gradients``, written over
    ``params``, so that with the step's inputs donated their buffers, and
    the captured launch, stay the same."""

    def __init__(self, rank, n_workers, layout, rate=0.0):
        import pycuda.driver as drv
        from cuda.bindings import driver as cu
        from pycuda.compiler import compile as compile_cuda

        from multi_gpu.devices import nvcc

        if n_workers > MAX_WORKERS:
            raise ValueError(f"the GPU-ordered exchange joins at most {MAX_WORKERS} workers")
        self.cu, self.drv, self.layout = cu, drv, layout
        self.rank, self.n_workers, self.rate = rank, n_workers, rate
        major, minor = drv.Device(0).compute_capability()
        with open(KERNELS) as f:
            cubin = compile_cuda(f.read(), nvcc=nvcc(), options=kernel_options(),
                                 arch=f"sm_{major}{minor}", no_extern_c=True)
        self._image = np.frombuffer(cubin, np.uint8)  # must outlive the module
        self._module = checked(cu.cuModuleLoadData(self._image.ctypes.data))
        self._kernel = checked(cu.cuModuleGetFunction(self._module, b"exchange"))
        self._read_clock = checked(cu.cuModuleGetFunction(self._module, b"read_clock"))
        flags_bytes = checked(cu.cuModuleGetGlobal(self._module, b"flags_size"))[1]
        address, nbytes = checked(cu.cuModuleGetGlobal(self._module, b"layouts"))
        compiled = np.zeros(nbytes // 8, np.uint64)
        drv.memcpy_dtoh(compiled, int(address))
        problem = mirror_problem(compiled)
        if problem:
            raise RuntimeError(problem)
        self.slot = slot_floats(layout.size)
        self.send = drv.mem_alloc(2 * self.slot * layout.dtype.itemsize)
        self.flags = drv.mem_alloc(flags_bytes)
        drv.memset_d8(self.flags, 0, flags_bytes)
        self.peers = None  # until connect() or loopback()
        self.done = drv.pagelocked_zeros(GRID, np.uint32, mem_flags=drv.host_alloc_flags.DEVICEMAP)
        self._opened = ()  # the others' buffers, opened by IPC
        self.stamps = None  # --trace: the kernel's ring of stamps (trace())
        self.callbacks = 0

    def steps_done(self):
        """The last step whose exchange this GPU has finished."""
        return int(self.done.min())

    def trace(self, slots):
        """--trace: from the first launch on, block 0 stamps every step's
        phases into a ring of ``slots`` steps in host memory (``stamp``
        reads them; a step's slot is written again ``slots`` steps later)."""
        self.stamps = self.drv.pagelocked_zeros(slots, STAMP,
                                                mem_flags=self.drv.host_alloc_flags.DEVICEMAP)
        self.stamps["step"] = -1
        self.kept, self.clock_at_start = [], self.read_clock()  # the GPU's clock beside the host's

    def keep_stamps(self, steps, marker, call):
        """--trace: the stamps of a call's exchanges (exchange ``marker`` its
        last), which ended ``steps``, kept as the host sees the call done."""
        exchanges = range(marker - len(steps) + 1, marker + 1)
        self.kept += [(s, call, self.stamp(n)) for s, n in zip(steps, exchanges)]

    def draw_stamps(self, tracer, rank):
        """--trace, at the end: the kept stamps as ``tracer``'s spans, on the
        host's clock, the GPU's read beside it once more (``trace.kernel_spans``)."""
        trace.kernel_spans(tracer, self.kept, rank, self.layout.nbytes, self.clock_at_start,
                           self.read_clock())

    def stamp(self, step):
        """The stamps of exchange ``step`` (counted from 1), or None where
        its slot holds another step's."""
        row = self.stamps[step % len(self.stamps)]
        if int(row["step"]) != step:
            return None
        stamp = row.copy()  # the host reads the step first, then the rest: x86 keeps that order
        return stamp if int(self.stamps[step % len(self.stamps)]["step"]) == step else None

    def read_clock(self, samples=64, timeout=10.0):
        """The GPU's clock beside the host's (``trace.DeviceClock``): (the
        GPU's time, the GPU's minus the host's, half the round trip), the
        round trip of ``samples`` that was shortest; and the GPU clock's tick
        in ns.  One thread on a stream of its own, while nothing else of
        this worker runs."""
        from multi_gpu import trace
        drv, cu = self.drv, self.cu
        flags = drv.host_alloc_flags.DEVICEMAP
        asked = drv.pagelocked_zeros(1, np.int32, mem_flags=flags)
        answer = drv.pagelocked_zeros(samples + 1, np.uint64, mem_flags=flags)
        stream = checked(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        args = [ctypes.c_void_p(int(asked.base.get_device_pointer())),
                ctypes.c_void_p(int(answer.base.get_device_pointer())), ctypes.c_int(samples)]
        pointers = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        best = None
        try:
            checked(cu.cuLaunchKernel(self._read_clock, 1, 1, 1, 1, 1, 1, 0, stream,
                                      ctypes.addressof(pointers), 0))
            deadline = trace.now() + int(timeout * 1e9)
            for k in range(1, samples + 1):
                before = trace.now()
                asked[0] = k
                while not answer[k]:
                    if trace.now() > deadline:
                        raise RuntimeError(f"the GPU did not answer its clock within {timeout:g} s")
                after = trace.now()
                if best is None or after - before < 2 * best[2]:
                    best = (int(answer[k]), int(answer[k]) - (before + after) // 2,
                            (after - before) / 2)
        finally:
            asked[0] = samples  # the kernel ends, whatever happened here
            checked(cu.cuStreamSynchronize(stream))
            checked(cu.cuStreamDestroy(stream))
        tick = int(answer[0])
        for buffer in (asked, answer):
            buffer.base.free()
        return best, tick

    def connect(self, buffers):
        """Every worker's (send slots, flags), in rank order: ours, and the
        others' as opened by IPC (``dual_mlp.swap_handles``), closed here."""
        self._opened = [b for w, b in enumerate(buffers) if w != self.rank]
        self._write_peers(buffers)

    def loopback(self):
        """A world of one: every phase runs, every counter is written and
        waited for, on this GPU's own buffers."""
        self.n_workers = 1
        self._write_peers([(self.send, self.flags)])

    def _write_peers(self, buffers):
        self.peers = Peers()
        for w, (send, flags) in enumerate(buffers):
            self.peers.send[w], self.peers.flags[w] = int(send), int(flags)

    def __call__(self, params, gradients):
        import jax
        from jax.experimental.buffer_callback import buffer_callback
        return buffer_callback(self._enqueue, [jax.ShapeDtypeStruct(p.shape, p.dtype)
                                               for p in params],
                               has_side_effect=False,
                               input_output_aliases={i: i for i in range(len(params))},
                               command_buffer_compatible=True)(*params, *gradients)

    def _enqueue(self, ctx, out, *inputs):  # inputs: params (the same buffers as out), gradients
        """XLA's callback: enqueue one step's exchange on ``ctx.stream``.
        Runs only when XLA captures the launch (once per program)."""
        self.callbacks += 1
        self.launch(ctx.stream, [(address(p), n) for p, n in zip(out, self.layout.sizes)],
                    [address(g) for g in inputs[len(out):]])

    def launch(self, stream, buffers, gradients=()):
        """Enqueue the kernel on ``stream`` (a raw handle) for the weights in
        ``buffers``, [(device address, number of floats)], at most the
        layout's, updated by the ``gradients`` at those device addresses
        (none: the mean of the weights as they are)."""
        if self.peers is None:
            raise RuntimeError("the exchange was launched before connect() or loopback()")
        args = [self.peers, ctypes.c_int(self.rank), ctypes.c_int(self.n_workers),
                ctypes.c_void_p(self.peers.flags[self.rank]),
                ctypes.c_void_p(self.peers.send[self.rank]), Segments.of(buffers, gradients),
                ctypes.c_float(self.rate), ctypes.c_longlong(self.slot),
                ctypes.c_void_p(int(self.done.base.get_device_pointer())),
                ctypes.c_void_p(None if self.stamps is None else
                                int(self.stamps.base.get_device_pointer())),
                ctypes.c_int(0 if self.stamps is None else len(self.stamps))]
        pointers = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        checked(self.cu.cuLaunchKernel(self._kernel, GRID, 1, 1, BLOCK, 1, 1, 0,
                                       self.cu.CUstream(stream), ctypes.addressof(pointers), 0))

    def close(self):
        for handles in self._opened:
            for handle in handles:
                handle.close()
        for buffer in (self.send, self.flags):
            buffer.free()
        for mapped in (self.done, self.stamps):
            if mapped is not None:
                mapped.base.free()
        checked(self.cu.cuModuleUnload(self._module))


def checked(result):
    """What a ``cuda.bindings`` driver call returned, (error, *values), as
    its value(s), or a RuntimeError that names the error."""
    from cuda.bindings import driver as cu
    error, *value = result
    if error != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver: {cu.cuGetErrorName(error)[1].decode()}")
    return (value[0] if len(value) == 1 else value) if value else None


def address(buffer):
    """The device address of a buffer XLA hands a callback."""
    return buffer.__cuda_array_interface__["data"][0]
