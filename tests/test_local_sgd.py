"""``--average-every H``: local SGD, each worker H steps on its own, then all
average; checked against a plain NumPy reference of the same algorithm."""
import json

import numpy as np
import pytensor.tensor as pt
import pytest

import mlp
from conftest import SHAPES, assert_identical_checkpoints, dual, refused
from multi_gpu import datasets, records

LEARNING_RATE, L2, BATCH = 0.13, 0.0001, 100  # the demo's defaults on the shipped digits


def initial_weights(seed=1234):
    """The tutorial MLP's starting weights (W1, b1, W2, b2), as the demo draws them."""
    classifier = mlp.MLP(np.random.RandomState(seed), pt.matrix("x"), datasets.N_PIXELS, 500,
                         datasets.N_CLASSES)
    return [p.get_value().astype(np.float64) for p in classifier.params]


def sgd_step(params, x, y, rate=LEARNING_RATE, l2=L2):
    """One step of the tutorial's SGD in float64: tanh hidden layer, softmax,
    mean negative log-likelihood plus l2 times the squared weights."""
    w1, b1, w2, b2 = params
    hidden = np.tanh(x @ w1 + b1)
    logits = hidden @ w2 + b2
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    d_logits = (p - np.eye(datasets.N_CLASSES)[y]) / len(y)
    d_hidden = (d_logits @ w2.T) * (1 - hidden ** 2)
    grads = [x.T @ d_hidden + 2 * l2 * w1, d_hidden.sum(0), hidden.T @ d_logits + 2 * l2 * w2,
             d_logits.sum(0)]
    return [w - rate * g for w, g in zip(params, grads)]


def local_sgd(workers, every, epochs):
    """Every worker's weights at the end: worker k trains on minibatches k,
    k + N, ... and all average after every ``every``-th step of an epoch
    and after its last."""
    (x, y), _, _ = datasets.read(datasets.SHIPPED)
    x, steps = x.astype(np.float64), len(x) // BATCH // workers
    replicas = [initial_weights() for _ in range(workers)]
    for _ in range(epochs):
        for step in range(steps):
            for k in range(workers):
                rows = slice((workers * step + k) * BATCH, (workers * step + k + 1) * BATCH)
                replicas[k] = sgd_step(replicas[k], x[rows], y[rows])
            if (step + 1) % every == 0 or step + 1 == steps:
                mean = [sum(r[i] for r in replicas) / workers for i in range(4)]
                replicas = [list(mean) for _ in range(workers)]
    return replicas, steps


@pytest.mark.parametrize("workers,exchange", [(2, "p2p"), (3, "p2p"), (3, "xla")])
def test_local_sgd_equals_a_numpy_reference_and_keeps_the_replicas_identical(tmp_path, workers,
                                                                             exchange):
    """H = 3 over two epochs (2 workers: 15 steps an epoch, averages after 3, 6,
    ..., 15; 3 workers: 10 steps, after 3, 6, 9 and 10).  The run is float32,
    the reference float64: the weights agree to rtol 1e-4, atol 2e-6, as one
    process with twice the batch agrees with two workers."""
    out = dual(*["cpu"] * workers, "--exchange", exchange, "--epochs", 2, "--average-every", 3,
               "--check", "--save", tmp_path / "ck.npz", "--json", tmp_path / "run.json")
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "run.json").read_text())
    replicas, steps = local_sgd(workers, 3, 2)
    assert summary["averages"] == 2 * (-(-steps // 3)) and summary["average_every"] == 3
    assert summary["max_replica_diff"] == 0.0  # identical after every average
    assert f"The replicas averaged {summary['averages']} times" in out.stdout
    weights = records.load_checkpoint(str(tmp_path / "ck.npz"), SHAPES)[0]
    for run, reference in zip(weights, replicas[0]):
        np.testing.assert_allclose(run, reference, rtol=1e-4, atol=2e-6)
    # and not the every-step demo's weights: averaging less often is another algorithm
    every_step = local_sgd(workers, 1, 2)[0][0]
    assert not np.allclose(weights[0], every_step[0], rtol=1e-4, atol=2e-6)


def test_average_every_one_is_the_2014_demo_to_the_bit(tmp_path):
    """H = 1 is the default: the same curve and weights, bit for bit, and one
    average a step."""
    runs = {}
    for name, extra in (("default", ()), ("h1", ("--average-every", 1))):
        out = dual("cpu", "cpu", "--epochs", 2, "--save", tmp_path / f"{name}.npz", "--json",
                   tmp_path / f"{name}.json", *extra)
        assert out.returncode == 0, out.stderr
        runs[name] = (json.loads((tmp_path / f"{name}.json").read_text()),
                      records.load_checkpoint(str(tmp_path / f"{name}.npz"), SHAPES)[0])
    (a, wa), (b, wb) = runs["default"], runs["h1"]
    assert [p["validation_error"] for p in a["curve"]] == \
        [p["validation_error"] for p in b["curve"]]
    assert all(np.array_equal(x, y) for x, y in zip(wa, wb))
    assert a["averages"] == b["averages"] == a["steps_per_epoch"] * 2
    assert "The replicas averaged" not in out.stdout  # the 2014 demo's lines, as they were


def test_a_local_sgd_run_resumed_mid_way_ends_as_an_uninterrupted_one(tmp_path, capsys):
    common = ("cpu", "cpu", "--average-every", 4)
    assert dual(*common, "--epochs", 2, "--save", tmp_path / "full.npz").returncode == 0
    assert dual(*common, "--epochs", 1, "--save", tmp_path / "half.npz").returncode == 0
    out = dual(*common, "--epochs", 2, "--resume", tmp_path / "half.npz", "--save",
               tmp_path / "resumed.npz")
    assert out.returncode == 0, out.stderr
    assert_identical_checkpoints(tmp_path / "full.npz", tmp_path / "resumed.npz")
    # another H is another training: refused, naming it
    out = refused(capsys, "cpu", "cpu", "--epochs", 2, "--resume", tmp_path / "half.npz")
    assert out.returncode == 2
    assert "--average-every 4 there, 1 here" in out.stderr, out.stderr


@pytest.mark.parametrize("value,why", [("0", "must be a positive integer, got 0"),
                                       ("-3", "must be a positive integer, got -3"),
                                       ("two", "not a number: two"),
                                       ("1.5", "not a number: 1.5")])
def test_a_bad_average_every_is_one_line(value, why, capsys):
    out = refused(capsys, "--average-every", value)  # by main(), in this process
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"dual_mlp.py: error: argument --average-every: {why} (see --help)"]


def test_steps_per_call_must_end_on_an_average():
    out = dual("cpu", "cpu", "--exchange", "xla", "--average-every", 3, "--steps-per-call", 4)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "dual_mlp.py: error: --steps-per-call 4 is not a multiple of --average-every 3: a "
        "compiled call of K steps ends on an average"]


def test_the_gpu_ordered_call_runs_rounds_of_own_steps_and_one_exchange():
    """The JAX side of ``--sync gpu --average-every 3``, on JAX's CPU: calls of
    6 steps, and the 2 left at the end of an epoch of 20 (the shipped digits
    at 150 a step), are rounds of 2 steps of the worker's own and one through
    the exchange.  With an exchange that counts its steps and hands back the
    worker's own update (the mean of replicas that all hold it), every step
    is the tutorial's SGD step, and the exchange runs once an average."""
    import jax
    from jax.experimental.buffer_callback import buffer_callback

    import dual_mlp
    from logistic_sgd import load_data
    from multi_gpu.devices import JaxDevice

    class CountingEcho:
        callbacks = 0

        def __init__(self, rank, n_workers, layout, rate):
            self.rate, self.steps = rate, 0

        def __call__(self, params, gradients):
            new = [p - self.rate * g for p, g in zip(params, gradients)]
            return buffer_callback(self.count, [jax.ShapeDtypeStruct(p.shape, p.dtype)
                                                for p in new], has_side_effect=False,
                                   input_output_aliases={i: i for i in range(len(new))})(*new)

        def count(self, ctx, out, *inputs):
            self.steps += 1

        def steps_done(self):
            return self.steps

    device = JaxDevice()
    model = mlp.Model(load_data(datasets.SHIPPED, put=device.put), 150, learning_rate=0.1,
                      mode="JAX")
    model.warm_up(put=device.put)
    no_peer = type("NoPeer", (), {"gather": None, "barrier": lambda self: None})()
    trainer = dual_mlp.GpuOrdered(0, 1, model, device, no_peer, check=False, watchdog=None,
                                  steps_per_call=6, average_every=3, exchange=CountingEcho)
    trainer.epoch(trainer.n_steps)
    assert trainer.n_steps == 20 and sorted(trainer.programs) == [2, 6]
    assert trainer.exchange.steps_done() == trainer.averages == 7  # after 3, 6, ..., 18 and 20
    for i in range(20):
        model.train_model(i)
    for mine, theirs in zip(trainer.weights(), model.get_params()):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
