"""What --trace costs the steps it traces.

    python -m bench.trace_cost [--devices cpu cpu] [--epochs 6] [--rounds 3]

The same run of ``dual_mlp.py``, with and without ``--trace`` (the window
every step from the second epoch on), in turn for ``--rounds`` rounds; from
each run's own learning curve (``--json``: the training seconds after each
epoch), the time per step of epochs 2 on.  Each figure is the median over
the rounds, and the ratio is traced over untraced.  Writes
``trace_cost_cpu.json`` (or ``trace_cost.json`` on GPUs) into ``--out``.
"""
import os
import statistics
import sys
import tempfile

from bench.common import OUT, measured_by, parse_args, record, show
from bench.compare import summary_of
from multi_gpu import cli
from multi_gpu.cli import Parser


def later_epochs_us(summary):
    """Microseconds per step over every epoch after the first (its curve)."""
    curve, steps = summary["curve"], summary["steps_per_epoch"]
    return 1e6 * (curve[-1]["train_s"] - curve[0]["train_s"]) / (steps * (len(curve) - 1))


def table(document):
    lines = [f"{measured_by(document)} ({' '.join(document['devices'])}, batch "
             f"{document['batch']} per worker, {document['epochs']} epochs): us per step of "
             f"epochs 2 to {document['epochs']}, the median of {document['rounds']} rounds in "
             "turn.", "", "| ordering | without --trace | with --trace | traced over untraced |",
             "| --- | --- | --- | --- |"]
    for f in document["figures"]:
        lines.append(f"| {f['ordering']} | {f['untraced_us']:.0f} | {f['traced_us']:.0f} | "
                     f"{f['ratio']:.3f}x |")
    return "\n".join(lines)


def main():
    parser = Parser(about=__doc__)
    parser.add_argument("--devices", nargs="+", default=["cpu", "cpu"],
                        help="dual_mlp.py's devices (default: %(default)s)")
    parser.add_argument("--orderings", nargs="+", default=None,
                        help="e.g. host gpu xla (default: host, and gpu on GPUs)")
    parser.add_argument("--dataset", help="the data set (default: the shipped digits)")
    parser.add_argument("--batch", type=cli.positive_int, default=100,
                        help="minibatch per worker (default: %(default)s)")
    parser.add_argument("--epochs", type=cli.positive_int, default=6,
                        help="epochs of each run, the first not counted (default: %(default)s)")
    parser.add_argument("--rounds", type=cli.positive_int, default=3,
                        help="runs of each, with and without --trace in turn (default: "
                             "%(default)s)")
    parser.add_argument("--out", default=OUT, help="folder for the JSON")
    parser.set_defaults(cpu=True)  # asks for no GPU check: the devices say where it runs
    args = parse_args(parser, table)
    if args.epochs < 2:
        parser.error("--epochs: at least 2 (a run's first epoch is not counted)")
    gpus = args.devices[0] != "cpu"
    orderings = args.orderings or (["host", "gpu"] if gpus else ["host"])
    how = {"host": ["--sync", "host"], "gpu": ["--sync", "gpu"], "xla": ["--exchange", "xla"]}
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        for ordering in orderings:
            common = [*args.devices, *how[ordering], "--batch-size", str(args.batch),
                      "--epochs", str(args.epochs)] + (["--dataset", args.dataset]
                                                       if args.dataset else [])
            times = {"untraced": [], "traced": []}
            for _ in range(args.rounds):
                times["untraced"].append(later_epochs_us(summary_of(common, 2, tmp)))
                trace = ["--trace", os.path.join(tmp, "t.json"), "--trace-steps", "1000000"]
                times["traced"].append(later_epochs_us(summary_of(common + trace, 2, tmp)))
            un, tr = (statistics.median(times[k]) for k in ("untraced", "traced"))
            figures.append(dict(ordering=f"--sync {ordering}" if ordering != "xla" else
                                "--exchange xla", untraced_us=un, traced_us=tr, ratio=tr / un,
                                rounds_us=times))
            print(f"  {ordering}: {un:.0f} us a step untraced, {tr:.0f} traced ({tr / un:.3f}x)",
                  flush=True)
    path = record("trace_cost" if gpus else "trace_cost_cpu", args.out, cpu=not gpus,
                  block="trace_cost.py" if gpus else "trace_cost.py --cpu",
                  devices=args.devices, batch=args.batch,
                  epochs=args.epochs, rounds=args.rounds, figures=figures)
    show(path, table)


if __name__ == "__main__":
    sys.exit(main())
