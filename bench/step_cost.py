"""What the GPU-ordered exchange costs a step, on one GPU: the plain step beside it, in loopback.

    python -m bench.step_cost --dataset /usr/share/datasets/fashion-mnist    # GPU 0
    python -m bench.step_cost --cpu                                          # CI's subset

On one device, at batch 100, 500 and 5000 and at 1 and K steps per call:

* ``plain step``: the tutorial's training step as the demo compiles it
  (PyTensor's graph, jitted, the weights donated, the minibatch picked by a
  counter on the device, the host running ahead), K steps a call: the best
  one-GPU program of ``references.py pytensor``;
* ``plain step, written out``: the same with an optimization barrier where
  the exchange stands, so that XLA writes every parameter out after each
  step (without one it fuses the updates into the next step's first
  kernels): what any exchange between two steps costs XLA, with no
  exchange at all;
* ``GPU-ordered step, loopback``: ``dual_mlp.GpuOrdered`` itself, its own
  epoch loop, with the exchange of ``--sync gpu`` and the worker as its own
  peer (``StreamExchange.loopback``): every kernel runs, every counter is
  written and waited for, on one GPU.  With ``--cpu``, where there are no
  kernels, the exchange is a host callback that echoes the weights, a
  stand-in that runs the same trainer;
* ``GPU-ordered step, --average-every 4``: the same trainer in local SGD,
  the kernel run every fourth step (the other three the tutorial's own
  step), at the K that are multiples of 4 (12 among the defaults);
* ``--exchange xla, a world of one``: ``xla_runtime.XlaOrdered`` itself, its
  program compiled over JAX's distributed runtime with this process its one
  worker: an all-reduce of one participant, which XLA compiles away on a
  GPU (gloo runs it on the CPU).  So this is what the host pays for the
  xla program and its end-of-call marker, with no link in the step.

Each is warmed up, then timed over at least ``--steps`` steps with one wait
at the end, ``--rounds`` times, the systems taking turns (what drifts on
the host during a run reaches them all alike): each figure is the
median of its rounds.  The host's time inside the calls says which of host
and device sets the pace.  Each exchange's own step counter must equal the
averages run (once a step, or once every four).  Target: the GPU-ordered step within 1.15x
of the plain step at every batch.  Writes ``step_cost.json`` (``step_cost_cpu.json``).
"""
import statistics
import sys
import time

import numpy as np

from bench.common import (
    DEBIAN_FASHION,
    OUT,
    keep_to_one_device,
    measured_by,
    one_device,
    parse_args,
    prog,
    record,
    show,
)
from multi_gpu.cli import Parser

TARGET = 1.15  # for the GPU-ordered step
EVERY = 4      # --average-every of the local-SGD row
ORDERED, XLA = "GPU-ordered step, loopback", "--exchange xla, a world of one"
LOCAL = f"GPU-ordered step, --average-every {EVERY}"
SYSTEMS = ("plain step", "plain step, written out", ORDERED, LOCAL, XLA)


def plain_step(dataset, batch, steps_per_call, written_out=False):
    """``(run(calls), wait, host seconds so far)`` of the plain step: the best
    one-GPU program of ``references.py pytensor``, K steps a call
    (``written_out``: with every parameter written out between steps)."""
    from bench import references
    trainer = references.pytensor_trainer(dataset, batch, references.DEFAULTS, steps_per_call,
                                          written_out)
    host = 0.0

    def run(calls):  # queueing only: the host never waits here
        nonlocal host
        called = time.perf_counter()
        trainer.run_steps(calls * steps_per_call)
        host += time.perf_counter() - called
    return run, trainer.synchronize, lambda: host


class HostEcho:
    """``--cpu``'s stand-in for ``StreamExchange``: a callback on the host that
    updates the weights it is given, as the mean with a peer that holds the
    same weights and gradients would be."""

    def __init__(self, rank, n_workers, layout, rate):
        self.rate, self.count, self.callbacks = np.float32(rate), 0, 0

    def __call__(self, params, gradients):
        import jax
        from jax.experimental.buffer_callback import buffer_callback
        return buffer_callback(self._echo, [jax.ShapeDtypeStruct(p.shape, p.dtype)
                                            for p in params], has_side_effect=False,
                               input_output_aliases={i: i for i in range(len(params))})(
                                   *params, *gradients)

    def _echo(self, ctx, out, *inputs):  # out: the params, in place
        for w, g in zip(out, inputs[len(out):]):
            w = np.from_dlpack(w)
            w -= self.rate * np.from_dlpack(g)
        self.count += 1
        self.callbacks += 1

    def loopback(self):
        pass

    def steps_done(self):
        return self.count

    def close(self):
        pass


def gpu_ordered_step(model, device, steps_per_call, cpu, average_every=1):
    """``(run(calls), wait, host seconds so far, trainer)`` of dual_mlp's
    GPU-ordered trainer in loopback."""
    import dual_mlp
    trainer = dual_mlp.GpuOrdered(0, 1, model, device, None, check=False, watchdog=None,
                                  steps_per_call=steps_per_call, average_every=average_every,
                                  **({"exchange": HostEcho} if cpu else {}))
    trainer.exchange.loopback()
    return (*its_own_epochs(trainer), trainer)


def world_of_one(cpu):
    """``--exchange xla``'s runtime with this process its only worker (it
    must start before anything else touches JAX)."""
    from multi_gpu.nodes import free_port
    from multi_gpu.xla_runtime import XlaExchange
    return XlaExchange(f"127.0.0.1:{free_port()}", 1, 0, timeout=60, cpu=cpu, one_machine=True)


def xla_ordered_step(model, device, xla, steps_per_call):
    """``(run(calls), wait, host seconds so far, trainer)`` of dual_mlp's
    ``--exchange xla`` trainer in a world of one."""
    from multi_gpu.xla_runtime import XlaOrdered
    trainer = XlaOrdered(0, 1, model, device, xla, check=False, watchdog=None,
                         steps_per_call=steps_per_call)
    return (*its_own_epochs(trainer), trainer)


def its_own_epochs(trainer):
    """``(run(calls), wait, host seconds so far)`` of a dual_mlp trainer
    through its own epoch loop, which waits once at its end, as the plain
    step's does."""
    return (lambda calls: trainer.epoch(calls * trainer.steps_per_call), lambda: None,
            lambda: trainer.host_time)


def measure(run, wait, host, steps_per_call, min_steps):
    """(us per step, us of host time per step inside the calls)."""
    calls = max(2, -(-min_steps // steps_per_call))
    host_before, start = host(), time.perf_counter()
    run(calls)
    wait()
    steps = calls * steps_per_call
    return 1e6 * (time.perf_counter() - start) / steps, 1e6 * (host() - host_before) / steps


def figure(system, batch, k, rounds, plain=None, **more):
    """One row of step_cost.json: the medians of ``rounds``, each as
    ``measure`` returns it, their ratio to the ``plain`` row's step, and ``more``."""
    row = dict(system=system, batch=batch, steps_per_call=k,
               step_us=statistics.median(us for us, _ in rounds),
               host_us_per_step=statistics.median(host for _, host in rounds),
               step_us_rounds=[us for us, _ in rounds])
    if plain:
        row["over_plain"] = row["step_us"] / plain["step_us"]
    return dict(row, **more)


BATCHES = (100, 500, 5000)


def arguments():
    """The command line, checked: each batch leaves two minibatches of the data."""
    from multi_gpu import datasets
    parser = Parser(about=__doc__)
    parser.add_argument("--dataset", default=datasets.SHIPPED,
                        help="training data (default: the shipped digits)")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help=f"examples per step (default: {' '.join(map(str, BATCHES))}, "
                             "those the data holds two minibatches of)")
    parser.add_argument("--steps-per-call", type=int, nargs="+", default=None,
                        help="K values, each at most an epoch (default: 1 and the demo's "
                             "default)")
    parser.add_argument("--steps", type=int, default=2000,
                        help="timed steps of a round, at least")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds, the systems taking turns; each figure is the median")
    parser.add_argument("--cpu", action="store_true", help="on the CPU, a small subset (CI)")
    parser.add_argument("--out", default=OUT, help="folder for step_cost.json")
    args = parse_args(parser, table)
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    if args.cpu:
        args.batches, args.steps = [100], min(args.steps, 40)
    n_train = len(datasets.read(args.dataset)[0][1])
    if args.batches is None:  # the defaults the data at hand holds, and a word on the others
        args.batches = [b for b in BATCHES if 2 * b <= n_train]
        if args.batches != list(BATCHES):
            left = ", ".join(str(b) for b in BATCHES if b not in args.batches)
            print(f"{prog()}: batch {left} left out: {args.dataset} holds {n_train:,} training "
                  f"images, fewer than two such minibatches (--dataset {DEBIAN_FASHION} holds "
                  "50,000)")
    too_big = [b for b in args.batches if 2 * b > n_train]
    if too_big:  # a step of the ordered trainers takes two minibatches: its worker's, its peer's
        parser.error(f"--batches {too_big[0]}: {args.dataset} holds {n_train:,} training images, "
                     "fewer than two minibatches: smaller --batches, or more data (--dataset "
                     f"{DEBIAN_FASHION})")
    return args


def main():
    args = arguments()
    keep_to_one_device(args.cpu)
    xla = world_of_one(args.cpu)
    device = one_device(args.cpu)
    import dual_mlp
    import mlp
    from logistic_sgd import load_data
    data = load_data(args.dataset, put=device.put)
    ks = args.steps_per_call or [1, dual_mlp.STEPS_PER_CALL, 3 * EVERY]
    figures = []
    for batch in args.batches:
        model = mlp.Model(data, batch, mode="JAX")
        model.warm_up(put=device.put)
        for k in sorted({min(k, model.n_train_batches) for k in ks}):
            ordered_trainers = [gpu_ordered_step(model, device, k, args.cpu, every)[-1]
                                for every in ((1, EVERY) if k % EVERY == 0 else (1,))]
            *xla_step, xla_trainer = xla_ordered_step(model, device, xla, k)
            systems = [plain_step(args.dataset, batch, k),
                       plain_step(args.dataset, batch, k, written_out=True),
                       *[its_own_epochs(t) for t in ordered_trainers], xla_step]
            for run, wait, _ in systems:  # warm: the first call compiles or captures
                run(2)
                wait()
            rounds = [[measure(*system, k, args.steps) for system in systems]
                      for _ in range(args.rounds)]
            plain, written, *ordered, by_xla = zip(*rounds)
            plain = figure("plain step", batch, k, plain)
            written = figure("plain step, written out", batch, k, written, plain)
            ordered = [figure(LOCAL if t.average_every > 1 else ORDERED, batch, k, timed, plain,
                              exchange_steps=t.exchange.steps_done(), averages_run=t.averages,
                              steps_run=t.steps_run, exchange_callbacks=t.exchange.callbacks)
                       for t, timed in zip(ordered_trainers, ordered)]
            for t in ordered_trainers:
                t.exchange.close()
            xla_trainer.finish()
            xla_trainer.to_model()  # its state began as the model's own buffers, donated since
            by_xla = figure(XLA, batch, k, by_xla, plain, exchange_steps=xla_trainer.exchange_steps,
                            averages_run=xla_trainer.steps_run, steps_run=xla_trainer.steps_run)
            for f in (*ordered, by_xla):
                if f["exchange_steps"] != f["averages_run"]:
                    sys.exit(f"step_cost.py: error: {f['system']} counted {f['exchange_steps']} "
                             f"of {f['averages_run']} averages at batch {batch}, K={k}")
            figures += [plain, written, *ordered, by_xla]
            for f in (plain, written, *ordered, by_xla):
                print(f"B={batch:5d} K={k:3d} {f['system']:33s} {f['step_us']:8.1f} us/step, "
                      f"host {f['host_us_per_step']:7.1f} us/step"
                      + (f"  {f['over_plain']:.3f}x plain" if "over_plain" in f else ""),
                      flush=True)
    device.close()
    import jax
    jax.distributed.shutdown()  # as a worker does: the runtime's watch ends without a word
    path = record("step_cost_cpu" if args.cpu else "step_cost", args.out,
                  device=device.description, dataset=args.dataset, target=TARGET,
                  rounds=args.rounds,
                  within_target=all(f["over_plain"] <= TARGET for f in figures
                                    if f["system"] == ORDERED),
                  figures=figures)
    show(path, table)
    return path


def table(document):
    """The Markdown table of a step_cost.json: us per step, host us per step."""
    figures = document["figures"]
    rows = sorted({(f["batch"], f["steps_per_call"]) for f in figures})
    by = {(f["system"], f["batch"], f["steps_per_call"]): f for f in figures}
    rounds = (f", the median of {document['rounds']} rounds in turn (the range of the step's)"
              if "rounds" in document else "")
    lines = [f"{measured_by(document)} "
             f"({document['device']}): us per step (of it, us of host time){rounds}, and its "
             "ratio to the plain step.", "",
             "| batch | steps per call | " + " | ".join(SYSTEMS) + " |",
             "| --- | --- |" + " --- |" * len(SYSTEMS)]

    def cell(f):
        if f is None:
            return "not run"
        ratio = f" {f['over_plain']:.3f}x" if "over_plain" in f else ""
        spread = (f" [{min(f['step_us_rounds']):.1f}-{max(f['step_us_rounds']):.1f}]"
                  if "step_us_rounds" in f else "")
        return f"{f['step_us']:.1f} ({f['host_us_per_step']:.1f}){spread}{ratio}"
    for batch, k in rows:
        lines.append(f"| {batch} | {k} | " + " | ".join(
            cell(by.get((system, batch, k))) for system in SYSTEMS) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
