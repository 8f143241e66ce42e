"""The trainers of ``dual_mlp.py``: what every one of them shares.

``Trainer``
    one worker's replica and its interface: ``handshake()``,
    ``check_start()`` (every replica starts from the same weights),
    ``epoch(n)``, ``to_model()``, ``weights()``, ``finish()``, ``close()``;
    ``--check``.
``DeviceOrdered``
    the loop of the trainers whose step, training and exchange, is one
    compiled program (``--sync gpu``, ``--exchange xla``): the host queues
    calls of K steps and runs ahead of the device.
``StepClock``
    runs and times the host-ordered step's phases, each by name.
``steps_per_epoch``, ``minibatch``
    how worker k of N takes the minibatches k, k + N, k + 2N, ...
``averages_after``, ``local_sgd``
    ``--average-every H``: which steps end on an average, and a compiled call
    of K steps as rounds of H - 1 steps of a worker's own and one that averages.
"""
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import collections
import functools
import operator
import time

import numpy as np

from multi_gpu.devices import place
from multi_gpu.hooks import FAULT, Interrupted, fault_point, stop_point, stopping
from multi_gpu.sockets import PeerError
from multi_gpu.trace import WAITING
from multi_gpu.worker import Unwatched

UNROLL = 5  # steps unrolled in a compiled call's loop: XLA runs a loop's body step by step
AHEAD = 8   # calls the host may queue ahead of the device


def steps_per_epoch(n_batches, world):
    """Steps each of ``world`` workers takes in an epoch of ``n_batches``
    minibatches: together they take one minibatch each a step."""
    return n_batches // world


def minibatch(step, rank, world, n_steps):
    """The minibatch worker ``rank`` trains on at ``step`` (any count of
    steps: epochs repeat): rank, rank + world, ...  Plain or traced
    integers alike."""
    return world * (step % n_steps) + rank


def averages_after(step, n_steps, every):
    """Do the replicas average after ``step`` (0-based) of an epoch of
    ``n_steps``?  After every ``every``-th, and after the epoch's last, so
    that validation and checkpoints always see one model (local SGD; at
    ``every`` = 1, after every step, as in 2014)."""
    return (step + 1) % every == 0 or step + 1 == n_steps


def averages_in(steps, every):
    """How many averages a call of ``steps`` steps holds (``local_sgd``): it
    starts on a round's first step and ends on an average."""
    return -(-steps // every)


def mean_in_rank_order(terms):
    """(worker 0's + worker 1's + ...) / N, the same sum in the same order on
    every worker, so that every replica gets the same bits; symbolic
    (PyTensor) or NumPy alike."""
    return functools.reduce(operator.add, terms) / len(terms)


class Trainer:
    """One worker's replica, and how it trains beside the others.

    ``handshake()`` meets the other workers once; ``check_start()`` checks
    that every replica starts from the same weights; ``epoch(n)`` runs n steps,
    after each of which every replica holds the average; ``to_model()``
    leaves the replica's weights in the model's shared variables (worker 0
    validates them); ``weights()`` hands them back as NumPy arrays;
    ``finish()`` waits until the last step is done everywhere."""

    route = ""  # how the weights travel, in words
    clock = None  # StepClock: where the host orders the step, it times each phase
    tracer = None  # --trace: the timeline's recorder (multi_gpu.trace.Tracer)
    steps_run = 0  # the steps taken so far, this run

    def __init__(self, rank, world, model, *, gather, check, average_every=1):
        """``gather(array)``: every worker's ``array``, stacked in rank order
        (the start's check, --check), which the exchange itself never uses;
        the replicas average every ``average_every`` steps (``averages_after``)."""
        self.rank, self.world, self.model, self.gather = rank, world, model, gather
        self.check, self.n_steps = check, steps_per_epoch(model.n_train_batches, world)
        self.average_every, self.averages = average_every, 0
        self.max_diff = 0.0

    def handshake(self):
        """Swap what the exchange needs to know of the others, once."""

    def check_start(self):
        """Every replica starts from the same weights."""
        start = np.array([sum(p.sum(dtype=np.float64) for p in self.model.get_params())])
        if len(set(self.gather(start).ravel())) > 1:
            raise PeerError("the replicas start from different weights")

    def trace(self, tracer):
        """Record the phases of the steps ``tracer`` asks for (``--trace``)."""
        self.tracer = tracer
        if self.clock:
            self.clock.tracer = tracer

    def count_step(self, steps=1):
        """``steps`` more steps begin now (the tracer learns which), unless a
        stop was asked for: a worker stops between two steps."""
        if stopping.signum:  # set by a stop signal's handler (an attribute: nothing to call)
            raise Interrupted
        if self.tracer:
            self.tracer.at(self.steps_run)
        self.steps_run += steps

    def check_replicas(self):
        """``--check``: the largest difference between this replica's weights
        and any other's, compared on the host."""
        if self.check:
            mine = np.concatenate([w.ravel() for w in self.weights()])
            self.max_diff = max(self.max_diff,
                                float(np.max(np.abs(self.gather(mine) - mine))))

    def to_model(self):
        pass  # the model's shared variables are the replica's weights

    def finish(self):
        pass

    def close(self):
        pass

    def step_us(self, steps):
        """Microseconds of a step by phase, where the host times them."""
        return self.clock.step_us(steps) if self.clock else {}

    def report(self):
        """More entries for the summary: how many times the replicas averaged,
        and the seconds of the exchange where the host times it."""
        return dict(averages=self.averages, average_every=self.average_every,
                    **({"exchange_s": self.clock.exchange_s()} if self.clock else {}))


class StepClock:
    """Runs the host-ordered step's phases, each by name, and sums each
    one's time under it.  A signal's time is split in two: the signal
    itself, and waiting for a later worker (which a faster worker does
    whatever the exchange costs).  With a ``tracer`` (``--trace``), each
    phase is also a span of the timeline, the bytes it moved beside it."""

    MOVES_WEIGHTS = ("publish", "copy")
    FAULTS = {"train": "train", "copy": "exchange"}  # DUAL_MLP_FAULT's places in the step

    def __init__(self, rank, nbytes, tracer=None):
        self.rank, self.nbytes, self.tracer = rank, nbytes, tracer
        self.totals = collections.defaultdict(float)
        # the fault tests' hook, only where DUAL_MLP_FAULT names this worker and a phase
        self.faulty = {name for name, where in self.FAULTS.items()
                       if FAULT[:2] == [str(rank), where]}

    def phase(self, name, call, *args):
        """``call(*args)``, timed as phase ``name``; a signal's call returns
        (the seconds of it spent waiting for a later worker, that one's rank)."""
        if name in self.faulty:
            fault_point(self.rank, self.FAULTS[name])
        start = time.perf_counter_ns()
        result = call(*args)
        end = time.perf_counter_ns()
        waited, last = result if name == "signal" else (0.0, None)
        self.totals[name] += (end - start) / 1e9 - waited
        self.totals["waiting"] += waited
        if self.tracer and self.tracer.on:
            if waited:
                self.tracer.span(WAITING, start, start + int(waited * 1e9), worker=last)
            self.tracer.span(name, start + int(waited * 1e9), end,
                             **({"bytes": self.nbytes} if name in self.MOVES_WEIGHTS else {}))
        return result

    def exchange_s(self):
        """Seconds in all of the exchange's phases, 2-6 (publish, the signals,
        copy, average): its work, waiting for a later worker told apart, as
        ``bench.compare`` counts it too."""
        return sum(self.totals[k] for k in ("publish", "signal", "copy", "average"))

    def step_us(self, steps):
        """Microseconds a step by phase, and ``exchange``: ``exchange_s``'s share."""
        return dict({k: 1e6 * v / steps for k, v in self.totals.items()},
                    exchange=1e6 * self.exchange_s() / steps)


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

    stamper = None  # an exchange that stamps its phases on the device's clock (--trace)

    def __init__(self, rank, world, model, *, gather, check, watchdog, steps_per_call,
                 average_every=1):
        super().__init__(rank, world, model, gather=gather, check=check,
                         average_every=average_every)
        self.queued, self.watchdog = collections.deque(), watchdog or Unwatched()
        self.in_flight, self.device_free = collections.deque(), 0  # --trace: calls not yet seen
        self.steps_per_call, self.programs, self.exchange_steps = steps_per_call, {}, None
        self.host_time, self.calls = 0.0, 0  # the host's share: inside the calls

    def compile(self):
        """The programs an epoch calls: ``steps_per_call`` steps, and what is
        left at the epoch's end.  Compiled, not run."""
        for steps in {self.steps_per_call, self.n_steps % self.steps_per_call} - {0}:
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
                self.averages += averages_in(steps, self.average_every)  # each call ends on one
                self.count_step(steps)
                called = time.perf_counter_ns()
                self.queued.append(self.queue(steps))
                self.host_time += (time.perf_counter_ns() - called) / 1e9
                self.traced_call(called, steps)
                self.calls += 1
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
        started, pause = time.perf_counter_ns(), 0.0002
        while not self.done(marker):
            if stopping.is_set():
                raise Interrupted
            self.see_the_device()
            time.sleep(pause)
            pause = min(2 * pause, 0.002)
        if self.tracer:
            self.see_the_device()
            self.tracer.span("waiting for the device", started, time.perf_counter_ns(),
                             call=self.calls - len(self.queued))

    def traced_call(self, called, steps):
        """--trace: the call just queued, on the host's track; the device's
        track learns when each call is done (``device_spans``)."""
        if not self.tracer:
            return
        self.tracer.span("queue", called, time.perf_counter_ns(), steps=steps,
                         first=self.steps_run - steps, call=self.calls)
        self.in_flight.append((self.queued[-1], self.tracer.step, steps, self.calls, called))
        self.see_the_device()

    def see_the_device(self):
        """The calls the device has finished since the host last looked (it
        looks between its calls and while it waits), each to ``device_spans``."""
        while self.tracer and self.in_flight and self.done(self.in_flight[0][0]):
            marker, step, steps, call, queued = self.in_flight.popleft()
            now = time.perf_counter_ns()
            self.device_spans(marker, step, steps, call, max(queued, self.device_free), now)
            self.device_free = now

    def trace(self, tracer):
        """--trace; an exchange that stamps its own phases (``stamper``: the
        kernel on a GPU, ``StreamExchange.trace``) keeps its stamps too."""
        super().trace(tracer)
        if self.stamped():
            self.stamper.trace((AHEAD + 2) * averages_in(self.steps_per_call,
                                                         self.average_every))

    def stamped(self):
        return hasattr(self.stamper, "trace")  # the stand-ins on CPUs have no GPU clock

    def device_spans(self, marker, step, steps, call, start, now):
        """The device's track of a call of ``steps`` steps from ``step`` that
        the host saw done at ``now``: one span, from when the one before it
        ended (or it was queued); or, from a ``stamper``, the stamps of the
        call's exchanges, drawn at the end (``draw_stamps``)."""
        if not self.stamped():
            self.tracer.span("steps", start, now, track="device", step=step, first=step,
                             steps=steps, call=call)
        elif self.tracer.traces(step, steps):  # the steps that end on an exchange
            self.stamper.keep_stamps([step + i for i in range(steps) if
                                      averages_after(i, steps, self.average_every)], marker, call)

    def draw_stamps(self):
        """--trace, once the last step is done: the stamps kept, as spans."""
        if self.stamped() and self.stamper.stamps is not None:
            self.stamper.draw_stamps(self.tracer, self.rank)

    def weights(self):
        return [np.array(w) for w in self.device_weights()]

    def to_model(self):
        for p, value in zip(self.model.params, self.device_weights()):
            place(p, value)

    def report(self):
        """What bounds the speed: a step that costs the host as long as the
        step takes is host-bound, one that costs it less waits for the GPU;
        and how many steps the device counted (``exchange_steps``: under
        ``--sync gpu`` the kernel's own count, which equals the averages run
        where it ran once an average)."""
        return dict(super().report(), host_us_per_call=1e6 * self.host_time / max(1, self.calls),
                    host_us_per_step=1e6 * self.host_time / max(1, self.steps_run),
                    steps_per_call=self.steps_per_call, exchange_steps=self.exchange_steps,
                    **({"exchange_callbacks": self.stamper.callbacks} if self.stamper else {}))


def repeat(step, steps, unroll=UNROLL):
    """``steps`` calls of ``step(data, *state) -> state`` as one loop, in the
    same order as one call each: ``unroll`` of them at a time in the loop's
    body, which XLA otherwise runs a step at a time."""
    import jax

    def loop(data, *state):
        return jax.lax.fori_loop(0, steps, lambda _, state: step(data, *state), state,
                                 unroll=max(1, min(steps, unroll)))
    return loop


def local_sgd(own_step, averaging_step, steps, every):
    """A compiled call of ``steps`` steps, ``--average-every`` ``every``:
    rounds of ``every - 1`` of a worker's ``own_step`` and one
    ``averaging_step``, and where a round is cut short (an epoch's end) its
    steps the same way, the last one averaging.  Both steps take and return
    ``(data, *state)`` alike.  At ``every`` = 1 every step averages: the
    2014 demo's call, ``repeat(averaging_step, steps)``."""
    if every == 1:
        return repeat(averaging_step, steps)

    def round_of(n):
        def round_(data, *state):
            for _ in range(n - 1):
                state = own_step(data, *state)
            return averaging_step(data, *state)
        return round_
    rounds, left = divmod(steps, every)
    whole = repeat(round_of(every), rounds, unroll=UNROLL // every) if rounds else None

    def call(data, *state):
        if whole:
            state = whole(data, *state)
        return round_of(left)(data, *state) if left else state
    return call
