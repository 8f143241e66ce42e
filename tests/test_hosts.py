"""Runs of several machines for real: each node in a test host of its own
(a network namespace on one bridge, its own interface and address), as
README.md's several-machines commands run on a cluster.  One machine
cannot stand for several any other way: on 127.0.0.1 gloo and JAX's
coordinator find each other whatever the flags say.

The runs are made once, all at the same time (``host_runs``), and each
test looks at what they did: an uninterrupted run, one run for each way a
node is lost (its cable cut, the machine killed or stopped, one of its
workers killed or stopped), each struck in its second epoch, node 0 lost
(its machine killed, its cable cut) after its second.  Restarts and
returns (--max-restarts) are tests/test_restarts.py's."""
import concurrent.futures
import shlex
import shutil
import signal
import time

import pytest

from bench.lost_node import node0_lost, stopped_after, strike
from bench.testhosts import FAULTS, NODE0_FAULTS, hosts_on_a_bridge, two_nodes, why_no_test_hosts
from conftest import (
    PACED,
    assert_identical_checkpoints,
    finish,
    made_once,
    run_directories,
    start_dual,
    wait_for,
)

pytestmark = pytest.mark.skipif(bool(why_no_test_hosts()), reason=str(why_no_test_hosts()))

EPOCHS = 10  # the uninterrupted run's and the resumed one's: a strike read late
# from node 0's pipe on a busy machine (CI saw it 7 epochs behind) still lands mid-run
# How soon the node left behind stops: a quiet machine, these runs alone, stops
# within 15 s (bench/results/lost_node.json: under 8 s); this bound is what one
# running two other copies of the suite met (up to 21 s: its seconds are the
# machine's, while the runs count their silences in their own, LOST_AFTER)
STOPS_WITHIN_S = 30
NAMED = {  # the words node 0's last line names each of bench.testhosts.FAULTS by
    "cut cable": "lost: not heard from for", "killed node": "lost: not heard from for",
    "stopped node": "lost: not heard from for",
    "killed worker": ": worker 1 (device cpu) failed: killed by SIGKILL",
    "stopped worker": ": worker 1 (device cpu) stopped: silent for"}


def node(folder, host, coordinator, rank, *args, env=None):
    """README's command for node ``rank`` of a run of two CPU machines, in
    ``host`` (in ``folder``, which its paths are relative to): node 0 at
    ``coordinator``, one worker each."""
    return start_dual(*two_nodes(coordinator, rank), *args, env=env, host=host, cwd=folder)


def checkpoint(fault):
    return fault.replace(" ", "-") + ".npz"


def readme_commands(hosts):
    """README.md's two commands for two machines, as typed, each on its test
    host: its address for 10.0.0.1, its interface for eth0; node 1's secret
    is the one node 0 prints (``run_secret``).  [(environment, arguments)]"""
    import re

    from conftest import ROOT
    text = (ROOT / "README.md").read_text()
    block = re.search(r"# machine A \(10\.0\.0\.1\).*?```", text, re.S).group(0)
    commands = []
    for line, host in zip([c for c in block.splitlines() if "python dual_mlp.py" in c], hosts):
        line = line.replace("10.0.0.1", hosts[0].address).replace("eth0", host.interface)
        env, _, args = line.partition("python dual_mlp.py ")
        commands.append((dict(w.split("=", 1) for w in shlex.split(env)), shlex.split(args)))
    return commands


def read_secret(node0):
    """The secret node 0 prints, as a user reads it off its terminal."""
    line = wait_for(lambda: next((line for line in iter(node0.stdout.readline, "")
                                  if "DUAL_MLP_SECRET=" in line), None), 60, "the run's secret")
    return line.split("DUAL_MLP_SECRET=")[1].split()[0]


def time_to_stop(name, node0, node1, hosts):
    """Seconds from ``name``'s strike at node 1 (``strike``) to node 0's end."""
    return stopped_after(node0, strike(name, node0, node1, hosts))


def run_on_hosts(folder):
    """Every run at once, two test hosts each: what each node printed, how
    it ended, how long after the fault node 0 stopped; then the cut cable's
    run resumed, as node 0's last line says, to the uninterrupted run's end."""
    secret_file = folder / "secret"
    secret_file.write_text("a secret of the tests' own runs, in a file")
    secret_file.chmod(0o600)
    seen, before, gone = {}, run_directories(), []  # gone: launchers killed with their host
    names = ["whole", *FAULTS, *NODE0_FAULTS]
    with hosts_on_a_bridge(2 * len(names)) as hosts:
        pairs = {name: hosts[2 * i:2 * i + 2] for i, name in enumerate(names)}
        # the uninterrupted run, as README.md says: node 0 makes the secret and prints it,
        # node 1 is given it
        (env0, args0), (env1, args1) = readme_commands(pairs["whole"])
        same = ("--epochs", EPOCHS, "--check")
        whole0 = start_dual(*args0, *same, "--json", "whole.json", "--save", "whole.npz",
                            env=dict(env0, DUAL_MLP_SECRET=""), host=pairs["whole"][0],
                            cwd=folder)
        env1["DUAL_MLP_SECRET"] = read_secret(whole0)
        whole1 = start_dual(*args1, *same, env=env1, host=pairs["whole"][1], cwd=folder)
        # the others once it has compiled: they read its programs from XLA's cache
        wait_for(lambda: next((line for line in iter(whole0.stdout.readline, "")
                               if line.startswith("... training")), None), 120, "training")
        struck = {}
        for name in FAULTS:
            h = pairs[name]
            same = ("--epochs", 1000, "--secret-file", "secret")
            struck[name] = [node(folder, h[0], h[0], 0, *same, "--save", checkpoint(name),
                                 env=PACED), node(folder, h[1], h[0], 1, *same, env=PACED)]
        for name in NODE0_FAULTS:
            h = pairs[name]
            struck[name] = [node(folder, h[i], h[0], i, "--epochs", 1000, "--secret-file",
                                 "secret", env=PACED) for i in (0, 1)]

        # each struck as soon as it has trained its first epoch: the others train meanwhile
        with concurrent.futures.ThreadPoolExecutor(len(struck)) as pool:
            took = dict(zip(struck, pool.map(lambda name: (
                node0_lost if name in NODE0_FAULTS else time_to_stop)(
                name, *struck[name], pairs[name]), struck)))
        for name, (node0, node1) in struck.items():
            if name in NODE0_FAULTS:
                (took[name], epoch), (code, _, err) = took[name], finish(node1, timeout=1)
                # node 0's last epoch: what it printed to its end, which the strike may have
                # left unread in its pipe on a busy machine (the line read was its second)
                finish(node0, timeout=30)
                epoch = max([epoch] + [int(line.split()[1].split("/")[0])
                                       for line in node0.out.splitlines()
                                       if line.startswith("epoch ")])
                seen[name] = dict(code=code, took=took[name], err=err, out=node1.out, epoch=epoch)
                gone.append(node0.pid)
                continue
            code, _, err = finish(node0, timeout=1)
            seen[name] = dict(code=code, took=took[name], err=err, out=node0.out)
            pairs[name][1].signal(signal.SIGCONT)
            seen[name]["node1"] = finish(node1, timeout=60)[::2]
        seen["whole"] = [finish(p, timeout=120)[::2] for p in (whole0, whole1)]
        seen["node1_said"] = whole1.out
        # resumed as node 0's last line says (to the uninterrupted run's epochs), and node 1
        # as its own says, with node 0's checkpoint
        line = seen["cut cable"]["err"].strip().splitlines()[-1]
        command = shlex.split(line.split("; resume (epoch ")[1].split("): ", 1)[1])
        command[command.index("--epochs") + 1] = str(EPOCHS)
        h = pairs["whole"]
        resumed = [node(folder, h[0], h[0], 0, *command[command.index("--coordinator") + 2:]),
                   node(folder, h[1], h[0], 1, "--epochs", EPOCHS, "--secret-file", "secret",
                        "--resume", checkpoint("cut cable"))]
        seen["resumed"] = [finish(p, timeout=120)[::2] for p in resumed]
        gone.append(struck["killed node"][1].pid)
    time.sleep(0.2)
    left, gone = run_directories() - before, set(map(str, gone))
    for folder in (f for f in left if f.name.split("-")[1] in gone):
        shutil.rmtree(folder)  # nobody was left there to remove it
    seen["left"] = sorted(str(f) for f in left if f.name.split("-")[1] not in gone)
    seen["hosts"] = {name: [h.address for h in pair] for name, pair in pairs.items()}
    return seen


@pytest.fixture(scope="module")
def host_runs():
    folder, seen = made_once("host_runs", run_on_hosts)
    return dict(seen, folder=folder)


def test_two_test_hosts_train_identical_replicas_as_the_readme_says(host_runs):
    """README.md's commands for two machines, as typed: node 0 prints the
    run's secret, node 1 is given it in its environment; one worker on each
    machine; the replicas agree to the bit."""
    import json
    for code, err in host_runs["whole"]:
        assert code == 0, err
    summary = json.loads((host_runs["folder"] / "whole.json").read_text())
    assert summary["workers"] == 2 and summary["nodes"] == 2
    assert summary["max_replica_diff"] == 0.0
    assert host_runs["left"] == []


def test_a_node_other_than_0_speaks_for_itself(host_runs):
    """Node 1's own terminal: that it joined node 0 (its address) and which
    worker it runs, each epoch it trained, and its end."""
    node0 = host_runs["hosts"]["whole"][0]
    lines = host_runs["node1_said"].splitlines()
    assert lines[0] == f"node 1 of 2: joined node 0 at {node0}:29500; worker 1 of 2 here, on cpu"
    epochs = [line for line in lines if line.startswith("node 1: epoch ")]
    assert [line.split(":")[1] for line in epochs] == [
        f" epoch {e}/{EPOCHS}" for e in range(1, EPOCHS + 1)], lines
    assert all(line.endswith("samples/s); node 0 validates") for line in epochs)
    assert lines[-1].startswith("node 1: done; total wall time ") and lines[-1].endswith(
        f"node 0 ({node0}) keeps the run's checkpoint and summary"), lines
    assert not any(line.startswith(("epoch ", "Optimization complete")) for line in lines)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_lost_node_is_named_by_the_other_soon(host_runs, fault):
    """Whichever way node 1 is lost, node 0 stops soon (``STOPS_WITHIN_S``), exit 1, in
    one line of at most 300 characters that names node 1 and its address,
    the epoch and step, the checkpoint and the command that resumes; nothing
    it prints reads as a crash; its checkpoint is intact."""
    from conftest import SHAPES
    from multi_gpu import records
    seen, node1 = host_runs[fault], host_runs["hosts"][fault][1]
    print(f"{fault}: node 0 stopped {seen['took']:.1f} s after it struck: {seen['err']}")
    assert seen["code"] == 1 and seen["took"] < STOPS_WITHIN_S
    lines = seen["err"].strip().splitlines()
    assert len(lines) == 1, seen["err"]
    line = lines[0]
    assert line.startswith(f"error: node 1 ({node1})") and NAMED[fault] in line, line
    assert " at epoch " in line and ", step " in line and "; resume (epoch " in line
    assert line.endswith(f" --resume {checkpoint(fault)}") and "python dual_mlp.py " in line
    assert len(line) <= 300, len(line)
    for crash in ("Traceback", "Error dispatching", "F1", "Fatal", "Gloo"):
        assert crash not in seen["err"] + seen["out"], crash
    records.load_checkpoint(str(host_runs["folder"] / checkpoint(fault)), SHAPES)


def test_the_node_left_behind_a_cut_cable_names_node_0(host_runs):
    """Across a cut cable each side sees the other lost: node 1 says so of
    node 0, in one line, and ends."""
    code, err = host_runs["cut cable"]["node1"]
    node0 = host_runs["hosts"]["cut cable"][0]
    assert code == 1 and err.strip().splitlines() == [err.strip()], err
    assert err.startswith(f"error: node 0 ({node0}) lost: not heard from for"), err


def test_a_run_resumed_after_a_lost_node_ends_as_the_uninterrupted_one(host_runs):
    """The cut cable's checkpoint, resumed with node 0's printed command,
    ends with the uninterrupted run's weights, bit for bit."""
    for code, err in host_runs["resumed"]:
        assert code == 0, err
    folder = host_runs["folder"]
    assert_identical_checkpoints(folder / checkpoint("cut cable"), folder / "whole.npz")
    assert host_runs["left"] == []


@pytest.mark.parametrize("fault", NODE0_FAULTS)
def test_node_1_names_a_lost_node_0_soon_and_reports_no_step_after(host_runs, fault):
    """Node 0's machine killed, or its cable cut, after its second epoch:
    node 1 ends soon (``STOPS_WITHIN_S``), exit 1, in one line that names node 0 and its
    address, with no traceback or runtime line, and reports no epoch that
    node 0 did not train with it (an all-reduce that came back without it
    is not a step)."""
    seen, node0 = host_runs[fault], host_runs["hosts"][fault][0]
    print(f"{fault}: node 1 stopped {seen['took']:.1f} s after it struck: {seen['err']}")
    assert seen["code"] == 1 and seen["took"] < STOPS_WITHIN_S
    assert seen["err"].strip().splitlines() == [seen["err"].strip()], seen["err"]
    assert seen["err"].startswith(f"error: node 0 ({node0}) lost: not heard from for"), seen["err"]
    epochs = [int(line.split()[3].split("/")[0]) for line in seen["out"].splitlines()
              if line.startswith("node 1: epoch ")]
    assert epochs and max(epochs) <= seen["epoch"] + 1, (seen["epoch"], epochs)
    for crash in ("Traceback", "XLA's runtime", "F1", "Fatal", "Gloo", "abort"):
        assert crash not in seen["err"] + seen["out"], crash
