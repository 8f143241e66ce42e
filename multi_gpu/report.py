"""Worker 0's words: the compile heartbeat's text, a run that diverged, the
closing lines and the ``--json`` summary of ``dual_mlp.py``."""
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import itertools
import os
import platform

import numpy as np
import pytensor

from multi_gpu import cli, elastic, records, xla_cache
from multi_gpu.nodes import host_and_port
from multi_gpu.trace import WAITING


class Diverged(Exception):
    """The training diverged: one line, which names the likely cause."""


def check_finite(weights, epoch, learning_rate, l1=0.0, l2=0.0,
                 kept="The last checkpoint, if any, is the last good one"):
    """Stop a run whose training diverged, before its weights are validated
    or saved: weights NaN or infinite, or a cost that is no longer a number
    (its penalty terms, ``l1 * sum|W| + l2 * sum W**2`` over the two weight
    matrices, overflow float32 long before the weights do).  The message
    names what was large: ``--l2`` (each step scales the weights by
    ``1 - 2 * rate * l2``), or the learning rate.  (Large input values do
    not diverge here: they saturate tanh, and the data set's check refuses
    what float32 cannot hold.)"""
    matrices = [w for w in weights if w.ndim == 2]
    with np.errstate(over="ignore", invalid="ignore"):
        penalty = sum(np.float32(rate) * sum(term(w).sum(dtype=np.float32) for w in matrices)
                      for rate, term in ((l1, np.abs), (l2, np.square)) if rate)
    finite = all(np.isfinite(w).all() for w in weights)
    if finite and np.isfinite(penalty):
        return
    shrink = 1 - 2 * learning_rate * l2
    why = (f"--l2 {l2:g} is too large for --learning-rate {learning_rate:g}: each "
           f"step scales the weights by 1 - 2 * rate * l2 = {shrink:.3g}"
           if abs(shrink) > 1 and l2 > 1 else f"is --learning-rate {learning_rate:g} too large?")
    raise Diverged(f"after epoch {epoch} {'the cost is' if finite else 'the weights are'} no "
                   f"longer finite (NaN or inf): the training diverged; {why} {kept}".strip())


def compiling(what, mode=None, where="cpu"):
    """What the heartbeat says while ``what`` compiles with ``mode``'s backend
    on ``where``: which backend, and how long a first run takes."""
    backend = cli.backend_name(mode)
    # as bench/README.md's first-run table has them (XLA on a GPU: seconds too)
    first = {"JAX": "a few seconds", "Numba": "tens of seconds"}.get(backend,
                                                                          "a minute or so")
    later = (f"load XLA's programs from {cli.tilde(xla_cache.jax_cache_folder())}"
             if backend == "JAX" else "use the cache")
    return (f"compiling {what} with PyTensor's {backend} backend on {where} (the first run takes "
            f"{first}; later runs {later})")


def since_start():
    """Seconds since this process started, as the kernel counts them
    (/proc: Python's own start-up and imports included, which a clock read
    in ``main`` misses, about a second)."""
    with open("/proc/self/stat") as f:
        started = int(f.read().rpartition(")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - started


def ended(args):
    """A node's last line when the run ends well."""
    line = f"total wall time {since_start():.1f} s (start-up and compile included)"
    if not args.node_rank:
        return line
    host = host_and_port(args.coordinator)[0]
    return (f"node {args.node_rank}: done; {line}; node 0 ({host}) keeps the run's checkpoint "
            "and summary")


CHANCE = 1 - 1 / 10  # the error of a guess among ten classes


def remarks(args, progress):
    """What worker 0 adds to its result: where the test error came out below
    validation's, why it can; where the model learnt nothing (its best
    validation error near a guess's), what to try."""
    if progress.best_validation_error >= CHANCE - 0.05:
        return (f"; near a guess's {CHANCE * 100:.0f} %: the model learnt nothing, which a "
                f"learning rate too large does (try one smaller than {args.learning_rate:g})")
    return (" (a separate sample of images: it can come out lower than validation)"
            if progress.test_error < progress.best_validation_error else "")


def speed(args, progress, trainer, world):
    """(Samples a second over the run's epochs, microseconds of a step: in
    all, ``step``, and by phase where the host times them)."""
    samples_per_s = world * progress.steps * args.batch_size / progress.train_s
    return samples_per_s, dict(trainer.step_us(progress.steps),
                               step=1e6 * progress.train_s / progress.steps)


def phases(step_us):
    """A step's phases in words, where the host timed them (``speed``)."""
    if "train" not in step_us:
        return ""
    return (": train {train:.0f} us, exchange {exchange:.0f} us (publish {publish:.0f} + signals "
            "{signal:.0f} + copy {copy:.0f} + average {average:.0f}), "
            f"{WAITING} {{waiting:.0f}} us").format(**step_us)


def worlds(epoch_workers):
    """'3 (epochs 1-2), 2 (epochs 3-12), 3 (epochs 13-24)': how many workers
    trained each epoch, in spans of epochs."""
    spans = [(n, [epoch for epoch, _ in span]) for n, span in
             itertools.groupby(enumerate(epoch_workers, 1), key=lambda point: point[1])]
    return ", ".join(f"{n} (epoch{f's {e[0]}-{e[-1]}' if len(e) > 1 else f' {e[0]}'})"
                     for n, e in spans)


def summarise(args, progress, trainer, n_steps, world, wall, device, say, speeds):
    """Worker 0's closing lines past its speed (``speeds``: ``speed``'s),
    and the --json summary."""
    samples_per_s, step_us = speeds
    averaged = trainer.report()
    if averaged["average_every"] > 1:  # local SGD
        spent = (f"the exchange {averaged['exchange_s']:.2f} s in all" if "exchange_s" in averaged
                 else "the exchange inside the compiled step")
        say(f"The replicas averaged {averaged['averages']} times (every "
            f"{averaged['average_every']} steps and at each epoch's end), {spent}")
    if args.check:
        say(f"max difference between the replicas after an exchange: {trainer.max_diff:g}")
    if len(set(progress.epoch_workers)) > 1:  # resumed, or elastic, on another number
        say(f"The workers of each epoch: {worlds(progress.epoch_workers)}")
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
    summary.update(averaged)
    records.write_json_or_show(args.json, summary, "worker 0")


def timeline(args, tracer, rundir, trainer, device, say):
    """--trace: this worker's spans into the run folder; the first worker of
    each machine merges its machine's into the trace and draws its picture."""
    tracer.write(rundir)
    n_local = len(args.devices)
    if tracer.rank % n_local:
        return
    from multi_gpu import trace
    first = elastic.first_worker(args)
    traces = trace.gather(rundir, range(first, first + n_local), args.timeout)
    title = (f"python dual_mlp.py {' '.join(args.devices)}: {trainer.route}, batch "
             f"{args.batch_size} per worker")
    about = dict(title=title, **records.run_header(args.command),
                 device_name=device.description,
                 window=dict(epoch=args.trace_from, steps=args.trace_steps,
                             first_step=tracer.first, steps_per_epoch=trainer.n_steps),
                 clock="CLOCK_MONOTONIC, ns, one clock for the machine")
    document = trace.chrome_trace(traces, {first + i: d for i, d in enumerate(args.devices)},
                                  about)
    records.write_json_or_show(args.trace, document, f"worker {tracer.rank}")
    picture = trace.plot(document, os.path.splitext(args.trace)[0] + ".png")
    say(f"... the timeline of steps from epoch {args.trace_from} is in {args.trace}"
        + (f" and {picture}" if picture else "") + " (open the JSON in ui.perfetto.dev)")
    if "device_clock" in tracer.about:
        say(f"... the devices' tracks: the kernel's own stamps, {tracer.about['device_clock']}")
