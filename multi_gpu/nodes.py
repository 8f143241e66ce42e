"""The nodes of a run on several machines: its addresses, its secret, and
the heartbeats that tell each node within seconds that another is lost.

Node 0 keeps a lobby at ``--coordinator``, every other node is a member of
it (``lobby.py``): from the moment a node is let in, for the whole run, the
launchers of node 0 and of each member send each other a heartbeat every
``BEAT_S`` seconds that says how their node stands (running, failed and
why, done).  A node not heard from for ``LOST_AFTER`` seconds is lost: a
cut cable, a machine gone, a node stopped.  The seconds are the listener's
own: a machine so busy that the listening thread itself waits its turn
(tests beside two other suites saw it wait seconds) does not count that
wait as the other's silence.  The launchers speak for their
nodes; the workers' own collectives (gloo, NCCL) would wait minutes for a
peer whose cable is cut, and say nothing of who it was.
"""
import collections
import collections.abc
import dataclasses
import enum
import errno
import hashlib
import json
import os
import secrets
import socket
import stat
import threading
import time

import zmq

from multi_gpu.cli import UsageError

BEAT_S = 0.5      # seconds between a node's heartbeats
LOST_AFTER = 5.0  # seconds without a word from a node that has joined: it is lost
TURN_S = BEAT_S   # the most one turn of the listening thread counts towards a silence


def free_port(host="127.0.0.1"):
    """A port on ``host`` that nobody listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_and_port(address):
    """'HOST:PORT' -> (HOST, PORT as an int); None where it is not of that form."""
    host, _, port = address.rpartition(":")
    return (host, int(port)) if host and port.isdigit() and 0 < int(port) < 65536 else None


def on_loopback(address):
    """Is HOST:PORT on this machine's loopback (so every node is on this machine)?"""
    host = host_and_port(address)[0]
    try:
        return all(info[4][0].startswith("127.") or info[4][0] == "::1"
                   for info in socket.getaddrinfo(host.strip("[]"), None))
    except OSError:
        return False


def check_port(address):
    """Refuse a HOST:PORT that this machine cannot listen on now (taken, or
    not one of its addresses), before any worker starts.  As zmq binds: a
    port whose last run's connections linger (TIME_WAIT) is free."""
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(host_and_port(address))
    except OSError as e:
        raise UsageError(f"cannot listen on {address} ({e.strerror.lower()}): another run "
                         "there, or not this machine's address? see --coordinator") from None


SECRET_VARIABLE = "DUAL_MLP_SECRET"  # the run's secret, for the nodes of a run of several
SHORTEST_SECRET = 16                 # characters: fewer could be guessed
LONGEST_SECRET = 4096                # bytes: node 0 prints 32 characters


def run_secret(args):
    """The secret the nodes of a run on several machines share, and the
    notice that tells it where node 0 made it: from ``--secret-file`` (a
    file only this user can read, as ssh wants of a key), else from
    ``DUAL_MLP_SECRET``, else, on node 0, a new one.  Never from the
    command line, which every user of a machine can read."""
    secret = secret_in_file(args.secret_file) if args.secret_file else \
        os.environ.get(SECRET_VARIABLE, "").strip()
    if secret:
        if len(secret) < SHORTEST_SECRET:
            raise UsageError(f"the run's secret is too short to keep strangers out: at least "
                             f"{SHORTEST_SECRET} characters")
        if len(secret.encode()) > LONGEST_SECRET:
            raise UsageError(f"the run's secret is longer than {LONGEST_SECRET} bytes: it is "
                             "the one line node 0 printed")
        return secret, None
    if args.node_rank != 0:
        raise UsageError(f"node {args.node_rank} needs the run's secret: start it with "
                         f"{SECRET_VARIABLE}=<the secret node 0 printed> or --secret-file FILE")
    secret = secrets.token_urlsafe(24)
    return secret, (f"the run's secret, which the other nodes must be given, and this one if it "
                    f"is started again: {SECRET_VARIABLE}="
                    f"{secret} (in their environment, or in a file of mode 600 named by "
                    "--secret-file), never on a command line")


def secret_in_file(path):
    """The secret in ``path``: a regular file of this user's that nobody else
    can read or write, not a link to one, holding one line of text."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        why = "a symbolic link: name the file itself, which a link's owner cannot change " \
            "under the run" if e.errno == errno.ELOOP else e.strerror.lower()
        raise UsageError(f"--secret-file {path}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise UsageError(f"--secret-file {path} must be a regular file of yours that nobody "
                             "else can read or write (chmod 600)")
        raw = os.read(fd, LONGEST_SECRET + 2).strip()
    finally:
        os.close(fd)
    if len(raw) > LONGEST_SECRET:
        raise UsageError(f"--secret-file {path} holds more than {LONGEST_SECRET} bytes: the "
                         "secret is the one line node 0 printed")
    try:
        secret = raw.decode()
    except UnicodeDecodeError:
        raise UsageError(f"--secret-file {path} does not hold text: the secret is the line "
                         "node 0 printed") from None
    if not secret:
        raise UsageError(f"--secret-file {path} is empty: put the run's secret in it (the line "
                         "node 0 printed), or leave the option out on node 0, which then makes "
                         "one")
    return secret


def curve_keys(secret):
    """The one CURVE key pair every node of a run derives from its secret:
    (public, secret key), Z85.  ZeroMQ's CURVE handshake proves that each
    side holds the secret key without sending it, then encrypts the rest."""
    import zmq
    from zmq.utils import z85
    private = z85.encode(hashlib.sha256(b"dual_mlp lobby\0" + secret.encode()).digest())
    return zmq.curve_public(private), private


class NodeState(enum.Enum):
    """How a node stands, as its heartbeats say."""
    RUNNING = "running"
    WAITING = "waiting"  # node 0, for a lost node to come back (``why``)
    FAILED = "failed"    # ``why``: what went wrong, in one line
    DONE = "done"


def beat(state=NodeState.RUNNING, why=None, final=False, generation=0):
    """A heartbeat: how the node that sends it stands."""
    return json.dumps({"beat": dict(state=state.value, why=why, final=final,
                                    generation=generation)}).encode()


@dataclasses.dataclass
class Standing:
    """What a node knows of another: its rank and address, how it stands
    (``state``, as its heartbeats tell), since which generation of the run
    (each restart is one more: ``--max-restarts``), and when it was last
    heard from, by ``clock``, the listener's seconds (``Heartbeats.listened``)."""
    rank: int
    address: str
    clock: collections.abc.Callable
    generation: int = 0
    state: NodeState = NodeState.RUNNING
    why: str | None = None
    final: bool = False  # failed for good: no restart brings it back
    waiting: str | None = None  # node 0's words while it waits for a lost node
    heard: float = dataclasses.field(default=None)

    def __post_init__(self):
        self.restart(self.generation)

    @property
    def name(self):
        return f"node {self.rank} ({self.address})"

    def restart(self, generation):
        self.state, self.why, self.final, self.heard = NodeState.RUNNING, None, False, self.clock()
        self.generation, self.waiting = generation, None

    def silent_for(self):
        return self.clock() - self.heard

    def spoke(self):
        """A word from the node, whatever it said."""
        self.heard = self.clock()

    def heard_from(self, beat):
        if beat.get("generation", 0) < self.generation:
            return  # an earlier start's last words
        self.spoke()
        said = NodeState(beat.get("state"))
        self.waiting = str(beat.get("why"))[:400] if said is NodeState.WAITING else None
        if self.state is NodeState.RUNNING and said in (NodeState.FAILED, NodeState.DONE):
            self.state, self.why = said, str(beat.get("why"))[:400]
            self.final = beat.get("final") is True

    def lost(self):
        return self.state is NodeState.RUNNING and self.silent_for() > LOST_AFTER

    def gone(self):
        """Lost, or ended for good (no restart brings it back)."""
        return self.lost() or (self.state is NodeState.FAILED and self.final)

    def verdict(self):
        """Why the run cannot go on because of this node, or None."""
        if self.state is NodeState.FAILED:
            return self.why if self.why.startswith("node ") else f"{self.name}: {self.why}"
        if self.lost():
            return f"{self.name} lost: not heard from for {self.silent_for():.0f} s"
        return None


class NotNode0:
    """What only node 0's lobby does (``lobby.Lobby``), as nothing, for the
    links that are not it: a run of one node, node 0's members."""

    def kept_by_others(self):
        return None

    def came_back(self):
        return None

    def door_ended(self):
        return None

    def share_saved(self, path):
        pass

    def never_joined(self):
        return None

    def say_who_is_missing(self, until, timeout):
        pass

    def present(self):
        return True


class Alone(NotNode0):
    """A run of one node: nobody else to hear from."""

    others, generation = False, 0

    def tell(self, state, why=None, final=False):
        pass

    def verdict(self):
        return None

    def gone(self):
        return False

    def ordered(self):
        return None

    def restart(self, generation):
        self.generation = generation


class Heartbeats(NotNode0):
    """What node 0 and its members share: this node's own standing, sent
    every ``BEAT_S`` seconds (and at once when it changes) by a thread that
    owns the zmq socket; the others' standings, each a ``Standing``; and
    where the run starts again (``--max-restarts``), node 0's order to."""

    others, generation, order = True, 0, None
    listened_s = 0.0  # the listener's seconds (``listened``), at its last turn

    def listened(self):
        """Seconds the listening thread has listened: each of its turns
        counts, up to ``TURN_S``, so that the time a busy machine keeps it
        waiting is nobody's silence."""
        return self.listened_s

    def start_beating(self, context, socket):
        self.context, self.socket, self.lock = context, socket, threading.Lock()
        self.outbox, self.open = collections.deque(), True
        self.tell(NodeState.RUNNING)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def tell(self, state, why=None, final=False):
        """This node now stands so (a ``NodeState``: waiting, for a node to
        come back, with why; failed, with why, and ``final`` where no restart
        brings it back; done)."""
        with self.lock:
            self.mine, self.sent = beat(state, why, final, self.generation), False
            self.standing = state

    def restart(self, generation):
        """The run starts again: every node stands anew, heard from now."""
        self.generation = generation
        for standing in self.standings():
            standing.restart(generation)
        self.tell(NodeState.RUNNING)

    def verdict(self):
        """The first other node that failed or was lost, in words; None while all stand."""
        return next(filter(None, (s.verdict() for s in self.standings())), None)

    def gone(self):
        """Is another node lost, or ended for good?"""
        return any(s.gone() for s in self.standings())

    def ordered(self):
        """Node 0's order to start again, where it has given one since this
        start (a dict: ``Lobby.order_restart``); None."""
        order = self.order
        return order if order and order["generation"] > self.generation else None

    def _serve(self):
        next_beat, turn = 0.0, time.monotonic()
        while self.open or not self.sent or self.outbox:  # its last words go out before it ends
            # every message that is there, then the beats: a thousand members beat
            # twice a second each, and one message a turn would fall behind them
            for _ in range(4096 if self.socket.poll(50) else 0):
                try:
                    frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    self.received(frames)
                except Exception:  # whatever a node sends is answered, or dropped
                    self.answer(frames, {"why": "not a dual_mlp.py node"})
            now = time.monotonic()
            self.listened_s += min(now - turn, TURN_S)
            turn = now
            with self.lock:
                outbox, self.outbox = self.outbox, collections.deque()
            for message in outbox:
                self.beat(message)
            if now >= next_beat or not self.sent:
                with self.lock:
                    mine, self.sent = self.mine, True
                self.beat(mine)
                next_beat = now + BEAT_S

    def stop_beating(self):
        """Once this node's last word has gone out."""
        self.open = False
        self.thread.join()
        self.said_all()
        self.socket.close(linger=1000)

    def said_all(self):
        """What follows this node's last word, where anything must (``Lobby``)."""
