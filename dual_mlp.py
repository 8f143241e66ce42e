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

Top to bottom: the configuration (2014's ``shared_args``); the transports
(``CudaIpcTransport``; ``HostTransport`` on CPUs); every zmq call; the
trainers ``HostOrdered`` (the step above) and ``GpuOrdered`` (``--sync gpu``:
phases 2-6 as one kernel); ``worker``; ``main``, the launcher.  Past two GPUs
or one machine, JAX's runtime runs the step (``multi_gpu/xla_runtime.py``).
"""
import signal
import sys
if __name__ == "__main__":  # a Ctrl-C while PyTensor loads ends the script, with no traceback
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.path.insert(0, __file__.rpartition("/")[0])  # the package, under python -I too
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)
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
from multi_gpu import (cli, datasets, devices, files, records, report, request, supervisor,
                       trace, xla_cache)
from multi_gpu.devices import place, storage
from multi_gpu.hooks import Interrupted, stop_point, stopping
from multi_gpu.sockets import HANDSHAKE, Peer, PeerError
from multi_gpu.stream_exchange import StreamExchange
from multi_gpu.trainer import (DeviceOrdered, StepClock, Trainer, averages_after, local_sgd,
                               mean_in_rank_order, minibatch)
from multi_gpu.transports import Layout, StagedCudaTransport
from multi_gpu.worker import run_worker
from multi_gpu.xla_runtime import XlaExchange, XlaOrdered

# -----------------------------------------------------------------------------
# configuration: the 2014 demo's shared_args
EPOCHS = 10
BATCH_SIZE = 5000          # per worker
LEARNING_RATE = 0.13
N_HIDDEN = 500
L1 = 0.0
L2 = 0.0001
SEED = 1234
SHIPPED_BATCH_SIZE = 100   # the shipped 3,000 training digits hold no two minibatches of 5,000
TIMEOUT = 120.0            # seconds a worker waits for the others before it reports them stalled
STEPS_PER_CALL = 10        # steps in one compiled call (--sync gpu, xla), at most an epoch
# the exchange's defaults (request.check_exchange applies them, refusing what cannot run)
CHOICES = {
    "exchange": {   # `0 1`, `cpu cpu cpu`, `0 0`: the 2014 exchange; `0 1 2 3`: JAX's runtime
        "two workers, or CPUs, or workers sharing a GPU, on one machine": "p2p",
        "GPUs past two, or several machines": "xla"},
    "sync": {"gpu": "gpu",      # the GPUs order phases 2-6, one kernel at the step's end
             "cpu": "host"},    # the 2014 loop: the only way on CPUs
    "avg": {"gpu": "theano",    # as in 2014: a compiled function whose updates are the means
            "cpu": "shared"},   # the mean the workers summed into one shared buffer, read
}                               # where it lies (HostTransport); fastest (compare_cpu.json)


# -----------------------------------------------------------------------------
# the 2014 step: ordered by the host

class CudaIpcTransport:
    """How the weights travel between GPUs.  PyCUDA allocates each worker's
    send buffer once, so one CUDA IPC handle, swapped over zmq at the start,
    serves the whole run, as 2014's did; each copy is a device-to-device copy
    from the other GPU's memory (over NVLink where there is one), as 2014's
    ``memcpy_peer`` was, into a JAX array that the average reads.  PyCUDA
    works in JAX's primary context (2014 made its own), so that a pointer
    into a JAX array is PyCUDA's too."""

    route = "CUDA IPC, peer to peer"

    def __init__(self, rank, n_workers, layout, device):
        self.rank = rank
        self.layout = layout
        self.device = device
        self.drv = device.drv
        self.send = self.drv.mem_alloc(layout.nbytes)
        self.recv = device.put(np.zeros(n_workers * layout.size, layout.dtype))
        self.received = [self.recv]  # every worker's weights, in rank order, once fetched
        self.sources = []  # every worker's send buffer, in rank order, once connected
        self.opened = []   # the others', opened in my context

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
        itemsize = self.layout.dtype.itemsize
        stream = self.device.stream
        for offset, value in zip(self.layout.offsets, values):
            self.drv.memcpy_dtod_async(int(self.send) + offset * itemsize,
                                       self.device.pointer(value), value.nbytes, stream)
        stream.synchronize()

    def fetch(self):
        """Every worker's send buffer, mine too, into my receive buffer, in rank order."""
        base = self.device.pointer(self.recv)
        nbytes = self.layout.nbytes
        stream = self.device.stream
        for w, source in enumerate(self.sources):
            self.drv.memcpy_dtod_async(base + w * nbytes, source, nbytes, stream)  # peer to peer
        stream.synchronize()

    def close(self):
        for handle in self.opened:
            handle.close()
        self.send.free()
        self.sources = self.opened = []


class HostTransport:
    """The same calls between CPU workers: a send buffer is a file in the
    run's private folder that every worker maps (``np.memmap``); its name is
    the handle.  The copy (phase 4) is each worker's share of the mean: worker
    k of N sums the k-th N-th of every send buffer, in rank order, into one
    more mapped file (``mean.bin``), which every worker's weights then are
    (phase 6).  Each element is summed by one worker: the same bits everywhere."""

    route = "host memory"

    def __init__(self, rundir, rank, n_workers, layout, device):
        self.rank = rank
        self.n = n_workers
        self.device = device
        self.layout = layout.aligned()
        self.path = os.path.join(rundir, f"weights{rank}.bin")
        self.send = files.mapped(self.path, self.layout, "new")
        self.send_views = self.layout.views(self.send)
        self.mean_path = os.path.join(rundir, "mean.bin")
        if rank == 0:  # made before the handshake, which the others wait for to open it
            files.mapped(self.mean_path, self.layout, "new")
        # my share of every buffer: whole 64-byte blocks, the last share takes the rest
        block = 64 // self.layout.dtype.itemsize
        cut = [min(self.layout.size, -(-self.layout.size * k // n_workers // block) * block)
               for k in range(n_workers + 1)]
        self.share = slice(cut[rank], cut[rank + 1])
        self.received = [devices.host_buffer(self.layout.size, self.layout.dtype)]
        self.sources = []  # every worker's send buffer, mapped, once connected
        self.aliased = []  # the mean's views, as JAX reads them in place

    def handle(self):
        return self.path

    def connect(self, handles):
        self.sources = [files.mapped(path, self.layout, "r") for path in handles]
        self.received = [files.mapped(self.mean_path, self.layout, "r+")]
        if self.device.mode == "JAX":  # views that JAX reads in place: made once, no copy
            self.aliased = [self.device.alias(v) for v in self.layout.views(self.received[0])]

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
        """6. under ``--avg shared``, the CPUs' default: every parameter is the
        mean as the copies left it, read where it lies (JAX never writes an
        array in place); another backend (Numba's) may, so it gets a copy."""
        if self.device.mode != "JAX":
            for p, mean in zip(params, self.layout.views(self.received[0])):
                np.copyto(storage(p), mean)
            return
        for p, mean in zip(params, self.aliased):
            place(p, mean)

    def close(self):
        self.received = self.sources = self.send = self.send_views = self.aliased = None  # unmaps


def transport(device, rundir, rank, world, layout, staged):
    """The host-ordered transport: PyCUDA peer to peer between GPUs, else
    through host memory (CPUs; ``staged``, GPUs without peer access)."""
    if staged:
        return StagedCudaTransport(rundir, rank, world, layout, device)
    if device.name == "cpu":
        return HostTransport(rundir, rank, world, layout, device)
    return CudaIpcTransport(rank, world, layout, device)


def wait_for_worker(peer, other, event, what):
    """Waiting for a later worker: until the socket to ``other`` can send or
    receive (``event``), polled in slices (a PAIR socket whose peer is gone
    blocks a plain send for ever); a stop request or --timeout ends it.  A
    receive first spins ``peer.spin`` s (GPUs: a wake-up costs microseconds)."""
    socket = peer.sockets[other]
    spin_until = time.perf_counter() + peer.spin
    while event == zmq.POLLIN and time.perf_counter() < spin_until:
        if socket.poll(0, event):
            return
    started = since = time.monotonic()
    while not socket.poll(100, event):
        if stopping.signum:  # an attribute, set by a signal's handler: nothing to call
            raise Interrupted
        if time.monotonic() - since > peer.timeout or since > started:  # or still compiling
            since = peer.overdue(other, what, started, since)  # PeerError, or counts anew


def barrier(peer):
    """3. and 5., a signal: a zmq message to every other worker, then one
    from each, so that nobody goes on before the last has arrived.  A message
    holds the barrier's number (all must be at the same) and when its sender
    arrived: returns (the seconds I waited for the last, its rank).  2014
    signalled through ``multiprocessing.Queue``s, which join one process's
    children only and wait for ever; this wait times out (--timeout)."""
    peer.barriers += 1
    arrived = time.perf_counter()
    what = f"barrier {peer.barriers}"
    for other, socket in peer.sockets.items():
        wait_for_worker(peer, other, zmq.POLLOUT, what)
        socket.send(struct.pack("<qd", peer.barriers, arrived), zmq.NOBLOCK)
    last, latest = arrived, peer.rank
    for other, socket in peer.sockets.items():
        wait_for_worker(peer, other, zmq.POLLIN, what)
        count, their_arrival = struct.unpack("<qd", socket.recv(zmq.NOBLOCK))
        if count != peer.barriers:
            raise PeerError(f"workers out of step: at {what}, worker {other} is at {count}")
        if their_arrival > last:
            last, latest = their_arrival, other
    return last - arrived, latest


def swap(peer, mine, what=HANDSHAKE):
    """Send ``mine`` to every other worker, as 2014's handshake did
    (``send_pyobj``, ``recv_pyobj``); returns every worker's, in rank order,
    mine included (the handles, once; the replica check)."""
    for other, socket in peer.sockets.items():
        wait_for_worker(peer, other, zmq.POLLOUT, what)
        socket.send_pyobj(mine, zmq.NOBLOCK)
    theirs = {}
    for other, socket in peer.sockets.items():
        wait_for_worker(peer, other, zmq.POLLIN, what)
        theirs[other] = socket.recv_pyobj(zmq.NOBLOCK)
    return [mine if other == peer.rank else theirs[other] for other in range(peer.n)]


def swap_handles(peer, drv, *buffers):
    """My PyCUDA ``buffers``' CUDA IPC handles (``drv.mem_get_ipc_handle``),
    swapped once; returns every worker's buffers, in rank order: mine, and
    the others' opened in my context (``drv.IPCMemoryHandle``)."""
    everyone = swap(peer, [drv.mem_get_ipc_handle(b) for b in buffers])
    return [buffers if w == peer.rank else [drv.IPCMemoryHandle(h) for h in handles]
            for w, handles in enumerate(everyone)]


def gather(peer, array):
    """Every worker's ``array``, stacked in rank order (the replica check)."""
    return np.stack(swap(peer, array, "the replica check"))


class HostOrdered(Trainer):
    """``--sync host``: the 2014 loop.  The host waits for its device after
    each phase and the workers meet at zmq barriers, so each phase is timed."""

    def __init__(self, rank, world, model, device, peer, *, rundir, avg, staged, check,
                 average_every=1):
        super().__init__(rank, world, model, gather=functools.partial(gather, peer), check=check,
                         average_every=average_every)
        self.device = device
        self.peer = peer
        self.avg = avg
        self.transport = transport(device, rundir, rank, world, Layout.of(model.params), staged)
        if avg == "theano":
            self.compiled_average = self.compile_average(self.transport.layout)
        model.warm_up(self.average_all, put=device.put)
        self.route = f"{self.transport.route}, ordered by the host, --avg {avg}"
        self.clock = StepClock(rank, self.transport.layout.nbytes)  # runs and times each phase

    def handshake(self):
        """Swap the send buffers' handles once, as 2014's ``send_pyobj`` and
        ``recv_pyobj`` did, and open the others'."""
        mine = self.transport.handle()        # my send buffer's IPC handle (CPU: its file)
        everyone = swap(self.peer, mine)      # every worker's, in rank order, over zmq, once
        self.transport.connect(everyone)      # open the others' (drv.IPCMemoryHandle)
        self.read_where_received()

    def epoch(self, n_steps):
        phase = self.clock.phase
        transport = self.transport
        peer = self.peer
        for step in range(n_steps):
            # start-snippet: the step (README.md quotes it)
            i = minibatch(step, self.rank, self.world, self.n_steps)  # k, k + N, ... of N
            new = phase("train", self.train_on, i)  # 1. one SGD step on my own minibatch
            if not averages_after(step, n_steps, self.average_every):
                continue  # local SGD (--average-every H): H steps of my own, then 2.-6.
            phase("publish", transport.publish, new)  # 2. my weights into my send buffer
            #     (GPU: drv.memcpy_dtod_async; CPU: a mapped file, which the others map too)
            phase("signal", barrier, peer)       # 3. zmq: "published"; wait for every other
            phase("copy", transport.fetch)       # 4. GPU: every send buffer into my receive
            #     buffer, peer to peer; CPU: my share of the mean, from every mapped send buffer
            phase("signal", barrier, peer)       # 5. zmq: "copied": each may overwrite its own
            phase("average", self.average_all)   # 6. my weights = the mean, in rank order
            #     (CPU: the mean as the copies left it, read where it lies)
            # end-snippet: the step
            self.averages += 1
            self.check_replicas()

    def train_on(self, index):
        """1. One SGD step on minibatch ``index``: the tutorial's ``train_model``."""
        self.count_step()
        self.model.train_model(index)
        return self.written()

    def average_all(self):
        """6. Every parameter set to the mean of every worker's, from where the
        copies left it (the transport's ``received``), summed in rank order
        everywhere (2014: ``param + param_other``): the same bits."""
        params = self.model.params
        received = self.transport.received
        layout = self.transport.layout
        if self.avg == "theano":    # as in 2014: a compiled function whose updates are the means
            self.compiled_average()
        elif self.avg == "pycuda":  # as in 2014: a PyCUDA kernel, in place on JAX's buffers
            self.device.average_in_place(params, received, layout)
        elif self.avg == "shared":  # CPUs: the mean the workers summed, read where it lies
            self.transport.average(params)
        else:                       # "cpu": the mean taken on the host, put back on the device
            slots = layout.slots([self.device.to_host(b) for b in received])
            for i, p in enumerate(params):
                place(p, self.device.put(mean_in_rank_order([slot[i] for slot in slots])))
        return self.written()

    def written(self):
        """The replica's weights, once the device has written them: the host
        waits for it after each phase, as in 2014."""
        new = [storage(p) for p in self.model.params]
        self.device.wait(new)
        return new

    def compile_average(self, layout):
        """``--avg theano``: a PyTensor function whose updates set every
        parameter to the mean of every worker's, read where the copies left
        them (``read_where_received``)."""
        self.everyone = [pytensor.shared(np.zeros(b.size, layout.dtype), name=f"all{i}")
                         for i, b in enumerate(self.transport.received)]
        self.read_where_received()
        slots = layout.slots(self.everyone)
        # (alloc: a slot of a size-1 dimension, --n-hidden 1, is broadcastable,
        # which the parameter's type is not; XLA copies nothing for it)
        return pytensor.function([], [], mode=self.device.mode, updates=[
            (p, pt.alloc(mean_in_rank_order([slot[i] for slot in slots]), *p.shape))
            for i, p in enumerate(self.model.params)])

    def read_where_received(self):
        """The compiled average's inputs: the transport's buffers, read in place."""
        for shared, buffer in zip(getattr(self, "everyone", ()), self.transport.received):
            place(shared, self.device.alias(buffer))

    def weights(self):
        return [self.device.to_host(storage(p)) for p in self.model.params]

    def close(self):
        self.transport.close()


# -----------------------------------------------------------------------------
# the same step, ordered by the GPUs (--sync gpu) or inside XLA (--exchange xla)

class GpuOrdered(DeviceOrdered):
    """``--sync gpu``: the exchange as one kernel on this GPU's stream, inside
    the step (``StreamExchange``, or a stand-in on a CPU).  The GPUs order
    the phases: the kernel applies the SGD update as it publishes, signals by
    writing counters into the other GPUs' memory, and copies and averages in
    one pass, while the host queues calls of K steps and runs ahead."""

    route = "CUDA IPC, peer to peer, ordered by the GPUs"

    def __init__(self, rank, world, model, device, peer, *, check, watchdog, steps_per_call,
                 average_every=1, exchange=StreamExchange):
        import jax
        super().__init__(rank, world, model, gather=functools.partial(gather, peer), check=check,
                         watchdog=watchdog, steps_per_call=steps_per_call,
                         average_every=average_every)
        self.peer = peer
        self.device = device
        model.warm_up(put=device.put)
        gradients, self.data = devices.jax_train_step(model, gradients=True)
        train, _ = devices.jax_train_step(model)  # the same model's data, in the same order
        self.exchange = self.stamper = exchange(rank, world, Layout.of(model.params),
                                                model.learning_rate)

        def step(data, counter, *params):
            index = minibatch(counter, rank, world, self.n_steps)  # this worker's minibatch
            _, g = gradients(index, data, list(params))          # 1. train: the gradients
            return counter + 1, *self.exchange(params, g)        # 2.-6. update as it publishes

        def own_step(data, counter, *params):  # local SGD: the tutorial's step, no exchange
            _, new = train(minibatch(counter, rank, world, self.n_steps), data, list(params))
            return counter + 1, *new

        self.one_step = step
        self.own_step = own_step
        # copies: the model's own weights stay for validation
        self.state = (device.put(np.int32(0)), *[jax.numpy.array(storage(p))
                                                  for p in model.params])
        self.compile()
        # the replica's weights (fresh buffers: the state's are given to the next call)
        self._weights = jax.jit(lambda counter, *params: list(params))
        self._weights(*self.state)  # compiled now, not in the first epoch

    def program(self, steps):
        """Compiled, not run (no peer yet), and called jitted: JAX's fast
        dispatch (compiled ahead, 180 us more of host a call on an H200 host).
        The whole state is donated and nothing else returned: XLA writes every
        step into the same buffers, and the kernel's captured launch holds."""
        import jax
        program = jax.jit(local_sgd(self.own_step, self.one_step, steps, self.average_every),
                          donate_argnums=tuple(range(1, 1 + len(self.state))))
        with xla_cache.not_kept(jax):
            program.lower(self.data, *self.state).compile()
        return program

    def handshake(self):
        """The kernel's send slots and flags, two PyCUDA buffers, swapped once."""
        self.exchange.connect(swap_handles(self.peer, self.device.drv, self.exchange.send,
                                           self.exchange.flags))

    def queue(self, steps):
        self.state = self.programs[steps](self.data, *self.state)
        return self.averages  # the call's last average, as the kernel counts them

    def done(self, marker):
        return self.exchange.steps_done() >= marker

    def device_weights(self):
        return self._weights(*self.state)

    def finish(self):  # both GPUs are done: neither send buffer is read any more
        barrier(self.peer)
        self.exchange_steps = self.exchange.steps_done()
        self.draw_stamps()
        self.exchange.close()


def make_trainer(args, rank, world, model, device, rundir, xla, watchdog, cleanup):
    """The trainer of the ordering asked for (see the module's text)."""
    how = dict(check=args.check, average_every=args.average_every)
    if xla:
        return XlaOrdered(rank, world, model, device, xla, watchdog=watchdog,
                          steps_per_call=args.steps_per_call, **how)
    # ipc:// sockets in the run's private folder, where 2014 bound TCP port 5000 on every
    # interface: nothing to collide with, nothing another user can reach
    peer = Peer(rundir, rank, world, timeout=args.timeout, spin=device.spin)
    cleanup.callback(peer.close)
    if args.sync == "gpu":
        return GpuOrdered(rank, world, model, device, peer, watchdog=watchdog,
                          steps_per_call=args.steps_per_call, **how)
    return HostOrdered(rank, world, model, device, peer, rundir=rundir, avg=args.avg,
                       staged=args.staged, **how)


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
        xla = args.exchange == "xla" and XlaExchange(args.jax_coordinator, world, rank,
                                                     args.timeout, dev == "cpu", args.one_machine)
        device = devices.open_device(dev, jax_on_cpu=bool(xla))
        cleanup.callback(device.close)
        # the data set as the launcher checked it (its copy in the run folder), on the device
        data = load_data(args.dataset_copy, put=device.put)
        with cli.heartbeat(report.compiling("the model", device.mode, device.name), say):
            model = mlp.Model(data, args.batch_size, args.n_hidden, args.learning_rate, args.l1,
                              args.l2, args.seed, mode=device.mode, evaluates=rank == 0)
            progress = records.Progress.begin(model, world, args.resume and args.resume_copy)
            for p in model.params:
                place(p, device.put(storage(p)))
            stop_point(rank, "start")
            trainer = make_trainer(args, rank, world, model, device, rundir, xla, watchdog,
                                   cleanup)
            cleanup.callback(trainer.close)
            trainer.handshake()    # once, before the loop, as 2014's: the buffers' handles
            trainer.check_start()  # every replica starts from the same weights
            watchdog.follow(trainer, progress.epoch)
            tracer = args.trace and trace.Tracer(rank, (args.trace_from - 1 - progress.epoch) *
                                                 trainer.n_steps, args.trace_steps)
            if tracer:
                trainer.trace(tracer)
        if args.resume:
            say(f"... resumed from {args.resume} at epoch {progress.epoch}")

        n_steps = trainer.n_steps
        nodes = f" x {len(args.world)} nodes" if len(args.world) > 1 else ""
        say(f"... training: {world} workers on {', '.join(args.devices)}{nodes}, "
            f"{args.batch_size} images per worker per step, {cli.counted(n_steps, 'step')} per "
            f"epoch; weights through {trainer.route}")
        start_time = time.perf_counter()
        for epoch in range(progress.epoch + 1, args.epochs + 1):
            epoch_start = time.perf_counter()
            trainer.epoch(n_steps)
            epoch_time = time.perf_counter() - epoch_start
            progress.trained(n_steps, epoch_time)
            samples_per_s = world * n_steps * args.batch_size / epoch_time
            if rank != 0:  # worker 0 validates and keeps the checkpoint
                say(f"node {args.node_rank}: epoch {epoch}/{args.epochs}: "
                    f"{cli.counted(n_steps, 'step')} per worker ({samples_per_s:,.0f} "
                    "samples/s); node 0 validates")
                continue
            trainer.to_model()
            report.check_finite(model.get_params(), epoch, args.learning_rate, args.l1, args.l2)
            with trace.timed(tracer, "validate"):  # drawn at the step the others wait there
                progress.validated(epoch, float(model.validate_model()), model.test_model,
                                   model.get_params)
            say(f"epoch {epoch}/{args.epochs}: {cli.counted(n_steps, 'step')} per worker "
                f"({cli.counted(world * n_steps, 'minibatch', 'minibatches')} of "
                f"{args.batch_size}), validation error "
                f"{progress.validation_errors[-1] * 100.:.2f} %  ({samples_per_s:,.0f} samples/s)")
            if args.save:
                progress.save(args.save, model.get_params(), args.trained_with, args.run_id)
        trainer.finish()
        if rank == 0:
            say(f"Optimization complete. Best validation error "
                f"{progress.best_validation_error * 100.:.2f} %, test error of that model "
                f"{progress.test_error * 100.:.2f} %{report.remarks(args, progress)}")
            samples_per_s, step_us = speeds = report.speed(args, progress, trainer, world)
            say(f"Trained at {samples_per_s:,.0f} samples/s ({world} workers), "
                f"{step_us['step']:.0f} us per step{report.phases(step_us)}")
            report.summarise(args, progress, trainer, n_steps, world,
                             time.perf_counter() - start_time, device, say, speeds)
            progress.check_saved(args.save)
        if tracer:
            report.timeline(args, tracer, rundir, trainer, device, say)


# -----------------------------------------------------------------------------
# the launcher, and the command line

def main(argv=None):
    cli.quiet_start_up()
    args = parse_args(argv)
    command = shlex.join(["python", "dual_mlp.py"] + (sys.argv[1:] if argv is None else argv))
    shapes = mlp.parameter_shapes(datasets.N_PIXELS, args.n_hidden, datasets.N_CLASSES)
    with ExitStack() as run:
        cli.keep_going_without_readers()  # it will hold locks, folders, workers: release them
        # the request checked (the plan: frozen), its outputs held, its private folder named,
        # the other nodes met
        plan, rundir, link = request.prepare(
            args, shapes, run, command=command, batch_size=BATCH_SIZE,
            shipped_batch_size=SHIPPED_BATCH_SIZE, steps_per_call=STEPS_PER_CALL, epochs=EPOCHS,
            choices=CHOICES)
        # each worker is forked from here, as in 2014, and runs worker() in its own process;
        # JAX and PyTensor are imported, never started: JAX's threads and CUDA would not
        # survive the fork (2014 forked first, then imported Theano)
        start = functools.partial(run_worker, worker, one_line_errors=(
            PeerError, records.CheckpointError, datasets.DatasetError, report.Diverged))
        code = supervisor.Supervisor(plan, shapes, start, rundir, link).run()
    if code == 0:
        cli.say(report.ended(plan))
    return code


def parse_args(argv=None):
    p = cli.Parser(about=__doc__, epilog=(
        "THEANO_FLAGS is honoured (mapped onto PyTensor's flags; floatX defaults to float32). "
        "See README.md for the data choices, the GPU set-up and runs on several machines."))
    p.add_argument("devices", nargs="*", metavar="DEV",
                   help="one worker per device, at least two, each a GPU index or 'cpu' "
                        "(default: 0 1 when two GPUs are usable, else cpu cpu); '0 0' puts "
                        "two workers on one GPU")
    cli.add_training_options(p, EPOCHS, BATCH_SIZE, LEARNING_RATE, SHIPPED_BATCH_SIZE)
    cli.add_model_options(p, N_HIDDEN, L1, L2, SEED)
    cli.add_exchange_options(p, CHOICES, STEPS_PER_CALL)  # --exchange, --sync, --avg, ...
    cli.add_run_options(p, TIMEOUT)  # --save, --trace, --timeout, --nodes, ...: the plumbing's
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
