"""--max-restarts, lost nodes coming back, and blips that lose no run: two
test hosts a run (``bench/testhosts.py``), as on a cluster.

The runs are made once, all at the same time (``restart_runs``), beside an
uninterrupted one, and each test looks at what one of them did:

- blips: node 1's cable cut and mended, or node 0's door stopped and let go
  on, for a few seconds, with and without --max-restarts; a cut as node 0
  reports its last epoch.  A silence shorter than ``nodes.LOST_AFTER``
  changes nothing; a longer one is a loss and a return: with --max-restarts
  the run starts again from its last checkpoint and ends as the
  uninterrupted run, bit for bit; without, each node ends in one line
  naming the other;
- returns: a worker killed; node 1's machine killed and its command started
  again; node 0's killed twice (its checkpoint with it), or started again
  with other options before the right ones, or lost as node 1 comes back.
  Each ends as the uninterrupted run, bit for bit.
"""
import concurrent.futures
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time

import pytest

from bench.lost_node import workers_of
from bench.testhosts import BLIPS, hosts_on_a_bridge, two_nodes, why_no_test_hosts
from conftest import PACED, assert_identical_checkpoints, made_once, run_directories, start_dual
from multi_gpu.nodes import LOST_AFTER

pytestmark = pytest.mark.skipif(bool(why_no_test_hosts()), reason=str(why_no_test_hosts()))

EPOCHS = 48  # enough for every blip of a run to strike mid-run, each once the last has settled
# a door stopped leaves the workers training (their sockets are their own): a run whose
# door stops is paced to outlast it
SLOWER = {"DUAL_MLP_FAULT": "0:train:slow=0.5"}
# name: (--max-restarts, the pace, its blips in turn: (what, seconds)); the first strikes
# once node 0 has reported its second epoch, each next at its next epoch once the last has
# settled; where the last is "at the end", as node 0 reports its last epoch
BLIP_RUNS = {
    "blips": (6, SLOWER, [("door", 8), ("cut", 3), ("cut", 5), ("cut", 6), ("cut", 8),
                          ("cut", 12)]),
    "cut 8 s, no restarts": (0, PACED, [("cut", 8)]),
    "door 8 s, no restarts": (0, SLOWER, [("door", 8)]),
    "cut 3 s, then as the last epoch is reported": (0, PACED, [("cut", 3), ("cut", 8)]),
}
RETURNS = ("worker killed, node 1 back", "node 0 back twice", "node 0 lost as node 1 comes back")


def slug(name):
    return name.replace(" ", "-").replace(",", "")


class Node:
    """A node's launcher in its test host: what it prints, line by line as
    it comes (with when), read by threads of their own."""

    started = []  # every one, those killed and started again too

    def __init__(self, folder, hosts, rank, name, *args, env=PACED):
        self.rank, self.out, self.err = rank, [], []
        Node.started.append(self)
        own = ("--save", f"{slug(name)}.npz", "--json", f"{slug(name)}.json") if rank == 0 \
            else ()
        self.proc = start_dual(*two_nodes(hosts[0], rank), "--epochs", EPOCHS, "--secret-file",
                               "secret", *args, *own, env=env, host=hosts[rank], cwd=folder)
        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self.listen, args=(stream, lines), daemon=True).start()

    @staticmethod
    def listen(stream, lines):
        with stream:
            for line in stream:
                lines.append((time.monotonic(), line))

    def said(self, start, timeout=180, stream="out"):
        """Wait for a line of its output (or error output) that starts so."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(line.startswith(start) for _, line in getattr(self, stream)):
                return
            if self.proc.poll() is not None and self.proc.stdout.closed:
                break
            time.sleep(0.05)
        raise AssertionError(f"node {self.rank} never said {start!r}: {self.text('err')}")

    def said_after(self, matches, since, timeout=180):
        """Wait for a line of its output that ``matches``, printed after
        ``since`` (monotonic seconds); False where the launcher ends first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(t > since and matches(line) for t, line in self.out):
                return True
            if self.proc.poll() is not None and self.proc.stdout.closed:
                return False
            time.sleep(0.05)
        raise AssertionError(f"node {self.rank}: no such line after {timeout} s: "
                             f"{self.text('err')}")

    def text(self, stream="out"):
        return "".join(line for _, line in getattr(self, stream))

    def ended(self, timeout=240):
        """Its exit code, once all it said is read; killed (a failed test)
        where it runs past ``timeout``."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"node {self.rank} still running after {timeout} s: "
                                 f"{self.text('err')}") from None
        while not (self.proc.stdout.closed and self.proc.stderr.closed):
            time.sleep(0.05)
        return self.proc.returncode


def blips(name, folder, hosts):
    """Each of the run's blips in turn, at node 0's epochs: node 1's cable,
    or node 0's door.  Returns the nodes, and when each blip struck."""
    restarts, pace, strikes = BLIP_RUNS[name]
    nodes = [Node(folder, hosts, rank, name, "--max-restarts", restarts, env=pace)
             for rank in (0, 1)]
    struck = []
    for n, (what, seconds) in enumerate(strikes):
        at_the_end = name.endswith("as the last epoch is reported") and n == len(strikes) - 1
        if not nodes[0].said_after(functools.partial(reported, EPOCHS if at_the_end else 2),
                                   settled(nodes[0], struck)):
            break  # the run ended
        struck.append(time.monotonic())
        BLIPS[what](hosts[1] if what == "cut" else hosts[0], seconds)
    return nodes, struck


def reported(epoch, line):
    """Is ``line`` node 0's line of an epoch past ``epoch`` - 1?"""
    return line.startswith("epoch ") and int(line.split()[1].split("/")[0]) >= epoch


def settled(node0, struck):
    """When node 0 has shown what the last blip did (monotonic seconds): a
    silence is named after ``LOST_AFTER`` s, and a restart, where there is
    one, has its workers training again."""
    if not struck:
        return 0.0
    since = time.monotonic()
    time.sleep(LOST_AFTER + 2)
    restarted = [t for t, line in node0.err if t > struck[-1]
                 and "restarting every worker" in line]
    if restarted:
        node0.said_after(lambda line: line.startswith("... training"), restarted[-1])
    return max(since, *(t for t, line in node0.out if line.startswith("... training")
                        and t > struck[-1]), 0.0)


def returns(name, folder, hosts):
    """A return of its own (``RETURNS``), struck as the run goes; the nodes
    as they end (the last started of each rank), and what was struck."""
    def node(rank, *args):
        return Node(folder, hosts, rank, name, "--max-restarts", 3, *args)

    def kill(rank, after_epoch):  # its machine, and node 0's checkpoint with it
        nodes[0].said(f"epoch {after_epoch}/")
        hosts[rank].signal(signal.SIGKILL)
        if rank == 0:
            os.remove(folder / f"{slug(name)}.npz")
    nodes = [node(0), node(1)]
    if name == "worker killed, node 1 back":
        nodes[0].said("epoch 1/")
        time.sleep(random.uniform(0, 0.5))  # into its second epoch
        os.kill(workers_of(nodes[1].proc.pid)[0], signal.SIGKILL)
        kill(1, 5)
        nodes.append(nodes[1])
        time.sleep(5)
        nodes[1] = node(1)
        nodes[0].said("epoch 9/")
        BLIPS["stop"](hosts[0], 15)  # node 0's machine stopped 15 s, then let go on
    elif name == "node 0 back twice":  # started again with other options first, twice
        kill(0, 3)
        for wrong in (("--learning-rate", 0.2), ("--n-hidden", 100)):
            refused = node(0, *wrong)
            refused.said("node 0: refused node 1 at ")
            nodes[1].said("node 1: refused by node 0 at ", stream="err")
            hosts[0].signal(signal.SIGKILL)
            refused.ended()
            nodes.append(refused)
        nodes[0] = node(0)
        kill(0, 8)
        time.sleep(5)
        nodes[0] = node(0)
    else:  # node 0 lost as node 1 comes back
        kill(1, 3)
        time.sleep(5)
        nodes[1] = node(1)
        nodes[1].said("node 1 of 2: back in node 0's run at ")
        hosts[0].signal(signal.SIGKILL)
        os.remove(folder / f"{slug(name)}.npz")
        time.sleep(5)
        nodes[0] = node(0)
    return nodes, []


def run_all(folder):
    before = run_directories()
    secret = folder / "secret"
    secret.write_text("a secret of the restart tests' own runs")
    secret.chmod(0o600)
    names = ["whole", *BLIP_RUNS, *RETURNS]
    seen = {}
    with hosts_on_a_bridge(2 * len(names)) as hosts:
        pairs = {name: hosts[2 * i:2 * i + 2] for i, name in enumerate(names)}
        whole = [Node(folder, pairs["whole"], rank, "whole") for rank in (0, 1)]
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            runs = {name: pool.submit(blips if name in BLIP_RUNS else returns, name, folder,
                                      pairs[name]) for name in names[1:]}
            runs = {name: future.result() for name, future in runs.items()}
        runs["whole"] = (whole, [])
        for name, (nodes, struck) in runs.items():
            seen[name] = []
            for node in nodes:
                code = node.ended()
                restarts = [[line for t, line in node.err if begin <= t < end
                             and "restarting every worker" in line]
                            for begin, end in zip(struck, struck[1:] + [float("inf")])]
                seen[name].append(dict(code=code, out=node.text(), err=node.text("err"),
                                       restarts=restarts))
        seen["hosts"] = {name: [h.address for h in pair] for name, pair in pairs.items()}
    time.sleep(0.2)
    # a launcher killed with its machine leaves its folders: nobody is there to remove them
    killed = {str(node.proc.pid) for node in Node.started if node.proc.wait() == -signal.SIGKILL}
    left = run_directories() - before
    for leftover in (f for f in left if f.name.split("-")[1] in killed):
        shutil.rmtree(leftover)
    seen["left"] = sorted(str(f) for f in left if f.name.split("-")[1] not in killed)
    return seen


@pytest.fixture(scope="module")
def restart_runs():
    folder, seen = made_once("restart_runs", run_all)
    return dict(seen, folder=folder)


def ended_as_the_uninterrupted_run(runs, name):
    folder = runs["folder"]
    assert runs["left"] == []
    for node in runs["whole"]:
        assert node["code"] == 0, node["err"]
    for node in runs[name][:2]:
        assert node["code"] == 0, (name, node["err"])
        assert "error" not in node["err"] and "Traceback" not in node["err"] + node["out"], \
            (name, node["err"])
    assert_identical_checkpoints(folder / f"{slug(name)}.npz", folder / "whole.npz")


def restarts_said(node):
    return [line for line in node["err"].splitlines() if "restarting every worker" in line]


def test_blips_with_restarts_end_as_the_uninterrupted_run(restart_runs):
    """--max-restarts, node 0's door stopped 8 s, then node 1's cable cut and
    mended after 3, 5, 6, 8 and 12 s, in turn: both nodes exit 0, and the
    checkpoint equals the uninterrupted run's, bit for bit.  A silence under
    the lost-bound changes nothing (3 s); a longer one is one restart, said
    on both nodes (5 and 6 s: a silence that TCP's back-off may stretch past
    the bound)."""
    counted = [[len(r) for r in node["restarts"]] for node in restart_runs["blips"]]
    print(f"restarts counted after each blip, on node 0 and node 1: {counted}")
    ended_as_the_uninterrupted_run(restart_runs, "blips")
    assert len(counted[0]) == len(BLIP_RUNS["blips"][2]), counted  # each struck mid-run
    for n, (what, seconds) in enumerate(BLIP_RUNS["blips"][2]):
        counts = {node[n] for node in counted}
        assert len(counts) == 1 and counts <= ({0} if seconds < 5 else {1} if seconds > 6
                                               else {0, 1}), (what, seconds, counted)


@pytest.mark.parametrize("name", ["cut 8 s, no restarts", "door 8 s, no restarts"])
def test_without_restarts_a_long_blip_ends_both_nodes_in_one_line_naming_the_other(
        restart_runs, name):
    """No --max-restarts: a cut of 8 s, or node 0's door stopped 8 s, ends
    both nodes, exit 1, in one line each that names the other."""
    node0, node1 = restart_runs["hosts"][name]
    for node, other in zip(restart_runs[name], (f"node 1 ({node1})", f"node 0 ({node0})")):
        assert node["code"] == 1, node["err"]
        assert node["err"].strip().splitlines() == [node["err"].strip()], node["err"]
        assert node["err"].startswith(f"error: {other} lost: not heard from for "), node["err"]


def test_a_short_cut_changes_nothing_and_one_as_the_last_epoch_is_reported_is_no_failure(
        restart_runs):
    """No --max-restarts: a cut of 3 s changes nothing (no word); the cable
    cut 8 s as node 0 prints its last epoch line: the run is trained and
    written, so both nodes end exit 0, node 0's summary and checkpoint
    written, each saying only what happened after the last epoch."""
    name = "cut 3 s, then as the last epoch is reported"
    ended_as_the_uninterrupted_run(restart_runs, name)
    for node in restart_runs[name]:
        assert [len(r) for r in node["restarts"]] == [0, 0]
        assert all(line.startswith("notice: ") and line.endswith(
            "after the last epoch was trained and written: the run is finished")
            for line in node["err"].splitlines()), node["err"]
    summary = json.loads((restart_runs["folder"] / f"{slug(name)}.json").read_text())
    assert summary["epochs_run"] == EPOCHS


def test_a_worker_killed_a_lost_node_1_and_a_stopped_node_0_restart_the_run(restart_runs):
    """--max-restarts 3, node 1's worker SIGKILLed at a random moment of the
    second epoch: node 0 starts every worker of both nodes again from its
    last checkpoint, which it sends node 1, each node saying so in one line;
    then node 1's machine killed after epoch 5 and its command started
    again: node 0 says, in one line, that it waits for it, node 1 that it
    is back; then node 0's machine stopped 15 s: node 1 knocks again as it
    comes back, and is taken back.  The run ends as the uninterrupted one."""
    name = "worker killed, node 1 back"
    node1_address = restart_runs["hosts"][name][1]
    ended_as_the_uninterrupted_run(restart_runs, name)
    node0, node1, node1_before = restart_runs[name]
    said = restarts_said(node0)
    assert len(said) == 3 and said[2].endswith("(restart 3 of 3)"), node0["err"]
    assert said[0].startswith(f"node 1 ({node1_address}): worker 1 (device cpu) failed: killed "
                              "by SIGKILL") and said[0].endswith("(restart 1 of 3)"), said
    assert said[1].startswith(f"node 1 ({node1_address}) lost: ") and \
        said[1].endswith("(restart 2 of 3)"), said
    assert len(restarts_said(node1_before)) == 1, node1_before["err"]
    waits = [line for line in node0["err"].splitlines() if "waiting up to 300 s for node " in line]
    assert len(waits) == 1 and waits[0].startswith(f"node 1 ({node1_address}) lost: "), waits
    assert node1["out"].startswith("node 1 of 2: back in node 0's run at "), node1["out"]
    assert len(restarts_said(node1)) == 2, node1["err"]


def test_node_1_keeps_the_run_through_node_0_lost_twice_and_given_other_options(restart_runs):
    """Node 0's machine killed, its checkpoint with it, and its command
    started again with another learning rate, then another --n-hidden (whose
    checkpoint is another size): each is refused in one line on both sides,
    node 1 keeping the run's only checkpoint and knocking again, until node 0
    comes back with the run's options and takes the run back from node 1's
    copy; then lost again, and back again the same way."""
    name = "node 0 back twice"
    ended_as_the_uninterrupted_run(restart_runs, name)
    node0, node1, lr, hidden = restart_runs[name]
    address = restart_runs["hosts"][name][1]
    for wrong, theirs, mine in ((lr, "--learning-rate 0.13", "0.2"),
                                (hidden, "--n-hidden 500", "100")):
        assert f"node 0: refused node 1 at {address}: it runs other options: {theirs} there, " \
            f"{mine} here" in wrong["out"], wrong["out"]
    refusals = [line for line in node1["err"].splitlines() if "refused by node 0" in line]
    assert len(refusals) == 2 and all("this node keeps the run's last checkpoint" in line
                                      for line in refusals), node1["err"]
    assert "from node 1's copy of the run's checkpoint at epoch " in node0["err"], node0["err"]
    assert len(restarts_said(node1)) == 2, node1["err"]


def test_node_0_lost_as_node_1_comes_back_is_knocked_for_again(restart_runs):
    """Node 1's machine killed and its command started again; node 0's
    killed as node 1 gets back in: node 1 knocks again, and node 0 started
    again takes the run in (from its first epoch: no checkpoint survived)."""
    ended_as_the_uninterrupted_run(restart_runs, "node 0 lost as node 1 comes back")
    node0, node1 = restart_runs["node 0 lost as node 1 comes back"]
    assert "waiting up to 300 s for node 0 to come back" in node1["err"], node1["err"]
