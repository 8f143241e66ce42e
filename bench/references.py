"""What people use instead, on the same model and data, for bench/compare.py.

    python -m bench.references torch      --dataset DIR --batches 500 5000 [--steps 200]
    python -m bench.references ddp        --dataset DIR --batches 500 5000
    python -m bench.references jax        --dataset DIR --batches 500 5000 [--steps-per-call K]
    python -m bench.references pytensor   --dataset DIR --batches 500 5000 [--steps-per-call K]

The model is the demo's: 784-500-10, tanh, softmax negative log-likelihood
plus 1e-4 times the squared L2 norm of the weights, plain SGD, float32 at
full precision (no TF32), the whole training set resident on each GPU.

* ``torch``: PyTorch eager on one GPU; ``torch-compile``: the same model
  through ``torch.compile``; ``torch-graph``: the whole step (forward,
  backward, SGD) captured once as a CUDA graph and replayed, the minibatch
  picked on the GPU from a step counter: PyTorch at its best on a small model.
* ``ddp``: DistributedDataParallel, one process per GPU (NCCL), batch B on
  each; ``ddp-graph``: the same with the whole step, the gradients'
  all-reduce included, captured as a CUDA graph.
* ``jax``: one jitted step over a mesh of every GPU, the global batch (B per
  GPU) sharded, XLA inserting the all-reduce; ``--steps-per-call K`` runs K
  steps in one call (a loop in the program), the host queueing calls.
* ``pytensor``: the demo's own training step on one GPU at its best: the
  graph PyTensor compiles from the tutorial (``devices.jax_train_step``),
  jitted, weights donated, the minibatch picked by a counter on the device,
  K steps a call (``multi_gpu.trainer.repeat``), the host running ahead.

``--out DIR`` also records the result (``references_SYSTEM.json``, or
``references_SYSTEM_kK.json`` for K steps a call).
Each batch size is warmed up, then timed over ``--steps`` steps with the
device synchronised only at both ends.  Prints one JSON object:
{batch: {"samples_per_s", "step_us", "gpus"}}.

With ``--curve`` (for bench/accuracy.py) it trains ``--epochs`` epochs at
the first batch size from the tutorial's initial weights, in the demo's
minibatch order, and prints the learning curve instead.
"""
import collections
import functools
import json
import os
import time

import numpy as np

from bench.common import keep_temporaries_here, prog, record
from multi_gpu import datasets
from multi_gpu.cli import Parser

N_HIDDEN, WARM_UP = 500, 20
CPU = False  # --cpu: the references on the CPU
DDP_GRAPH_WARM_UP = 11  # eager DDP steps before a capture, as PyTorch's CUDA graph notes ask
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


class TorchModel:
    """The MLP in PyTorch on GPU ``rank``, the data resident there, and what
    every PyTorch system shares: its weights reset to the tutorial's, its
    error rate on a data set."""

    def __init__(self, x, y, rank):
        import torch
        torch.backends.cuda.matmul.allow_tf32 = False
        if CPU:
            self.torch, self.device = torch, torch.device("cpu")
        else:
            self.torch, self.device = torch, torch.device("cuda", rank)
            torch.cuda.set_device(self.device)
        self.x, self.y = torch.from_numpy(x).to(self.device), \
            torch.from_numpy(y).long().to(self.device)
        self.layers = torch.nn.Sequential(torch.nn.Linear(784, N_HIDDEN), torch.nn.Tanh(),
                                          torch.nn.Linear(N_HIDDEN, 10)).to(self.device)
        self.weights = [self.layers[0].weight, self.layers[2].weight]

    def loss(self, model, xb, yb, hyper):
        return self.torch.nn.functional.cross_entropy(model(xb), yb) + \
            hyper.l2 * sum((w ** 2).sum() for w in self.weights)

    def reset(self):
        w1, b1, w2, b2 = initial_weights()
        with self.torch.no_grad():  # torch keeps a layer's weights as (out, in)
            for p, v in zip(self.layers.parameters(), (w1.T, b1, w2.T, b2)):
                p.copy_(self.torch.from_numpy(np.ascontiguousarray(v)))

    def error(self, xs, ys):
        torch = self.torch
        with torch.no_grad():
            xs, ys = torch.from_numpy(xs).to(self.device), torch.from_numpy(ys).long().to(
                self.device)
            return (self.layers(xs).argmax(1) != ys).float().mean().item()


def torch_trainer(x, y, batch, hyper, rank=0, world=1, compiled=False):
    """PyTorch eager on GPU ``rank``; wrapped in DistributedDataParallel where
    ``world`` > 1 (the process group already set up); through ``torch.compile``
    where ``compiled``."""
    import torch
    m = TorchModel(x, y, rank)
    model = m.layers
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(m.layers,
                                                          device_ids=None if CPU else [rank])
    if compiled:
        model = torch.compile(model)
    optimiser = torch.optim.SGD(model.parameters(), lr=hyper.learning_rate)
    n_batches, t = len(x) // (batch * world), 0

    def reset():
        nonlocal t
        m.reset()
        t = 0

    def run_steps(n):
        nonlocal t
        for _ in range(n):
            start = (t % n_batches * world + rank) * batch  # rank's part of minibatch t
            loss = m.loss(model, m.x[start:start + batch], m.y[start:start + batch], hyper)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            t += 1

    reset()
    return Trainer(run_steps, (lambda: None) if CPU else torch.cuda.synchronize, m.error, reset,
                   world, n_batches)


def torch_graph_trainer(x, y, batch, hyper, rank=0, world=1):
    """The whole step captured once as a CUDA graph (forward, backward, the
    gradients' all-reduce where ``world`` > 1, SGD), then replayed: one launch
    a step.  The minibatch comes from a step counter on the GPU, picked with
    ``index_select`` (indexing with a 0-d tensor would wait for the GPU)."""
    import torch
    m = TorchModel(x, y, rank)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # DDP is built, and warmed up, off the capture's stream
        model = m.layers if world == 1 else torch.nn.parallel.DistributedDataParallel(
            m.layers, device_ids=[rank])
    params = list(m.layers.parameters())
    n_batches = len(x) // (batch * world)
    t = torch.zeros((), dtype=torch.long, device=m.device)
    rows = torch.arange(batch, device=m.device)

    def step():
        index = rows + (t % n_batches * world + rank) * batch  # rank's part of minibatch t
        loss = m.loss(model, m.x.index_select(0, index), m.y.index_select(0, index), hyper)
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-hyper.learning_rate)
        t.add_(1)

    with torch.cuda.stream(side):
        for _ in range(DDP_GRAPH_WARM_UP):
            for p in params:
                p.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None  # the capture's backward then writes the gradients, not adds to them
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def reset():
        m.reset()
        t.zero_()

    # The graph reads its buffers by address, the minibatch's rows and DDP's
    # buckets among them: what holds them must live as long as the graph does
    # (freed, their memory went to the next allocation: the validation's).
    def run_steps(n, holds=(step, rows, model)):
        for _ in range(n):
            graph.replay()

    reset()
    return Trainer(run_steps, torch.cuda.synchronize, m.error, reset, world, n_batches)


def logits(params, xb):
    import jax.numpy as jnp
    w1, b1, w2, b2 = params
    return jnp.tanh(xb @ w1 + b1) @ w2 + b2


def error_rate(params, xs, ys):
    import jax.numpy as jnp
    return jnp.mean(jnp.argmax(logits(params, xs), 1) != ys)


def loop_of(step, steps_per_call):
    """``run(n)``: n steps of ``step(k)`` (k steps in one call), in calls of
    ``steps_per_call`` and one for what is left."""
    def run(n):
        full, rest = divmod(n, steps_per_call)
        for _ in range(full):
            step(steps_per_call)
        if rest:
            step(rest)
    return run


def jax_trainer(x, y, batch, hyper, steps_per_call=1):
    """One jitted program over a mesh of every GPU, the global batch sharded;
    ``steps_per_call`` steps in each call, the step counter on the devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    jax.config.update("jax_default_matmul_precision", "highest")
    mesh = Mesh(np.array(jax.devices()), ("gpus",))
    world = len(jax.devices())
    replicated = NamedSharding(mesh, P())

    def loss(params, xb, yb):
        nll = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits(params, xb)),
                                            yb[:, None], 1))
        return nll + hyper.l2 * (jnp.sum(params[0] ** 2) + jnp.sum(params[2] ** 2))

    def one(params, t, data_x, data_y):
        grads = jax.grad(loss)(params, data_x[t % n_batches], data_y[t % n_batches])
        return [p - hyper.learning_rate * g for p, g in zip(params, grads)], t + 1

    @functools.partial(jax.jit, static_argnums=4, donate_argnums=(0, 1))  # updated in place
    def steps(params, t, data_x, data_y, k):
        return jax.lax.fori_loop(0, k, lambda _, s: one(*s, data_x, data_y), (params, t),
                                 unroll=min(k, 5))

    n_batches = len(x) // (batch * world)
    rows = n_batches * batch * world
    # (step, global batch, ...), the batch axis split over the GPUs
    data_x = jax.device_put(x[:rows].reshape(n_batches, batch * world, 784),
                            NamedSharding(mesh, P(None, "gpus")))
    data_y = jax.device_put(y[:rows].reshape(n_batches, batch * world),
                            NamedSharding(mesh, P(None, "gpus")))
    errors = jax.jit(error_rate)
    state = {}

    def reset():
        state.update(t=jax.device_put(np.int32(0), replicated),
                     params=[jax.device_put(w, replicated) for w in initial_weights()])

    def step(k):
        state["params"], state["t"] = steps(state["params"], state["t"], data_x, data_y, k)
        if CPU:  # queued calls of two CPU devices deadlock in XLA's rendezvous on two cores
            jax.block_until_ready(state["params"])

    def error(xs, ys):
        return float(errors(state["params"], jax.device_put(xs, replicated),
                            jax.device_put(ys, replicated)))

    reset()
    return Trainer(loop_of(step, steps_per_call), lambda: jax.block_until_ready(state["params"]),
                   error, reset, world, n_batches)


def pytensor_trainer(dataset, batch, hyper, steps_per_call=1, written_out=False):
    """The demo's own step on this process's one GPU, at its best (see the
    module's text); the programs of k steps each compiled on first use.
    ``written_out``: an optimization barrier after each step, where the
    exchange stands in the GPU-ordered step, so that XLA must write every
    parameter out before the next step, as it must for any exchange
    (``bench.step_cost``)."""
    import multi_gpu.flags as flags  # noqa: F401  (first: float32, as the scripts run)

    import jax
    import jax.numpy as jnp

    import mlp
    from logistic_sgd import load_data
    from multi_gpu.devices import JaxDevice, jax_train_step, storage
    from multi_gpu.trainer import repeat
    device = JaxDevice()
    model = mlp.Model(load_data(dataset, put=device.put), batch, learning_rate=hyper.learning_rate,
                      L2_reg=hyper.l2, mode="JAX")
    train, data = jax_train_step(model)
    n = model.n_train_batches

    def one(data, counter, params):
        new = train(counter % n, data, params)[1]
        return counter + 1, jax.lax.optimization_barrier(new) if written_out else new
    programs = {}
    errors = jax.jit(error_rate)
    initial = [jnp.array(storage(p)) for p in model.params]
    state = {}

    def reset():
        state["state"] = (device.put(np.int32(0)), [p.copy() for p in initial])

    def step(k):
        if k not in programs:
            programs[k] = jax.jit(repeat(one, k), donate_argnums=(1, 2))
        state["state"] = programs[k](data, *state["state"])

    def error(xs, ys):
        return float(errors(state["state"][1], device.put(xs), device.put(ys)))

    reset()
    return Trainer(loop_of(step, steps_per_call), lambda: jax.block_until_ready(state["state"]),
                   error, reset, 1, n)


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
    trainer_for = {
        "jax": functools.partial(jax_trainer, x, y, hyper=args.hyper,
                                 steps_per_call=args.steps_per_call),
        "pytensor": functools.partial(pytensor_trainer, args.dataset, hyper=args.hyper,
                                      steps_per_call=args.steps_per_call),
        "torch-graph": functools.partial(torch_graph_trainer, x, y, hyper=args.hyper,
                                         rank=rank, world=world),
        "ddp-graph": functools.partial(torch_graph_trainer, x, y, hyper=args.hyper,
                                       rank=rank, world=world),
    }.get(args.system) or functools.partial(torch_trainer, x, y, hyper=args.hyper, rank=rank,
                                            world=world, compiled=args.system == "torch-compile")
    if args.curve:
        return curve(trainer_for(args.batches[0]), args.epochs, valid, test)
    return rates(trainer_for, args.batches, args.steps)


def ddp_worker(rank, world, port, args, queue):
    global CPU
    CPU = args.cpu  # a spawned process: the module read afresh
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.system == "ddp-graph":  # a collective in a CUDA graph: PyTorch's notes ask for it
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    if CPU:  # the cores shared out, as the demo's launcher shares them out
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    dist.init_process_group("gloo" if CPU else "nccl", rank=rank, world_size=world)
    try:
        # read here: data handed to mp.spawn would be pickled through a pipe,
        # gigabytes of it for each process
        result = job(args, datasets.read(args.dataset), rank, world)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def ddp(args):
    """One process per GPU, DistributedDataParallel over NCCL (on CPUs: two
    processes over gloo, as PyTorch runs DDP without GPUs)."""
    import torch
    import torch.multiprocessing as mp

    from multi_gpu.nodes import free_port
    world, port = (2 if CPU else torch.cuda.device_count()), free_port()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(ddp_worker, args=(world, port, args, queue), nprocs=world)
    return queue.get()


def main():
    parser = Parser(prog=prog(), about=__doc__)
    parser.add_argument("system", choices=("torch", "torch-compile", "torch-graph", "ddp",
                                           "ddp-graph", "jax", "pytensor"),
                        help="the reference to time (each is described above)")
    parser.add_argument("--dataset", required=True,
                        help="a folder of MNIST-format files (Debian's dataset-fashion-mnist: "
                             "/usr/share/datasets/fashion-mnist)")
    parser.add_argument("--batches", type=int, nargs="+", required=True,
                        help="the batch sizes to time, examples per GPU a step")
    parser.add_argument("--steps", type=int, default=200,
                        help="steps timed at each batch size, after a warm-up")
    parser.add_argument("--steps-per-call", type=int, default=1,
                        help="jax, pytensor: steps in one compiled call")
    parser.add_argument("--curve", action="store_true",
                        help="train --epochs at the first batch size and print the learning "
                             "curve instead of the speed")
    parser.add_argument("--epochs", type=int, default=100, help="--curve: epochs to train")
    parser.add_argument("--learning-rate", type=float, default=DEFAULTS.learning_rate,
                        help="SGD's step size")
    parser.add_argument("--l2", type=float, default=DEFAULTS.l2,
                        help="the weight of the L2 penalty in the cost")
    parser.add_argument("--cpu", action="store_true",
                        help="on the CPU: torch on all the cores, ddp as two processes over "
                             "gloo, jax over the CPU devices XLA_FLAGS gives it")
    parser.add_argument("--out", metavar="DIR",
                        help="also write what it prints, with the date, machine and command, "
                             "to DIR/references_SYSTEM.json")
    args = parser.parse_args()
    keep_temporaries_here()
    global CPU
    CPU = args.cpu
    if CPU and args.system.endswith("graph"):
        parser.error(f"{args.system} captures CUDA graphs: GPUs only")
    args.hyper = Hyper(args.learning_rate, args.l2)
    result = ddp(args) if args.system.startswith("ddp") else job(args, datasets.read(args.dataset))
    print(json.dumps(result))
    if args.out:
        name = f"references_{args.system}"
        record(name + (f"_k{args.steps_per_call}" if args.steps_per_call > 1 else ""),
               args.out, result=result)


if __name__ == "__main__":
    main()
