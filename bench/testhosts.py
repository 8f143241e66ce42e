"""Test hosts: several "machines" on one, as Linux network namespaces on
one bridge, each with its own interface and address (../shared/testhosts.md
says how they were checked).  The tests run the demo's several-machines
commands in them (tests/test_hosts.py), and ``bench.lost_node`` times how
long a node takes to name another that is lost.  They need root and
iproute2's ``ip``; no traffic leaves them."""
import contextlib
import os
import shutil
import signal
import subprocess
import time

from bench.common import parse_args


def why_no_test_hosts():
    """Why test hosts cannot be made here (None where they can)."""
    if os.geteuid() != 0:
        return "test hosts (network namespaces) need root"
    if not shutil.which("ip"):
        return "test hosts need iproute2's ip (apt-get install iproute2)"
    probe = f"dual-mlp-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return None


class Host:
    """A test host: a network namespace, with its own interface and address."""

    def __init__(self, name, interface, address):
        self.name, self.interface, self.address = name, interface, address

    def runs(self, command):
        """``command`` (a list of words) as this host runs it: in its namespace,
        gloo on its interface."""
        return ["ip", "netns", "exec", self.name, "env", f"GLOO_SOCKET_IFNAME={self.interface}",
                *command]

    def cut(self):
        """Its cable cut: its interface down."""
        ip("-n", self.name, "link", "set", self.interface, "down")

    def mend(self):
        """Its cable back: its interface up."""
        ip("-n", self.name, "link", "set", self.interface, "up")

    def door(self):
        """The pid of node 0's door (``multi_gpu/door.py``) in it."""
        for pid in self.pids():
            with contextlib.suppress(OSError, IndexError), open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[1].endswith(b"/multi_gpu/door.py"):
                    return pid
        raise RuntimeError(f"no door in test host {self.name}")

    def pids(self):
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def signal(self, signum):
        """``signum`` to every process in it: the machine stopped, or gone."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


def host_arguments(parser, table):
    """A test-host benchmark's command line, parsed as a CPU benchmark's
    (``bench.common.parse_args``), or refused in one line where test hosts
    cannot be made here."""
    parser.set_defaults(cpu=True)
    args = parse_args(parser, table)
    why = why_no_test_hosts()
    if why:
        parser.error(why)
    return args


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def hosts_on_a_bridge(n):
    """``n`` test hosts on one bridge, as ../shared/testhosts.md makes them:
    each a network namespace with a veth link into the bridge's own, at
    10.77.0.(i + 1) on its interface.  No traffic leaves them; every
    namespace, link and process in them goes after, also when a test fails."""
    tag = f"{os.getpid() % 100000:05d}"  # names are the machine's: each run its own
    bridge, hosts = f"dmt{tag}br", []
    try:
        ip("netns", "add", bridge)
        ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        ip("-n", bridge, "link", "set", "br0", "up")
        for i in range(n):
            host = Host(f"dmt{tag}h{i}", f"dv{tag}{i}", f"10.77.0.{i + 1}")
            hosts.append(host)
            ip("netns", "add", host.name)
            ip("link", "add", host.interface, "type", "veth", "peer", "name", f"dp{tag}{i}")
            ip("link", "set", host.interface, "netns", host.name)
            ip("link", "set", f"dp{tag}{i}", "netns", bridge)
            ip("-n", bridge, "link", "set", f"dp{tag}{i}", "master", "br0")
            ip("-n", bridge, "link", "set", f"dp{tag}{i}", "up")
            ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", host.interface)
            ip("-n", host.name, "link", "set", host.interface, "up")
            ip("-n", host.name, "link", "set", "lo", "up")
        yield hosts
    finally:
        for host in hosts:
            host.signal(signal.SIGCONT)
            host.signal(signal.SIGKILL)
        for name in [h.name for h in hosts] + [bridge]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


# The ways a node is lost, as they strike node 1: ``FAULTS[name](host, worker)``
FAULTS = {
    "cut cable": lambda host, worker: host.cut(),
    "killed node": lambda host, worker: host.signal(signal.SIGKILL),
    "stopped node": lambda host, worker: host.signal(signal.SIGSTOP),
    "killed worker": lambda host, worker: os.kill(worker, signal.SIGKILL),
    "stopped worker": lambda host, worker: os.kill(worker, signal.SIGSTOP),
}


# The ways node 0 is lost, as they strike it: ``NODE0_FAULTS[name](host)``
NODE0_FAULTS = {
    "node 0 killed": lambda host: host.signal(signal.SIGKILL),
    "node 0 cut": lambda host: host.cut(),
}


# A blip: ``BLIPS[name](host, seconds)`` takes ``host`` out for ``seconds``, then back
BLIPS = {
    "cut": lambda host, s: (host.cut(), time.sleep(s), host.mend()),
    "door": lambda host, s: (os.kill(host.door(), signal.SIGSTOP), time.sleep(s),
                             os.kill(host.door(), signal.SIGCONT)),
    "stop": lambda host, s: (host.signal(signal.SIGSTOP), time.sleep(s),
                             host.signal(signal.SIGCONT)),
}


def two_nodes(node0, rank):
    """README.md's arguments for node ``rank`` of a run of two CPU machines,
    one worker each, node 0 on test host ``node0``."""
    return ["cpu", "--nodes", "2", "--node-rank", str(rank), "--coordinator",
            f"{node0.address}:29500"]
