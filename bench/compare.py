"""Where the demo stands: the same model on every system, in one run.

    python -m bench.compare --dataset /usr/share/datasets/fashion-mnist   # two GPUs: ~7 min
    python -m bench.compare --cpu                                          # a small CPU subset

Samples/s and microseconds per step of the demo's model (784-500-10 tanh,
softmax NLL, L2 1e-4, SGD, float32 at full precision, data on the device)
at 500, 5000 and 20000 examples per GPU per step, for:

* the project's own model on one GPU: ``THEANO_FLAGS=device=cuda0 python mlp.py``;
* ``dual_mlp.py 0 1`` with each exchange: GPU-ordered (``--sync gpu``),
  host-ordered (``--sync host``, under each ``--avg`` at 5000), ``--exchange
  xla``; and ``0 0`` (both workers on one GPU) at 5000;
* PyTorch eager on one GPU and DistributedDataParallel on two, each also at
  its best, the whole step captured as a CUDA graph, and ``torch.compile`` on
  one where it runs (where it does not, the JSON says why);
* JAX's own data parallelism: one ``jit`` over a mesh of both GPUs, one step
  per call and ``STEPS_PER_CALL`` (the demo's default);
* the best one-GPU program: the demo's own compiled step, K steps per call.

Every ratio is taken in this one run: the demo against one GPU, against
JAX's mesh, and against the best reference at that batch size.

The demo's runs report their own throughput (``--json``); the references
are timed by ``bench/references.py``.  The demo validates after every epoch,
as the tutorial does, and there the host waits for the device: the device
then idles while the host queues the next epoch's first step.  The
references validate nothing, so to time the same thing, the training set is
tiled (validation and test stay as they are) until every run has at least
``--epoch-steps`` steps per epoch at its batch size (at the largest batch,
as many as 32 copies of the training set give), where that idle time
hardly shows.  Every run is warmed up and timed over at least ``--steps``
steps.  A run that fails, or GPUs that another process is using, stop the
benchmark with an error: no figures from a failed or a shared run.

Writes ``compare.json`` (command, date, machine, versions, every figure) and
``compare.png`` into ``--out`` (with ``--out bench/results``, the committed
results, the tables of README.md and bench/README.md are regenerated from
that JSON too; ``--tables-from JSON`` does only that, from a results file).
"""
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.common import (
    OUT,
    ROOT,
    SCRIPT,
    duration,
    measured_by,
    parse_args,
    pyplot,
    rate,
    rate_unit,
    record,
    refuse_busy_gpus,
    show,
)
from dual_mlp import STEPS_PER_CALL
from multi_gpu import datasets
from multi_gpu.cli import Parser

BATCHES = (500, 5000, 20000)
CPU_BATCHES = (100, 500, 5000)
K = ["--steps-per-call", str(STEPS_PER_CALL)]
ONE_GPU = {"CUDA_VISIBLE_DEVICES": "0"}
# (system of references.py, its options, environment, label)
REFERENCES = (("torch", [], None, "PyTorch eager, one GPU"),
              ("torch-graph", [], None, "PyTorch CUDA graph, one GPU"),
              ("ddp", [], None, "PyTorch DDP, two GPUs"),
              ("ddp-graph", [], None, "PyTorch DDP CUDA graph, two GPUs"),
              ("jax", [], None, "JAX jit over a 2-GPU mesh"),
              ("jax", K, None, f"JAX jit over a 2-GPU mesh, {STEPS_PER_CALL} steps per call"),
              ("pytensor", K, ONE_GPU, f"one GPU, the demo's step, {STEPS_PER_CALL} per call"),
              ("torch-compile", [], None, "PyTorch torch.compile, one GPU"))
OPTIONAL = {"torch-compile"}  # measured where it runs; where it does not, the run says why


def tile(splits, folder, repeat):
    """A data set whose training part is ``splits``' (as ``datasets.read``
    returns them), ``repeat`` times over: unpacked IDX files (quick to write
    and read), or, where the validation split is not IDX's last 10,000
    images (the shipped digits), a pickle."""
    (tx, ty), valid, test = splits
    if len(valid[0]) != datasets.N_VALID:
        path = os.path.join(folder, "tiled.pkl.gz")
        datasets.write_pickle(((np.concatenate([tx] * repeat), np.concatenate([ty] * repeat)),
                               valid, test), path, compresslevel=1)
        return path, len(tx) * repeat
    as_bytes = lambda x: np.rint(x * 255).astype(np.uint8).reshape(-1, 28, 28)  # noqa: E731
    images = np.concatenate([as_bytes(tx)] * repeat + [as_bytes(valid[0])])
    labels = np.concatenate([ty] * repeat + [valid[1]])
    names = [f[:-3] for f in datasets.IDX_FILES]
    for name, array in zip(names, (images, labels, as_bytes(test[0]), test[1])):
        datasets.write_idx(os.path.join(folder, name), array)
    return folder, len(tx) * repeat


# Each worker holds the whole training set: 32 x 50,000 images are 5 GB of float32
MAX_REPEAT = 32


class Tiles:
    """``tiles(global_batch) -> (data set, training images)``: the training
    set tiled often enough for ``epoch_steps`` steps of ``global_batch``
    images per epoch, at most ``max_repeat`` times, each tiling written once."""

    def __init__(self, dataset, folder, epoch_steps, max_repeat=MAX_REPEAT):
        self.splits, self.folder, self.epoch_steps = datasets.read(dataset), folder, epoch_steps
        self.n_base, self.max_repeat = len(self.splits[0][0]), max_repeat
        self.made = {}

    def __call__(self, global_batch):
        repeat = min(self.max_repeat,
                     max(1, math.ceil(self.epoch_steps * global_batch / self.n_base)))
        if repeat not in self.made:
            folder = os.path.join(self.folder, f"x{repeat}")
            os.makedirs(folder)
            self.made[repeat] = tile(self.splits, folder, repeat)
        return self.made[repeat]


class Failed(Exception):
    """An optional system that did not run here; the message says why."""


def run(cmd, env=None, optional=False):
    """Run a command to completion; its failure stops the benchmark, or, for
    an ``optional`` one, raises Failed with the last line of its error output."""
    refuse_busy_gpus()
    print("$", shlex.join(cmd), flush=True)
    started = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, **(env or {})))
    out.wall_s = time.perf_counter() - started  # start-up and compile included
    if out.returncode != 0:
        if optional:  # the line that says why: a fatal log line, an exception, else the last
            lines = out.stderr.strip().splitlines() or ["no error output"]
            said = [line for line in lines if re.match(r"(F\d{4} |\w*(Error|Exception)\b)",
                                                       line.strip())]
            raise Failed((said or lines)[-1].strip()[:300])
        sys.exit(f"{SCRIPT}: error: {shlex.join(cmd)} failed (exit {out.returncode}):\n"
                 f"{out.stderr[-3000:]}")
    return out


def epochs_for(steps, steps_per_epoch):
    return max(1, math.ceil(steps / steps_per_epoch))


def summary_of(args, workers, tmp, env=None):
    """Run dual_mlp.py (or mlp.py, for one worker) with ``args`` to completion
    and return its --json summary, with the run's wall time as ``wall_s``."""
    path = os.path.join(tmp, "run.json")
    script = "mlp.py" if workers == 1 else "dual_mlp.py"
    out = run([sys.executable, script, *args, "--json", path], env)
    with open(path) as f:
        return dict(json.load(f), wall_s=out.wall_s)


def demo(name, args, batch, workers, steps, tiles, tmp, env=None):
    """One dual_mlp.py or mlp.py run; its own --json summary has the figures."""
    data, n_train = tiles(batch * workers)
    epochs = epochs_for(steps, n_train // batch // workers)
    s = summary_of([*args, "--dataset", data, "--batch-size", str(batch), "--epochs",
                    str(epochs)], workers, tmp, env)
    us = s["step_us"]["step"]
    figure = dict(system=name, batch=batch, gpus=workers, samples_per_s=s["samples_per_s"],
                  step_us=us, steps=s["epochs_run"] * s["steps_per_epoch"],
                  steps_per_epoch=s["steps_per_epoch"], wall_s=s["wall_s"],
                  validation_error=s["validation_errors"][-1])
    # how often XLA ran the exchange's Python callback; the host's time per step call
    figure.update({k: s[k] for k in ("exchange_callbacks", "host_us_per_call", "host_us_per_step",
                                     "steps_per_call", "exchange_steps", "max_replica_diff")
                   if k in s})
    if "train" in s["step_us"]:  # the host-ordered loop times its phases
        phases = s["step_us"]
        figure.update(train_us=phases["train"], waiting_us=phases["waiting"],
                      exchange_us=sum(phases[k] for k in ("publish", "signal", "copy",
                                                           "average")))
    print(f"  {name:28s} B={batch:6d}: {figure['samples_per_s'] / 1e6:8.2f} M samples/s "
          f"{us:8.0f} us/step  ({s['wall_s']:.0f} s to run)", flush=True)
    return figure


def reference(system, options, env, label, batches, steps, data, optional=None):
    """A reference system at every batch size, cycling through ``data``
    (it validates nothing, so no tiling changes its figures)."""
    out = run([sys.executable, "-m", "bench.references", system, *options, "--dataset", data,
               "--batches", *map(str, batches), "--steps", str(steps)], env,
              optional=system in OPTIONAL if optional is None else optional)
    rates = json.loads(out.stdout.strip().splitlines()[-1])
    figures = []
    for batch in batches:
        r = rates[str(batch)]
        figures.append(dict(system=label, batch=batch, gpus=r["gpus"], steps=steps,
                            samples_per_s=r["samples_per_s"], step_us=r["step_us"],
                            wall_s=out.wall_s))
        print(f"  {label:28s} B={batch:6d}: {r['samples_per_s'] / 1e6:8.2f} M samples/s "
              f"{r['step_us']:8.0f} us/step", flush=True)
    return figures


def gpu_demo_runs(batch):
    """The demo's runs at ``batch`` on GPUs: (name, its devices and options,
    workers, environment)."""
    runs = [("one GPU (mlp.py)", [], 1, {"THEANO_FLAGS": "device=cuda0"}),
            ("demo 0 1 --sync gpu", ["0", "1", "--sync", "gpu"], 2, None),
            ("demo 0 1 --exchange xla", ["0", "1", "--exchange", "xla"], 2, None),
            ("demo 0 1 --sync host", ["0", "1", "--sync", "host"], 2, None)]
    if batch == 5000:  # the 2014 demo's batch: every way of averaging, and one GPU shared
        runs += [(f"demo 0 1 --sync host --avg {avg}", ["0", "1", "--sync", "host", "--avg",
                                                        avg], 2, None)
                 for avg in ("pycuda", "cpu")]
        runs += [("demo 0 0 (one GPU, two workers)", ["0", "0"], 2, None)]
    return runs


def gpu_runs(args, tiles, tmp, figures):
    """Every system at every batch size, on GPUs 0 and 1: the references
    first, then the demo at 5000, 20000 and 500 per GPU, then the optional
    references (slow to compile), so that a run cut short still holds the
    comparisons that matter most."""
    def add_reference(system, options, env, label):
        try:
            for figure in reference(system, options, env, label, args.batches, args.steps,
                                    tiles(2 * max(args.batches))[0]):
                figures.add(figure)
        except Failed as e:
            print(f"  {label}: did not run here: {e}", flush=True)
            figures.meta.setdefault("not_run", {})[label] = str(e)

    for system, *how in REFERENCES:
        if system not in OPTIONAL:
            add_reference(system, *how)
    for batch in sorted(args.batches, key=lambda b: (b != 5000, -b)):
        for name, cmd, workers, env in gpu_demo_runs(batch):
            figures.add(demo(name, cmd, batch, workers, args.steps, tiles, tmp, env))
    for system, *how in REFERENCES:
        if system in OPTIONAL:
            add_reference(system, *how)


ONE_PROCESS = "one process (mlp.py), twice the batch"
CPU_REFERENCES = (("torch", "PyTorch, one process on every core, twice the batch", 2, {}),
                  ("ddp", "PyTorch DDP over gloo, two processes", 1, {}),
                  ("jax", "JAX jit over two CPU devices, one process", 1,
                   {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}))


def cpu_runs(args, tiles, tmp, figures):
    """Two CPU workers beside what a CPU user would pick, on the same cores
    (this process's, which every run inherits): the tutorial's one process
    and PyTorch on all of them at twice the batch (the same examples a
    step), PyTorch's DDP over gloo (two processes, a core each), JAX's own
    data parallelism over two CPU devices in one process; the demo averaging
    every step, every fourth (local SGD), and through XLA (gloo).  Then the
    floor: one copy of the weights and one averaging pass, on one core."""
    for batch in args.batches:
        one = demo(ONE_PROCESS, [], 2 * batch, 1, args.steps, tiles, tmp)
        figures.add(dict(one, batch=batch))  # a row per examples a step: batch per worker
        for name, more in (("demo cpu cpu", []), ("demo cpu cpu --average-every 4",
                                                  ["--average-every", "4"]),
                           ("demo cpu cpu --exchange xla", ["--exchange", "xla"])):
            figures.add(demo(name, ["cpu", "cpu", *more], batch, 2, args.steps, tiles, tmp))
    for system, label, times, env in CPU_REFERENCES:
        for batch in args.batches:  # one run each: a batch where it fails keeps the others
            try:
                found = reference(system, ["--cpu"], dict(env, JAX_PLATFORMS="cpu"), label,
                                  [times * batch], args.steps, tiles(2 * batch)[0],
                                  optional=True)
            except Failed as e:
                print(f"  {label} @ {batch}: did not run here: {e}", flush=True)
                figures.meta.setdefault("not_run", {})[f"{label} @ {batch}"] = str(e)[:300]
                continue
            for figure in found:
                figures.add(dict(figure, batch=batch))
    figures.meta["floor"] = floor()
    figures.write(complete=False)


FLOOR = """
import os, sys, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import numpy as np, jax
n = int(sys.argv[1])
a, b, c = (np.random.rand(n).astype(np.float32) for _ in range(3))
mean = jax.jit(lambda x, y: (x + y) / 2)
x, y = jax.device_put(a), jax.device_put(b)
def us(f, r=300):
    f()
    t = time.perf_counter()
    for _ in range(r):
        f()
    return (time.perf_counter() - t) / r * 1e6
print(us(lambda: np.copyto(c, a)), us(lambda: mean(x, y).block_until_ready()))
"""


def floor():
    """What moving and averaging the weights costs at the least, on one core
    (one thread): one copy of them (NumPy) and one pass that reads two copies
    and writes their mean (XLA, fused): the exchange's floor."""
    import mlp
    n = sum(int(np.prod(s)) for s in mlp.parameter_shapes(784, 500, 10))
    out = run([sys.executable, "-c", FLOOR, str(n)],
              dict(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_cpu_multi_thread_eigen=false"))
    copy_us, average_us = map(float, out.stdout.split())
    print(f"  the floor: a copy of the weights {copy_us:.0f} us, an averaging pass "
          f"{average_us:.0f} us (one core)", flush=True)
    return dict(copy_us=copy_us, average_us=average_us, us=copy_us + average_us, values=n)


class Figures(list):
    """The figures so far, written out after each one: a run cut short (by a
    time limit) keeps what it measured, marked ``complete: false``."""

    def __init__(self, name, out, **meta):
        super().__init__()
        self.name, self.out, self.meta = name, out, meta

    def add(self, figure):
        self.append(figure)
        return self.write(complete=False)

    def write(self, complete):
        return record(self.name, self.out, complete=complete, **self.meta, figures=list(self),
                      ratios=ratios(self))


def ratios(figures):
    """The comparisons the issues ask about, per batch size: the demo over the
    tutorial's one GPU, over JAX's mesh, and over the fastest reference."""
    by = {(f["system"], f["batch"]): f["samples_per_s"] for f in figures}
    references = {label for *_, label in REFERENCES}
    out = {}
    for batch in sorted({f["batch"] for f in figures}):
        one, jax = by.get(("one GPU (mlp.py)", batch)), by.get(("JAX jit over a 2-GPU mesh", batch))
        best = max(((v, s) for (s, b), v in by.items() if b == batch and s in references),
                   default=None)
        for system in ("demo 0 1 --sync gpu", "demo 0 1 --exchange xla"):
            mine = by.get((system, batch))
            if mine and one and jax and best:
                out[f"{system} @ {batch}"] = dict(over_one_gpu=mine / one, over_jax_mesh=mine / jax,
                                                  over_best_reference=mine / best[0],
                                                  best_reference=best[1])
    return out


def systems(figures):
    """The systems measured, the project's first and the references last."""
    references = {label for *_, label in REFERENCES}
    names = list(dict.fromkeys(f["system"] for f in figures))
    return [n for n in names if n not in references] + [n for n in names if n in references]


def plot(figures, path):
    plt = pyplot()
    if plt is None:
        return
    names = systems(figures)
    batches = sorted({f["batch"] for f in figures})
    by = {(f["system"], f["batch"]): f["samples_per_s"] / 1e6 for f in figures}
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(names)
    for i, system in enumerate(names):
        xs = [j + i * width for j, b in enumerate(batches) if (system, b) in by]
        ys = [by[(system, b)] for b in batches if (system, b) in by]
        ax.bar(xs, ys, width, label=system)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))])
    ax.set_xticklabels([f"{b} per GPU" for b in batches])
    ax.set_ylabel("million samples / s")
    ax.set_title("784-500-10 MLP, float32, one SGD step per minibatch")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(document):
    """The Markdown table of a compare.json."""
    figures = document["figures"]
    batches = sorted({f["batch"] for f in figures})
    by = {(f["system"], f["batch"]): f for f in figures}
    cpu, unit = document.get("cpu", False), rate_unit(figures)
    each = "worker" if cpu else "GPU"
    lines = [f"{measured_by(document)} "
             f"({document['device']}); samples/s (time per step).", "",
             f"| system | {'processes' if cpu else 'GPUs'} | "
             + " | ".join(f"batch {b} per {each}" for b in batches) + " |",
             "| --- | --- | " + " | ".join("---" for _ in batches) + " |"]
    for system in systems(figures):
        cells = [f"{rate(by[system, b]['samples_per_s'], unit)} "
                 f"({duration(by[system, b]['step_us'])})"
                 if (system, b) in by else "" for b in batches]
        gpus = next(f["gpus"] for f in figures if f["system"] == system)
        lines.append(f"| {system} | {gpus} | " + " | ".join(cells) + " |")
    for name, why in document.get("not_run", {}).items():
        lines.append(f"\n{name}: did not run here ({why})")
    for name, r in document.get("ratios", {}).items():
        system, batch = name.split(" @ ")
        figure = by[system, int(batch)]
        host = figure.get("host_us_per_step", figure.get("host_us_per_call"))
        bound = "" if host is None else (
            f"; the host spends {host:.0f} us of the {figure['step_us']:.0f} us step queueing it")
        best = "" if "best_reference" not in r else (
            f", {r['over_best_reference']:.3f}x the fastest reference ({r['best_reference']})")
        lines.append(f"\n{name}: {r['over_one_gpu']:.2f}x one GPU, {r['over_jax_mesh']:.3f}x "
                     f"JAX's own data parallelism{best}{bound}")
    if cpu:
        lines += cpu_lines(document, by)
    return "\n".join(lines)


def cpu_lines(document, by):
    """Under the CPU table: the cores and the load, and the demo's exchange
    against the floor and against its own training, at each batch."""
    floor = document.get("floor")
    lines = [f"\nEvery system on cores {', '.join(map(str, document['cores']))} (load average "
             f"{document['load'][0]:.2f} as the run began)."]
    if floor:
        lines.append(f"\nThe floor, on one core: a copy of the weights {floor['copy_us']:.0f} us "
                     f"and an averaging pass {floor['average_us']:.0f} us, {floor['us']:.0f} us.")
    for batch in sorted({b for _, b in by}):
        f = by.get(("demo cpu cpu", batch))
        if f and "exchange_us" in f and floor:
            lines.append(f"\ndemo cpu cpu @ {batch}: exchange (publish, signals, copy, average) "
                         f"{f['exchange_us']:.0f} us a step, {f['exchange_us'] / floor['us']:.2f}x "
                         f"the floor and {f['exchange_us'] / f['train_us']:.2f}x its train phase "
                         f"({f['train_us']:.0f} us; {f['waiting_us']:.0f} us more waiting for a "
                         "later worker)")
    return lines


def main():
    parser = Parser(about=__doc__)
    parser.add_argument("--dataset", default=datasets.SHIPPED,
                        help="a data set to tile (default: the shipped digits)")
    parser.add_argument("--cpu", action="store_true", help="the small CPU subset (CI)")
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES, help="per GPU")
    parser.add_argument("--steps", type=int, default=200, help="timed steps, at least")
    parser.add_argument("--epoch-steps", type=int, default=100,
                        help="steps per epoch, at least: the training set is tiled to give "
                             f"them, at most {MAX_REPEAT} times over (default: %(default)s)")
    parser.add_argument("--out", default=OUT, help="folder for compare.json and .png")
    args = parse_args(parser, table)
    if args.cpu:
        os.sched_setaffinity(0, os.sched_getaffinity(0))  # every run on these cores, said below
        args.batches = args.batches if args.batches != BATCHES else CPU_BATCHES
        args.epoch_steps, args.steps = min(args.epoch_steps, 10), min(args.steps, 60)
    versions = {}
    for module in ("numpy", "pytensor", "jax", "torch", "zmq", "pycuda"):
        try:
            versions[module] = __import__(module).__version__
        except (ImportError, AttributeError):
            pass
    name = "compare_cpu" if args.cpu else "compare"
    figures = Figures(name, args.out, device=device_name(args.cpu), cpu=args.cpu,
                      dataset=args.dataset, cores=sorted(os.sched_getaffinity(0)),
                      load=os.getloadavg(),
                      epoch_steps=args.epoch_steps, min_steps=args.steps, versions=versions)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            tiles = Tiles(args.dataset, tmp, args.epoch_steps)
        except datasets.DatasetError as e:
            sys.exit(f"{SCRIPT}: error: {e}")
        (cpu_runs if args.cpu else gpu_runs)(args, tiles, tmp, figures)
    path = figures.write(complete=True)
    plot(figures, os.path.join(args.out, f"{name}.png"))
    show(path, table)


def device_name(cpu):
    if cpu:
        import platform
        return platform.processor() or platform.machine()
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True)
    names = out.stdout.split("\n")[:2] if out.returncode == 0 else ["?"]
    return " + ".join(n.strip() for n in names if n.strip())


if __name__ == "__main__":
    main()
