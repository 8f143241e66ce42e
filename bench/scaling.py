"""Scaling: samples/s for 1, 2, 4 and 8 workers, beside JAX's own data parallelism.

    python -m bench.scaling --dataset /usr/share/datasets/fashion-mnist   # every GPU here
    python -m bench.scaling --cpu                                          # 1-3 CPU workers

For each worker count N up to the GPUs this machine has (1, 2, 4, 8) and each
batch size per GPU: the demo on N GPUs with ``--exchange xla`` (N = 1: the
project's model on one GPU, ``mlp.py``), the peer-to-peer exchange
(``--exchange p2p``: ordered by the GPUs, by the host on CPUs) from N = 2 on,
and JAX's own data parallelism over the
same N GPUs (``bench.references jax`` with those GPUs visible).  Scaling
efficiency is N-worker samples/s over N times the one-worker figure of the
same system.  A short ``--check`` run per N confirms identical replicas.  A
run that fails stops the benchmark.  Writes ``scaling.json`` (command, date,
machine with ``nvidia-smi topo -m``, every figure) and ``scaling.png``;
``--tables-from JSON`` regenerates the tables of README.md and
bench/README.md from such a file.
"""
import os
import subprocess
import tempfile

from bench.common import OUT, measured_by, parse_args, pyplot, rate, rate_unit, record, show
from bench.compare import Tiles, demo, reference
from multi_gpu import cli, datasets
from multi_gpu.cli import Parser

JAX = "JAX jit over a mesh of the same devices"
DEMO = "the demo (mlp.py on one, --exchange xla on more)"


def gpu_count():
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return len(out.stdout.strip().splitlines()) if out.returncode == 0 else 0


def runs_for(n, cpu):
    """(system, command line, environment) of each demo run with ``n`` workers."""
    if cpu:
        devices = ["cpu"] * n
        one = (DEMO, [], {})
    else:
        devices = [str(i) for i in range(n)]
        one = (DEMO, [], {"THEANO_FLAGS": "device=cuda0"})
    if n == 1:
        return [one]
    return [(DEMO, devices + ["--exchange", "xla"], {}),
            ("the demo, peer to peer", devices + ["--exchange", "p2p"], {})]


def measure(args, tiles, tmp):
    figures, checks = [], {}
    for n in args.workers:
        visible = ",".join(str(i) for i in range(n))
        jax_env = ({"JAX_PLATFORMS": "cpu",
                    "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
                   if args.cpu else {"CUDA_VISIBLE_DEVICES": visible})
        for f in reference("jax", [], jax_env, JAX, args.batches, args.steps,
                           tiles(n * max(args.batches))[0]):
            figures.append(dict(f, workers=n))
        for batch in args.batches:
            for system, cmd, env in runs_for(n, args.cpu):
                figures.append(dict(demo(system, cmd, batch, n, args.steps, tiles, tmp, env),
                                    workers=n))
        if n > 1:  # identical replicas: every step's weights compared across all workers
            check = runs_for(n, args.cpu)[0][1] + ["--check"]
            s = demo(f"--check, {n} workers", check, args.batches[0], n, 1, tiles, tmp)
            checks[n] = s["max_replica_diff"]
    return figures, checks


def efficiency(figures):
    """N-worker samples/s over N times the same system's one-worker figure."""
    one = {(f["system"], f["batch"]): f["samples_per_s"] for f in figures if f["workers"] == 1}
    for f in figures:
        base = one.get((f["system"], f["batch"])) or one.get((DEMO, f["batch"]))
        f["efficiency"] = f["samples_per_s"] / (f["workers"] * base) if base else None
    return figures


def table(document):
    """The Markdown table of a scaling.json: samples/s and efficiency by workers."""
    counts = document["workers"]
    lines = [f"{measured_by(document)}; samples/s "
             "(scaling efficiency); largest weight difference between replicas under "
             "`--check`: " + ", ".join(f"{diff} with {n} workers" for n, diff in
                                       document["max_replica_diff"].items()) + ".", "",
             "| system | batch per worker | " + " | ".join(
                 f"{n} worker{'s' if n > 1 else ''}" for n in counts) + " |",
             "| --- | --- |" + " --- |" * len(counts)]
    by = {(f["system"], f["batch"], f["workers"]): f for f in document["figures"]}
    unit = rate_unit(document["figures"])
    for system, batch in dict.fromkeys((f["system"], f["batch"]) for f in document["figures"]):
        cells = [by.get((system, batch, n)) for n in counts]
        lines.append(f"| {system} | {batch} | " + " | ".join(
            f"{rate(f['samples_per_s'], unit)} ({f['efficiency']:.2f})" if f else ""
            for f in cells) + " |")
    return "\n".join(lines)


def plot(figures, path):
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for (system, batch) in dict.fromkeys((f["system"], f["batch"]) for f in figures):
        points = sorted((f["workers"], f["samples_per_s"] / 1e6) for f in figures
                        if (f["system"], f["batch"]) == (system, batch))
        ax.plot(*zip(*points), marker="o", label=f"{system}, {batch} per worker")
    ax.set_xlabel("workers (GPUs)")
    ax.set_ylabel("million samples / s")
    ax.set_xticks(sorted({f["workers"] for f in figures}))
    ax.set_title("784-500-10 MLP, float32, data parallel")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = Parser(about=__doc__)
    parser.add_argument("--dataset", default=datasets.SHIPPED,
                        help="a data set to tile (default: the shipped digits)")
    parser.add_argument("--cpu", action="store_true", help="1 to 3 CPU workers (CI)")
    parser.add_argument("--batches", type=int, nargs="+", default=[5000, 20000],
                        help="per worker (default: 5000 20000)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps, at least")
    parser.add_argument("--epoch-steps", type=int, default=100,
                        help="steps per epoch, at least: the training set is tiled to give "
                             "them, as in compare.py (default: %(default)s)")
    parser.add_argument("--workers", type=cli.positive_int, nargs="+", default=[1, 2, 3, 4],
                        help="--cpu: the worker counts (default: %(default)s)")
    parser.add_argument("--out", default=OUT, help="folder for scaling.json and .png")
    args = parse_args(parser, table)
    if args.cpu:
        args.batches, args.epoch_steps, args.steps = [100], 1, 12
    else:
        gpus = gpu_count()
        args.workers = [n for n in (1, 2, 4, 8) if n <= gpus]
        if not args.workers:
            parser.error("no GPU here (nvidia-smi lists none); --cpu runs CPU workers")
    name = "scaling_cpu" if args.cpu else "scaling"
    with tempfile.TemporaryDirectory() as tmp:
        figures, checks = measure(args, Tiles(args.dataset, tmp, args.epoch_steps), tmp)
    path = record(name, args.out, cpu=args.cpu, workers=args.workers, batches=args.batches,
                  dataset=args.dataset, epoch_steps=args.epoch_steps, min_steps=args.steps,
                  max_replica_diff=checks, figures=efficiency(figures))
    plot(figures, os.path.join(args.out, f"{name}.png"))
    show(path, table)


if __name__ == "__main__":
    main()
