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
minibatches whose index is k modulo N.  Two workers, as in 2014
(``--exchange p2p``), after every step of their own:

  1. train    one SGD step on its minibatch;
  2. publish  copy its weights into its send buffer, whose address never moves;
  3. signal   "published", and wait until the peer has published too;
  4. copy     copy the peer's send buffer into its own memory
              (GPUs: a peer-to-peer copy of a CUDA IPC buffer; CPUs: host memory);
  5. signal   "copied": the peer may overwrite its send buffer again;
  6. average  set its weights to (mine + peer's) / 2.

What changed since 2014 is who orders these steps (``--sync``):

  host   the host waits for its GPU after each phase, and the signals are
         zmq messages: the 2014 loop, and the only way on CPUs;
  gpu    steps 2-5 are kernels on the GPU's own stream, inside the compiled
         training step, and the signals are counters each GPU writes into the
         other's memory (stream_exchange.py); step 6 opens the next step.  The
         host only queues steps, so it runs ahead while the GPUs compute.

More than two workers, or several machines, average with ``--exchange xla``:
the compiled step ends in a ``pmean`` over all workers that JAX's distributed
runtime runs (NCCL between GPUs, gloo between CPUs).

Every replica then holds the same weights, and together they have taken one
SGD step on a minibatch N times the size: the mean of N minibatch gradients
is the gradient of their union's mean cost.
"""
import cli  # first: quiet Ctrl-C and closed pipes from the very start
import argparse
import collections
import ctypes
import datetime
import itertools
import json
import os
import platform
import shlex
import shutil
import signal
import sys
import threading
import time
import traceback
import types
from contextlib import ExitStack

import theano_flags  # noqa: F401  (maps THEANO_FLAGS onto PyTensor; must precede it)
import numpy as np
import pytensor

import datasets
import mlp
import launcher
from exchange import (CudaDevice, HostDevice, Interrupted, JaxDevice, Layout, Peer, PeerError,
                      XlaExchange, request_stop, stopping)
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
AHEAD = 8                  # steps the host may queue ahead of the device (--sync gpu, xla)
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
                   help="how the replicas average: 'p2p' the 2014 exchange between two "
                        "workers (PyCUDA peer-to-peer copies, or host memory on CPUs); 'xla' "
                        "a pmean inside the compiled step, through JAX's distributed runtime "
                        "(default: p2p for two workers, xla for more)")
    p.add_argument("--sync", choices=("gpu", "host"),
                   help="p2p: who orders the exchange; 'gpu' the GPUs, on their streams, "
                        "the host never waiting within a step; 'host' the 2014 loop, the host "
                        "waiting for each phase (default: gpu on two GPUs, host on CPUs)")
    p.add_argument("--avg", choices=("theano", "pycuda", "cpu"),
                   help="--sync host: how to average; 'theano' a compiled PyTensor function "
                        "(the default, as in 2014); 'pycuda' in place on the buffers (a CUDA "
                        "kernel on GPUs, NumPy on the CPU); 'cpu' through host memory")
    p.add_argument("--save", metavar="PATH", type=cli.writable,
                   help="checkpoint (.npz) written after every epoch, atomically: current "
                        "and best-validation weights, training state")
    p.add_argument("--resume", metavar="PATH", help="continue from a --save checkpoint")
    p.add_argument("--json", metavar="PATH", type=cli.writable,
                   help="write a summary of the run as JSON")
    p.add_argument("--check", action="store_true", help="after every step, measure how far "
                   "the replicas differ (max_replica_diff; slow: the host waits)")
    p.add_argument("--seed", type=int, default=SEED,
                   help="weight initialisation seed (default: %(default)s)")
    p.add_argument("--staged", action="store_true",
                   help="GPUs: copy the weights through host memory, the fallback used "
                        "where the two GPUs cannot reach each other's memory")
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
    p.add_argument("--worker", nargs=2, metavar=("INDEX", "RUNDIR"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -----------------------------------------------------------------------------
# the worker

def storage(shared):
    """The array a shared variable holds now (a jax.Array under JAX)."""
    return shared.container.storage[0]


def place(shared, value):
    """Set a shared variable's array without a copy back to NumPy (set_value
    would make one), so device arrays stay on the device."""
    shared.container.storage[0] = value


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


def make_average(kind, params, peer_weights, layout, transport, device):
    """The ``--avg`` variants; each sets every parameter to (mine + peer's) / 2."""
    if kind == "theano":
        return pytensor.function([], [], mode=device.mode, updates=[
            (p, (p + q) / 2) for p, q in zip(params, layout.views(peer_weights))])
    if kind == "pycuda":
        return lambda: device.average_in_place([storage(p) for p in params], transport.recv,
                                               layout)

    def through_host():
        peer = layout.views(device.to_host(transport.recv))
        for p, q in zip(params, peer):
            place(p, device.put((device.to_host(storage(p)) + q) / 2))
    return through_host


def replica_spread(weights, gather):
    """The largest difference between this replica's weights and any
    other's, compared on the host, over a channel the exchange never uses."""
    mine = np.concatenate([w.ravel() for w in weights])
    return float(np.max(np.abs(gather(mine) - mine)))


class HostOrdered:
    """``--sync host``: the 2014 loop.  The host waits for its device after
    each phase and the two workers meet at zmq barriers, so the host clock
    can time every phase."""

    def __init__(self, rank, model, device, transport, peer, average, check):
        self.rank, self.model, self.device, self.transport = rank, model, device, transport
        self.peer, self.average, self.check = peer, average, check
        self.clock, self.max_diff = StepClock(), 0.0

    def epoch(self, n_steps):
        model, transport, peer, clock = self.model, self.transport, self.peer, self.clock
        for step in range(n_steps):
            stop_point(self.rank, "train")
            clock.start()
            model.train_model(2 * step + self.rank)         # 1. on my own minibatch
            new = [storage(p) for p in model.params]
            self.device.wait(new)
            clock.lap("train")
            transport.publish(new)                          # 2. into my send buffer
            clock.lap("publish")
            clock.lap("signal", waited=peer.barrier())      # 3. both published
            fault_point(self.rank, "exchange")
            transport.fetch()                               # 4. the peer's, into mine
            clock.lap("copy")
            clock.lap("signal", waited=peer.barrier())      # 5. both copied
            self.average()                                  # 6. (mine + peer's) / 2
            self.device.wait([storage(p) for p in model.params])
            clock.lap("average")
            if self.check:
                self.max_diff = max(self.max_diff, replica_spread(self.weights(), peer.gather))

    def weights(self):
        return [self.device.to_host(storage(p)) for p in self.model.params]

    def step_us(self, steps):
        us = {k: 1e6 * v / steps for k, v in self.clock.totals.items()}
        us["exchange"] = sum(us[k] for k in ("publish", "signal", "waiting", "copy"))
        return us

    def finish(self):
        pass

    def report(self):
        return {}


class DeviceOrdered:
    """``--sync gpu`` and ``--exchange xla``: a step, training and exchange,
    is one compiled program.  The host only queues it: it runs up to
    ``AHEAD`` steps ahead of the device and never waits within a step, so
    the host clock times whole steps only.

    ``program(step, *state)`` queues one step and returns ``(marker, state)``;
    ``done(marker)`` says whether the device has finished that step."""

    def __init__(self, rank, program, done, state, weights, gather, check, timeout,
                 finish=None, report=dict):
        self.rank, self.program, self.done = rank, program, done
        self.state, self._weights, self.gather, self.check = state, weights, gather, check
        self._finish, self._report, self.max_diff = finish, report, 0.0
        self.queued, self.watchdog = collections.deque(), Watchdog(rank, timeout)
        self.host_time, self.calls = 0.0, 0  # spent inside the program's call: the host's share

    def epoch(self, n_steps):
        with self.watchdog:
            for step in range(n_steps):
                stop_point(self.rank, "train")
                called = time.perf_counter()
                marker, self.state = self.program(step, *self.state)
                self.host_time, self.calls = self.host_time + time.perf_counter() - called, \
                    self.calls + 1
                fault_point(self.rank, "exchange")
                self.queued.append(marker)
                if len(self.queued) > AHEAD:
                    self.wait(self.queued.popleft())
                self.watchdog.alive()
                if self.check:
                    self.max_diff = max(self.max_diff, replica_spread(self.weights(), self.gather))
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
        return [np.array(w) for w in self._weights(*self.state)]

    def device_weights(self):
        return self._weights(*self.state)

    def step_us(self, steps):
        return {}

    def report(self):
        """What bounds the speed: a step that costs the host as long as the
        step takes is host-bound, one that costs it less waits for the GPU."""
        return dict(self._report(), host_us_per_call=1e6 * self.host_time / max(1, self.calls))

    def finish(self):
        if self._finish:
            self._finish()


class Watchdog:
    """A thread that ends this worker when, in an epoch, no step finishes
    for ``timeout`` seconds, or a stop request goes unheeded for a second.
    Where the devices order the steps, a GPU waiting for ever on a peer that
    stalled or died can hold the host thread inside a call into XLA (which
    waits for the last launch before it launches again): no check of ours
    runs there, and a signal only sets a flag."""

    def __init__(self, rank, timeout):
        self.rank, self.timeout, self.last, self.armed = rank, timeout, time.monotonic(), False
        threading.Thread(target=self._watch, daemon=True).start()

    def alive(self):
        self.last = time.monotonic()

    def __enter__(self):
        self.alive()
        self.armed = True

    def __exit__(self, *exc):
        self.armed = False

    def _watch(self):
        stop_seen = None
        while True:
            time.sleep(0.1)
            now = time.monotonic()
            if not self.armed:
                continue
            if stopping.is_set():
                stop_seen = stop_seen or now
                if now - stop_seen > 1.0:
                    quit_now(128 + stopping.signum)
            elif now - self.last > self.timeout:
                print(f"worker {self.rank}: error: no step finished within {self.timeout:g} s: "
                      "another worker stalled (see --timeout)", file=sys.stderr, flush=True)
                quit_now(1)


def jax_step(model):
    """The model's PyTensor-compiled training step as a JAX function
    ``train(index, data, params) -> cost, new_params``: PyTensor's JAX backend
    jits the whole graph, and its jitted callable can be called inside
    another jitted program."""
    f = model.train_model
    inputs = [i.variable for i in f.maker.inputs]          # index, data, params, in its order
    updated = [i.variable for i in f.maker.inputs if i.update is not None]
    data_vars = [v for v in inputs[1:] if v not in model.params]

    def train(index, data, params):
        value = dict(zip(data_vars, data)) | dict(zip(model.params, params))
        cost, *new = f.vm.jit_fn(index, *[value[v] for v in inputs[1:]])
        new = dict(zip(updated, new))
        return cost, [new[p] for p in model.params]
    return train, [storage(v) for v in data_vars]


def gpu_ordered(rank, world, model, device, layout, peer, args):
    """``--sync gpu``: the exchange as kernels on this GPU's stream, inside the step."""
    import jax
    import jax.numpy as jnp
    from stream_exchange import StreamExchange

    train, data = jax_step(model)
    exchange = StreamExchange(device, layout)
    n_steps = model.n_train_batches // world

    def flat(params):  # the weights travel as one buffer: one copy each way
        return jnp.concatenate([p.ravel() for p in params])

    def average(params, received):
        return (params + received) / 2

    def step(data, counter, params, received):
        index = world * (counter % n_steps) + rank               # this worker's minibatch
        mean = average(params, received)                         # 6. average, of step t-1
        _, new = train(index, data, layout.views(mean))          # 1. train
        new = flat(new)
        return counter + 1, new, exchange(new, received)         # 2.-5. publish, signal, copy

    params = jax.jit(flat)([storage(p) for p in model.params])
    # received = mine: the first average is a no-op
    state = (device.put(np.int32(0)), params, params.copy())
    # Compiled, not run (no peer yet).  The whole state is donated and the
    # step returns nothing else, so XLA writes every step into the same
    # buffers: the exchange's captured launches stay valid, and XLA replays
    # its recorded step as it is, with nothing to update in it.  The host
    # learns which steps are done from the exchange's counter in host memory.
    compiled = jax.jit(step, donate_argnums=(1, 2, 3)).lower(data, *state).compile()
    # the replica's weights, for validation and --check
    weights = jax.jit(lambda counter, params, received: layout.views(average(params, received)))
    weights(*state)  # compiled now, not in the first epoch

    queued = itertools.count(1)

    def program(_, *state):  # the marker: this step's number, as the exchange counts them
        return next(queued), compiled(data, *state)

    def finish():  # both GPUs are done: neither send buffer is read any more
        peer.barrier()
        exchange.close()

    trainer = DeviceOrdered(rank, program, lambda t: exchange.steps_done() >= t, state,
                            weights, peer.gather, args.check, args.timeout, finish,
                            report=lambda: {"exchange_callbacks": exchange.callbacks})
    return trainer, exchange


def xla_ordered(rank, world, model, device, xla, args):
    """``--exchange xla``: the mean over all workers as an XLA all-reduce, inside the step."""
    train, data = jax_step(model)

    def step(index, data, params):
        cost, new = train(index[0], data, params)                    # 1. train
        return cost[None], ([xla.mean(p) for p in new],)             # 2.-6. all-reduce

    data = [xla.replicated(d) for d in data]
    state = ([xla.replicated(storage(p)) for p in model.params],)
    indices = [xla.per_worker(device.put(np.array([world * t + rank], np.int32)))
               for t in range(model.n_train_batches // world)]
    compiled = xla.program(step).lower(indices[0], data, *state).compile()
    trainer = DeviceOrdered(rank, lambda t, *state: compiled(indices[t], data, *state),
                            lambda cost: cost.is_ready(), state,
                            lambda params: [xla.local(p) for p in params], xla.gather,
                            args.check, args.timeout)
    return trainer


def fault_point(rank, where):
    """The fault tests' hook: DUAL_MLP_FAULT=RANK:WHERE:HOW makes worker RANK
    fail on reaching WHERE (start, train, exchange) by HOW (raise, oom, kill,
    or hint: an error whose message ends in a hint line, as PyTensor's do)."""
    spec = os.environ.get("DUAL_MLP_FAULT", "").split(":")
    if spec[:2] != [str(rank), where]:
        return
    if spec[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if spec[2] == "oom":
        np.empty(1 << 60, np.uint8)  # raises MemoryError, as a real allocation failure would
    hint = "\nHINT: re-run with more detail" if spec[2] == "hint" else ""
    raise RuntimeError(f"fault injected at {where}{hint}")


def stop_point(rank, where):
    """Where a step may stop: on request, or by the fault tests' hook."""
    if stopping.is_set():
        raise Interrupted
    fault_point(rank, where)


def die_with_parent():
    """Ask Linux to SIGTERM this worker if the launcher dies, even by SIGKILL."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def make_device(dev, jax_on_cpu):
    if dev != "cpu":
        return CudaDevice(int(dev))
    return JaxDevice() if jax_on_cpu else HostDevice()


def worker(args, rank, world, dev, rundir):
    say = print if rank == 0 else (lambda *a, **k: None)  # only global rank 0 prints
    with ExitStack() as cleanup:
        # JAX's distributed runtime must start before anything else touches JAX
        xla = XlaExchange(args.coordinator, world, rank, args.timeout, dev == "cpu") \
            if args.exchange == "xla" else None
        device = make_device(dev, jax_on_cpu=xla is not None)
        cleanup.callback(device.close)
        data = load_data(args.dataset, put=device.put)  # resident on the device
        t0 = time.perf_counter()
        with cli.heartbeat(f"compiling the model with PyTensor's {cli.backend_name(device.mode)} "
                           f"backend on {device.name} (the first run takes a minute or so; "
                           "later runs use the cache)", say):
            model = mlp.Model(data, args.batch_size, args.n_hidden, args.learning_rate, args.l1,
                              args.l2, args.seed, mode=device.mode)
            layout = Layout([p.get_value().shape for p in model.params], pytensor.config.floatX)
            state = dict(epoch=0, best_validation_error=np.inf, test_error=np.inf,
                         validation_errors=[])
            best_params = model.get_params()
            if args.resume:
                current, best_params, state = mlp.load_checkpoint(args.resume, layout.shapes,
                                                                  mlp.TRAINING_STATE)
                model.set_params(current)
            for p in model.params:
                place(p, device.put(storage(p)))
            start = float(sum(p.sum(dtype=np.float64) for p in model.get_params()))
            stop_point(rank, "start")
            if xla:
                model.warm_up(put=device.put)
                trainer, peer = xla_ordered(rank, world, model, device, xla, args), None
                if len(set(xla.gather(np.array([start])).ravel())) > 1:
                    raise PeerError("the replicas start from different weights")
                route = "an XLA all-reduce (JAX's distributed runtime)"
            else:
                peer = Peer(rundir, rank, args.timeout, stopping, device.spin)
                cleanup.callback(peer.close)
                if args.sync == "gpu":
                    model.warm_up(put=device.put)
                    trainer, transport = gpu_ordered(rank, world, model, device, layout, peer, args)
                    route = "CUDA IPC, peer to peer, ordered by the GPUs"
                else:
                    transport = device.transport(rundir, rank, layout, args.staged)
                    cleanup.callback(transport.close)
                    peer_weights = pytensor.shared(np.zeros(layout.size, layout.dtype), name="peer")
                    place(peer_weights, transport.recv)
                    average = make_average(args.avg, model.params, peer_weights, layout,
                                           transport, device)
                    model.warm_up(average, put=device.put)
                    trainer = HostOrdered(rank, model, device, transport, peer, average, args.check)
                    route = f"{transport.route}, ordered by the host, --avg {args.avg}"
                # The handshake: swap buffer handles once, and check that both
                # replicas start from the same weights.
                theirs = peer.exchange({"handle": transport.handle(), "start": start})
                if theirs["start"] != start:
                    raise PeerError("the two replicas start from different weights")
                transport.connect(theirs["handle"])
        say(f"... compiled in {time.perf_counter() - t0:.1f} s")
        if args.resume:
            say(f"... resumed from {args.resume} at epoch {state['epoch']}")

        n_steps = model.n_train_batches // world
        say(f"... training: {world} workers on {', '.join(args.devices)}"
            f"{f' x {args.nodes} nodes' if args.nodes > 1 else ''}, {args.batch_size} images per "
            f"worker per step, {n_steps} steps per epoch; weights through {route}")
        steps_run, train_time, start_time, curve = 0, 0.0, time.perf_counter(), []
        for epoch in range(state["epoch"] + 1, args.epochs + 1):
            epoch_start = time.perf_counter()
            trainer.epoch(n_steps)
            epoch_time = time.perf_counter() - epoch_start
            steps_run, train_time = steps_run + n_steps, train_time + epoch_time
            if rank != 0:
                continue
            if isinstance(trainer, DeviceOrdered):
                for p, value in zip(model.params, trainer.device_weights()):
                    place(p, value)
            this_validation_error = float(model.validate_model())
            state["validation_errors"].append(this_validation_error)
            if this_validation_error < state["best_validation_error"]:
                state["best_validation_error"] = this_validation_error
                state["test_error"] = float(model.test_model())
                best_params = model.get_params()
            state["epoch"] = epoch
            curve.append(mlp.epoch_record(epoch, train_time, this_validation_error,
                                          state["test_error"]))
            say(f"epoch {epoch}/{args.epochs}: {n_steps} steps per worker ({world * n_steps} "
                f"minibatches of {args.batch_size}), validation error "
                f"{this_validation_error * 100.:.2f} %  "
                f"({world * n_steps * args.batch_size / epoch_time:,.0f} samples/s)")
            if args.save:
                save(args.save, model.get_params(), best_params, state)
        trainer.finish()

        if rank != 0:
            return
        summarise(args, state, trainer, steps_run, n_steps, world, train_time,
                  time.perf_counter() - start_time, device, route, curve, say)


def summarise(args, state, trainer, steps_run, n_steps, world, train_time, wall, device, route,
              curve, say):
    """Worker 0's closing lines, and the --json summary."""
    samples_per_s = world * steps_run * args.batch_size / train_time
    step_us = dict(trainer.step_us(steps_run), step=1e6 * train_time / steps_run)
    best = state["best_validation_error"]
    say(f"Optimization complete. Best validation error {best * 100.:.2f} %"
        f", test error of that model {state['test_error'] * 100.:.2f} % (a separate sample of "
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
        command=args.command,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=platform.node(), devices=args.devices, workers=world, nodes=args.nodes,
        exchange=args.exchange, sync=args.sync, route=route, device_name=device.description,
        backend=type(pytensor.compile.mode.get_mode(device.mode).linker).__name__,
        floatX=pytensor.config.floatX,
        versions=dict(python=platform.python_version(), numpy=np.__version__,
                      pytensor=pytensor.__version__),
        validation_errors=state["validation_errors"],
        best_validation_error=state["best_validation_error"],
        test_error=state["test_error"], epochs_run=steps_run // n_steps,
        steps_per_epoch=n_steps, wall_time_s=wall, training_time_s=train_time,
        samples_per_s=samples_per_s, step_us=step_us, curve=curve)
    if "exchange" in step_us:
        summary["exchange_us_per_step"] = step_us["exchange"]
    if args.check:
        summary["max_replica_diff"] = trainer.max_diff
    summary.update(trainer.report())
    write_summary(args.json, summary)


def save(path, params, best_params, state):
    """The epoch's checkpoint; a write that fails (a full disk) leaves the
    previous checkpoint as it was, and training goes on."""
    try:
        mlp.save_checkpoint(path, params, best_params, **state)
    except OSError as e:
        print(f"worker 0: warning: could not write {path} ({e.strerror}): the previous one "
              "is kept", file=sys.stderr)


def write_summary(path, summary):
    text = json.dumps(summary, indent=2)
    try:
        with datasets.atomic_write(path) as f:
            f.write(text.encode())
    except OSError as e:  # a full disk, say: the run's result must not be lost
        print(f"worker 0: error: could not write {path} ({e.strerror}); the summary "
              "follows on stdout", file=sys.stderr)
        print(text)
        raise SystemExit(1)


def run_worker(index, rundir):
    launcher = os.getppid()
    die_with_parent()
    cli.install_stop_handler(request_stop)
    with open(os.path.join(rundir, "config.json")) as f:
        args = types.SimpleNamespace(**json.load(f))
    rank, world = args.node_rank * len(args.devices) + index, args.nodes * len(args.devices)
    code = 0
    try:
        worker(args, rank, world, args.devices[index], rundir)
    except Exception as e:
        if stopping.is_set():  # asked to stop: what broke on the way out is no news
            code = 128 + stopping.signum
        elif isinstance(e, (PeerError, mlp.CheckpointError, datasets.DatasetError)):
            print(f"worker {rank}: error: {e}", file=sys.stderr)
            code = 1
        else:
            traceback.print_exc()
            code = 1
    finally:
        # Told to stop, or orphaned: the launcher may be dying too, and the
        # files there are of no use to the peer any more (it has them open).
        if stopping.is_set() or os.getppid() != launcher:
            shutil.rmtree(rundir, ignore_errors=True)
    if code:
        quit_now(code)
    return 0


def quit_now(code):
    """Exit without Python's clean-up: a GPU may wait for ever on a peer that
    is gone, and freeing its memory, or JAX's own exit, would wait with it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return run_worker(int(args.worker[0]), args.worker[1])
    started = time.perf_counter()
    try:
        notices = launcher.check_request(args, BATCH_SIZE, SHIPPED_BATCH_SIZE)
    except (launcher.UsageError, datasets.DatasetError, mlp.CheckpointError) as e:
        print(f"dual_mlp.py: error: {e}", file=sys.stderr)
        return 2
    for notice in notices:
        print(notice, file=sys.stderr if notice.startswith("warning:") else sys.stdout)
    args.command = shlex.join(["python", "dual_mlp.py"] + (sys.argv[1:] if argv is None else argv))
    code = launcher.launch(args, os.path.abspath(__file__))
    if code == 0:
        print(f"total wall time {time.perf_counter() - started:.1f} s (start-up and compile "
              "included)")
    return code


if __name__ == "__main__":
    sys.exit(main())
