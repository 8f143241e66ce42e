"""What people use instead, on the same model and data, for bench/compare.py.

    python bench/references.py torch --dataset DIR --batches 500 5000 [--steps 200]
    python bench/references.py ddp   --dataset DIR --batches 500 5000
    python bench/references.py jax   --dataset DIR --batches 500 5000

The model is the demo's: 784-500-10, tanh, softmax negative log-likelihood
plus 1e-4 times the squared L2 norm of the weights, plain SGD, float32 at
full precision (no TF32), the whole training set resident on each GPU.
``torch``: PyTorch eager on one GPU; ``ddp``: DistributedDataParallel, one
process per GPU (NCCL), batch B on each; ``jax``: one jitted step over a
mesh of every GPU, the global batch (B per GPU) sharded, XLA inserting the
all-reduce.  Each batch size is warmed up, then timed over ``--steps``
steps with the device synchronised only at both ends.  Prints one JSON
object: {batch: {"samples_per_s", "step_us", "gpus"}}.
"""
import argparse
import functools
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import datasets  # noqa: E402

N_HIDDEN, LEARNING_RATE, L2, WARM_UP = 500, 0.13, 1e-4, 20


def initial_weights(seed=1234):
    rng = np.random.RandomState(seed)
    bound = np.sqrt(6.0 / (784 + N_HIDDEN))
    return [rng.uniform(-bound, bound, (784, N_HIDDEN)).astype(np.float32),
            np.zeros(N_HIDDEN, np.float32), np.zeros((N_HIDDEN, 10), np.float32),
            np.zeros(10, np.float32)]


def timed(run_steps, synchronize, steps):
    """Seconds for ``steps`` steps after a warm-up, the device synchronised at both ends."""
    run_steps(WARM_UP)
    synchronize()
    start = time.perf_counter()
    run_steps(steps)
    synchronize()
    return time.perf_counter() - start


def torch_rates(x, y, batches, steps, rank=0, world=1):
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    x, y = torch.from_numpy(x).to(device), torch.from_numpy(y).long().to(device)
    rates = {}
    for batch in batches:
        layers = torch.nn.Sequential(torch.nn.Linear(784, N_HIDDEN), torch.nn.Tanh(),
                                     torch.nn.Linear(N_HIDDEN, 10)).to(device)
        model = layers
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(layers, device_ids=[rank])
        weights = [layers[0].weight, layers[2].weight]
        optimiser = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        n_batches, t = len(x) // (batch * world), 0

        def run_steps(n):
            nonlocal t
            for _ in range(n):
                start = (t % n_batches * world + rank) * batch  # rank's part of minibatch t
                xb, yb = x[start:start + batch], y[start:start + batch]
                loss = torch.nn.functional.cross_entropy(model(xb), yb) + \
                    L2 * sum((w ** 2).sum() for w in weights)
                optimiser.zero_grad(set_to_none=True)
                loss.backward()
                optimiser.step()
                t += 1
        seconds = timed(run_steps, torch.cuda.synchronize, steps)
        rates[batch] = dict(samples_per_s=world * batch * steps / seconds,
                            step_us=1e6 * seconds / steps, gpus=world)
    return rates


def ddp_worker(rank, world, port, x, y, batches, steps, queue):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        rates = torch_rates(x, y, batches, steps, rank, world)
        if rank == 0:
            queue.put(rates)
    finally:
        dist.destroy_process_group()


def ddp_rates(x, y, batches, steps):
    import socket

    import torch
    import torch.multiprocessing as mp
    world = torch.cuda.device_count()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.spawn(ddp_worker, args=(world, port, x, y, batches, steps, queue), nprocs=world)
    return queue.get()


def jax_rates(x, y, batches, steps):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    jax.config.update("jax_default_matmul_precision", "highest")
    mesh = Mesh(np.array(jax.devices()), ("gpus",))
    world = len(jax.devices())

    def loss(params, xb, yb):
        w1, b1, w2, b2 = params
        logits = jnp.tanh(xb @ w1 + b1) @ w2 + b2
        nll = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], 1))
        return nll + L2 * (jnp.sum(w1 ** 2) + jnp.sum(w2 ** 2))

    @functools.partial(jax.jit, donate_argnums=0)  # the weights, updated in place
    def step(params, data_x, data_y, t):
        grads = jax.grad(loss)(params, data_x[t], data_y[t])
        return [p - LEARNING_RATE * g for p, g in zip(params, grads)]

    rates = {}
    for batch in batches:
        n_batches = len(x) // (batch * world)
        rows = n_batches * batch * world
        # (step, global batch, ...), the batch axis split over the GPUs
        data_x = jax.device_put(x[:rows].reshape(n_batches, batch * world, 784),
                                NamedSharding(mesh, P(None, "gpus")))
        data_y = jax.device_put(y[:rows].reshape(n_batches, batch * world),
                                NamedSharding(mesh, P(None, "gpus")))
        params = [jax.device_put(w, NamedSharding(mesh, P())) for w in initial_weights()]
        indices = [jnp.int32(t) for t in range(n_batches)]
        t = 0

        def run_steps(n):
            nonlocal params, t
            for _ in range(n):
                params = step(params, data_x, data_y, indices[t % n_batches])
                t += 1
        seconds = timed(run_steps, lambda: jax.block_until_ready(params), steps)
        rates[batch] = dict(samples_per_s=world * batch * steps / seconds,
                            step_us=1e6 * seconds / steps, gpus=world)
    return rates


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("system", choices=("torch", "ddp", "jax"))
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--batches", type=int, nargs="+", required=True, help="per GPU")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    (x, y), _, _ = datasets.read(args.dataset)
    rates = {"torch": torch_rates, "ddp": ddp_rates, "jax": jax_rates}[args.system](
        x, y, args.batches, args.steps)
    print(json.dumps(rates))


if __name__ == "__main__":
    main()
