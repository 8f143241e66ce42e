"""Sixteen machines of one CPU worker each: how long they take to meet and
compile, a step, and how soon every node names a host whose cable is cut.

    python -m bench.many_hosts [--hosts 16] [--out DIR]     (as root: test hosts)

``--hosts`` test hosts (``bench/testhosts.py``: network namespaces on one
bridge, each its own address) each run README.md's command for one node
(``cpu --nodes N --node-rank R --coordinator ...``, the secret in a file),
twice.  The first run trains an epoch with ``--check``: every node's exit
code and last line, the seconds from the start to node 0's first step, its
step, and the replicas' largest difference.  The second, whose start-up is
timed too (its programs in XLA's cache by then: the machine's pace), is
struck once node 0's workers train (its first step under way, every node's
with it, an epoch being 15 s of sixteen workers on two cores): the middle
host's cable is cut, and for every node, the seconds until it ended, its
exit code and its last line.
Writes ``many_hosts.json`` into ``--out`` (default: ``out/``).
"""
import os
import re
import subprocess
import sys
import tempfile
import time

from bench.common import OUT, measured_by, record, show
from bench.testhosts import host_arguments, hosts_on_a_bridge
from multi_gpu.cli import Parser, positive_int

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_nodes(hosts, folder, *args):
    """README.md's command for every node, each in its test host, in ``folder``."""
    return [subprocess.Popen(
        host.runs([sys.executable, os.path.join(ROOT, "dual_mlp.py"), "cpu", "--nodes",
                   str(len(hosts)), "--node-rank", str(rank), "--coordinator",
                   f"{hosts[0].address}:29500", "--secret-file", "secret", *args]),
        cwd=folder, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True) for rank, host in enumerate(hosts)]


def ended(node, timeout):
    """(exit code, its last line: of its error output where it has one, what
    it printed from here on, its error output), or None for each where it did
    not end within ``timeout`` s."""
    try:
        out, err = node.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, None, None, None
    return node.returncode, ((err.strip() or out.strip()).splitlines() or [""])[-1], out, err


def whole_run(hosts, folder):
    """An epoch, --check (the replicas compared after every step): every
    node's end, node 0's start-up, step and check."""
    started = time.monotonic()
    nodes = start_nodes(hosts, folder, "--epochs", "1", "--check")
    out0 = []
    for line in nodes[0].stdout:
        out0.append(line)
        if line.startswith("... training"):
            break
    start_up = time.monotonic() - started
    ends = [ended(nodes[0], 600)] + [ended(node, 60) for node in nodes[1:]]
    text = "".join(out0) + (ends[0][2] or "")
    step = re.search(r"(\d+) us per step", text)
    check = re.search(r"max difference between the replicas after an exchange: (\S+)", text)
    return dict(start_up_s=start_up, step_us=step and int(step.group(1)),
                max_replica_diff=check and float(check.group(1)),
                codes=[end[0] for end in ends], last_lines=[end[1] for end in ends])


def cut_run(hosts, folder):
    """The middle host's cable cut once node 0's workers train: when, and
    how, every other node ended, and the node cut off."""
    victim = len(hosts) // 2
    started = time.monotonic()
    nodes = start_nodes(hosts, folder, "--epochs", "1000")
    try:
        for line in nodes[0].stdout:
            if line.startswith("... training"):
                break
        start_up = time.monotonic() - started  # its programs in XLA's cache: the machine's pace
        hosts[victim].cut()
        struck, took, ends = time.monotonic(), {}, {}
        while len(took) < len(hosts) and time.monotonic() < struck + 120:
            for rank, node in enumerate(nodes):
                if rank not in took and node.poll() is not None:
                    took[rank] = time.monotonic() - struck
            time.sleep(0.05)
        ends = {rank: ended(node, 1) for rank, node in enumerate(nodes)}
    finally:
        for host in hosts:
            host.signal(9)  # any node that did not end
    code, line, _, err = ends.pop(victim)
    return dict(victim=victim, victim_address=hosts[victim].address, start_up_s=start_up,
                survivors=[dict(rank=rank, stopped_after_s=took.get(rank), exit_code=code,
                                last_line=line, stderr=err)
                           for rank, (code, line, _, err) in ends.items()],
                cut_off=dict(stopped_after_s=took.get(victim), exit_code=code, last_line=line,
                             stderr=err))


def measure(n, folder):
    """Both runs on ``n`` fresh test hosts each, in ``folder``."""
    secret = os.path.join(folder, "secret")
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write("the secret of the many-hosts runs")
    with hosts_on_a_bridge(n) as hosts:
        return dict(hosts=n, whole=whole_run(hosts, folder), cut=cut_run(hosts, folder))


def table(document):
    f = document["figures"]
    survivors = f["cut"]["survivors"]
    named = sum(f"node {f['cut']['victim']} ({f['cut']['victim_address']}) lost" in s["last_line"]
                for s in survivors)
    slowest = max(s["stopped_after_s"] or float("inf") for s in survivors)
    return (f"{measured_by(document)}: {f['hosts']} test hosts, a CPU worker each, two cores: "
            f"meet and compile in {f['whole']['start_up_s']:.0f} s, step in "
            f"{f['whole']['step_us'] / 1000:.0f} ms, replicas "
            f"{'equal' if f['whole']['max_replica_diff'] == 0 else 'apart'}; a cable cut: "
            f"{named} of {len(survivors)} survivors name the host, within {slowest:.1f} s.")


def main():
    parser = Parser(about=__doc__)
    parser.add_argument("--hosts", type=positive_int, default=16,
                        help="test hosts, one node of one CPU worker each (default: 16)")
    parser.add_argument("--out", default=OUT, help="folder for the JSON")
    args = host_arguments(parser, table)
    if args.hosts < 3:
        parser.error("--hosts: at least 3 (one is cut, two go on)")
    with tempfile.TemporaryDirectory() as folder:
        figures = measure(args.hosts, folder)
    show(record("many_hosts", args.out, cpu=True, block="many_hosts.py", figures=figures), table)


if __name__ == "__main__":
    sys.exit(main())
