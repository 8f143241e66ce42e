"""Where a training step's time goes on one GPU: the host's calls, or the GPU.

    python -m bench.host_time --dataset DIR [--batch-size 5000] [--steps 300]

The same PyTensor-compiled step of the demo's model, called four ways, each
timed over ``--steps`` steps after a warm-up:

* ``pytensor``: ``model.train_model(i)``, PyTensor's Function (as mlp.py does);
* ``jit_fn``: the jitted callable PyTensor built, called directly;
* ``compiled``: that callable inside one ahead-of-time compiled JAX program
  with the weights donated (as dual_mlp.py's GPU-ordered and xla steps);
* each once more with the host waiting for the GPU after every step, which
  leaves the GPU's own time per step plus the wait.

The host's time per call (the host clock around the call alone) next to the
time per step (a sync at both ends) says which of the two bounds the loop.
Also prints the profile of PyTensor's call path.  Writes host_time.json.
"""
import cProfile
import io
import os
import pstats
import time

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")  # one GPU, as a worker sees it

import multi_gpu.flags as flags  # noqa: F401  (first: float32, as the scripts run)

import jax
import numpy as np

import mlp
from bench.common import OUT, keep_temporaries_here, prog, record, require_gpus
from logistic_sgd import load_data
from multi_gpu.cli import Parser
from multi_gpu.devices import JaxDevice, jax_train_step, storage


def measure(call, steps, wait):
    """(us per step, us of host time inside the calls) over ``steps`` calls."""
    for _ in range(20):
        out = call()
    jax.block_until_ready(out)
    inside, start = 0.0, time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        out = call()
        inside += time.perf_counter() - t
        if wait:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    return 1e6 * (time.perf_counter() - start) / steps, 1e6 * inside / steps


def main():
    parser = Parser(prog=prog(), about=__doc__)
    parser.add_argument("--dataset", required=True, help="the data set, e.g. "
                        "/usr/share/datasets/fashion-mnist")
    parser.add_argument("--batch-size", type=int, default=5000,
                        help="minibatch (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=300,
                        help="steps of each way (default: %(default)s)")
    parser.add_argument("--out", default=OUT, help="folder for host_time.json (default: out/, "
                        "which git ignores)")
    args = parser.parse_args()
    keep_temporaries_here()
    require_gpus()
    device = JaxDevice()
    model = mlp.Model(load_data(args.dataset, put=device.put), args.batch_size, mode="JAX")
    model.warm_up(put=device.put)
    n = model.n_train_batches
    f = model.train_model
    train, data = jax_train_step(model)
    indices = [device.put(np.int32(i)) for i in range(n)]
    t = 0

    def pytensor_call():
        nonlocal t
        t += 1
        return f(t % n)

    params = [storage(p) for p in model.params]

    def jit_fn_call():
        nonlocal t, params
        t += 1
        cost, params = train(indices[t % n], data, params)  # PyTensor's jitted callable
        return cost

    program = jax.jit(lambda i, d, p: train(i, d, p), donate_argnums=2).lower(
        indices[0], data, [p.copy() for p in params]).compile()
    state = [p.copy() for p in params]

    def compiled_call():
        nonlocal t, state
        t += 1
        cost, state = program(indices[t % n], data, state)
        return cost

    results = {}
    for name, call in (("pytensor", pytensor_call), ("jit_fn", jit_fn_call),
                       ("compiled", compiled_call)):
        for wait in (False, True):
            step_us, host_us = measure(call, args.steps, wait)
            key = f"{name}{' waiting' if wait else ''}"
            results[key] = dict(step_us=step_us, host_us_per_call=host_us,
                                samples_per_s=1e6 * args.batch_size / step_us)
            print(f"{key:18s} {step_us:8.0f} us/step  {host_us:8.0f} us host time per call  "
                  f"{1e6 * args.batch_size / step_us / 1e6:6.2f} M samples/s", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    measure(pytensor_call, 100, False)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
    print(text.getvalue())
    record("host_time", args.out, dataset=args.dataset, batch_size=args.batch_size,
           steps=args.steps, device=device.description, results=results,
           pytensor_profile=text.getvalue().splitlines()[:40])


if __name__ == "__main__":
    main()
