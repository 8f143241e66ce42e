#!/usr/bin/env python
"""Train the tutorial's MLP on several workers that average their weights after every step.

A re-creation of "Multi-GPU using Theano and PyCUDA" (dual_mlp.py, University
of Guelph, 2014), on PyTensor, PyCUDA and pyzmq::

    THEANO_FLAGS=mode=FAST_RUN,floatX=float32 python dual_mlp.py 0 1    # GPUs 0 and 1
    python dual_mlp.py cpu cpu                                          # no GPU needed
    python dual_mlp.py 0 1 2 3                                          # four GPUs

This process is the launcher: it checks the request, starts one worker per
device (this same file, with ``--worker``), watches them, and stops them all
if one fails.  Worker k of N holds a full replica of the MLP and trains on the
minibatches whose index is k modulo N.  As in 2014 (``--exchange p2p``), after
every step of their own, on one machine:

  1. train    one SGD step on its minibatch;
  2. publish  copy its weights into its send buffer, whose address never moves;
  3. signal   "published", and wait until every other worker has published too;
  4. copy     read every send buffer (GPUs: peer-to-peer reads of CUDA IPC
              buffers; CPUs: host memory);
  5. signal   "copied": the others may overwrite their send buffers again;
  6. average  set its weights to the mean of all, summed in rank order, so
              that every replica gets the same bits.

What changed since 2014 is who orders these steps (``--sync``):

  host   the host waits for its GPU after each phase, and the signals are
         zmq messages: the 2014 loop, and the only way on CPUs;
  gpu    steps 2-6 are one kernel on the GPU's own stream, at the end of the
         compiled training step, and the signals are counters each GPU writes
         into the others' memory (stream_exchange.py).  The step hands the
         kernel its gradients, and the kernel applies the SGD update as it
         publishes: left to XLA, the update would write every weight once
         more, in kernels of its own, just before the exchange reads them.
         The host only queues calls of K steps (``--steps-per-call``), so it
         runs ahead while the GPUs compute.

Several machines, or more GPUs than two by default, average with
``--exchange xla``: the compiled step ends in a ``pmean`` over all workers
that JAX's distributed runtime runs (NCCL between GPUs, gloo between CPUs).

Every replica then holds the same weights, and together they have taken one
SGD step on a minibatch N times the size: the mean of N minibatch gradients
is the gradient of their union's mean cost.
"""
import cli  # first: quiet Ctrl-C and closed pipes from the very start
import argparse
import collections
import functools
import json
import operator
import os
import platform
import shlex
import shutil
import sys
import time
from contextlib import ExitStack

import theano_flags  # noqa: F401  (maps THEANO_FLAGS onto PyTensor; must precede it)
import numpy as np
import pytensor

import datasets
import devices
import exchange
import launcher
import mlp
import records
from devices import place, storage
from exchange import Layout, Peer, PeerError, XlaExchange
from launcher import Interrupted, Unwatched, fault_point, stop_point, stopping
from logistic_sgd import load_data

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
UNROLL = 5                 # of them unrolled in the program: XLA runs a loop's body step by step
AHEAD = 8                  # calls the host may queue ahead of the device
# -----------------------------------------------------------------------------


def parse_args(argv=None):
    p = cli.Parser(description=__doc__.split("\n")[0], epilog=(
        "THEANO_FLAGS is honoured (mapped onto PyTensor's flags; floatX defaults to float32). "
        "See README.md for the data choices, the GPU set-up and runs on several machines."))
    p.add_argument("devices", nargs="*", metavar="DEV",
                   help="one worker per device, at least two, each a GPU index or 'cpu' "
                        "(default: 0 1 when two GPUs are usable, else cpu cpu); '0 0' puts "
                        "two workers on one GPU")
    p.add_argument("--epochs", type=cli.positive_int, default=EPOCHS,
                   help="passes over the training set (default: %(default)s)")
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
    p.add_argument("--dataset", metavar="PATH",
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
                        "(the default, as in 2014); 'pycuda' in place on the buffers (a CUDA "
                        "kernel on GPUs, NumPy on the CPU); 'cpu' through host memory")
    p.add_argument("--save", metavar="PATH", type=cli.writable,
                   help="checkpoint (.npz) written after every epoch, atomically: current "
                        "and best-validation weights, training state and configuration; the "
                        "run holds it, and a second run asking for it is refused")
    p.add_argument("--resume", metavar="PATH", help="continue from a --save checkpoint, with "
                   "the options it was trained with (--save may name the same file)")
    p.add_argument("--json", metavar="PATH", type=cli.writable,
                   help="write a summary of the run as JSON")
    p.add_argument("--check", action="store_true", help="after every step, measure how far "
                   "the replicas differ (max_replica_diff; slow: the host waits)")
    p.add_argument("--seed", type=int, default=SEED,
                   help="weight initialisation seed (default: %(default)s)")
    p.add_argument("--staged", action="store_true",
                   help="GPUs: copy the weights through host memory, the fallback used "
                        "where the two GPUs cannot reach each other's memory")
    p.add_argument("--steps-per-call", type=cli.positive_int, metavar="K",
                   help="--sync gpu and --exchange xla: K steps in one compiled call, so that "
                        "the host queues a call, not a step, and a small step is not bound by "
                        "the host (default: " + str(STEPS_PER_CALL) + ", at most an epoch); the "
                        "host-ordered loop takes one step per call")
    p.add_argument("--timeout", type=cli.positive, default=TIMEOUT,
                   help="seconds a worker waits for the others (to meet, or to finish a "
                        "step) before it reports them stalled (default: %(default)s)")
    p.add_argument("--nodes", type=cli.positive_int, default=1,
                   help="machines taking part, each running this launcher with its own "
                        "devices, the same number on each (default: %(default)s)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this machine's number, 0..nodes-1; node 0 hosts the coordinator")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="--exchange xla: where node 0's coordinator listens, and only there "
                        "(default, one machine: 127.0.0.1 on a free port)")
    p.add_argument("--worker", nargs=3, metavar=("INDEX", "RUNDIR", "LAUNCHER_PID"),
                   help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -----------------------------------------------------------------------------
# the trainers: one per ordering, one interface

class Trainer:
    """One worker's replica, and how it trains beside the others.

    ``start()`` meets the other workers once (the handshake) and checks that
    every replica starts from the same weights; ``epoch(n)`` runs n steps,
    after each of which every replica holds the average; ``to_model()``
    leaves the replica's weights in the model's shared variables (worker 0
    validates them); ``weights()`` hands them back as NumPy arrays;
    ``finish()`` waits until the last step is done everywhere."""

    route = ""  # how the weights travel, in words

    def __init__(self, rank, model, link, check):
        """``link`` reaches the other workers, for the handshake and for
        ``gather``, which the exchange itself never uses."""
        self.rank, self.model, self.link, self.check = rank, model, link, check
        self.max_diff = 0.0

    def start(self):
        self.handshake()
        start = np.array([sum(p.sum(dtype=np.float64) for p in self.model.get_params())])
        if len(set(self.link.gather(start).ravel())) > 1:
            raise PeerError("the replicas start from different weights")

    def handshake(self):
        """Swap what the exchange needs to know of the others, once."""

    def check_replicas(self):
        """``--check``: the largest difference between this replica's weights
        and any other's, compared on the host."""
        if self.check:
            mine = np.concatenate([w.ravel() for w in self.weights()])
            self.max_diff = max(self.max_diff,
                                float(np.max(np.abs(self.link.gather(mine) - mine))))

    def to_model(self):
        pass  # the model's shared variables are the replica's weights

    def finish(self):
        pass

    def close(self):
        pass

    def step_us(self, steps):
        """Microseconds of a step by phase, where the host can time them."""
        return {}

    def report(self):
        """More entries for the summary."""
        return {}


class StepClock:
    """Sums the time between laps under each lap's name.  A signal's time is
    split in two: the signal itself, and waiting for a peer that arrived
    later (which a faster worker does whatever the exchange costs)."""

    def __init__(self):
        self.totals = collections.defaultdict(float)
        self.last = time.perf_counter()

    def start(self):
        self.last = time.perf_counter()

    def lap(self, name, waited=0.0):
        now = time.perf_counter()
        self.totals[name] += now - self.last - waited
        self.totals["waiting"] += waited
        self.last = now


def mean_in_rank_order(terms):
    """(worker 0's + worker 1's + ...) / N, the same sum in the same order on
    every worker, so that every replica gets the same bits; symbolic
    (PyTensor) or NumPy alike."""
    return functools.reduce(operator.add, terms) / len(terms)


class HostOrdered(Trainer):
    """``--sync host``: the 2014 loop.  The host waits for its device after
    each phase and the workers meet at zmq barriers, so the host clock can
    time every phase."""

    def __init__(self, rank, world, model, device, peer, rundir, avg, staged, check):
        super().__init__(rank, model, peer, check)
        self.world, self.device, self.peer, self.clock = world, device, peer, StepClock()
        layout = Layout.of(model.params)
        self.transport = exchange.transport(device, rundir, rank, world, layout, staged)
        self.average = self.make_average(avg, layout)
        model.warm_up(self.average, put=device.put)
        self.route = f"{self.transport.route}, ordered by the host, --avg {avg}"

    def make_average(self, kind, layout):
        """The ``--avg`` variants; each sets every parameter to the mean of
        every worker's, which the transport fetched into ``recv``."""
        params, recv, device, world = self.model.params, self.transport.recv, self.device, \
            self.world
        if kind == "theano":
            everyone = pytensor.shared(np.zeros(world * layout.size, layout.dtype), name="all")
            place(everyone, recv)
            slots = layout.slots(everyone, world)
            return pytensor.function([], [], mode=device.mode, updates=[
                (p, mean_in_rank_order([slot[i] for slot in slots]))
                for i, p in enumerate(params)])
        if kind == "pycuda":
            return lambda: device.average_in_place([storage(p) for p in params], recv, layout,
                                                   world)

        def through_host():
            slots = layout.slots(device.to_host(recv), world)
            for i, p in enumerate(params):
                place(p, device.put(mean_in_rank_order([slot[i] for slot in slots])))
        return through_host

    def handshake(self):
        self.transport.connect(self.peer.exchange(self.transport.handle()))

    def epoch(self, n_steps):
        model, transport, peer, clock = self.model, self.transport, self.peer, self.clock
        for step in range(n_steps):
            stop_point(self.rank, "train")
            clock.start()
            model.train_model(self.world * step + self.rank)  # 1. on my own minibatch
            new = [storage(p) for p in model.params]
            self.device.wait(new)
            clock.lap("train")
            transport.publish(new)                          # 2. into my send buffer
            clock.lap("publish")
            clock.lap("signal", waited=peer.barrier())      # 3. all published
            fault_point(self.rank, "exchange")
            transport.fetch()                               # 4. everyone's, into mine
            clock.lap("copy")
            clock.lap("signal", waited=peer.barrier())      # 5. all copied
            self.average()                                  # 6. the mean of all
            self.device.wait([storage(p) for p in model.params])
            clock.lap("average")
            self.check_replicas()

    def weights(self):
        return [self.device.to_host(storage(p)) for p in self.model.params]

    def step_us(self, steps):
        us = {k: 1e6 * v / steps for k, v in self.clock.totals.items()}
        us["exchange"] = sum(us[k] for k in ("publish", "signal", "waiting", "copy"))
        return us

    def close(self):
        self.transport.close()


class DeviceOrdered(Trainer):
    """``--sync gpu`` and ``--exchange xla``: a step, training and exchange,
    is one compiled program, and ``steps_per_call`` steps are one call of
    it (a loop in the program).  The host only queues calls: it runs up to
    ``AHEAD`` calls ahead of the device and never waits within a step, so
    the host clock times whole steps only.

    A subclass compiles ``program(steps)``, the program of so many steps
    over its ``state``; says how to ``queue`` a call of it (returning a
    marker), whether the device is ``done`` with the call of a marker, and
    where the replica's ``device_weights`` are."""

    def __init__(self, rank, model, link, check, watchdog, steps_per_call):
        super().__init__(rank, model, link, check)
        self.queued, self.watchdog = collections.deque(), watchdog or Unwatched()
        self.steps_per_call, self.programs, self.exchange_steps = steps_per_call, {}, None
        self.host_time, self.calls, self.steps = 0.0, 0, 0  # the host's share: inside the calls

    def compile(self, n_steps):
        """The programs an epoch of ``n_steps`` calls: ``steps_per_call``
        steps, and what is left at the epoch's end.  Compiled, not run."""
        for steps in {self.steps_per_call, n_steps % self.steps_per_call} - {0}:
            self.programs[steps] = self.program(steps)

    def program(self, steps):
        raise NotImplementedError

    def queue(self, steps):
        raise NotImplementedError

    def done(self, marker):
        raise NotImplementedError

    def device_weights(self):
        raise NotImplementedError

    def epoch(self, n_steps):
        with self.watchdog:
            for first in range(0, n_steps, self.steps_per_call):
                steps = min(self.steps_per_call, n_steps - first)
                stop_point(self.rank, "train")
                called = time.perf_counter()
                self.queued.append(self.queue(steps))
                self.host_time += time.perf_counter() - called
                self.calls, self.steps = self.calls + 1, self.steps + steps
                fault_point(self.rank, "exchange")
                if len(self.queued) > AHEAD:
                    self.wait(self.queued.popleft())
                self.watchdog.alive()
                self.check_replicas()
            while self.queued:  # the epoch ends when the device is done with it
                self.wait(self.queued.popleft())
                self.watchdog.alive()

    def wait(self, marker):
        """Wait for the device to finish a step, and for a stop request meanwhile."""
        while not self.done(marker):
            if stopping.is_set():
                raise Interrupted
            time.sleep(0.0002)

    def weights(self):
        return [np.array(w) for w in self.device_weights()]

    def to_model(self):
        for p, value in zip(self.model.params, self.device_weights()):
            place(p, value)

    def report(self):
        """What bounds the speed: a step that costs the host as long as the
        step takes is host-bound, one that costs it less waits for the GPU;
        and how many steps the device counted (``exchange_steps``: the
        exchange ran once a step where it equals the steps run)."""
        return dict(host_us_per_call=1e6 * self.host_time / max(1, self.calls),
                    host_us_per_step=1e6 * self.host_time / max(1, self.steps),
                    steps_per_call=self.steps_per_call, exchange_steps=self.exchange_steps)


def repeat(step, steps):
    """``steps`` calls of ``step(data, *state) -> state`` as one loop, in the
    same order as one call each: ``UNROLL`` of them at a time in the loop's
    body, which XLA otherwise runs a step at a time."""
    import jax

    def loop(data, *state):
        return jax.lax.fori_loop(0, steps, lambda _, state: step(data, *state), state,
                                 unroll=min(steps, UNROLL))
    return loop


class GpuOrdered(DeviceOrdered):
    """``--sync gpu``: the exchange as kernels on this GPU's stream, inside the
    step (stream_exchange.py)."""

    route = "CUDA IPC, peer to peer, ordered by the GPUs"

    def __init__(self, rank, world, model, device, peer, check, watchdog, steps_per_call):
        import jax
        from stream_exchange import StreamExchange

        super().__init__(rank, model, peer, check, watchdog, steps_per_call)
        model.warm_up(put=device.put)
        gradients, self.data = devices.jax_train_step(model, gradients=True)
        self.exchange = StreamExchange(rank, world, Layout.of(model.params), model.learning_rate)
        n_steps = model.n_train_batches // world

        def step(data, counter, *params):
            index = world * (counter % n_steps) + rank           # this worker's minibatch
            _, g = gradients(index, data, list(params))          # 1. train: the gradients
            return counter + 1, *self.exchange(params, g)        # 2.-6. update as it publishes

        self.one_step = step
        # copies: the model's own weights stay for validation
        self.state = (device.put(np.int32(0)), *[jax.numpy.array(storage(p))
                                                  for p in model.params])
        self.compile(n_steps)
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
        memory."""
        import jax
        program = jax.jit(repeat(self.one_step, steps),
                          donate_argnums=tuple(range(1, 1 + len(self.state))))
        with devices.not_kept(jax):
            program.lower(self.data, *self.state).compile()
        return program

    def handshake(self):
        self.exchange.connect(self.link.exchange(self.exchange.handle()))

    def queue(self, steps):
        self.state = self.programs[steps](self.data, *self.state)
        return self.steps + steps  # the call's last step, as the exchange counts them

    def done(self, marker):
        return self.exchange.steps_done() >= marker

    def device_weights(self):
        return self._weights(*self.state)

    def finish(self):  # both GPUs are done: neither send buffer is read any more
        self.link.barrier()
        self.exchange_steps = self.exchange.steps_done()
        self.exchange.close()

    def report(self):
        return dict(super().report(), exchange_callbacks=self.exchange.callbacks)


class XlaOrdered(DeviceOrdered):
    """``--exchange xla``: the mean over all workers as an XLA all-reduce, inside the step."""

    route = "an XLA all-reduce (JAX's distributed runtime)"

    def __init__(self, rank, world, model, device, xla, check, watchdog, steps_per_call):
        super().__init__(rank, model, xla, check, watchdog, steps_per_call)
        model.warm_up(put=device.put)
        train, data = devices.jax_train_step(model)
        n_steps = model.n_train_batches // world

        def step(data, counter, params, cost):
            index = world * (counter % n_steps) + xla.rank()             # this worker's minibatch
            cost, new = train(index, data, params)                       # 1. train
            return counter + 1, [xla.mean(p) for p in new], cost[None]   # 2.-6. all-reduce

        self.one_step, self.xla = step, xla
        self.data = [xla.replicated(d) for d in data]
        self.state = (xla.replicated(device.put(np.int32(0))),
                      [xla.replicated(storage(p)) for p in model.params])
        self.compile(n_steps)

    def program(self, steps):
        import jax.numpy as jnp
        loop = repeat(self.one_step, steps)

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


# -----------------------------------------------------------------------------
# the worker

def worker(args, rank, world, dev, rundir, watchdog):
    """One worker, start to end: its device, the data, the model, the
    trainer of the ordering asked for, the epochs; worker 0 validates,
    keeps the checkpoint and reports."""
    say = print if rank == 0 else (lambda *a, **k: None)  # only global rank 0 prints
    with ExitStack() as cleanup:
        # JAX's distributed runtime must start before anything else touches JAX
        xla = XlaExchange(args.coordinator, world, rank, args.timeout, dev == "cpu",
                          args.nodes == 1) \
            if args.exchange == "xla" else None
        device = devices.open_device(dev, jax_on_cpu=xla is not None)
        cleanup.callback(device.close)
        data = load_data(args.dataset, put=device.put)  # resident on the device
        t0 = time.perf_counter()
        with cli.heartbeat(compiling(device), say):
            model = mlp.Model(data, args.batch_size, args.n_hidden, args.learning_rate, args.l1,
                              args.l2, args.seed, mode=device.mode)
            progress = records.Progress(model.get_params())
            if args.resume:
                current, progress = records.Progress.resume(args.resume, Layout.of(model.params)
                                                            .shapes)
                model.set_params(current)
            for p in model.params:
                place(p, device.put(storage(p)))
            stop_point(rank, "start")
            trainer = make_trainer(args, rank, world, model, device, rundir, xla, watchdog,
                                   cleanup)
            cleanup.callback(trainer.close)
            trainer.start()
        say(f"... compiled in {time.perf_counter() - t0:.1f} s")
        if args.resume:
            say(f"... resumed from {args.resume} at epoch {progress.epoch}")

        n_steps = model.n_train_batches // world
        say(f"... training: {world} workers on {', '.join(args.devices)}"
            f"{f' x {args.nodes} nodes' if args.nodes > 1 else ''}, {args.batch_size} images per "
            f"worker per step, {n_steps} steps per epoch; weights through {trainer.route}")
        start_time = time.perf_counter()
        for epoch in range(progress.epoch + 1, args.epochs + 1):
            epoch_start = time.perf_counter()
            trainer.epoch(n_steps)
            epoch_time = time.perf_counter() - epoch_start
            progress.trained(n_steps, epoch_time)
            if rank != 0:
                continue
            trainer.to_model()
            check_finite(model.get_params(), epoch, args.learning_rate)
            progress.validated(epoch, float(model.validate_model()), model.test_model,
                               model.get_params)
            say(f"epoch {epoch}/{args.epochs}: {n_steps} steps per worker ({world * n_steps} "
                f"minibatches of {args.batch_size}), validation error "
                f"{progress.validation_errors[-1] * 100.:.2f} %  "
                f"({world * n_steps * args.batch_size / epoch_time:,.0f} samples/s)")
            if args.save:
                progress.save(args.save, model.get_params(), args.trained_with)
        trainer.finish()
        if rank == 0:
            summarise(args, progress, trainer, n_steps, world, time.perf_counter() - start_time,
                      device, say)


class Diverged(Exception):
    """The weights are no longer numbers: one line, which says why that happens."""


def check_finite(weights, epoch, learning_rate):
    """Stop a run whose weights became NaN or infinite, before they are validated or saved."""
    if not all(np.isfinite(w).all() for w in weights):
        raise Diverged(f"after epoch {epoch} the weights are no longer finite (NaN or inf): "
                       f"the training diverged; is --learning-rate {learning_rate:g} too large? "
                       "The last checkpoint, if any, is the last good one")


def compiling(device):
    """What the heartbeat says while the model compiles."""
    backend = cli.backend_name(device.mode)
    if backend == "JAX":
        return (f"compiling the model on {device.name}: PyTensor builds the graph, XLA compiles "
                f"it (the first run takes a minute or so; later runs load XLA's programs from "
                f"{devices.jax_cache_folder()})")
    return (f"compiling the model with PyTensor's {backend} backend on {device.name} (the "
            "first run takes a minute or so; later runs use the cache)")


def make_trainer(args, rank, world, model, device, rundir, xla, watchdog, cleanup):
    """The trainer of the ordering asked for (see the module's text)."""
    if xla:
        return XlaOrdered(rank, world, model, device, xla, args.check, watchdog,
                          args.steps_per_call)
    peer = Peer(rundir, rank, world, args.timeout, stopping, device.spin)
    cleanup.callback(peer.close)
    if args.sync == "gpu":
        return GpuOrdered(rank, world, model, device, peer, args.check, watchdog,
                          args.steps_per_call)
    return HostOrdered(rank, world, model, device, peer, rundir, args.avg, args.staged,
                       args.check)


def summarise(args, progress, trainer, n_steps, world, wall, device, say):
    """Worker 0's closing lines, and the --json summary."""
    samples_per_s = world * progress.steps * args.batch_size / progress.train_s
    step_us = dict(trainer.step_us(progress.steps), step=1e6 * progress.train_s / progress.steps)
    say(f"Optimization complete. Best validation error {progress.best_validation_error * 100.:.2f}"
        f" %, test error of that model {progress.test_error * 100.:.2f} % (a separate sample of "
        "images: it can come out lower than validation)")
    say(f"Trained at {samples_per_s:,.0f} samples/s ({world} workers), {step_us['step']:.0f} us "
        "per step" + ("" if "train" not in step_us else
                      ": train {train:.0f} us, exchange {exchange:.0f} us (publish {publish:.0f} "
                      "+ signals {signal:.0f} + waiting for the peer {waiting:.0f} + copy "
                      "{copy:.0f}), average {average:.0f} us".format(**step_us)))
    if args.check:
        say(f"max difference between the replicas after an exchange: {trainer.max_diff:g}")
    if not args.json:
        return
    summary = dict(
        config={k: v for k, v in vars(args).items() if k != "worker"},
        **records.run_header(args.command), devices=args.devices, workers=world,
        nodes=args.nodes, exchange=args.exchange, sync=args.sync, route=trainer.route,
        device_name=device.description,
        backend=type(pytensor.compile.mode.get_mode(device.mode).linker).__name__,
        floatX=pytensor.config.floatX,
        versions=dict(python=platform.python_version(), numpy=np.__version__,
                      pytensor=pytensor.__version__),
        **progress.summary(n_steps), wall_time_s=wall, samples_per_s=samples_per_s,
        step_us=step_us, curve=progress.curve)
    if "exchange" in step_us:
        summary["exchange_us_per_step"] = step_us["exchange"]
    if args.check:
        summary["max_replica_diff"] = trainer.max_diff
    summary.update(trainer.report())
    try:
        records.write_json(args.json, summary)
    except OSError as e:  # a full disk, say: the run's result must not be lost
        print(f"worker 0: error: could not write {args.json} ({e.strerror}); the summary "
              "follows on stdout", file=sys.stderr)
        print(json.dumps(summary, indent=2))
        raise SystemExit(1)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        index, rundir, launcher_pid = args.worker
        return launcher.run_worker(worker, int(index), rundir, int(launcher_pid),
                                   (PeerError, records.CheckpointError, datasets.DatasetError,
                                    Diverged))
    started = time.perf_counter()
    args.command = shlex.join(["python", "dual_mlp.py"] + (sys.argv[1:] if argv is None else argv))
    with ExitStack() as run:
        try:
            notices = launcher.check_request(args, BATCH_SIZE, SHIPPED_BATCH_SIZE, STEPS_PER_CALL)
            run.enter_context(records.hold(args.save))
            rundir, folder_notice = launcher.run_folder(args)
            run.callback(shutil.rmtree, rundir, ignore_errors=True)
            if args.nodes > 1 and args.node_rank == 0:  # the others prove they belong here
                run.enter_context(launcher.Lobby(args.coordinator, args.run_options, args.nodes))
            elif args.nodes > 1:
                launcher.enter_lobby(args.coordinator, args.node_rank, args.run_options,
                                     args.timeout)
        except (launcher.UsageError, datasets.DatasetError, records.CheckpointError,
                launcher.NoAnswer) as e:
            print(f"dual_mlp.py: error: {e}", file=sys.stderr)
            return 1 if isinstance(e, launcher.NoAnswer) else 2
        for notice in notices + [folder_notice] if args.node_rank == 0 else []:  # one node speaks
            if notice:
                print(notice, file=sys.stderr if notice.startswith("warning:") else sys.stdout)
        code = launcher.launch(args, os.path.abspath(__file__), rundir)
    if code == 0 and args.node_rank == 0:
        print(f"total wall time {time.perf_counter() - started:.1f} s (start-up and compile "
              "included)")
    return code


if __name__ == "__main__":
    sys.exit(main())
