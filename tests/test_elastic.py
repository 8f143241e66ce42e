"""--nodes MIN:MAX: a run that goes on with the nodes it has (multi_gpu/elastic.py).

Three test hosts (``bench/testhosts.py``), as on a cluster: node 2's machine
killed, the run goes on with nodes 0 and 1 once --rejoin-timeout is past;
node 2's command started again later, it is taken back in at an epoch's end.
The run ends as its oracle, bit for bit: the same epochs trained in three
stages on one machine, each saved and resumed with the next world.  Beside
it, in three more test hosts, a run whose node 2 is lost for good ends as
its oracle (two stages); on the loopback, a run left below MIN nodes ends,
and one whose node 0 is lost waits for node 0 alone."""
import concurrent.futures
import os
import re
import signal
import subprocess
import threading
import time

import pytest

from bench.testhosts import hosts_on_a_bridge, why_no_test_hosts
from conftest import (
    PACED,
    SECRET,
    SHAPES,
    assert_identical_checkpoints,
    finish,
    made_once,
    refused,
    start_dual,
)
from multi_gpu import records
from multi_gpu.nodes import free_port

EPOCHS = 36  # the loss, the wait and the return (a start-up: slow on a busy machine) take epochs
ELASTIC = ("--nodes", "2:3", "--max-restarts", 3, "--rejoin-timeout", 4)


class Node:
    """A node's launcher: what it prints, line by line as it comes."""

    def __init__(self, rank, coordinator, *args, host=None, cwd):
        self.rank, self.out, self.err = rank, [], []
        own = ("--save", "m.npz", "--json", "m.json") if rank == 0 else ()
        self.proc = start_dual("cpu", *ELASTIC, "--node-rank", rank, "--coordinator",
                               coordinator, *args, *own, env=dict(PACED, DUAL_MLP_SECRET=SECRET),
                               host=host, cwd=cwd)
        self.readers = [threading.Thread(target=lines.extend, args=(stream,), daemon=True)
                        for stream, lines in ((self.proc.stdout, self.out),
                                              (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    def said(self, words, stream="out", count=1, timeout=240):
        """Wait until ``count`` of its lines hold ``words``."""
        deadline = time.monotonic() + timeout
        while sum(words in line for line in getattr(self, stream)) < count:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"node {self.rank} never said {words!r}: "
                                     f"{''.join(self.err)}")
            time.sleep(0.05)

    def ended(self, timeout=240):
        """Its exit code and all it said (killed, a failed test, past ``timeout``)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"node {self.rank} still running after {timeout} s: "
                                 f"{''.join(self.err)}") from None
        for reader in self.readers:
            reader.join()
        return dict(code=code, out="".join(self.out), err="".join(self.err))


def elastic_run(folder, hosts):
    """Node 2's machine killed after node 0's second epoch, its command
    started again once the run went on without it for two epochs."""
    coordinator = f"{hosts[0].address}:29500"
    nodes = [Node(rank, coordinator, "--epochs", EPOCHS, host=hosts[rank], cwd=folder)
             for rank in range(3)]
    nodes[0].said("epoch 2/")
    hosts[2].signal(signal.SIGKILL)
    nodes[0].said("the run goes on with 2 of its 3 nodes", "err")
    nodes[0].said("15 steps per worker", count=2)
    back = Node(2, coordinator, "--epochs", EPOCHS, host=hosts[2], cwd=folder)
    return [node.ended() for node in (*nodes[:2], back)]


def stage(folder, n, epochs, *args):
    """The oracle's stage: ``n`` nodes on the loopback, node 0 saving o.npz."""
    port = free_port()
    procs = [start_dual("cpu", "--nodes", n, "--node-rank", rank, "--coordinator",
                        f"127.0.0.1:{port}", "--epochs", epochs, *args,
                        *(("--save", "o.npz") if rank == 0 else ()),
                        env={"DUAL_MLP_SECRET": SECRET}, cwd=folder) for rank in range(n)]
    return [finish(proc, 240)[0] for proc in procs]


def lost_for_good(folder, killed, hosts=None):
    """Three nodes, in test ``hosts`` or on the loopback; the nodes
    ``killed`` after node 0's first epoch, for good."""
    coordinator = f"{hosts[0].address}:29500" if hosts else f"127.0.0.1:{free_port()}"
    nodes = [Node(rank, coordinator, "--epochs", EPOCHS, host=hosts and hosts[rank], cwd=folder)
             for rank in range(3)]
    nodes[0].said("epoch 1/")
    for rank in killed:
        if hosts:
            hosts[rank].signal(signal.SIGKILL)
        else:
            os.killpg(nodes[rank].proc.pid, signal.SIGKILL)
    return [node.ended() for rank, node in enumerate(nodes) if rank not in killed]


def oracle_of(run, folder, worlds):
    """A run's oracle: the nodes of each of ``worlds`` in turn, each stage
    up to the epoch the run restarted from next (its last to EPOCHS), from
    the last one's checkpoint; the stages' exit codes (None where the run
    did not restart once for each change)."""
    restarts = [int(e) for e in re.findall(r"at epoch (\d+) \(restart", run[0]["err"])]
    if len(restarts) != len(worlds) - 1:
        return None
    return [stage(folder, n, end, *(("--resume", "o.npz") if i else ()))
            for i, (n, end) in enumerate(zip(worlds, [*restarts, EPOCHS]))]


def make_runs(folder):
    with concurrent.futures.ThreadPoolExecutor() as pool:
        below = pool.submit(lost_for_good, folder / "below", (1, 2))
        node0 = pool.submit(lost_for_good, folder / "node0", (0,))
        with hosts_on_a_bridge(6) as hosts:
            gone = pool.submit(lost_for_good, folder / "gone", (2,), hosts[3:])
            runs = dict(elastic=elastic_run(folder / "elastic", hosts[:3]), gone=gone.result())
        runs.update(below=below.result(), node0=node0.result())
    runs["oracle"] = oracle_of(runs["elastic"], folder / "elastic", (3, 2, 3))
    runs["gone oracle"] = oracle_of(runs["gone"], folder / "gone", (3, 2))
    return runs


@pytest.fixture(scope="module")
def runs():
    if why_no_test_hosts():
        pytest.skip(why_no_test_hosts())

    def make(folder):
        for name in ("elastic", "below", "node0", "gone"):
            (folder / name).mkdir(exist_ok=True)
        return make_runs(folder)
    return made_once("elastic", make)


def test_a_node_lost_for_good_leaves_the_others_training_and_its_return_is_taken_in(runs):
    """Each change in one line on every node: who left or came back, the
    new number of workers, the step's minibatches, the epoch it restarts
    from; exit 0 everywhere; the checkpoint counts each epoch's workers and
    equals the three-stage oracle's, bit for bit."""
    folder, made = runs
    node0, node1, node2 = made["elastic"]
    assert [node0["code"], node1["code"], node2["code"]] == [0, 0, 0], node0["err"]
    shrink = re.compile(r"node 2 \(10\.77\.0\.3\) lost: not heard from for \d+ s at epoch \d+, "
                        r"step \d+; node 2 did not come back within 4 s \(--rejoin-timeout\): "
                        r"the run goes on with 2 of its 3 nodes \(0, 1\): 2 workers, each step "
                        r"SGD on 2 minibatches of 100: restarting every worker from (.+) at "
                        r"epoch (\d+) \(restart 1 of 3\)")
    grow = re.compile(r"node 2 \(10\.77\.0\.3\) came back, taken in at an epoch's end: the run "
                      r"goes on with 3 of its 3 nodes \(0, 1, 2\): 3 workers, each step SGD on "
                      r"3 minibatches of 100: restarting every worker from (.+) at epoch (\d+) "
                      r"\(restart 2 of 3\)")
    for node, own in ((node0, "m.npz"), (node1, "node 0's checkpoint")):
        lines = node["err"].splitlines()
        assert shrink.fullmatch(lines[-2]) and grow.fullmatch(lines[-1]), node["err"]
        assert own in lines[-1]
    assert grow.fullmatch(node2["err"].strip())  # the node taken in says it too
    shrunk, grown = (int(r.fullmatch(line)[2]) for r, line in
                     zip((shrink, grow), node0["err"].splitlines()[-2:]))
    assert 2 <= shrunk < grown < EPOCHS - 1
    assert (f"The workers of each epoch: 3 (epochs 1-{shrunk}), 2 (epochs {shrunk + 1}-{grown}), "
            f"3 (epochs {grown + 1}-{EPOCHS})\n") in node0["out"]
    ckpt = folder / "elastic" / "m.npz"
    state = records.load_checkpoint(str(ckpt), SHAPES, ("epoch_workers",))[2]
    assert state["epoch_workers"] == [3] * shrunk + [2] * (grown - shrunk) + [3] * (EPOCHS - grown)
    assert made["oracle"] == [[0, 0, 0], [0, 0], [0, 0, 0]]
    assert_identical_checkpoints(ckpt, folder / "elastic" / "o.npz", records.TRAINING_STATE)


def test_a_node_lost_for_good_leaves_a_run_that_ends_as_its_two_stage_oracle(runs):
    """Three test hosts, node 2's machine killed and its command never
    started again: nodes 0 and 1 go on once --rejoin-timeout is past, end
    exit 0, and node 0's checkpoint equals, bit for bit, the epochs up to
    the restart trained on three nodes, saved, and resumed on two."""
    folder, made = runs
    assert [node["code"] for node in made["gone"]] == [0, 0], made["gone"][0]["err"]
    assert "node 2 (10.77.0.6) lost: not heard from for " in made["gone"][1]["err"] and \
        "the run goes on with 2 of its 3 nodes (0, 1)" in made["gone"][1]["err"]
    assert made["gone oracle"] == [[0, 0, 0], [0, 0]]
    assert_identical_checkpoints(folder / "gone" / "m.npz", folder / "gone" / "o.npz",
                                 records.TRAINING_STATE)


def test_a_run_left_with_fewer_than_min_nodes_ends_in_one_line(runs):
    (node0,) = runs[1]["below"]
    assert node0["code"] == 1
    last = node0["err"].strip().splitlines()[-1]
    assert last.startswith("error: node ") and "did not come back within 4 s " \
        "(--rejoin-timeout): fewer than 2 nodes (--nodes 2:3) are left; resume " in last, last


def test_a_run_whose_node_0_is_lost_waits_for_node_0_alone(runs):
    for node in runs[1]["node0"]:
        assert node["code"] == 1
        assert "for node 0 to come back at 127.0.0.1:" in node["err"] and \
            "(an elastic run goes on without any node but node 0, whose address is the " \
            "run's)" in node["err"], node["err"]
        assert node["err"].strip().splitlines()[-1].startswith("error: node 0 (127.0.0.1) lost")


@pytest.mark.parametrize("args,words", [
    (["--nodes", "3:2"], "argument --nodes: MIN:MAX needs MIN <= MAX, got 3:2"),
    (["--nodes", "2:3", "--coordinator", "127.0.0.1:29500", "--save", "m.npz"],
     "--nodes 2:3: the nodes change at a checkpoint, each change a restart: give "
     "--max-restarts too"),
    (["--nodes", "2:3", "--coordinator", "127.0.0.1:29500", "--max-restarts", "1"],
     "--nodes 2:3: the nodes change at a checkpoint, node 0's: give it --save too"),
    (["--nodes", "1:2", "--coordinator", "127.0.0.1:29500", "--max-restarts", "1", "--save",
      "m.npz"], "--nodes 1:2: the nodes change at a checkpoint, and 1 node of one worker would "
     "train alone: give MIN 2, or each node two devices (e.g. 'cpu cpu')"),
])
def test_an_elastic_run_is_refused_without_what_it_needs(args, words, capsys):
    out = refused(capsys, "cpu", *args)
    assert out.returncode == 2 and words in out.stderr and len(out.stderr.splitlines()) == 1, \
        out.stderr
