"""How far node 0's lobby goes: many members, simulated.

    python -m bench.lobby [--members 64 256 1024] [--out DIR]

Node 0's lobby (``multi_gpu.lobby.Lobby``, the one the launcher opens) in
this process, its door (``multi_gpu.door``) in one of its own, and for each
figure of ``--members``, that many members in processes of their own that
speak the members' protocol with no JAX worker behind it: each its own zmq
connection, its own CURVE handshake with the run's key, its own hello
(``member.hello``) and its own heartbeat twice a second (``nodes.beat``).
Measured for each: the seconds until node 0 has let every member in; node
0's CPU (the lobby's and its door's, a share of one core) while every
member beats; the seconds until node 0 names one member that
falls silent (a node is lost after ``nodes.LOST_AFTER`` s); and the
seconds from that member's knock, as it comes back, to node 0's answer.
Writes ``lobby.json`` into ``--out`` (default: ``out/``).
"""
import json
import multiprocessing
import resource
import secrets
import sys
import time

import zmq

from bench.common import OUT, measured_by, needed, parse_args, record, show
from multi_gpu.cli import Parser, positive_int
from multi_gpu.lobby import Lobby
from multi_gpu.member import hello
from multi_gpu.nodes import BEAT_S, LOST_AFTER, beat, curve_keys, free_port

psutil = needed("psutil")  # the test requirements', not the demo's

OPTIONS = {"epochs": 1, "seed": 1234}  # what every simulated member shows node 0
MEMBERS_A_PROCESS = 256  # a zmq context's sockets stay well under its limit of 1023


class Members:
    """Simulated members of node 0's lobby at ``address``, in one process:
    each its own zmq connection, its own CURVE handshake with the run's key
    (from ``secret``), its own hello and heartbeat."""

    def __init__(self, address, secret, ranks):
        self.address, self.keys, self.context = address, curve_keys(secret), zmq.Context()
        self.sockets, self.ranks, self.poller = {}, {}, zmq.Poller()  # rank <-> its socket
        self.waiting, self.knocked, self.refused = set(), {}, []
        for rank in ranks:
            self.knock(rank)

    def knock(self, rank):
        """Connect as node ``rank`` and say hello; its answer is awaited."""
        public, private = self.keys
        member = self.context.socket(zmq.DEALER)
        member.curve_serverkey, member.curve_publickey, member.curve_secretkey = public, public, \
            private
        member.setsockopt(zmq.LINGER, 0)
        member.connect(f"tcp://{self.address}")
        member.send_multipart([b"", hello(rank, OPTIONS)])
        self.sockets[rank], self.ranks[member], self.knocked[rank] = member, rank, \
            time.monotonic()
        self.poller.register(member, zmq.POLLIN)
        self.waiting.add(rank)

    def silence(self, rank):
        """Node ``rank`` falls silent: its connection closed without a word."""
        self.poller.unregister(self.sockets[rank])
        del self.ranks[self.sockets[rank]]
        self.sockets.pop(rank).close()

    def read(self, ms):
        """Node 0's answers and beats, for ``ms`` at most; the answers' ranks
        and seconds since their knock."""
        answered = []
        for member, _ in self.poller.poll(ms):
            message = member.recv_multipart()[-1]
            rank = self.ranks[member]
            if rank in self.waiting:
                self.waiting.discard(rank)
                self.refused += [rank] if json.loads(message)["why"] else []
                answered.append((rank, time.monotonic() - self.knocked[rank]))
        return answered

    def beat(self):
        message = beat()
        for member in self.sockets.values():
            member.send_multipart([b"", message])


def simulate(address, secret, ranks, orders):
    """``Members`` ``ranks``, beating every ``BEAT_S`` s and reading node 0's
    beats, until ``orders`` (a pipe) says ``silence`` a rank, ``return`` it
    (it knocks again; the seconds to node 0's answer go back), or ``end``.
    They knock once ``orders`` says ``go``: the clock is node 0's, not
    Python's start-up."""
    orders.send(("ready", None))
    orders.recv()
    members, next_beat, back = Members(address, secret, ranks), time.monotonic(), None
    while True:
        for rank, seconds in members.read(10):
            if rank == back:
                orders.send(("back", rank, seconds))
        if time.monotonic() >= next_beat:
            members.beat()
            next_beat += BEAT_S
        if orders.poll():
            order, rank = orders.recv()
            if order == "end":
                break
            if rank in members.sockets:
                members.silence(rank)
            if order == "return":
                members.knock(rank)
                back = rank
    orders.send(("refused", members.refused))
    members.context.destroy(linger=0)


def measure(n, cpu_seconds=10.0):
    """``n`` simulated members of one lobby: what node 0 did (see the module's text)."""
    secret, address = secrets.token_urlsafe(24), f"127.0.0.1:{free_port()}"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * n + 256)), hard))
    spawn = multiprocessing.get_context("spawn")
    with Lobby(address, OPTIONS, n + 1, secret, None, run="the lobby benchmark's", returns=True,
               shapes=[(1,)]) as lobby:
        node0 = (psutil.Process(), psutil.Process(lobby.door.pid))  # the lobby and its door
        ranks = list(range(1, n + 1))
        shares = [ranks[i:i + MEMBERS_A_PROCESS] for i in range(0, n, MEMBERS_A_PROCESS)]
        pipes = [spawn.Pipe() for _ in shares]
        processes = [spawn.Process(target=simulate, args=(address, secret, share, theirs),
                                   daemon=True) for share, (_, theirs) in zip(shares, pipes)]
        for process in processes:
            process.start()
        for mine, _ in pipes:
            mine.recv()  # ready
        started = time.monotonic()
        for mine, _ in pipes:
            mine.send(("go", None))
        if not until(lobby.present, 120):
            raise RuntimeError(f"{n} members were not all let in within 120 s: "
                               f"{len(lobby.missing())} missing")
        let_in = time.monotonic() - started
        before, cpu_started = cpu_of(node0), time.monotonic()
        time.sleep(cpu_seconds)
        after, cpu_took = cpu_of(node0), time.monotonic() - cpu_started
        false_losses = lobby.verdict()
        victim = ranks[len(ranks) // 2]
        ours = pipes[shares.index(next(s for s in shares if victim in s))][0]
        ours.send(("silence", victim))
        silenced = time.monotonic()
        named = until(lambda: (lobby.verdict() or "").startswith(f"node {victim} ("), 60)
        named_after, named_as = time.monotonic() - silenced, lobby.verdict()
        ours.send(("return", victim))
        answered = ours.recv()[2] if ours.poll(60) else None
        back = until(lobby.present, 60)
        for mine, _ in pipes:
            mine.send(("end", None))
        refused = sum(len(mine.recv()[1]) for mine, _ in pipes if mine.poll(30))
        for process in processes:
            process.join(10)
    cpu = (after - before) / cpu_took
    return dict(members=n, processes=len(processes), let_in_s=let_in, refused=refused,
                node0_cpu_share=cpu, beats_per_s=n / BEAT_S, false_losses=false_losses,
                lost_named_after_s=named_after if named else None, lost_named_as=named_as,
                lost_after_s=LOST_AFTER, back_answered_after_s=answered, back_in=back)


def cpu_of(processes):
    """The CPU seconds these processes took so far, together."""
    return sum(t.user + t.system for t in (p.cpu_times() for p in processes))


def until(test, timeout):
    """Poll ``test`` 20 times a second until it holds (True) or ``timeout`` s pass (False)."""
    deadline = time.monotonic() + timeout
    while not test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def table(document):
    lines = [f"{measured_by(document)}: node 0's lobby and its door, its members simulated "
             f"in others ({MEMBERS_A_PROCESS} a process, each its own connection, CURVE "
             "handshake and heartbeat twice a second), on one machine.", "",
             "| members | all let in | node 0's CPU, all beating | a silent member named "
             "after | its return answered after |", "| --- | --- | --- | --- | --- |"]
    for f in document["figures"]:
        lines.append(f"| {f['members']} | {f['let_in_s']:.1f} s | {100 * f['node0_cpu_share']:.0f} "
                     f"% of a core ({f['beats_per_s']:.0f} beats/s in, as many out) | "
                     f"{f['lost_named_after_s']:.1f} s (lost after {f['lost_after_s']:g} s) | "
                     f"{1000 * f['back_answered_after_s']:.0f} ms |")
    return "\n".join(lines)


def summary(document):
    """README.md's line: how far the lobby was measured, and how it held."""
    f = document["figures"]
    return (f"{measured_by(document)}: {', '.join(str(x['members']) for x in f)} members "
            f"simulated: all in within {max(x['let_in_s'] for x in f):.1f} s, node 0 at "
            f"{100 * max(x['node0_cpu_share'] for x in f):.0f} % of a core at most, a silent one "
            f"named after {max(x['lost_named_after_s'] for x in f):.1f} s.")


def main():
    parser = Parser(about=__doc__)
    parser.add_argument("--members", type=positive_int, nargs="+", default=[64, 256, 1024],
                        help="how many members to simulate, one lobby for each figure "
                             "(default: 64 256 1024)")
    parser.add_argument("--out", default=OUT, help="folder for the JSON")
    parser.set_defaults(cpu=True)
    args = parse_args(parser, table)
    figures = []
    for n in args.members:
        figures.append(measure(n))
        f = figures[-1]
        print(f"  {n} members: let in after {f['let_in_s']:.1f} s, node 0 at "
              f"{100 * f['node0_cpu_share']:.0f} % of a core, a silent one named after "
              f"{f['lost_named_after_s']:.1f} s, its return answered after "
              f"{1000 * f['back_answered_after_s']:.0f} ms", flush=True)
    show(record("lobby", args.out, cpu=True, block="lobby.py", figures=figures), table)


if __name__ == "__main__":
    sys.exit(main())
