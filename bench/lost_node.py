"""How soon a node of a run on two machines names the other when it is lost.

    python -m bench.lost_node [--out DIR]          (as root: test hosts)

Two test hosts (``bench/hosts.py``: network namespaces, each its own
address) run README.md's two commands, one CPU worker each, node 0 keeping
a checkpoint; once node 0 has trained its first epoch, a fault strikes node
1 (``hosts.FAULTS``): its cable cut, the machine killed or stopped, one of
its workers killed or stopped.  For each fault in turn, a run of its own:
the seconds from the fault to node 0's end, its exit code and its last
line.  Writes ``lost_node.json`` into ``--out`` (default: ``out/``).
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
from bench.hosts import FAULTS, host_arguments, hosts_on_a_bridge, two_nodes
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
    FAULTS[fault](hosts[1], workers_of(node1.pid)[0])
    return time.monotonic()


def stopped_after(node0, struck, timeout=60):
    """Seconds from ``struck`` to node 0's end (None: it did not end within ``timeout``)."""
    while node0.poll() is None and time.monotonic() < struck + timeout:
        time.sleep(0.05)
    return time.monotonic() - struck if node0.poll() is not None else None


def measure(fault, folder):
    """One run of two test hosts, struck by ``fault``: what node 0 did."""
    with hosts_on_a_bridge(2) as hosts:
        nodes = [start_node(hosts[rank], hosts[0], rank, folder, "--epochs", "1000",
                            *(("--save", "ck.npz") if rank == 0 else ())) for rank in (0, 1)]
        try:
            took = stopped_after(nodes[0], strike(fault, *nodes, hosts))
            hosts[1].signal(signal.SIGCONT)  # a stopped node 1 goes on, finds node 0 gone
            stopped_after(nodes[1], time.monotonic(), 20)
        finally:  # what is left, in either host
            for host in hosts:
                host.signal(signal.SIGCONT)
                host.signal(signal.SIGKILL)
        for left in glob.glob(f"/dev/shm/dual_mlp-{nodes[1].pid}-*") + \
                glob.glob(os.path.join(tempfile.gettempdir(), f"dual_mlp-{nodes[1].pid}-*")):
            shutil.rmtree(left, ignore_errors=True)  # a killed node 1's, which nobody removed
        last = (nodes[0].stderr.read().strip().splitlines() or [""])[-1]
        return dict(fault=fault, stopped_after_s=took, exit_code=nodes[0].wait(), last_line=last)


def table(document):
    lines = [f"{measured_by(document)}: two test hosts (network namespaces), `cpu --nodes 2`, "
             "a fault striking node 1 after node 0's first epoch, a run each; the seconds "
             "until node 0 ended, and its last line.", "",
             "| fault at node 1 | node 0's last line | exit | node 0 ended after |",
             "| --- | --- | --- | --- |"]
    for f in document["figures"]:
        took = "did not end" if f["stopped_after_s"] is None else f"{f['stopped_after_s']:.1f} s"
        lines.append(f"| {f['fault']} | `{f['last_line']}` | {f['exit_code']} | {took} |")
    return "\n".join(lines)


def main():
    parser = Parser(about=__doc__)
    parser.add_argument("--out", default=OUT, help="folder for the JSON")
    args = host_arguments(parser, table)
    figures = []
    with tempfile.TemporaryDirectory() as folder:
        for fault in FAULTS:
            figures.append(measure(fault, folder))
            print(f"  {fault}: node 0 ended after {figures[-1]['stopped_after_s']:.1f} s: "
                  f"{figures[-1]['last_line']}", flush=True)
            os.remove(os.path.join(folder, "ck.npz"))
    show(record("lost_node", args.out, cpu=True, block="lost_node.py", figures=figures), table)


if __name__ == "__main__":
    sys.exit(main())
