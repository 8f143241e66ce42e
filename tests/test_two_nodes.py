"""Two launchers as two nodes of one run, on this machine: node 0's lobby
before the run's node 1 comes (strangers, a node's odd messages, idle
connections), then the run itself.  One run serves every test here: each
looks at what the module's fixture saw at its own stage."""
import json
import os
import resource
import socket
import threading
import time

import psutil
import pytest
import zmq

from conftest import (
    SECRET,
    child_running,
    finish,
    leftover_workers,
    made_once,
    run_directories,
    run_folder_of,
    start_node,
    wait_for,
    workers_of,
)
from multi_gpu.nodes import curve_keys, free_port

TWO = ("cpu", "cpu")  # the devices of each node: four workers in all

# what a node holding the run's secret might send node 0's lobby: each gets an answer
ODD_MESSAGES = (b'{"node_rank": 1e999, "options": {}}', b"\xff not json",
                b'{"node_rank": "1", "options": []}', b'{"node_rank": 7, "options": {}}', b"[]",
                b'{"node_rank": 1, "options": {"epochs": [1e999]}}')


def lobby_client(context, port, secret=None):
    """A zmq REQ socket to node 0's lobby: a node's with ``secret``, else a
    stranger's, who speaks plain zmq."""
    ask = context.socket(zmq.REQ)
    ask.setsockopt(zmq.LINGER, 0)
    if secret:
        public, private = curve_keys(secret)
        ask.curve_serverkey, ask.curve_publickey, ask.curve_secretkey = public, public, private
    ask.connect(f"tcp://127.0.0.1:{port}")
    return ask


def answered_strangers(port):
    """A stranger in plain zmq and one with another secret ask to join: the
    ones of them answered within 3 s (none, if the lobby is shut to them)."""
    context = zmq.Context()
    try:
        asks = {who: lobby_client(context, port, who)
                for who in (None, "not the run's secret at all")}
        poller = zmq.Poller()
        for ask in asks.values():
            ask.send(b'{"node_rank": 1, "options": {}}')
            poller.register(ask, zmq.POLLIN)
        answered = dict(poller.poll(3000))
        return [who for who, ask in asks.items() if ask in answered]
    finally:
        context.destroy()


def answers_to_odd_messages(port, secret):
    """[the lobby's answer to each of ODD_MESSAGES, or None where none came within 30 s]"""
    context = zmq.Context()
    try:
        answers = []
        for message in ODD_MESSAGES:
            ask = lobby_client(context, port, secret)
            ask.send(message)
            answers.append(ask.recv_json() if ask.poll(30000) else None)
            ask.close()
        return answers
    finally:
        context.destroy()


DESCRIPTORS = 1024  # node 0's, as `ulimit -n 1024` sets them
FLOOD = DESCRIPTORS - 6  # a stranger's connections: all but what a process starts with


def door_of(launcher):
    """Node 0's door: the process of its launcher's that listens (``multi_gpu.door``)."""
    return wait_for(lambda: child_running(launcher, "door.py"), 10, "the door")


def flood(port):
    """A stranger's FLOOD connections to node 0's lobby, at once: [them]."""
    return [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(FLOOD)]


def swell(launcher, port):
    """1100 connections that never speak, and 200 MB sent by a stranger:
    (the open connections, node 0's growth in bytes: its launcher's and
    its door's)."""
    door = door_of(launcher)
    size = launcher.memory_info().rss + door.memory_info().rss
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(1100)]
    with socket.create_connection(("127.0.0.1", port)) as big:
        big.settimeout(20)
        chunk = b"\x01" * (1 << 20)
        try:
            for _ in range(200):
                big.sendall(chunk)
        except OSError:
            pass  # dropped by node 0: as it should
    time.sleep(1)
    return idle, launcher.memory_info().rss + door.memory_info().rss - size


@pytest.fixture(scope="module")
def two_nodes():
    """The run's node 0, at `ulimit -n 1024`, makes the run's secret and
    prints it; at once a stranger opens FLOOD connections to its lobby,
    before node 0 has imported JAX; its lobby then meets, in turn,
    strangers, a node's odd messages, nodes with another secret or none,
    idle connections and a huge message; then node 1 joins,
    given the printed secret, while the idle connections are still open, and
    both train two epochs with --check, --json and --trace.  What was seen
    at each stage, for the tests below (made once: ``made_once``)."""
    folder, seen = made_once("two_nodes", meet_and_train)
    return dict(seen, folder=folder)


def meet_and_train(folder):
    port = free_port()
    same = ("--epochs", 2, "--check", "--timeout", 120, "--trace", folder / "t.json",
            "--trace-steps", 4)  # every node runs the same options
    node0 = start_node(port, 0, *same, "--json", folder / "run.json", devices=TWO,
                       env={"DUAL_MLP_SECRET": ""})
    resource.prlimit(node0.pid, resource.RLIMIT_NOFILE, (DESCRIPTORS, DESCRIPTORS))
    seen, before, idle = {"port": port}, run_directories(), []
    try:
        line = wait_for(lambda: next((line for line in iter(node0.stdout.readline, "")
                                      if "the run's secret" in line), None), 60, "the secret")
        idle = flood(port)
        seen["flood"] = len(idle)
        seen["secret"] = secret = line.split("DUAL_MLP_SECRET=")[1].split()[0]
        launcher = psutil.Process(node0.pid)
        seen["answered_strangers"] = answered_strangers(port)
        seen["answers"] = answers_to_odd_messages(port, secret)
        seen["refused"] = []
        for env in ({"DUAL_MLP_SECRET": "another secret, long enough"}, {"DUAL_MLP_SECRET": ""}):
            stranger = start_node(port, 1, *same, devices=TWO, env=env)
            seen["refused"].append(finish(stranger, timeout=60))
        seen["cannot_start"] = finish(start_node(port, 1, *same, "--save", folder / "n1.npz",
                                                 devices=TWO, env={"DUAL_MLP_SECRET": secret}),
                                      timeout=60)
        unchecked = [a for a in same if a != "--check"]  # node 0 only: both would wait for ever
        seen["refused"].append(finish(start_node(port, 1, *unchecked, devices=TWO,
                                                 env={"DUAL_MLP_SECRET": secret}), timeout=60))
        for s in idle:
            s.close()
        idle, seen["growth"] = swell(launcher, port)
        node1 = start_node(port, 1, *same, devices=TWO, env={"DUAL_MLP_SECRET": secret})
        worker0 = wait_for(lambda: workers_of(node0), 60, "node 0's workers")[0]
        folder0 = run_folder_of(node0)
        seen["coordinator"] = wait_for(lambda: [c.laddr for c in worker0.net_connections("unix")
                                                if c.laddr.startswith(folder0)], 120,
                                       "JAX's coordinator on node 0's worker 0")
        seen["folder0_mode"] = os.stat(folder0).st_mode & 0o777
        seen["nodes"] = [finish(node, timeout=300) for node in (node0, node1)]
        seen["said0"] = node0.out
    finally:
        for s in idle:
            s.close()
    time.sleep(0.2)
    seen["left"] = [[p.pid for p in leftover_workers()],
                    sorted(map(str, run_directories() - before))]
    return seen


def trained(seen):
    """Both nodes trained to the end, and left no worker and no run folder."""
    for code, _, err in seen["nodes"]:
        assert code == 0, err
    assert seen["left"] == [[], []]


def test_only_a_node_holding_the_runs_secret_gets_in_and_a_stranger_learns_nothing(two_nodes):
    """Node 0 makes the run's secret and prints it.  A stranger asking in
    plain zmq, or with another secret, gets no answer at all (no option
    value, no fingerprint, no coordinator address); a node started with
    another secret, or none, is refused in one line; the node given the
    printed secret joins, and both train."""
    assert len(two_nodes["secret"]) >= 16 and two_nodes["secret"] != SECRET
    assert two_nodes["answered_strangers"] == []
    for (code, _, err), words in zip(two_nodes["refused"], (
            "the handshake failed: this node does not hold the run's secret",
            "node 1 needs the run's secret",
            "refused by node 0 at 127.0.0.1:{port}: node 0 runs other options: --check True "
            "there, False here")):
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert words.format(port=two_nodes["port"]) in err, err
    assert len(two_nodes["refused"]) == 3
    trained(two_nodes)


def test_a_node_whose_own_command_is_refused_tells_node_0_at_once(two_nodes):
    """Node 1 given --save (node 0's alone): it ends in one line, exit 2,
    and node 0, waiting for it, says why at once (it went on waiting, and
    the run's node 1 joined later)."""
    code, seconds, err = two_nodes["cannot_start"]
    why = "--save: node 0 keeps the run's checkpoint and summary; give it to node 0 only"
    assert code == 2 and err.strip() == f"dual_mlp.py: error: {why}", err
    assert f"node 0: node 1 at 127.0.0.1 cannot start: its command was refused there: {why}\n" \
        in two_nodes["said0"], two_nodes["said0"]
    trained(two_nodes)


def test_the_lobby_answers_any_message_and_lets_the_real_node_in(two_nodes):
    """Messages a node holding the run's secret could send to node 0's lobby
    each get an answer; the door stays open, and the run's own node 1 joins
    after them."""
    for message, answer in zip(ODD_MESSAGES, two_nodes["answers"]):
        assert answer is not None, f"no answer to {message!r}"
        assert answer["why"], message
    trained(two_nodes)


def test_idle_strangers_and_a_huge_message_neither_keep_the_node_out_nor_swell_node_0(
        two_nodes):
    """1100 connections that never speak, and 200 MB sent by a stranger:
    node 0 stays within 100 MB of its size, and the run's node 1 joins
    while the connections are still open."""
    assert two_nodes["growth"] < 100 << 20
    trained(two_nodes)


def test_a_strangers_flood_as_the_secret_is_printed_leaves_node_0_its_descriptors(two_nodes):
    """Node 0 at `ulimit -n 1024`; the moment it prints the secret, before
    it has imported JAX, a stranger opens all but six of 1024 connections
    to its lobby: they fill its door's descriptors, not the launcher's,
    which goes on, and both nodes train and end exit 0."""
    assert two_nodes["flood"] == FLOOD
    trained(two_nodes)


def test_two_launchers_as_two_nodes_train_identical_replicas(two_nodes):
    trained(two_nodes)
    summary = json.loads((two_nodes["folder"] / "run.json").read_text())
    assert summary["workers"] == 4 and summary["nodes"] == 2
    assert summary["max_replica_diff"] == 0.0
    assert summary["steps_per_epoch"] == 3000 // 100 // 4
    assert summary["validation_errors"][-1] < 0.35  # chance: 0.9


def test_each_node_traces_its_own_workers_beside_node_0s(two_nodes):
    """Two nodes on one machine, both given --trace PATH.json: node 0 writes
    its workers into PATH.json, node 1 its own into PATH.node1.json (a
    shared file system, or one machine, would otherwise have them meet)."""
    from test_trace import spans
    trained(two_nodes)
    for path, workers in (("t.json", {0, 1}), ("t.node1.json", {2, 3})):
        document = json.loads((two_nodes["folder"] / path).read_text())
        assert set(spans(document)) == workers, path
        assert (two_nodes["folder"] / path).with_suffix(".png").stat().st_size > 10000


def test_two_nodes_of_one_machine_meet_where_no_other_user_reaches(two_nodes):
    """Both nodes on this machine (their --coordinator on the loopback):
    JAX's coordinator listens on a Unix socket in node 0's private run
    folder (mode 700), not on a TCP port any local user could connect to."""
    trained(two_nodes)
    assert {os.path.basename(a) for a in two_nodes["coordinator"]} == {"coordinator.sock"}
    assert two_nodes["folder0_mode"] == 0o700


def test_node_0s_door_killed_is_named_as_the_doors(no_leftovers):
    """Node 0's door (its lobby's socket, a process of its own) killed
    mid-run: node 0 ends in one line naming its door, not the other node;
    node 1, which hears no more from node 0, names node 0 lost."""
    import signal

    from conftest import PACED
    port = free_port()
    nodes = [start_node(port, rank, "--epochs", 1000, env=PACED) for rank in (0, 1)]
    wait_for(lambda: next((line for line in iter(nodes[0].stdout.readline, "")
                           if line.startswith("epoch 1/")), None), 120, "a first epoch")
    child_running(nodes[0], "door.py").send_signal(signal.SIGKILL)
    (code0, _, err0), (code1, _, err1) = (finish(node, timeout=60) for node in nodes)
    assert code0 == 1 and err0.strip().splitlines() == [err0.strip()], err0
    assert err0.startswith(f"error: node 0's door, the lobby's socket at 127.0.0.1:{port} (pid "
                           ) and "ended (killed by SIGKILL): no other node can reach this one" \
        in err0, err0
    assert code1 == 1 and err1.startswith("error: node 0 (127.0.0.1) lost: "), err1


def test_a_worker_stopped_20_s_in_its_start_on_node_1_is_waited_for(no_leftovers):
    """--exchange xla across two nodes, node 1's worker stopped (SIGSTOP) for
    20 s as it starts: the workers meet at the coordinator's barrier within
    --timeout, not at gloo's 30 s rendezvous (which ended node 0 in a stack
    trace), and both nodes train and end well."""
    import signal
    port = free_port()
    node0 = start_node(port, 0, "--epochs", 2)
    node1 = start_node(port, 1, "--epochs", 2, env={"DUAL_MLP_FAULT": "1:start:stop"})
    worker = wait_for(lambda: next((w for w in workers_of(node1) if w.status() == "stopped"),
                                   None), 120, "node 1's worker stopped as it starts")
    time.sleep(20)
    worker.send_signal(signal.SIGCONT)
    for node in (node0, node1):
        code, _, err = finish(node, timeout=120)
        assert code == 0, err


def test_node_0_started_again_without_the_runs_secret_is_told_so_on_both_sides(no_leftovers,
                                                                                tmp_path):
    """Node 0 killed and started again with its command as typed, which
    holds no secret (node 0 makes a new one): node 1, which keeps the run's
    last checkpoint, names the secret node 0 lacks and knocks on; node 0
    names the knock it turned away, and does not call its checkpoint
    another run's.  Node 0 started once more, with the
    run's secret: the run goes on and both end well."""
    import signal

    from conftest import PACED
    port = free_port()
    same = ("--epochs", 6, "--max-restarts", 1, "--rejoin-timeout", 120)

    def node0(secret):
        return start_node(port, 0, *same, "--save", tmp_path / "ck.npz", cwd=tmp_path,
                          env=dict(PACED, DUAL_MLP_SECRET=secret))

    first, node1, heard = node0(SECRET), start_node(port, 1, *same), []
    hearing = threading.Thread(target=lambda: heard.extend(iter(node1.stderr.readline, "")))
    hearing.start()
    wait_for(lambda: next((line for line in iter(first.stdout.readline, "")
                           if line.startswith("epoch 2/")), None), 120, "a second epoch")
    os.killpg(first.pid, signal.SIGKILL)
    first.communicate()
    secretless, said = node0(""), []
    refused = wait_for(lambda: next((line for line in iter(secretless.stdout.readline, "")
                                     if said.append(line) or "refused" in line), None), 120,
                       "a knock refused")
    assert f"notice: --save {tmp_path / 'ck.npz'} holds a checkpoint (epoch 2) of an earlier " \
        "run, or of this one before this node 0 was lost" in "".join(said), said
    assert refused.startswith("node 0: refused a node: it does not hold this run's "
                              "secret: "), refused
    assert "DUAL_MLP_SECRET or --secret-file" in refused, refused
    wait_for(lambda: "this node keeps the run's last checkpoint" in "".join(heard), 120,
             "node 1 refused")
    os.killpg(secretless.pid, signal.SIGKILL)
    secretless.communicate()
    last = node0(SECRET)
    (code0, _, err0), (code1, _, _) = (finish(node, timeout=240) for node in (last, node1))
    hearing.join()
    err1 = "".join(heard)
    assert code0 == 0 and code1 == 0, (err0, err1)
    assert "the run's secret in DUAL_MLP_SECRET or --secret-file)" in err1, err1
    assert "the handshake failed: node 0 there does not hold this run's secret (node 0 started " \
        "again needs it: in DUAL_MLP_SECRET or --secret-file on its command); this node keeps " \
        "the run's last checkpoint" in err1, err1
