"""How soon a node of a run on two machines names the other when it is
lost, and how soon a lost node started again trains again.

    python -m bench.lost_node [--out DIR]          (as root: test hosts)

Two test hosts (``bench/testhosts.py``: network namespaces, each its own
address) run README.md's two commands, one CPU worker each, node 0 keeping
a checkpoint; once node 0 has trained its first epoch, a fault strikes node
1 (``hosts.FAULTS``): its cable cut, the machine killed or stopped, one of
its workers killed or stopped; once it has trained its second, a fault
strikes node 0 (``hosts.NODE0_FAULTS``): its machine killed, its cable cut.
For each fault in turn, a run of its own: the seconds from the fault to the
other node's end, its exit code and its last line.  Then, with
``--max-restarts 1``, node 1's machine killed, and node 0's (its checkpoint
with it), and the command started again 10 s later: the seconds from its
start to its workers training again, and how both nodes ended.
Writes ``lost_node.json`` into ``--out`` (default: ``out/``).
"""
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from bench.common import OUT, measured_by, record, show
from bench.testhosts import FAULTS, NODE0_FAULTS, host_arguments, hosts_on_a_bridge, two_nodes
from multi_gpu.cli import Parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "the secret of a lost-node benchmark's runs"


def start_node(host, node0, rank, folder, *args):
    """README.md's command for node ``rank`` of two, in test host ``host``."""
    return subprocess.Popen(
        host.runs([sys.executable, os.path.join(ROOT, "dual_mlp.py"), *two_nodes(node0, rank),
                   *args]), cwd=folder, env=dict(os.environ, DUAL_MLP_SECRET=SECRET), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def workers_of(pid):
    """The pids of a launcher's workers (Linux's /proc)."""
    found = []
    for child in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{child}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{child}/comm", "rb") as f:
                worker = f.read().startswith(b"dual_mlp w")
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid and worker:
            found.append(int(child))
    return found


def strike(fault, node0, node1, hosts, into=0.0):
    """Once node 0 has trained an epoch (and the fraction ``into`` of the
    next, counted in the first one's time: in seconds, a fault would land in
    a later epoch, or after the run, on a faster machine),
    ``FAULTS[fault]`` strikes node 1; returns when (monotonic seconds)."""
    began = None
    for line in node0.stdout:
        if line.startswith("... training"):
            began = time.monotonic()
        elif line.startswith("epoch 1/"):
            break
    else:
        raise RuntimeError(f"{fault}: node 0 ended before its first epoch: {node0.stderr.read()}")
    epoch = time.monotonic() - began if began else 0.0
    deadline = time.monotonic() + 10
    while not workers_of(node1.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(into * epoch)
    workers = workers_of(node1.pid)
    if not workers:  # what it said, where it has ended (a running node's pipe would block)
        said = node1.stderr.read() if node1.poll() is not None else "(still running)"
        raise RuntimeError(f"{fault}: node 1 has no worker to strike once node 0 has trained "
                           f"an epoch; node 1: exit code {node1.returncode}, {said}")
    FAULTS[fault](hosts[1], workers[0])
    return time.monotonic()


def come_back(victim, nodes, hosts, again, checkpoint=None, after=10.0, epochs=2):
    """Once node 0 has trained ``epochs`` epochs, node ``victim``'s machine is
    killed (and, where it is node 0, its checkpoint removed: a replacement
    machine without its files), and ``after`` s later its command is started
    again (``again()``, which returns its process).  Returns (that process,
    the seconds from its start to its workers training again, what it
    printed until then)."""
    for line in nodes[0].stdout:
        if line.startswith(f"epoch {epochs}/"):
            break
    else:
        raise RuntimeError(f"node 0 ended before its epoch {epochs}: {nodes[0].stderr.read()}")
    hosts[victim].signal(signal.SIGKILL)
    if checkpoint:
        os.remove(checkpoint)
    time.sleep(after)
    started, said = time.monotonic(), []
    proc = again()
    for line in proc.stdout:
        said.append(line)
        if line.startswith("... training"):
            break
    return proc, time.monotonic() - started, "".join(said)


def node0_lost(fault, node0, node1, hosts):
    """Once node 0 has trained two epochs, ``NODE0_FAULTS[fault]`` strikes
    it: (seconds from then to node 1's end, the epoch node 0 was read to
    have trained: its second; on a busy machine its pipe may hold later ones)."""
    epoch = 0
    for line in node0.stdout:
        if line.startswith("epoch "):
            epoch = int(line.split()[1].split("/")[0])
            if epoch == 2:
                break
    NODE0_FAULTS[fault](hosts[0])
    return stopped_after(node1, time.monotonic()), epoch


def stopped_after(node0, struck, timeout=60):
    """Seconds from ``struck`` to node 0's end (None: it did not end within ``timeout``)."""
    while node0.poll() is None and time.monotonic() < struck + timeout:
        time.sleep(0.05)
    return time.monotonic() - struck if node0.poll() is not None else None


def measure(fault, folder):
    """One run of two test hosts, struck by ``fault``: what the other node did."""
    with hosts_on_a_bridge(2) as hosts:
        nodes = [start_node(hosts[rank], hosts[0], rank, folder, "--epochs", "1000",
                            *(("--save", "ck.npz") if rank == 0 else ())) for rank in (0, 1)]
        struck = 0 if fault in NODE0_FAULTS else 1
        try:
            if struck:
                took = stopped_after(nodes[0], strike(fault, *nodes, hosts))
                hosts[1].signal(signal.SIGCONT)  # a stopped node 1 goes on, finds node 0 gone
                stopped_after(nodes[1], time.monotonic(), 20)
            else:
                took = node0_lost(fault, *nodes, hosts)[0]
        finally:  # what is left, in either host
            for host in hosts:
                host.signal(signal.SIGCONT)
                host.signal(signal.SIGKILL)
        drop_folders_of(nodes[struck])
        other = nodes[1 - struck]
        last = (other.stderr.read().strip().splitlines() or [""])[-1]
        return dict(fault=fault, node=struck, stopped_after_s=took, exit_code=other.wait(),
                    last_line=last)


def drop_folders_of(launcher):
    """The run folders of a launcher killed with its host, which nobody removed."""
    for left in glob.glob(f"/dev/shm/dual_mlp-{launcher.pid}-*") + \
            glob.glob(os.path.join(tempfile.gettempdir(), f"dual_mlp-{launcher.pid}-*")):
        shutil.rmtree(left, ignore_errors=True)


def measure_return(victim, folder):
    """--max-restarts 1: node ``victim``'s machine killed and its command
    started again 10 s later (``come_back``): how soon it trained, how the
    two nodes ended, and what the other said meanwhile."""
    with hosts_on_a_bridge(2) as hosts:
        def node(rank):
            return start_node(hosts[rank], hosts[0], rank, folder, "--epochs", "8",
                              "--max-restarts", "1",
                              *(("--save", "back.npz") if rank == 0 else ()))
        nodes = [node(0), node(1)]
        try:
            killed = nodes[victim]
            nodes[victim], took, _ = come_back(victim, nodes, hosts, lambda: node(victim),
                                               os.path.join(folder, "back.npz") if victim == 0
                                               else None)
            ends = [node.communicate(timeout=120) for node in nodes]
        finally:
            for host in hosts:
                host.signal(signal.SIGKILL)
        drop_folders_of(killed)
    said = [line for line in ends[1 - victim][1].splitlines()
            if "waiting up to" in line or "restarting every worker" in line]
    return dict(node=victim, training_again_after_s=took, exit_codes=[n.returncode for n in nodes],
                other_said=said)


def table(document):
    lines = [f"{measured_by(document)}: two test hosts (network namespaces), `cpu --nodes 2`, "
             "a fault striking node 1 after node 0's first epoch, or node 0 after its second, "
             "a run each; the seconds until the other node ended, and its last line.", "",
             "| fault | the other node's last line | exit | it ended after |",
             "| --- | --- | --- | --- |"]
    for f in document["figures"]:
        took = "did not end" if f["stopped_after_s"] is None else f"{f['stopped_after_s']:.1f} s"
        at = "" if f["fault"].startswith("node 0") else " at node 1"
        lines.append(f"| {f['fault']}{at} | `{f['last_line']}` | {f['exit_code']} | {took} |")
    lines += ["", "With `--max-restarts 1`, the machine killed after node 0's second epoch (node "
              "0's checkpoint with it) and the command started again 10 s later:", "",
              "| node started again | training again after | exit codes |",
              "| --- | --- | --- |"]
    for f in document.get("returns", []):
        lines.append(f"| node {f['node']} | {f['training_again_after_s']:.1f} s | "
                     f"{', '.join(map(str, f['exit_codes']))} |")
    return "\n".join(lines)


def summary(document):
    """README.md's line: how soon a lost node is named, node 0 or node 1, and
    how soon one started again trains."""
    def slowest(node):
        return max(f["stopped_after_s"] or float("inf") for f in document["figures"]
                   if f["node"] == node)
    back = {f["node"]: f for f in document.get("returns", [])}
    codes = sorted({c for f in back.values() for c in f["exit_codes"]})
    return (f"{measured_by(document)}: node 1 lost, named within {slowest(1):.1f} s, node 0 "
            f"within {slowest(0):.1f} s; a killed node started again trained after "
            f"{back[1]['training_again_after_s']:.1f} s (node 1), "
            f"{back[0]['training_again_after_s']:.1f} s (node 0); all exit "
            f"{' or '.join(map(str, codes))}{under_load(document)}.")


def under_load(document):
    """Where the figures were taken: the machine's cores and load (an older
    record, without it, says nothing)."""
    load, cores = document.get("load"), document["machine"].get("cores")
    return f" ({cores} cores, load {load['start']:.1f} at the start)" if load and cores else ""


def main():
    parser = Parser(about=__doc__)
    parser.add_argument("--out", default=OUT, help="folder for the JSON")
    args = host_arguments(parser, table)
    figures, returns = [], []
    with tempfile.TemporaryDirectory() as folder:
        for fault in [*FAULTS, *NODE0_FAULTS]:
            figures.append(measure(fault, folder))
            print(f"  {fault}: the other node ended after {figures[-1]['stopped_after_s']:.1f} "
                  f"s: {figures[-1]['last_line']}", flush=True)
            if os.path.exists(os.path.join(folder, "ck.npz")):
                os.remove(os.path.join(folder, "ck.npz"))
        for victim in (1, 0):
            returns.append(measure_return(victim, folder))
            print(f"  node {victim} started again: training after "
                  f"{returns[-1]['training_again_after_s']:.1f} s, exit codes "
                  f"{returns[-1]['exit_codes']}", flush=True)
    show(record("lost_node", args.out, cpu=True, block="lost_node.py", figures=figures,
                returns=returns), table)


if __name__ == "__main__":
    sys.exit(main())
