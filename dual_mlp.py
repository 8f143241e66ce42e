#!/usr/bin/env python
"""Train the tutorial's MLP on several workers that average their weights after every step.

A re-creation of "Multi-GPU using Theano and PyCUDA" (dual_mlp.py, University
of Guelph, 2014), on PyTensor, PyCUDA and pyzmq::

    THEANO_FLAGS=mode=FAST_RUN,floatX=float32 python dual_mlp.py 0 1    # GPUs 0 and 1
    python dual_mlp.py cpu cpu                                          # no GPU needed
    python dual_mlp.py 0 1 2 3                                          # four GPUs

The step, in 2014 and here (``HostOrdered.epoch``; README.md tells why each
phase changed, and each change is told again where its code is)::

    2014                                     here
    1. train    train_model(i)               1. train    one SGD step, its own minibatch
                                             2. publish  its weights into its send buffer
    2. signal   this_queue.put(''); get()    3. signal   zmq: "published", to every worker
    3. copy     drv.memcpy_peer, synchronize 4. copy     every send buffer, peer to peer
    4. signal   the queues again             5. signal   zmq: "copied"
    5. average  (param + param_other) / 2    6. average  the mean of all, in rank order

Worker k of N holds a full replica and trains on the minibatches whose index
is k modulo N; after the average, the replicas have taken one SGD step on a
minibatch N times the size.

The file, top to bottom: the configuration (2014's ``shared_args``); the
transports (``CudaIpcTransport``, ``HostTransport`` for CPUs,
``StagedCudaTransport``) and ``barrier``; the trainers: ``HostOrdered``
(the step above, ``--sync host``), ``GpuOrdered`` (phases 2-6 as one kernel,
``--sync gpu``), ``XlaOrdered`` (a ``pmean`` in the compiled step,
``--exchange xla``); ``worker``, one process's run; ``main``, the launcher.
The plumbing (checks, processes, sockets, data, records) is in the package
``multi_gpu/``, one named call away.
"""
import signal
import sys
if __name__ == "__main__":  # a Ctrl-C while PyTensor loads ends the script, with no traceback
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.path.insert(0, __file__.rpartition("/")[0])  # the package, under python -I too
from multi_gpu import flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)
import functools
import os
import shlex
import struct
import time
from contextlib import ExitStack

import numpy as np
import pytensor
import pytensor.tensor as pt
import zmq

import mlp
from logistic_sgd import load_data
from multi_gpu import (cli, datasets, devices, files, launcher, records, report, request,
                       trace)
from multi_gpu.devices import place, storage
from multi_gpu.links import Layout, Peer, PeerError, XlaExchange
from multi_gpu.trainer import (AHEAD, DeviceOrdered, StepClock, Trainer, averages_after,
                               averages_in, local_sgd,
                               mean_in_rank_order, minibatch)
from multi_gpu.worker import hooked, run_worker, stop_point, stopping

# -----------------------------------------------------------------------------
# configuration: the 2014 demo's shared_args
EPOCHS = 10
BATCH_SIZE = 5000          # per worker
LEARNING_RATE = 0.13
N_HIDDEN = 500
L1, L2 = 0.0, 0.0001
SEED = 1234
SHIPPED_BATCH_SIZE = 100   # the shipped 3,000 training digits hold no two minibatches of 5,000
TIMEOUT = 120.0            # seconds a worker waits for the others before it reports them stalled
STEPS_PER_CALL = 10        # steps in one compiled call (--sync gpu, xla), at most an epoch
# the exchange's defaults, by hardware; --exchange: p2p on one machine for two workers, for
# CPUs, or GPUs shared, else xla (request.check_exchange applies them, refusing what can't run)
CHOICES = {
    "sync": {"gpu": "gpu",      # the GPUs order phases 2-6, one kernel at the step's end
             "cpu": "host"},    # the 2014 loop: the only way on CPUs
    "avg": {"gpu": "theano",    # as in 2014: a compiled function whose updates are the means
            "cpu": "pycuda"},   # in place: the mean the workers summed (HostTransport) read
}                               # where it lies, no PyCUDA on a CPU; fastest (compare_cpu.json)


# -----------------------------------------------------------------------------
# the 2014 step: ordered by the host

class CudaIpcTransport:
    """How the weights travel between GPUs: PyCUDA allocates each worker's
    send buffer once, so its address never moves (JAX writes every step's
    weights to new buffers) and one CUDA IPC handle, sent to the others over
    zmq at the start, serves the whole run, as the handles of 2014 did.
    Every copy is a device-to-device copy on this GPU's stream, from the
    other GPU's memory (over NVLink where there is one), as 2014's
    ``memcpy_peer`` was.  The receive buffer is a JAX array, so the compiled
    averaging function reads it directly.  PyCUDA works in JAX's primary CUDA
    context (2014 made a context of its own), so that a pointer into a JAX
    array is PyCUDA's too."""

    route = "CUDA IPC, peer to peer"

    def __init__(self, rank, n_workers, layout, device):
        self.rank, self.layout, self.device, self.drv = rank, layout, device, device.drv
        self.send = self.drv.mem_alloc(layout.nbytes)
        self.recv = device.put(np.zeros(n_workers * layout.size, layout.dtype))
        self.received = [self.recv]  # every worker's weights, in rank order, once fetched
        self.sources, self.opened = [], []

    def handle(self):
        """What the others need to open my send buffer."""
        return self.drv.mem_get_ipc_handle(self.send)

    def connect(self, handles):
        """Every worker's handle in rank order: open theirs in my context."""
        self.opened = [self.drv.IPCMemoryHandle(h) for w, h in enumerate(handles) if w != self.rank]
        others = iter(self.opened)
        self.sources = [int(self.send) if w == self.rank else next(others)
                        for w in range(len(handles))]

    def publish(self, values):
        """My new weights into my send buffer.  New since 2014: Theano updated
        its weights in place, and the handles were taken on them; JAX writes
        each step's into new buffers, where a handle would go stale."""
        itemsize, stream = self.layout.dtype.itemsize, self.device.stream
        for offset, value in zip(self.layout.offsets, values):
            self.drv.memcpy_dtod_async(int(self.send) + offset * itemsize,
                                       self.device.pointer(value), value.nbytes, stream)
        stream.synchronize()

    def fetch(self):
        """Every worker's send buffer, mine too, into my receive buffer, in rank order."""
        base, nbytes = self.device.pointer(self.recv), self.layout.nbytes
        stream = self.device.stream
        for w, source in enumerate(self.sources):
            self.drv.memcpy_dtod_async(base + w * nbytes, source, nbytes, stream)  # peer to peer
        stream.synchronize()

    def close(self):
        for handle in self.opened:
            handle.close()
        self.send.free()
        self.sources = self.opened = []


def mapped(path, layout, mode):
    """A run-folder file of ``layout``'s floats mapped into memory
    (``np.memmap``): ``new`` (made here, exclusively), ``r`` or ``r+``."""
    with (files.new_file(path, layout.nbytes) if mode == "new" else
          files.open_file(path, write=mode == "r+")) as f:
        return np.memmap(f, layout.dtype, mode="r" if mode == "r" else "r+",
                         shape=(layout.size,))


class HostTransport:
    """The same calls between CPU workers, the transport a laptop runs: the
    send buffer is a file in the run's private folder that every worker maps
    into its memory (``np.memmap``), and its name is the handle.  On a CPU
    nothing needs copying out of the others' buffers: they are mapped here.
    So the copy (phase 4) is each worker's share of the mean: worker k of N
    sums the k-th N-th of every send buffer, in rank order, into one more
    mapped file, the mean (``mean.bin``), and after the second signal every
    worker's weights are that mean, read where it lies (phase 6): every
    element summed once, by one worker, so the replicas hold the same bits.
    ``received`` is that mean; the parameters sit 64 bytes apart in it, so
    that JAX reads each in place (``devices.JaxDevice.alias``)."""

    route = "host memory"

    def __init__(self, rundir, rank, n_workers, layout, device):
        self.rank, self.n, self.device, self.layout = rank, n_workers, device, layout.aligned()
        self.path = os.path.join(rundir, f"weights{rank}.bin")
        self.send = mapped(self.path, self.layout, "new")
        self.send_views = self.layout.views(self.send)
        self.mean_path = os.path.join(rundir, "mean.bin")
        if rank == 0:  # made before the handshake, which the others wait for to open it
            mapped(self.mean_path, self.layout, "new")
        # my share of every buffer: whole 64-byte blocks, the last share takes the rest
        block = 64 // self.layout.dtype.itemsize
        cut = [min(self.layout.size, -(-self.layout.size * k // n_workers // block) * block)
               for k in range(n_workers + 1)]
        self.share = slice(cut[rank], cut[rank + 1])
        self.received = [devices.host_buffer(self.layout.size, self.layout.dtype)]
        self.sources, self.aliased = [], None

    def handle(self):
        return self.path

    def connect(self, handles):
        self.sources = [mapped(path, self.layout, "r") for path in handles]
        self.received, self.aliased = [mapped(self.mean_path, self.layout, "r+")], None

    def publish(self, values):
        for view, value in zip(self.send_views, values):
            view[...] = value

    def fetch(self):
        """My share of the mean, from every worker's send buffer, in rank order."""
        mine, (mean,) = self.share, self.received
        np.add(self.sources[0][mine], self.sources[1][mine], out=mean[mine])
        for source in self.sources[2:]:
            mean[mine] += source[mine]
        mean[mine] /= self.n

    def average(self, params):
        """6. under ``--avg pycuda``, the CPUs' default: every parameter is the
        mean as the copies left it, read where it lies: JAX's arrays alias
        the mapped file, made once, with no copy (JAX never writes an array
        in place); another backend (Numba's) may, so it gets a copy."""
        if self.device.mode != "JAX":
            for p, mean in zip(params, self.layout.views(self.received[0])):
                np.copyto(storage(p), mean)
            return
        if self.aliased is None:
            self.aliased = [self.device.alias(view) for view in self.layout.views(self.received[0])]
        for p, mean in zip(params, self.aliased):
            place(p, mean)

    def close(self):
        self.received = self.sources = self.send = self.send_views = self.aliased = None  # unmaps


class StagedCudaTransport:
    """The fallback for GPUs without peer access (``--staged``): each worker
    copies its weights down into a mapped host file (its name the handle),
    the others copy them up into a receive buffer on their GPU."""

    route = "host memory (staged)"

    def __init__(self, rundir, rank, n_workers, layout, device):
        self.layout, self.device = layout, device
        self.path = os.path.join(rundir, f"weights{rank}.bin")
        self.send = mapped(self.path, layout, "new")
        self.send_views = layout.views(self.send)
        self.recv = device.put(np.zeros(n_workers * layout.size, layout.dtype))
        self.received, self.sources = [self.recv], []

    def handle(self):
        return self.path

    def connect(self, handles):
        self.sources = [mapped(path, self.layout, "r") for path in handles]

    def publish(self, values):
        for view, value in zip(self.send_views, values):
            self.device.drv.memcpy_dtoh(view, self.device.pointer(value))

    def fetch(self):
        base, nbytes = self.device.pointer(self.recv), self.layout.nbytes
        for w, source in enumerate(self.sources):
            self.device.drv.memcpy_htod(base + w * nbytes, source)

    def close(self):
        self.sources = self.send = self.send_views = None  # unmaps


def transport(device, rundir, rank, world, layout, staged):
    """The host-ordered transport for ``device``: PyCUDA peer to peer between
    GPUs, else through host memory (CPUs; ``staged``, chosen by the launcher
    where the GPUs cannot reach each other's memory)."""
    if staged:
        return StagedCudaTransport(rundir, rank, world, layout, device)
    if device.name == "cpu":
        return HostTransport(rundir, rank, world, layout, device)
    return CudaIpcTransport(rank, world, layout, device)


def barrier(peer):
    """3. and 5., a signal: a zmq message to every other worker, then one
    from each, on the PAIR socket between the two, so that nobody goes on
    before the last has arrived.  A message holds the barrier's number (all
    must be at the same one) and when its sender arrived, on the machine's
    monotonic clock: returns (the seconds this worker waited for the last to
    arrive, the last one's rank).  (``peer.ready`` waits, in slices, with the
    run's --timeout.)  2014 signalled through two ``multiprocessing.Queue(1)``,
    which join the children of one process only and wait for ever; a zmq
    wait times out, so a worker sees a peer that died."""
    peer.barriers += 1
    arrived, what = time.perf_counter(), f"barrier {peer.barriers}"
    for other, socket in peer.sockets.items():
        peer.ready(other, zmq.POLLOUT, what)
        socket.send(struct.pack("<qd", peer.barriers, arrived), zmq.NOBLOCK)
    last, latest = arrived, peer.rank
    for other, socket in peer.sockets.items():
        peer.ready(other, zmq.POLLIN, what)
        count, their_arrival = struct.unpack("<qd", socket.recv(zmq.NOBLOCK))
        if count != peer.barriers:
            raise PeerError(f"workers out of step: at {what}, worker {other} is at {count}")
        if their_arrival > last:
            last, latest = their_arrival, other
    return last - arrived, latest


class HostOrdered(Trainer):
    """``--sync host``: the 2014 loop.  The host waits for its device after
    each phase and the workers meet at zmq barriers, so the host clock can
    time every phase (``StepClock``, wrapped once around each)."""

    def __init__(self, rank, world, model, device, peer, rundir, avg, staged, check,
                 average_every=1):
        super().__init__(rank, world, model, peer, check, average_every)
        self.device, self.peer, self.clock = device, peer, StepClock()
        layout = Layout.of(model.params)
        self.transport = transport(device, rundir, rank, world, layout, staged)
        self.mean = self.make_average(avg, self.transport.layout)
        model.warm_up(self.mean, put=device.put)
        self.route = f"{self.transport.route}, ordered by the host, --avg {avg}"
        # the six phases, each timed; the fault tests' hook only where DUAL_MLP_FAULT asks
        clock, nbytes = self.clock, self.transport.layout.nbytes
        self.train = clock.timed("train", hooked(rank, "train", self.train_on, stops=True))
        self.publish = clock.timed("publish", self.transport.publish, bytes=nbytes)
        self.signal = clock.timed("signal", functools.partial(barrier, peer), waits=True)
        self.copy = clock.timed("copy", hooked(rank, "exchange", self.transport.fetch),
                                bytes=nbytes)
        self.average = clock.timed("average", self.average_all)

    def handshake(self):
        """Swap the send buffers' handles once, as 2014's ``send_pyobj`` and
        ``recv_pyobj`` did, and open the others'."""
        mine = self.transport.handle()        # my send buffer's IPC handle (CPU: its file)
        everyone = self.peer.exchange(mine)   # every worker's, in rank order, over zmq, once
        self.transport.connect(everyone)      # open the others' (drv.IPCMemoryHandle)
        self.read_where_received()

    def epoch(self, n_steps):
        for step in range(n_steps):
            # start-snippet: the step (README.md quotes it)
            new = self.train(minibatch(step, self.rank, self.world, self.n_steps))  # 1. my own
            if not averages_after(step, n_steps, self.average_every):
                continue        # local SGD (--average-every H): H steps of my own, then 2.-6.
            self.publish(new)   # 2. my new weights into my send buffer (GPU: memcpy_dtod_async)
            self.signal()       # 3. zmq: "published" to every other worker; wait for theirs
            self.copy()         # 4. GPU: every send buffer into my receive buffer, peer to peer;
            #                     CPU: my share of the mean, summed from every mapped send buffer
            self.signal()       # 5. zmq: "copied": the others may overwrite their send buffers
            self.average()      # 6. my weights = the mean of everyone's, summed in rank order
            #                     (CPU: the mean as the copies left it, read where it lies)
            # end-snippet: the step
            self.averages += 1
            self.check_replicas()

    def train_on(self, index):
        """1. One SGD step on minibatch ``index``: the tutorial's ``train_model``."""
        self.count_step()
        self.model.train_model(index)
        return self.written()

    def average_all(self):
        """6. Every parameter set to the mean of everyone's (``--avg``): N
        workers, where 2014 had two, each summing every replica, its own too,
        in rank order (2014: ``param + param_other`` on each side), so that
        every replica gets the same bits."""
        self.mean()
        return self.written()

    def written(self):
        """The replica's weights, once the device has written them: the host
        waits for it after each phase, as in 2014."""
        new = [storage(p) for p in self.model.params]
        self.device.wait(new)
        return new

    def make_average(self, kind, layout):
        """The ``--avg`` variants; each sets every parameter to the mean of
        every worker's, read from the transport's ``received`` buffers (the
        receive buffer the copies went into, or on a CPU every worker's own
        send buffer, mapped)."""
        params, device = self.model.params, self.device
        if kind == "theano":  # as in 2014: a compiled function whose updates are the means
            self.everyone = [pytensor.shared(np.zeros(b.size, layout.dtype), name=f"all{i}")
                             for i, b in enumerate(self.transport.received)]
            self.read_where_received()
            slots = layout.slots(self.everyone)
            # (alloc: a slot of a size-1 dimension, --n-hidden 1, is broadcastable,
            # which the parameter's type is not; XLA copies nothing for it)
            return pytensor.function([], [], mode=device.mode, updates=[
                (p, pt.alloc(mean_in_rank_order([slot[i] for slot in slots]), *p.shape))
                for i, p in enumerate(params)])
        if kind == "pycuda" and device.name == "cpu":  # the laptop's: HostTransport's mean
            return lambda: self.transport.average(params)
        if kind == "pycuda":  # a CUDA kernel, in place on the buffers JAX handed back
            return lambda: device.average_in_place(params, self.transport.received, layout)

        def through_host():
            slots = layout.slots([device.to_host(b) for b in self.transport.received])
            for i, p in enumerate(params):
                place(p, device.put(mean_in_rank_order([slot[i] for slot in slots])))
        return through_host

    def read_where_received(self):
        """The compiled average's inputs: the transport's buffers themselves,
        read in place (no copy), as they are after the handshake."""
        for shared, buffer in zip(getattr(self, "everyone", ()), self.transport.received):
            place(shared, self.device.alias(buffer))

    def weights(self):
        return [self.device.to_host(storage(p)) for p in self.model.params]

    def step_us(self, steps):
        return self.clock.step_us(steps)

    def trace(self, tracer):
        super().trace(tracer)
        self.clock.tracer = tracer

    def report(self):
        return dict(super().report(), exchange_s=self.clock.exchange_s())

    def close(self):
        self.transport.close()


# -----------------------------------------------------------------------------
# the same step, ordered by the GPUs (--sync gpu) or inside XLA (--exchange xla)

class GpuOrdered(DeviceOrdered):
    """``--sync gpu``: the exchange as one kernel on this GPU's stream, inside
    the step (``multi_gpu/stream_exchange.cu``).  ``exchange`` makes this
    worker's side of it: ``StreamExchange``, or a stand-in on a CPU.  Where
    2014's host waited after each phase, the GPUs order them: the kernel
    applies the SGD update as it publishes, signals by writing counters into
    the other GPUs' memory, and copies and averages in one pass, while the
    host queues calls of K steps (``--steps-per-call``) and runs ahead."""

    route = "CUDA IPC, peer to peer, ordered by the GPUs"

    def __init__(self, rank, world, model, device, peer, check, watchdog, steps_per_call,
                 average_every=1, exchange=None):
        import jax
        if exchange is None:
            from multi_gpu.stream_exchange import StreamExchange as exchange

        super().__init__(rank, world, model, peer, check, watchdog, steps_per_call, average_every)
        model.warm_up(put=device.put)
        gradients, self.data = devices.jax_train_step(model, gradients=True)
        train, _ = devices.jax_train_step(model)  # the same model's data, in the same order
        self.exchange = exchange(rank, world, Layout.of(model.params), model.learning_rate)

        def step(data, counter, *params):
            index = minibatch(counter, rank, world, self.n_steps)  # this worker's minibatch
            _, g = gradients(index, data, list(params))          # 1. train: the gradients
            return counter + 1, *self.exchange(params, g)        # 2.-6. update as it publishes

        def own_step(data, counter, *params):  # local SGD: the tutorial's step, no exchange
            _, new = train(minibatch(counter, rank, world, self.n_steps), data, list(params))
            return counter + 1, *new

        self.one_step, self.own_step = step, own_step
        # copies: the model's own weights stay for validation
        self.state = (device.put(np.int32(0)), *[jax.numpy.array(storage(p))
                                                  for p in model.params])
        self.compile()
        # the replica's weights (fresh buffers: the state's are given to the next call)
        self._weights = jax.jit(lambda counter, *params: list(params))
        self._weights(*self.state)  # compiled now, not in the first epoch

    def program(self, steps):
        """Compiled, not run (no peer yet): ``jit``'s own cache keeps what
        ``compile`` made, and a call of the jitted function takes JAX's fast
        dispatch, which a compiled-ahead program with a callback in it does
        not (about 180 us of host per call more on an H200 host).  The whole
        state is donated and the program returns nothing else, so XLA writes
        every step into the same buffers: the exchange's captured launch
        stays valid, and XLA replays its recorded steps as they are.  The host
        learns which steps are done from the exchange's counter in host
        memory.  With ``--average-every H`` the call's steps come in rounds
        of H - 1 of the worker's own and one with the kernel."""
        import jax
        program = jax.jit(local_sgd(self.own_step, self.one_step, steps, self.average_every),
                          donate_argnums=tuple(range(1, 1 + len(self.state))))
        with devices.not_kept(jax):
            program.lower(self.data, *self.state).compile()
        return program

    def handshake(self):
        self.exchange.connect(self.link.exchange(self.exchange.handle()))

    def queue(self, steps):
        self.state = self.programs[steps](self.data, *self.state)
        return self.averages  # the call's last average, as the kernel counts them

    def done(self, marker):
        return self.exchange.steps_done() >= marker

    def device_weights(self):
        return self._weights(*self.state)

    def trace(self, tracer):
        """--trace; on a GPU the kernel stamps its own phases, in a ring that
        holds every step the host may be ahead by, and the GPU's clock is
        read beside the host's now and at the end."""
        super().trace(tracer)
        if hasattr(self.exchange, "trace"):  # the stand-ins on CPUs have no GPU clock
            self.exchange.trace((AHEAD + 2) * averages_in(self.steps_per_call,
                                                          self.average_every))
            self.clock_at_start, self.stamped = self.exchange.read_clock(), []

    stamped = None  # --trace on a GPU: (step, call, the kernel's stamps) of each traced exchange

    def device_spans(self, marker, step, steps, call, start, now):
        """The kernel's stamps of the call's exchanges, kept for ``finish``,
        which puts them on the host's clock."""
        if self.stamped is None:
            return super().device_spans(marker, step, steps, call, start, now)
        if self.tracer.traces(step, steps):
            at = [step + i for i in range(steps) if averages_after(i, steps, self.average_every)]
            self.stamped += [(s, call, self.exchange.stamp(n))
                             for s, n in zip(at, range(marker - len(at) + 1, marker + 1))]

    def finish(self):  # both GPUs are done: neither send buffer is read any more
        barrier(self.link)
        self.exchange_steps = self.exchange.steps_done()
        if self.stamped is not None:  # the stamps onto the host's clock, read once more
            trace.kernel_spans(self.tracer, self.stamped, self.rank, self.exchange.layout.nbytes,
                               self.clock_at_start, self.exchange.read_clock())
        self.exchange.close()

    def report(self):
        return dict(super().report(), exchange_callbacks=self.exchange.callbacks)


class XlaOrdered(DeviceOrdered):
    """``--exchange xla``: the mean over all workers as an XLA all-reduce,
    inside the step, which JAX's distributed runtime runs (NCCL between GPUs,
    gloo between CPUs): for several machines, or more GPUs than two."""

    route = "an XLA all-reduce (JAX's distributed runtime)"

    def __init__(self, rank, world, model, device, xla, check, watchdog, steps_per_call,
                 average_every=1):
        super().__init__(rank, world, model, xla, check, watchdog, steps_per_call, average_every)
        model.warm_up(put=device.put)
        train, data = devices.jax_train_step(model)

        def step(data, counter, params, cost, average=True):
            index = minibatch(counter, xla.rank(), world, self.n_steps)  # this worker's minibatch
            cost, new = train(index, data, params)                       # 1. train
            if average:                                                  # 2.-6. all-reduce
                new = [xla.mean(p) for p in new]
            return counter + 1, new, cost[None]

        self.one_step, self.xla = step, xla
        self.own_step = functools.partial(step, average=False)  # local SGD: no all-reduce
        self.data = [xla.replicated(d) for d in data]
        self.state = (xla.replicated(device.put(np.int32(0))),
                      [xla.replicated(storage(p)) for p in model.params])
        self.compile()

    def program(self, steps):
        import jax.numpy as jnp
        loop = local_sgd(self.own_step, self.one_step, steps, self.average_every)

        def call(data, counter, params):  # the marker: each worker's cost of the last step
            return loop(data, counter, params, jnp.zeros(1, params[0].dtype))
        return self.xla.program(call).lower(self.data, *self.state).compile()

    def queue(self, steps):
        *self.state, cost = self.programs[steps](self.data, *self.state)
        return cost

    def done(self, cost):
        return cost.is_ready()

    def device_weights(self):
        return [self.link.local(p) for p in self.state[1]]

    def finish(self):
        self.exchange_steps = int(np.asarray(self.link.local(self.state[0])))


def make_trainer(args, rank, world, model, device, rundir, xla, watchdog, cleanup):
    """The trainer of the ordering asked for (see the module's text)."""
    if xla:
        return XlaOrdered(rank, world, model, device, xla, args.check, watchdog,
                          args.steps_per_call, args.average_every)
    # ipc:// sockets in the run's private folder, where 2014 bound TCP port 5000 on every
    # interface: nothing to collide with, nothing another user can reach
    peer = Peer(rundir, rank, world, args.timeout, stopping, device.spin)
    cleanup.callback(peer.close)
    if args.sync == "gpu":
        return GpuOrdered(rank, world, model, device, peer, args.check, watchdog,
                          args.steps_per_call, args.average_every)
    return HostOrdered(rank, world, model, device, peer, rundir, args.avg, args.staged,
                       args.check, args.average_every)


# -----------------------------------------------------------------------------
# the worker

def worker(args, rank, world, dev, rundir, watchdog):
    """One worker, start to end: its device, the data, the model, the
    trainer of the ordering asked for, the epochs; worker 0 validates,
    keeps the checkpoint and reports."""
    # worker 0 speaks for the run, the first worker of each other node for its node
    say = print if rank % len(args.devices) == 0 else (lambda *a, **k: None)
    with ExitStack() as cleanup:
        # JAX's distributed runtime must start before anything else touches JAX
        xla = XlaExchange(args.jax_coordinator, world, rank, args.timeout, dev == "cpu",
                          args.one_machine) \
            if args.exchange == "xla" else None
        device = devices.open_device(dev, jax_on_cpu=xla is not None)
        cleanup.callback(device.close)
        # the data set as the launcher checked it (its copy in the run folder), resident
        # on the device
        data = load_data(args.dataset_copy, put=device.put)
        with cli.heartbeat(report.compiling("the model", device.mode, device.name), say):
            model = mlp.Model(data, args.batch_size, args.n_hidden, args.learning_rate, args.l1,
                              args.l2, args.seed, mode=device.mode, evaluates=rank == 0)
            progress = records.Progress(model.get_params())
            if args.resume:
                current, progress = records.Progress.resume(args.resume_copy,  # as checked
                                                            Layout.of(model.params).shapes)
                model.set_params(current)
            for p in model.params:
                place(p, device.put(storage(p)))
            stop_point(rank, "start")
            trainer = make_trainer(args, rank, world, model, device, rundir, xla, watchdog,
                                   cleanup)
            cleanup.callback(trainer.close)
            trainer.start()
            watchdog.follow(trainer, progress.epoch)
            tracer = args.trace and trace.Tracer(rank, (args.trace_from - 1 - progress.epoch) *
                                                 trainer.n_steps, args.trace_steps)
            if tracer:
                trainer.trace(tracer)
        if args.resume:
            say(f"... resumed from {args.resume} at epoch {progress.epoch}")

        n_steps = trainer.n_steps
        say(f"... training: {world} workers on {', '.join(args.devices)}"
            f"{f' x {args.nodes} nodes' if args.nodes > 1 else ''}, {args.batch_size} images per "
            f"worker per step, {cli.counted(n_steps, 'step')} per epoch; weights through "
            f"{trainer.route}")
        start_time = time.perf_counter()
        for epoch in range(progress.epoch + 1, args.epochs + 1):
            epoch_start = time.perf_counter()
            trainer.epoch(n_steps)
            epoch_time = time.perf_counter() - epoch_start
            progress.trained(n_steps, epoch_time)
            if rank != 0:  # worker 0 validates and keeps the checkpoint
                say(report.trained(args, epoch, n_steps, world * n_steps * args.batch_size /
                                   epoch_time))
                continue
            trainer.to_model()
            report.check_finite(model.get_params(), epoch, args.learning_rate, args.l1, args.l2)
            with trace.timed(tracer, "validate"):  # drawn at the step the others wait there
                progress.validated(epoch, float(model.validate_model()), model.test_model,
                                   model.get_params)
            minibatches = cli.counted(world * n_steps, "minibatch", "minibatches")
            say(f"epoch {epoch}/{args.epochs}: {cli.counted(n_steps, 'step')} per worker "
                f"({minibatches} of {args.batch_size}), validation error "
                f"{progress.validation_errors[-1] * 100.:.2f} %  "
                f"({world * n_steps * args.batch_size / epoch_time:,.0f} samples/s)")
            if args.save:
                progress.save(args.save, model.get_params(), args.trained_with)
        trainer.finish()
        if rank == 0:
            report.summarise(args, progress, trainer, n_steps, world,
                             time.perf_counter() - start_time, device, say)
            progress.check_saved(args.save)
        if tracer:
            report.timeline(args, tracer, rundir, trainer, say)


# -----------------------------------------------------------------------------
# the launcher, and the command line

def main(argv=None):
    cli.quiet_start_up()
    args = parse_args(argv)
    started = time.perf_counter()
    args.command = shlex.join(["python", "dual_mlp.py"] + (sys.argv[1:] if argv is None else argv))
    shapes = mlp.parameter_shapes(datasets.N_PIXELS, args.n_hidden, datasets.N_CLASSES)
    with ExitStack() as run:
        cli.keep_going_without_readers()  # it will hold locks, folders, workers: release them
        # the request checked, its outputs held, its private folder named, the other nodes met
        rundir, link = request.prepare(args, shapes, run, BATCH_SIZE, SHIPPED_BATCH_SIZE,
                                       STEPS_PER_CALL, EPOCHS, CHOICES)
        # each worker is forked from here, as in 2014, and runs worker() in its own process;
        # JAX and PyTensor are imported, never started: JAX's threads and CUDA would not
        # survive the fork (2014 forked first, then imported Theano)
        start = functools.partial(run_worker, worker, one_line_errors=(
            PeerError, records.CheckpointError, datasets.DatasetError, report.Diverged))
        code = launcher.supervise(args, shapes, start, rundir, link)
    if code == 0:
        cli.say(report.ended(args, time.perf_counter() - started))
    return code


def parse_args(argv=None):
    p = cli.Parser(about=__doc__, epilog=(
        "THEANO_FLAGS is honoured (mapped onto PyTensor's flags; floatX defaults to float32). "
        "See README.md for the data choices, the GPU set-up and runs on several machines."))
    p.add_argument("devices", nargs="*", metavar="DEV",
                   help="one worker per device, at least two, each a GPU index or 'cpu' "
                        "(default: 0 1 when two GPUs are usable, else cpu cpu); '0 0' puts "
                        "two workers on one GPU")
    p.add_argument("--epochs", type=cli.positive_int,
                   help=f"passes over the training set (default: {EPOCHS}; with --resume, "
                        "those the checkpoint's run asked for)")
    p.add_argument("--batch-size", type=cli.positive_int, default=None,
                   help=f"minibatch size per worker (default: {BATCH_SIZE}; "
                        f"{SHIPPED_BATCH_SIZE} on the shipped digits)")
    p.add_argument("--learning-rate", type=cli.positive, default=LEARNING_RATE,
                   help="SGD step size (default: %(default)s)")
    p.add_argument("--n-hidden", type=cli.positive_int, default=N_HIDDEN,
                   help="hidden units (default: %(default)s)")
    p.add_argument("--l1", type=cli.non_negative, default=L1,
                   help="L1 weight penalty (default: %(default)s)")
    p.add_argument("--l2", type=cli.non_negative, default=L2,
                   help="squared L2 weight penalty (default: %(default)s)")
    p.add_argument("--dataset", metavar="PATH", type=cli.dataset,
                   help="mnist.pkl.gz or a folder of MNIST-format IDX files, e.g. "
                        "/usr/share/datasets/fashion-mnist (default: ./mnist.pkl.gz if "
                        "present, else the 5,000 digits shipped in data/)")
    p.add_argument("--exchange", choices=("p2p", "xla"),
                   help="how the replicas average: 'p2p' the 2014 exchange among the workers "
                        "of one machine (PyCUDA peer-to-peer copies, or host memory on CPUs); "
                        "'xla' a pmean inside the compiled step, through JAX's distributed "
                        "runtime (default: p2p for two workers and for CPUs, xla for more "
                        "GPUs and for several machines)")
    p.add_argument("--sync", choices=("gpu", "host"),
                   help="p2p: who orders the exchange; 'gpu' the GPUs, on their streams, "
                        "the host never waiting within a step; 'host' the 2014 loop, the host "
                        "waiting for each phase (default: gpu on GPUs, host on CPUs; "
                        "workers sharing a GPU run it only when asked, time-sliced)")
    p.add_argument("--avg", choices=("theano", "pycuda", "cpu"),
                   help="--sync host: how to average; 'theano' a compiled PyTensor function "
                        "whose updates are the means (the default on GPUs, as in 2014); "
                        "'pycuda' in place on the buffers (a CUDA kernel on GPUs; on CPUs, "
                        "where the workers sum the mean into one shared buffer, each its "
                        "share, the weights read it where it lies: the default there, "
                        "measured fastest); 'cpu' through host memory")
    p.add_argument("--average-every", type=cli.positive_int, default=1, metavar="H",
                   help="average the replicas every H steps (local SGD): each worker takes H "
                        "SGD steps on its own minibatches, then all average; an epoch always "
                        "ends on an average (default: 1, the 2014 demo: after every step)")
    p.add_argument("--seed", type=cli.seed, default=SEED,
                   help="weight initialisation seed (default: %(default)s)")
    p.add_argument("--staged", action="store_true",
                   help="GPUs: copy the weights through host memory, the fallback used "
                        "where the two GPUs cannot reach each other's memory")
    p.add_argument("--steps-per-call", type=cli.positive_int, metavar="K",
                   help="--sync gpu and --exchange xla: K steps in one compiled call, so that "
                        "the host queues a call, not a step, and a small step is not bound by "
                        "the host (default: " + str(STEPS_PER_CALL) + ", at most an epoch); the "
                        "host-ordered loop takes one step per call")
    cli.add_run_options(p, TIMEOUT)  # --save, --trace, --timeout, --nodes, ...: the plumbing's
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
