"""Time to accuracy: how long each system takes to reach a test accuracy.

    python -m bench.accuracy --dataset /usr/share/datasets/fashion-mnist   # two GPUs: ~5 min
    python -m bench.accuracy --cpu                                          # a small CPU subset

Every system trains the same model from the same initial weights on the
same minibatches in the same order: 784-500-10 tanh, softmax NLL, SGD at
``--learning-rate`` with ``--l2``, 200 examples per step in all (100 per GPU
on two GPUs, 200 on one), for ``--epochs`` epochs.  After each epoch it
records the training seconds so far (no compile, no evaluation), the
validation error and the test error of the best-validation model (the
tutorial's rule).  A system reaches the target at the first epoch where that
test accuracy is at least ``--target``: its training seconds and steps then
are the figures.  The systems: ``dual_mlp.py 0 1`` (GPU-ordered, ``--exchange
xla``, host-ordered), the project's model on one GPU (``mlp.py``, and its
compiled step at its best), PyTorch eager and as a CUDA graph, on one GPU and
with DDP on two, JAX's mesh data parallelism, one step and K steps per call
(``bench.references --curve``), and the demo in local SGD, averaging every
H steps (``--average-every``, 2, 4 and 8 by default beside the every-step
H = 1).  A run that fails stops the benchmark.

Writes ``accuracy.json`` (command, date, machine, every curve, the figures)
and ``accuracy.png`` (test accuracy against training seconds); ``--tables-from
JSON`` regenerates the tables of README.md and bench/README.md from one.
"""
import json
import os
import sys
import tempfile

from bench.common import OUT, measured_by, parse_args, pyplot, record, show
from bench.compare import ONE_GPU, STEPS_PER_CALL, K, run, summary_of
from multi_gpu import cli, datasets
from multi_gpu.cli import Parser

GLOBAL_BATCH = 200


def training(opts):
    """The options every system trains with: the data, batch, epochs and rates."""
    return ["--dataset", opts.dataset, "--epochs", str(opts.epochs), "--learning-rate",
            str(opts.learning_rate), "--l2", str(opts.l2)]


def demo(name, args, workers, opts, tmp, env=None):
    """A dual_mlp.py (two workers) or mlp.py (one) run: its --json curve."""
    summary = summary_of([*args, *training(opts), "--batch-size",
                          str(GLOBAL_BATCH // workers)], workers, tmp, env)
    result = summarise(name, workers, summary, opts.target)
    if workers > 1:
        result.update(average_every=summary["average_every"], averages=summary["averages"])
    return result


def local_sgd(devices, opts, tmp):
    """The demo on ``devices``, averaging every H steps, for each H > 1 asked."""
    for every in opts.average_every:
        if every > 1:
            yield demo(f"demo {' '.join(devices)} --average-every {every}",
                       [*devices, "--average-every", str(every)], 2, opts, tmp)


def reference(system, name, workers, opts, options=(), env=None):
    out = run([sys.executable, "-m", "bench.references", system, *options, "--curve",
               *training(opts), "--batches", str(GLOBAL_BATCH // workers)], env)
    return summarise(name, workers, json.loads(out.stdout.strip().splitlines()[-1]),
                     opts.target)


def summarise(name, workers, run, target):
    """The figures of one system (``run``: its ``curve`` and ``steps_per_epoch``):
    when its test accuracy first reached ``target``."""
    curve, steps_per_epoch = run["curve"], run["steps_per_epoch"]
    reached = next((p for p in curve if 1 - p["test_error"] >= target), None)
    result = dict(system=name, gpus=workers, batch_per_gpu=GLOBAL_BATCH // workers,
                  curve=curve, final_test_accuracy=1 - curve[-1]["test_error"],
                  reached=None if reached is None else dict(
                      epoch=reached["epoch"], steps=reached["epoch"] * steps_per_epoch,
                      train_s=reached["train_s"]))
    where = (f"{reached['train_s']:7.1f} s, epoch {reached['epoch']}" if reached
             else f"not within {len(curve)} epochs")
    print(f"  {name:32s} {100 * target:.1f} % test accuracy: {where}; last "
          f"{100 * result['final_test_accuracy']:.2f} %", flush=True)
    return result


def gpu_systems(opts, tmp):
    yield demo("demo 0 1 --sync gpu", ["0", "1", "--sync", "gpu"], 2, opts, tmp)
    yield demo("demo 0 1 --exchange xla", ["0", "1", "--exchange", "xla"], 2, opts, tmp)
    yield demo("one GPU (mlp.py)", [], 1, opts, tmp, {"THEANO_FLAGS": "device=cuda0"})
    yield reference("pytensor", f"one GPU, the demo's step, {STEPS_PER_CALL} per call", 1, opts,
                    K, ONE_GPU)
    yield reference("jax", "JAX jit over a 2-GPU mesh", 2, opts)
    yield reference("jax", f"JAX jit over a 2-GPU mesh, {STEPS_PER_CALL} steps per call", 2,
                    opts, K)
    yield reference("torch", "PyTorch eager, one GPU", 1, opts)
    yield reference("torch-graph", "PyTorch CUDA graph, one GPU", 1, opts)
    yield reference("ddp", "PyTorch DDP, two GPUs", 2, opts)
    yield reference("ddp-graph", "PyTorch DDP CUDA graph, two GPUs", 2, opts)
    yield demo("demo 0 1 --sync host", ["0", "1", "--sync", "host"], 2, opts, tmp)
    yield from local_sgd(["0", "1", "--sync", "gpu"], opts, tmp)


def cpu_systems(opts, tmp):
    yield demo("demo cpu cpu", ["cpu", "cpu"], 2, opts, tmp)
    yield demo("one CPU process (mlp.py)", [], 1, opts, tmp)
    yield from local_sgd(["cpu", "cpu"], opts, tmp)


def plot(results, target, path):
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in results:
        ax.plot([p["train_s"] for p in r["curve"]],
                [100 * (1 - p["test_error"]) for p in r["curve"]], label=r["system"])
    ax.axhline(100 * target, color="k", linestyle="--", linewidth=1,
               label=f"target {100 * target:.1f} %")
    ax.set_xscale("log")
    ax.set_xlabel("training seconds (compile and evaluation not counted)")
    ax.set_ylabel("test accuracy, best-validation model (%)")
    ax.set_ylim(100 * target - 6, 100 * target + 2)
    ax.set_title(f"784-500-10 MLP, {GLOBAL_BATCH} examples per step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(document):
    """The Markdown table of an accuracy.json."""
    target = 100 * document["target"]
    lines = [f"{measured_by(document)}; "
             f"{document['global_batch']} examples per step, learning rate "
             f"{document['learning_rate']}, L2 {document['l2']}, {document['epochs']} epochs.", "",
             f"| system | {'processes' if document.get('cpu') else 'GPUs'} | batch per "
             f"{'worker' if document.get('cpu') else 'GPU'} | training seconds to {target:.1f} % "
             f"| epoch (steps) | test accuracy after {document['epochs']} epochs |",
             "| --- | --- | --- | --- | --- | --- |"]
    for s in document["systems"]:
        r = s["reached"]
        when = (f"{r['train_s']:.1f} s", f"{r['epoch']} ({r['steps']})") if r else \
            ("not reached", "")
        lines.append(f"| {s['system']} | {s['gpus']} | {s['batch_per_gpu']} | {when[0]} | "
                     f"{when[1]} | {100 * s['final_test_accuracy']:.2f} % |")
    return "\n".join(lines)


def main():
    parser = Parser(about=__doc__)
    parser.add_argument("--dataset", default=datasets.SHIPPED,
                        help="a data set (default: the shipped digits)")
    parser.add_argument("--cpu", action="store_true", help="the small CPU subset (CI)")
    parser.add_argument("--target", type=cli.fraction, default=0.875,
                        help="test accuracy to reach, above 0 and below 1 (default: %(default)s)")
    parser.add_argument("--epochs", type=cli.positive_int, default=120,
                        help="the budget, in epochs (default: %(default)s)")
    parser.add_argument("--learning-rate", type=cli.positive, default=0.1,
                        help="SGD step size (default: %(default)s)")
    parser.add_argument("--l2", type=cli.non_negative, default=0.0,
                        help="squared L2 weight penalty (default: %(default)s)")
    parser.add_argument("--average-every", type=cli.positive_int, nargs="+", default=[1, 2, 4, 8],
                        metavar="H", help="the demo's H values (local SGD; default: %(default)s)")
    parser.add_argument("--out", default=OUT, help="folder for accuracy.json and .png")
    opts = parse_args(parser, table)
    name = "accuracy_cpu" if opts.cpu else "accuracy"
    results = []

    def write(complete):  # after every system: a run cut short keeps what it measured
        return record(name, opts.out, complete=complete, target=opts.target, cpu=opts.cpu,
                      dataset=opts.dataset, global_batch=GLOBAL_BATCH,
                      learning_rate=opts.learning_rate, l2=opts.l2, epochs=opts.epochs,
                      systems=results)
    with tempfile.TemporaryDirectory() as tmp:
        for result in (cpu_systems if opts.cpu else gpu_systems)(opts, tmp):
            results.append(result)
            write(complete=False)
    show(write(complete=True), table)
    plot(results, opts.target, os.path.join(opts.out, f"{name}.png"))


if __name__ == "__main__":
    main()
