"""What people use instead, on the same model and data, for bench/compare.py.

    python bench/references.py torch --dataset DIR --batches 500 5000 [--steps 200]
    python bench/references.py ddp   --dataset DIR --batches 500 5000
    python bench/references.py jax   --dataset DIR --batches 500 5000

The model is the demo's: 784-500-10, tanh, softmax negative log-likelihood
plus 1e-4 times the squared L2 norm of the weights, plain SGD, float32 at
full precision (no TF32), the whole training set resident on each GPU.
``torch``: PyTorch eager on one GPU; ``torch-compile``: the same model
through ``torch.compile``; ``ddp``: DistributedDataParallel, one
process per GPU (NCCL), batch B on each; ``jax``: one jitted step over a
mesh of every GPU, the global batch (B per GPU) sharded, XLA inserting the
all-reduce.  Each batch size is warmed up, then timed over ``--steps``
steps with the device synchronised only at both ends.  Prints one JSON
object: {batch: {"samples_per_s", "step_us", "gpus"}}.

With ``--curve`` (for bench/accuracy.py) it trains ``--epochs`` epochs at
the first batch size from the tutorial's initial weights, in the demo's
minibatch order, and prints the learning curve instead.
"""
import argparse
import collections
import functools
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import datasets  # noqa: E402

N_HIDDEN, WARM_UP = 500, 20
# the demo's defaults; --curve takes others
Hyper = collections.namedtuple("Hyper", "learning_rate l2")
DEFAULTS = Hyper(0.13, 1e-4)

# One system ready to train: ``run_steps(n)`` queues n SGD steps, ``synchronize()``
# waits for the device, ``error(x, y)`` is the error rate of the replica on a
# data set, ``reset()`` puts back the initial weights and minibatch order.
Trainer = collections.namedtuple("Trainer", "run_steps synchronize error reset world "
                                            "steps_per_epoch")


def initial_weights(seed=1234):
    """The tutorial's: hidden weights uniform in +-sqrt(6 / (fan in + fan out)), the rest 0."""
    rng = np.random.RandomState(seed)
    bound = np.sqrt(6.0 / (784 + N_HIDDEN))
    return [rng.uniform(-bound, bound, (784, N_HIDDEN)).astype(np.float32),
            np.zeros(N_HIDDEN, np.float32), np.zeros((N_HIDDEN, 10), np.float32),
            np.zeros(10, np.float32)]


def torch_trainer(x, y, batch, hyper, rank=0, world=1, compiled=False):
    """PyTorch eager on GPU ``rank``; wrapped in DistributedDataParallel where
    ``world`` > 1 (the process group already set up); through ``torch.compile``
    where ``compiled``."""
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    x, y = torch.from_numpy(x).to(device), torch.from_numpy(y).long().to(device)
    layers = torch.nn.Sequential(torch.nn.Linear(784, N_HIDDEN), torch.nn.Tanh(),
                                 torch.nn.Linear(N_HIDDEN, 10)).to(device)
    model = layers
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(layers, device_ids=[rank])
    if compiled:
        model = torch.compile(model)
    weights = [layers[0].weight, layers[2].weight]
    optimiser = torch.optim.SGD(model.parameters(), lr=hyper.learning_rate)
    n_batches, t = len(x) // (batch * world), 0

    def reset():
        nonlocal t
        w1, b1, w2, b2 = initial_weights()
        with torch.no_grad():  # torch keeps a layer's weights as (out, in)
            for p, v in zip(layers.parameters(), (w1.T, b1, w2.T, b2)):
                p.copy_(torch.from_numpy(np.ascontiguousarray(v)))
        t = 0

    def run_steps(n):
        nonlocal t
        for _ in range(n):
            start = (t % n_batches * world + rank) * batch  # rank's part of minibatch t
            xb, yb = x[start:start + batch], y[start:start + batch]
            loss = torch.nn.functional.cross_entropy(model(xb), yb) + \
                hyper.l2 * sum((w ** 2).sum() for w in weights)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            t += 1

    @torch.no_grad()
    def error(xs, ys):
        xs, ys = torch.from_numpy(xs).to(device), torch.from_numpy(ys).long().to(device)
        return (layers(xs).argmax(1) != ys).float().mean().item()

    reset()
    return Trainer(run_steps, torch.cuda.synchronize, error, reset, world, n_batches)


def jax_trainer(x, y, batch, hyper):
    """One jitted step over a mesh of every GPU, the global batch sharded."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    jax.config.update("jax_default_matmul_precision", "highest")
    mesh = Mesh(np.array(jax.devices()), ("gpus",))
    world = len(jax.devices())
    replicated = NamedSharding(mesh, P())

    def logits(params, xb):
        w1, b1, w2, b2 = params
        return jnp.tanh(xb @ w1 + b1) @ w2 + b2

    def loss(params, xb, yb):
        nll = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits(params, xb)),
                                            yb[:, None], 1))
        return nll + hyper.l2 * (jnp.sum(params[0] ** 2) + jnp.sum(params[2] ** 2))

    @functools.partial(jax.jit, donate_argnums=0)  # the weights, updated in place
    def step(params, data_x, data_y, t):
        grads = jax.grad(loss)(params, data_x[t], data_y[t])
        return [p - hyper.learning_rate * g for p, g in zip(params, grads)]

    n_batches = len(x) // (batch * world)
    rows = n_batches * batch * world
    # (step, global batch, ...), the batch axis split over the GPUs
    data_x = jax.device_put(x[:rows].reshape(n_batches, batch * world, 784),
                            NamedSharding(mesh, P(None, "gpus")))
    data_y = jax.device_put(y[:rows].reshape(n_batches, batch * world),
                            NamedSharding(mesh, P(None, "gpus")))
    indices = [jnp.int32(t) for t in range(n_batches)]
    errors = jax.jit(lambda params, xs, ys: jnp.mean(jnp.argmax(logits(params, xs), 1) != ys))
    state = {}

    def reset():
        state.update(t=0, params=[jax.device_put(w, replicated) for w in initial_weights()])

    def run_steps(n):
        for _ in range(n):
            state["params"] = step(state["params"], data_x, data_y,
                                   indices[state["t"] % n_batches])
            state["t"] += 1

    def error(xs, ys):
        return float(errors(state["params"], jax.device_put(xs, replicated),
                            jax.device_put(ys, replicated)))

    reset()
    return Trainer(run_steps, lambda: jax.block_until_ready(state["params"]), error, reset,
                   world, n_batches)


def step_us(run_steps, synchronize, steps):
    """Microseconds per step: warmed up, then ``steps`` steps timed with the
    device synchronised only at both ends."""
    run_steps(WARM_UP)
    synchronize()
    start = time.perf_counter()
    run_steps(steps)
    synchronize()
    return 1e6 * (time.perf_counter() - start) / steps


def rates(trainer_for, batches, steps):
    """{batch: samples/s and us per step} (see ``step_us``)."""
    out = {}
    for batch in batches:
        trainer = trainer_for(batch)
        us = step_us(trainer.run_steps, trainer.synchronize, steps)
        out[batch] = dict(samples_per_s=1e6 * trainer.world * batch / us, step_us=us,
                          gpus=trainer.world)
    return out


def curve(trainer, epochs, valid, test):
    """The learning curve, as ``dual_mlp.py --json`` records it (``curve`` and
    ``steps_per_epoch``): after each epoch the training seconds so far
    (warm-up, evaluation not counted), the validation error, and the test
    error of the best-validation replica."""
    trainer.run_steps(WARM_UP)  # compiles and initialises; then back to the start
    trainer.synchronize()
    trainer.reset()
    train_s, best, test_error, points = 0.0, np.inf, np.inf, []
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        trainer.run_steps(trainer.steps_per_epoch)
        trainer.synchronize()
        train_s += time.perf_counter() - start
        validation_error = trainer.error(*valid)
        if validation_error < best:
            best, test_error = validation_error, trainer.error(*test)
        points.append(dict(epoch=epoch, train_s=train_s, validation_error=validation_error,
                           test_error=test_error))
    return dict(curve=points, steps_per_epoch=trainer.steps_per_epoch)


def job(args, data, rank=0, world=1):
    """What the command line asks for, on one process (``rank`` of ``world``)."""
    (x, y), valid, test = data
    if args.system == "jax":
        trainer_for = functools.partial(jax_trainer, x, y, hyper=args.hyper)
    else:
        trainer_for = functools.partial(torch_trainer, x, y, hyper=args.hyper, rank=rank,
                                        world=world, compiled=args.system == "torch-compile")
    if args.curve:
        return curve(trainer_for(args.batches[0]), args.epochs, valid, test)
    return rates(trainer_for, args.batches, args.steps)


def ddp_worker(rank, world, port, args, queue):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        # read here: data handed to mp.spawn would be pickled through a pipe,
        # gigabytes of it for each process
        result = job(args, datasets.read(args.dataset), rank, world)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def ddp(args):
    """One process per GPU, DistributedDataParallel over NCCL."""
    import socket

    import torch
    import torch.multiprocessing as mp
    world = torch.cuda.device_count()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(ddp_worker, args=(world, port, args, queue), nprocs=world)
    return queue.get()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("system", choices=("torch", "torch-compile", "ddp", "jax"))
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--batches", type=int, nargs="+", required=True, help="per GPU")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--curve", action="store_true",
                        help="train --epochs at the first batch size and print the learning "
                             "curve instead of the speed")
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--learning-rate", type=float, default=DEFAULTS.learning_rate)
    parser.add_argument("--l2", type=float, default=DEFAULTS.l2)
    args = parser.parse_args()
    args.hyper = Hyper(args.learning_rate, args.l2)
    result = ddp(args) if args.system == "ddp" else job(args, datasets.read(args.dataset))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
