"""Where one training step's device time goes: PyTensor's step beside the hand-written JAX step.

    python -m bench.step_profile --dataset /usr/share/datasets/fashion-mnist   # GPU 0
    python -m bench.step_profile --cpu                                          # CI's subset

On one device, the same model and batch (default 20000): the training step
that PyTensor's JAX backend builds from the tutorial's graph (as the demo
runs it: jitted, weights donated, the minibatch index kept on the device,
``--steps-per-call`` steps a program),
the hand-written JAX step of ``bench.references``, and on a GPU the
demo's GPU-ordered step with its exchange in loopback (``bench.step_cost``):
where the exchange's time goes, kernel by kernel.  Each is timed as
``references.py`` times its systems (``references.step_us``), then 50
steps of each are profiled (``jax.profiler``) and the device's time per
step summed by kernel.  Writes ``step_profile.json`` (command, date,
machine, both timings, the kernels of each).
"""
import collections
import glob
import os
import tempfile

from bench.common import OUT, keep_temporaries_here, one_device, record, require_gpus
from multi_gpu import datasets
from multi_gpu.cli import Parser

PROFILED = 50


def kernels(run, synchronize, cpu):
    """Device time per step by kernel name, from a profile of PROFILED steps
    (on a CPU: XLA's own threads, where its kernels run)."""
    import jax
    from jax.profiler import ProfileData
    with tempfile.TemporaryDirectory() as folder:
        synchronize()
        with jax.profiler.trace(folder):
            run(PROFILED)
            synchronize()
        (path,) = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
        profile = ProfileData.from_file(path)
    per_step = collections.Counter()
    for plane in profile.planes:
        for line in plane.lines:
            if (line.name.startswith("tf_XLA") if cpu else
                    plane.name.startswith("/device:GPU") and line.name.startswith("Stream")):
                for event in line.events:
                    if not event.name.startswith(("ThunkExecutor", "SlinkyThreadPool")):
                        per_step[event.name] += event.duration_ns / 1e3 / PROFILED
    return [dict(kernel=k, us_per_step=v) for k, v in per_step.most_common() if v > 0]


def main():
    parser = Parser(about=__doc__)
    parser.add_argument("--dataset", default=datasets.SHIPPED,
                        help="training data (default: the shipped digits)")
    parser.add_argument("--batch", type=int, default=20000, help="examples per step")
    parser.add_argument("--steps", type=int, default=300, help="timed steps")
    parser.add_argument("--steps-per-call", type=int, default=1, metavar="K",
                        help="steps in one compiled program, as dual_mlp.py --steps-per-call "
                             "(default 1)")
    parser.add_argument("--cpu", action="store_true", help="on the CPU, batch 500 (CI)")
    parser.add_argument("--out", default=OUT, help="folder for step_profile.json")
    args = parser.parse_args()
    keep_temporaries_here()
    if not args.cpu:
        require_gpus()
    if args.cpu:
        args.batch, args.steps = 500, min(args.steps, 20)
    device = one_device(args.cpu)
    import mlp
    from bench import references, step_cost
    from logistic_sgd import load_data

    k = args.steps_per_call
    ours = references.pytensor_trainer(args.dataset, args.batch, references.DEFAULTS, k)
    (x, y), _, _ = datasets.read(args.dataset)
    reference = references.jax_trainer(x, y, args.batch, references.DEFAULTS)  # on this device
    systems = {"PyTensor's step (the demo's)": (ours.run_steps, ours.synchronize),
               "hand-written JAX step": (reference.run_steps, reference.synchronize)}
    if not args.cpu:
        model = mlp.Model(load_data(args.dataset, put=device.put), args.batch, mode="JAX")
        calls, _, _, trainer = step_cost.gpu_ordered_step(model, device, k, cpu=False)
        systems["GPU-ordered step, loopback (the demo's)"] = (lambda n: calls(-(-n // k)),
                                                                lambda: None)
    results = {}
    for name, (run, synchronize) in systems.items():
        us = references.step_us(run, synchronize, args.steps)
        results[name] = dict(step_us=us, kernels=kernels(run, synchronize, args.cpu))
        print(f"{name:30s} {us:8.1f} us/step; device time by kernel:")
        for kernel in results[name]["kernels"][:8]:
            print(f"    {kernel['us_per_step']:8.1f} us  {kernel['kernel'][:90]}")
    if not args.cpu:
        trainer.exchange.close()
    device.close()
    record("step_profile_cpu" if args.cpu else "step_profile", args.out, batch=args.batch,
           steps=args.steps, steps_per_call=k, device=device.description, systems=results)


if __name__ == "__main__":
    main()
