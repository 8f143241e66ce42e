"""More than two workers, and more than one launcher: on JAX's distributed
runtime (--exchange xla, gloo between CPU processes), and the 2014 exchange
for N workers (--exchange p2p, host memory between CPU processes): real
processes, real sockets, the shipped digits."""
import argparse
import importlib.metadata
import json
import os
import signal
import time

import numpy as np
import psutil
import pytest

import mlp
from conftest import (
    PACED,
    SHAPES,
    assert_identical_checkpoints,
    child_running,
    dual,
    finish,
    kill_one_worker,
    leftover_workers,
    refused,
    run_directories,
    run_once,
    start_dual,
    start_node,
    two_epochs,
    wait_for,
    wait_until_training,
    workers_of,
)
from logistic_sgd import load_data
from multi_gpu import datasets, records, xla_runtime
from multi_gpu.nodes import free_port


def run(tmp_path, name, *args, **kw):
    out = dual(*args, "--json", tmp_path / f"{name}.json", "--save", tmp_path / f"{name}.npz",
               **kw)
    assert out.returncode == 0, out.stderr
    return json.loads((tmp_path / f"{name}.json").read_text()), out


def weights(tmp_path, name):
    return records.load_checkpoint(str(tmp_path / f"{name}.npz"), SHAPES)[0]


THREE_BY_XLA = ("cpu", "cpu", "cpu", "--exchange", "xla", "--steps-per-call", 1)


def two_epochs_of_three(name, *args):
    """A run of three workers, two epochs, with --check (which only reads the
    weights), made once for the tests below that look at it (``run_once``):
    (its summary, its output, its final weights, its checkpoint)."""
    folder, out = run_once(name, *args, "--epochs", 2, "--check", "--json", "{folder}/three.json",
                           "--save", "{folder}/three.npz")
    return json.loads((folder / "three.json").read_text()), out, weights(folder, "three"), \
        folder / "three.npz"


@pytest.fixture(scope="module")
def three_by_xla():
    """Under --exchange xla, one step a call."""
    return two_epochs_of_three("three_by_xla", *THREE_BY_XLA)


@pytest.fixture(scope="module")
def three_by_p2p():
    """The 2014 exchange's, under the default --avg."""
    return two_epochs_of_three("three_by_p2p", "cpu", "cpu", "cpu")


def test_three_workers_equal_two_at_the_same_total_batch(tmp_path, three_by_xla):
    """Worker k of 3 at batch 100 trains on rows 300t+100k..; two workers at
    150 on rows 300t+150k..: the same 300 rows a step, so the same weights,
    up to float reordering (JAX's CPU backend here, Numba's there)."""
    three, out, three_weights, _ = three_by_xla
    two, _ = run(tmp_path, "two", "cpu", "cpu", "--batch-size", 150, "--epochs", 2)
    assert three["workers"] == 3 and three["exchange"] == "xla" and two["exchange"] == "p2p"
    assert three["max_replica_diff"] == 0.0
    assert three["steps_per_epoch"] == two["steps_per_epoch"] == 10
    np.testing.assert_allclose(three["validation_errors"], two["validation_errors"], atol=0.005)
    for a, b in zip(three_weights, weights(tmp_path, "two")):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
    assert "weights through an XLA all-reduce" in out.stdout
    assert out.stdout.count("epoch 1/2:") == 1  # only global rank 0 prints


def test_three_workers_peer_to_peer_hold_the_xla_average(tmp_path, three_by_xla, three_by_p2p):
    """The 2014 exchange for three: each worker publishes into its own mapped
    buffer, fetches all three, and takes their mean in rank order, under the
    default --avg (the module's run) and --avg cpu (--avg theano, a compiled
    PyTensor function, is checked for two workers: test_dual.py); the
    replicas stay identical, and the weights are --exchange xla's up to float
    reordering (NumPy and Numba here, XLA there): within 1e-6 absolute
    (measured: 1.5e-7 after 20 steps)."""
    xla, _, xla_weights, _ = three_by_xla
    for avg in ("shared", "cpu"):  # p2p: the default for CPUs of one machine
        if avg == "shared":
            p2p, out, p2p_weights, _ = three_by_p2p
            assert p2p["config"]["avg"] == avg
        else:
            p2p, out = run(tmp_path, "p2p", "cpu", "cpu", "cpu", "--avg", avg, "--epochs", 2,
                           "--check")
            p2p_weights = weights(tmp_path, "p2p")
        assert p2p["exchange"] == "p2p" and p2p["workers"] == 3 and p2p["sync"] == "host"
        assert p2p["max_replica_diff"] == 0.0
        assert "weights through host memory, ordered by the host" in out.stdout
        for a, b in zip(p2p_weights, xla_weights):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(p2p["validation_errors"], xla["validation_errors"],
                                   atol=0.002)


def test_several_steps_per_call_take_the_same_steps_as_one(tmp_path, three_by_xla):
    """10 steps an epoch in calls of 4, 4 and 2 against 10 calls of one (the
    module's run): the same minibatches in the same order, the same weights
    up to float reordering inside XLA's loop (rtol 1e-5), and the step
    counter in the compiled program counts every step once."""
    one, _, one_weights, _ = three_by_xla
    many, _ = run(tmp_path, "many", "cpu", "cpu", "cpu", "--exchange", "xla", "--epochs", 2,
                  "--steps-per-call", 4, "--check")
    assert many["steps_per_call"] == 4 and one["steps_per_call"] == 1
    for summary in (many, one):
        assert summary["exchange_steps"] == summary["epochs_run"] * summary["steps_per_epoch"] == 20
    assert many["max_replica_diff"] == 0.0
    for a, b in zip(weights(tmp_path, "many"), one_weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(many["validation_errors"], one["validation_errors"], atol=0.002)


def test_this_jax_lets_every_cpu_worker_keep_its_own_programs():
    """The private writer of XLA's cache the demo wraps is there, as the demo
    knows it (JAX 0.10 to 0.12): on another JAX this fails, and a run says
    what it loses in its "compiled" line."""
    import jax

    from multi_gpu import xla_cache
    assert xla_cache.cache_writer_problem(jax) is None


def test_xla_with_two_workers_follows_the_p2p_exchange_and_each_keeps_its_programs(tmp_path):
    """Two workers under xla train as under p2p.  XLA's cache, empty at
    first, then holds each worker's programs, for the next run (JAX alone
    keeps process 0's, and a CPU program's key names its process)."""
    cache = tmp_path / "cache"
    xla, _ = run(tmp_path, "xla", "cpu", "cpu", "--exchange", "xla", "--epochs", 2, "--check",
                 env={"PYTENSOR_FLAGS": f"base_compiledir={cache}"})
    k, n = xla["steps_per_call"], xla["steps_per_epoch"]
    programs = len({k, n % k} - {0})  # an epoch's calls: of K steps, and what is left
    kept = os.listdir(cache / "jax_cache")
    assert sum(name.startswith("jit_call-") for name in kept) == 2 * programs, sorted(kept)
    p2p = two_epochs()  # the same two epochs, peer to peer
    assert xla["max_replica_diff"] == 0.0 and xla["exchange"] == "xla"
    for a, b in zip(weights(tmp_path, "xla"), weights(p2p, "m")):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("exchange", ["xla", "p2p"])
def test_a_killed_worker_stops_all_three_within_10_s(no_leftovers, exchange):
    proc = start_dual("cpu", "cpu", "cpu", "--exchange", exchange, "--epochs", 1000, env=PACED)
    wait_until_training(proc)
    took = kill_one_worker(proc, 2, "cpu")
    print(f"{exchange}: launcher stopped {took:.2f} s after the worker was killed")


@pytest.mark.parametrize("exchange,words", [
    ("xla", "no step finished within 3 s: worker 2 stopped running"),
    ("p2p", "worker 2 did not reach barrier")])
def test_a_stalled_worker_is_reported_within_the_timeout(no_leftovers, exchange, words):
    """Inside a collective the host thread waits in XLA, where no check of
    ours runs: the watchdog must see that no step finishes, and name the
    worker whose heartbeat stopped.  Peer to peer, the others wait for it at
    a barrier, and name it."""
    proc = start_dual("cpu", "cpu", "cpu", "--exchange", exchange, "--epochs", 1000,
                      "--timeout", 3, env=PACED)
    wait_until_training(proc)
    workers_of(proc)[2].send_signal(signal.SIGSTOP)
    code, took, err = finish(proc, timeout=20)
    assert code == 1
    assert words in err.splitlines()[-1]
    print(f"{exchange}: a stalled worker reported {took:.2f} s after it stopped")


def test_a_dead_node_stops_the_other_node():
    """Node 1's launcher and worker SIGKILLed at once: node 0 names it in
    one line; the folder node 1 left goes with a later run (issue 49.7)."""
    port, before = free_port(), run_directories()
    node0, node1 = (start_node(port, rank, "--epochs", 1000, env=PACED) for rank in (0, 1))
    wait_until_training(node0)
    for p in [*workers_of(node1), psutil.Process(node1.pid)]:  # that machine's, at once
        p.kill()
    node1.communicate()
    code, took, err = finish(node0, timeout=30)
    assert code == 1 and err.splitlines()[-1].startswith("error: node 1 (127.0.0.1) lost: ")
    print(f"node 0 stopped {took:.2f} s after node 1 died: {err.splitlines()[-1]}")
    wait_for(lambda: not leftover_workers(), 5, "every worker to exit")
    # node 1's folder: nobody was left to remove it; the next run does, once nothing in it
    # has changed for a minute (younger, it is left: its launcher may be in another pid
    # namespace)
    from multi_gpu import files
    leftover, = run_directories() - before
    files.drop_folders_of_dead_runs(str(leftover.parent))
    assert leftover.exists()
    old = time.time() - files.STALE_AFTER - 1
    for path in [leftover, *leftover.iterdir()]:
        os.utime(path, (old, old), follow_symlinks=False)
    files.run_folder(argparse.Namespace(devices=["cpu", "cpu"]), SHAPES)
    assert not leftover.exists()


def test_the_folder_of_a_door_killed_with_its_node_0_goes_with_a_later_run():
    """Node 0's machine lost as it waits for node 1: its launcher and its
    lobby's door SIGKILLed at once.  The door's private folder, named after
    the launcher as a run folder is, goes with a later run, as a dead run's."""
    from multi_gpu import files
    before = run_directories()
    node0 = start_node(free_port(), 0, "--epochs", 1)
    launcher = psutil.Process(node0.pid)
    door = wait_for(lambda: child_running(launcher, "door.py"), 60, "the door")
    # (the door makes its folder, then its socket there)
    folder, = wait_for(lambda: {f for f in run_directories() - before
                                if (f / "lobby.sock").exists()}, 30, "the door's socket")
    assert folder.name.startswith(f"dual_mlp-{node0.pid}-door-")
    for p in (door, launcher):
        p.kill()
    node0.communicate()
    files.drop_folders_of_dead_runs(str(folder.parent))
    assert folder.exists()  # young: its launcher may be in another pid namespace
    old = time.time() - files.STALE_AFTER - 1
    for path in [folder, *folder.iterdir()]:
        os.utime(path, (old, old), follow_symlinks=False)
    files.drop_folders_of_dead_runs(str(folder.parent))
    assert not folder.exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_node_alone_reports_the_missing_nodes_within_the_timeout(no_leftovers, rank):
    """Rank 1: no node 0 to let it in; rank 0: the other node never comes.
    Either way one line says so; node 0 says meanwhile, on its output, whom
    it waits for."""
    port = free_port()
    proc = start_node(port, rank, "--timeout", 5)
    code, took, err = finish(proc, timeout=40)
    lines = err.strip().splitlines()
    if rank == 1:
        assert code == 1 and lines == [f"dual_mlp.py: error: node 0 did not answer at "
                                       f"127.0.0.1:{port} within 5 s (is it started, and can "
                                       "this machine reach it? see --timeout)"], err
    else:
        assert code == 1 and lines == [f"error: node 1 never joined node 0 at 127.0.0.1:{port}"]
        assert f"node 0: waiting for node 1 to join at 127.0.0.1:{port} (" in proc.out


@pytest.mark.parametrize("exchange", ["xla", "p2p"])
def test_resumed_three_worker_run_equals_an_uninterrupted_one(tmp_path, exchange, request):
    """One epoch, then resumed to two, against two at once (the module's run
    of two epochs: --check only reads the weights)."""
    common = THREE_BY_XLA if exchange == "xla" else ("cpu", "cpu", "cpu", "--exchange", exchange)
    full = request.getfixturevalue(f"three_by_{exchange}")[-1]
    run(tmp_path, "half", *common, "--epochs", 1)
    _, out = run(tmp_path, "resumed", *common, "--epochs", 2, "--resume", tmp_path / "half.npz")
    assert "resumed from" in out.stdout and "epoch 1/2:" not in out.stdout
    assert_identical_checkpoints(full, tmp_path / "resumed.npz", records.TRAINING_STATE)


def test_a_run_resumed_on_fewer_workers_takes_their_steps_and_says_so(tmp_path, three_by_p2p):
    """Two epochs of three workers, resumed on two: worker k trains the
    minibatches k, k + 2, ..., and each averaged step is SGD on the 200
    rows of minibatches 2t and 2t + 1, the step one process at batch 200
    takes from the same weights; the checkpoint and --json count each
    epoch's workers."""
    three = three_by_p2p[-1]
    summary, out = run(tmp_path, "two", "cpu", "cpu", "--epochs", 3, "--resume", three)
    assert ("notice: the workers change from 3 to 2 at epoch 3: worker k trains minibatches "
            "k, k + 2, ... of each epoch, and each step averages 2 of them (SGD on 200 images "
            "a step, not 300)") in out.stdout
    assert summary["workers_per_epoch"] == [3, 3, 2] and summary["workers"] == 2
    assert "The workers of each epoch: 3 (epochs 1-2), 2 (epoch 3)\n" in out.stdout
    assert [point["workers"] for point in summary["curve"]] == [2]  # this run's epoch
    state = records.load_checkpoint(str(tmp_path / "two.npz"), SHAPES, ("epoch_workers",))[2]
    assert state["epoch_workers"] == [3, 3, 2]
    one = mlp.Model(load_data(datasets.SHIPPED), 200, 500, 0.13, 0.0, 0.0001,
                    mode="FAST_COMPILE", evaluates=False)
    one.set_params(records.load_checkpoint(str(three), SHAPES)[0])
    for t in range(one.n_train_batches):
        one.train_model(t)
    for a, b in zip(weights(tmp_path, "two"), one.get_params()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)


def test_every_option_is_compared_at_the_lobby_or_is_a_nodes_own():
    """Each option of dual_mlp.py is classified once: what every node must
    be given alike (compared at node 0's lobby, ``RUN_OPTIONS``) or a node's
    own (``NODE_OWN``); an option added without a class fails here."""
    import dual_mlp
    from multi_gpu import request
    options = set(vars(dual_mlp.parse_args([])))
    compared, own = set(request.RUN_OPTIONS), set(request.NODE_OWN)
    assert not compared & own
    assert options - compared - own == set()
    assert own <= options  # the run options may be derived (workers in all, platform)


def test_a_jaxlib_whose_cpu_all_reduce_hangs_is_refused_in_one_line(monkeypatch, capsys,
                                                                     no_leftovers):
    """jaxlib 0.12.1 hangs in the first all-reduce (gloo) of the step between
    CPU processes, every worker waiting in gloo for ever (its release before
    runs the same step, saved by jax.export): --exchange xla on CPUs says so
    before anything starts, rather than stalling for --timeout and blaming a
    worker.  A GPU run's all-reduce is NCCL's, not refused."""
    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.12.1" if name == "jaxlib" else version(name))
    for args in (["cpu", "cpu", "--exchange", "xla"],
                 ["cpu", "cpu", "cpu", "--exchange", "xla", "--epochs", "1"]):
        out = refused(capsys, *args)
        assert out.returncode == 2 and out.stderr.strip().splitlines() == [
            "dual_mlp.py: error: --exchange xla on CPUs: jaxlib 0.12.1's all-reduce between CPU "
            "processes (gloo) hangs in the step's first call: pip install 'jax[cpu]<0.12.1' "
            "(as requirements.txt asks)"], out.stderr
    assert xla_runtime.jax_problem(cpu=False) is None


def test_bad_requests_for_many_workers_get_one_line_exit_2(tmp_path, no_leftovers, capsys):
    """The first request by the script, as typed; the others by its main()."""
    cases = [
        (["cpu"], "give at least two devices"),
        (["cpu", "cpu", "--exchange", "p2p", "--nodes", "2", "--coordinator", "h:1"],
         "--exchange p2p joins the workers of one machine"),
        (["cpu", "cpu", "--nodes", "0"], "argument --nodes: must be a positive integer"),
        (["cpu", "cpu", "--nodes", "2", "--node-rank", "2", "--coordinator", "h:1"],
         "--node-rank 2 is out of range: 0..1"),
        (["cpu", "cpu", "--nodes", "2"], "--nodes > 1 needs --coordinator HOST:PORT"),
        (["cpu", "--nodes", "2", "--node-rank", "1", "--coordinator", "h:1", "--save",
          tmp_path / "n1.npz"], "--save: node 0 keeps the run's checkpoint and summary"),
        (["cpu", "--nodes", "2", "--node-rank", "1", "--coordinator", "h:1", "--json",
          tmp_path / "n1.json"], "--json: node 0 keeps the run's checkpoint and summary"),
        (["cpu", "cpu", "--nodes", "2", "--coordinator", "10.0.0.1"], "expected HOST:PORT"),
        (["cpu", "cpu", "--coordinator", "host:99999"], "expected HOST:PORT"),
        (["cpu", "cpu", "--sync", "gpu"], "--sync gpu orders the exchange on GPU streams"),
        (["cpu", "cpu", "cpu", "--exchange", "xla", "--avg", "shared"],
         "--exchange xla averages inside"),
        (["cpu", "cpu", "--avg", "pycuda"], "--avg pycuda averages in place on GPUs: on CPUs, "
                                            "--avg shared does"),
        (["cpu", "cpu", "cpu", "cpu", "--batch-size", "1000"], "each of the 4 workers"),
        (["cpu", "cpu", "--steps-per-call", "2"], "the host-ordered 2014 loop (--sync host) "
                                                  "takes one step per call"),
        (["cpu", "cpu", "cpu", "--steps-per-call", "0"], "must be a positive integer"),
        (["cpu", "cpu", "cpu", "--steps-per-call", "4"], "the host-ordered 2014 loop"),
    ]
    for i, (args, words) in enumerate(cases):
        out = refused(capsys, *args, typed=i == 0)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2, (args, out.stderr)
        assert len(lines) == 1 and words in lines[0], (args, out.stderr)
