"""The nodes of a run on several machines: its secret, node 0's lobby, and
the heartbeats that tell each node within seconds that another is lost.

Node 0 keeps a ``Lobby`` at ``--coordinator``; every other node is a
``Member`` of it, on one zmq connection under ZeroMQ's CURVE security, keyed
by the run's secret.  A node first proves that it holds the secret, then
shows its options, and is let in; from then on, for the whole run, the
launchers of node 0 and of each member send each other a heartbeat every
``BEAT_S`` seconds that says how their node stands (running, failed and
why, done).  A node not heard from for ``LOST_AFTER`` seconds is lost: a
cut cable, a machine gone, a node stopped.  The launchers speak for their
nodes; the workers' own collectives (gloo, NCCL) would wait minutes for a
peer whose cable is cut, and say nothing of who it was.
"""
import base64
import hashlib
import json
import os
import secrets
import socket
import stat
import threading
import time

from multi_gpu.cli import UsageError

BEAT_S = 0.5      # seconds between a node's heartbeats
LOST_AFTER = 5.0  # seconds without a word from a node that has joined: it is lost


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


def run_secret(args):
    """The secret the nodes of a run on several machines share, and the
    notice that tells it where node 0 made it: from ``--secret-file`` (a
    file only this user can read, as ssh wants of a key), else from
    ``DUAL_MLP_SECRET``, else, on node 0, a new one.  Never from the
    command line, which every user of a machine can read."""
    if args.secret_file:
        try:
            fd = os.open(args.secret_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise UsageError(f"--secret-file {args.secret_file}: {e.strerror.lower()}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise UsageError(f"--secret-file {args.secret_file} must be a regular file of "
                                 "yours that nobody else can read or write (chmod 600)")
            secret = os.read(fd, 4096).decode().strip()
        except UnicodeDecodeError:
            raise UsageError(f"--secret-file {args.secret_file} does not hold text: the "
                             "secret is the line node 0 printed") from None
        finally:
            os.close(fd)
        if not secret:
            raise UsageError(f"--secret-file {args.secret_file} is empty: put the run's secret "
                             "in it (the line node 0 printed), or leave the option out on node 0, "
                             "which then makes one")
    else:
        secret = os.environ.get(SECRET_VARIABLE, "").strip()
    if secret:
        if len(secret) < SHORTEST_SECRET:
            raise UsageError(f"the run's secret is too short to keep strangers out: at least "
                             f"{SHORTEST_SECRET} characters")
        return secret, None
    if args.node_rank != 0:
        raise UsageError(f"node {args.node_rank} needs the run's secret: start it with "
                         f"{SECRET_VARIABLE}=<the secret node 0 printed> or --secret-file FILE")
    secret = secrets.token_urlsafe(24)
    return secret, (f"the run's secret, which the other nodes must be given: {SECRET_VARIABLE}="
                    f"{secret} (in their environment, or in a file of mode 600 named by "
                    "--secret-file), never on a command line")


def curve_keys(secret):
    """The one CURVE key pair every node of a run derives from its secret:
    (public, secret key), Z85.  ZeroMQ's CURVE handshake proves that each
    side holds the secret key without sending it, then encrypts the rest."""
    import zmq
    from zmq.utils import z85
    private = z85.encode(hashlib.sha256(b"dual_mlp lobby\0" + secret.encode()).digest())
    return zmq.curve_public(private), private


class OnlyTheRun:
    """The lobby's ZAP policy: a client is let in only with the run's key."""

    def __init__(self, public):
        self.public = public

    def callback(self, domain, key):
        return key == self.public


LOBBY_MESSAGE_LIMIT = 1 << 16  # bytes: a node's options fit many times over
HANDSHAKE_MS = 5000            # a connection that has not proved itself by then is dropped


class Standing:
    """How a node stands, as its heartbeats tell the others: ``running``,
    ``failed`` (``why``: what went wrong, in one line), or ``done``; and
    when it was last heard from.  Its heartbeats count from the run's
    ``generation`` on (each restart is one more: ``--max-restarts``)."""

    def __init__(self, name, generation=0):
        self.name = name
        self.restart(generation)

    def restart(self, generation):
        self.state, self.why, self.final, self.heard = "running", None, False, time.monotonic()
        self.generation = generation

    def heard_from(self, beat):
        if beat.get("generation", 0) < self.generation:
            return  # an earlier start's last words
        self.heard = time.monotonic()
        if self.state == "running" and beat.get("state") in ("failed", "done"):
            self.state, self.why = beat["state"], str(beat.get("why"))[:400]
            self.final = beat.get("final") is True

    def lost(self):
        return self.state == "running" and time.monotonic() - self.heard > LOST_AFTER

    def gone(self):
        """Lost, or ended for good (no restart brings it back)."""
        return self.lost() or (self.state == "failed" and self.final)

    def verdict(self):
        """Why the run cannot go on because of this node, or None."""
        if self.state == "failed":
            return self.why if self.why.startswith("node ") else f"{self.name}: {self.why}"
        if self.lost():
            return f"{self.name} lost: not heard from for {time.monotonic() - self.heard:.0f} s"
        return None


class Alone:
    """A run of one node: nobody else to hear from."""

    others = False

    def tell(self, state, why=None, final=False):
        pass

    def verdict(self):
        return None

    def gone(self):
        return False

    def ordered(self):
        return None


class Heartbeats:
    """What node 0 and its members share: this node's own standing, sent
    every ``BEAT_S`` seconds (and at once when it changes) by a thread that
    owns the zmq socket; the others' standings, each a ``Standing``; and
    where the run starts again (``--max-restarts``), node 0's order to."""

    others = True

    def start_beating(self, context, socket):
        self.context, self.socket, self.lock = context, socket, threading.Lock()
        self.generation, self.order, self.outbox = 0, None, None
        self.mine, self.sent, self.open = {"state": "running"}, False, True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def tell(self, state, why=None, final=False):
        """This node now stands so (``failed``, with why, and ``final`` where
        no restart brings it back; ``done``)."""
        with self.lock:
            self.mine = {"state": state, "why": why, "final": final,
                         "generation": self.generation}
            self.sent = False

    def restart(self, generation):
        """The run starts again: every node stands anew, heard from now."""
        self.generation = generation
        for standing in self.standings():
            standing.restart(generation)
        self.tell("running")

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
        next_beat = 0.0
        while self.open:
            if self.socket.poll(50):
                frames = self.socket.recv_multipart(copy=False)
                try:
                    self.received(frames)
                except Exception:  # whatever a node sends is answered, or dropped
                    self.answer(frames, {"why": "not a dual_mlp.py node"})
            now = time.monotonic()
            with self.lock:
                outbox, self.outbox = self.outbox, None
            if outbox:
                self.beat(outbox)
            if now >= next_beat or not self.sent:
                with self.lock:
                    beat, self.sent = json.dumps({"beat": self.mine}).encode(), True
                self.beat(beat)
                next_beat = now + BEAT_S

    def close(self):
        """After this node's last word has gone out (at most a second)."""
        for _ in range(20):
            if self.sent:
                break
            time.sleep(0.05)
        self.open = False
        self.thread.join()
        self.socket.close(linger=1000)


class Lobby(Heartbeats):
    """Node 0's door to a run of several machines, at ``--coordinator``.

    A node first proves it holds the run's secret: the lobby is a zmq
    socket under ZeroMQ's CURVE security, its key pair and the only client
    key it lets in derived from the secret (``curve_keys``), so a stranger's
    handshake fails before a byte of a message is read, and the stranger
    learns nothing.  Then the node shows its run options and its node rank,
    and is let in only where ``judge(options)`` finds nothing to say and
    the rank is free; it is then told where JAX's coordinator listens (a
    port of node 0's own choosing, or a socket in node 0's private run
    folder where every node is on this machine).  Messages are bounded, a
    connection that does not finish its handshake within seconds is
    dropped, and the door stays open for the run's nodes.  A node let in
    is a member from then on: the lobby hears its heartbeats and sends it
    node 0's (``Heartbeats``)."""

    def __init__(self, address, judge, nodes, secret, jax_coordinator):
        import zmq
        import zmq.auth.thread
        self.address, self.judge_options, self.nodes = address, judge, nodes
        self.jax_coordinator, self.members = jax_coordinator, {}  # identity -> (rank, Standing)
        check_port(address)
        public, private = curve_keys(secret)
        context = zmq.Context()
        self.auth = zmq.auth.thread.ThreadAuthenticator(context)
        self.auth.start()
        self.auth.configure_curve_callback("*", OnlyTheRun(public))
        lobby = context.socket(zmq.ROUTER)
        lobby.curve_secretkey, lobby.curve_publickey = private, public
        lobby.curve_server = True
        for option, value in ((zmq.LINGER, 0), (zmq.MAXMSGSIZE, LOBBY_MESSAGE_LIMIT),
                              (zmq.HANDSHAKE_IVL, HANDSHAKE_MS)):
            lobby.setsockopt(option, value)
        lobby.bind(f"tcp://{address}")
        self.start_beating(context, lobby)

    def standings(self):
        return [standing for _, standing in list(self.members.values())]

    def answer(self, frames, reply):
        self.socket.send_multipart([frames[0].bytes, b"", json.dumps(reply).encode()])

    def received(self, frames):
        identity, message = frames[0].bytes, json.loads(frames[-1].bytes)
        if identity in self.members:  # a member's heartbeat
            self.members[identity][1].heard_from(message["beat"])
            return
        why = self.judge(message)
        if not why:
            rank = message["node_rank"]
            address = frames[-1].get("Peer-Address") or "address unknown"
            self.members[identity] = (rank, Standing(f"node {rank} ({address})"))
        self.answer(frames, {"why": why, "jax_coordinator": None if why else
                             self.jax_coordinator})

    def judge(self, visitor):
        """Why a visitor may not join (None: it may)."""
        rank, options = visitor["node_rank"], dict(visitor["options"])
        if type(rank) is not int or not 0 < rank < self.nodes:
            return f"node rank {str(rank)[:20]} is not one of 1..{self.nodes - 1}"
        why = self.judge_options(options)
        if why:
            return f"node 0 runs other options: {why}"
        if rank in {r for r, _ in self.members.values()}:
            return (f"node {rank} of the run at {self.address} has joined already: is another "
                    "run using this --coordinator?")
        return None

    def beat(self, message):
        for identity in list(self.members):
            self.socket.send_multipart([identity, b"", message])

    def order_restart(self, generation, why, jax_coordinator, resume_epoch, checkpoint):
        """Start the run again, every node: where JAX's coordinator listens
        now, and the checkpoint's bytes (None: from the first epoch), which
        the other machines may not hold."""
        self.restart(generation)
        if not why.startswith("node "):
            why = f"node 0 ({host_and_port(self.address)[0]}): {why}"
        order = dict(generation=generation, why=why, jax_coordinator=jax_coordinator,
                     resume_epoch=resume_epoch, checkpoint=checkpoint and
                     base64.b64encode(checkpoint).decode())
        with self.lock:
            self.outbox = json.dumps({"restart": order}).encode()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        self.auth.stop()
        self.context.term()


class NoAnswer(Exception):
    """Node 0 never answered: a run that did not happen (the launcher exits 1)."""


class Member(Heartbeats):
    """Node ``node_rank`` of a run, from the moment node 0's lobby at
    ``address`` lets it in (``Lobby``): ``jax_coordinator`` is where JAX's
    coordinator listens; node 0's heartbeats are heard, this node's sent."""

    def __init__(self, address, node_rank, options, timeout, secret):
        import zmq
        import zmq.utils.monitor
        public, private = curve_keys(secret)
        context = zmq.Context()
        member = context.socket(zmq.DEALER)
        member.curve_serverkey, member.curve_publickey, member.curve_secretkey = public, public, \
            private
        member.setsockopt(zmq.LINGER, 0)
        monitor = member.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                            | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        try:
            try:
                member.connect(f"tcp://{address}")
                member.send_multipart([b"", json.dumps({"node_rank": node_rank,
                                                        "options": options}).encode()])
                answer = self.answer_of(member, monitor, address, timeout)
            finally:
                member.disable_monitor()
                monitor.close()
            if answer["why"]:
                raise UsageError(f"refused by node 0 at {address}: {answer['why']}")
        except BaseException:
            member.close()
            context.term()
            raise
        self.jax_coordinator = answer["jax_coordinator"]
        self.node0 = Standing(f"node 0 ({host_and_port(address)[0]})")
        self.start_beating(context, member)

    @staticmethod
    def answer_of(member, monitor, address, timeout):
        from multi_gpu.worker import stopping
        deadline = time.monotonic() + timeout
        while not member.poll(100):
            if monitor.poll(0):
                raise UsageError(f"refused by node 0 at {address}: the handshake failed: this "
                                 "node does not hold the run's secret (give it the one node 0 "
                                 f"printed, in {SECRET_VARIABLE} or --secret-file)")
            if stopping.is_set():
                raise UsageError("interrupted while waiting for node 0")
            if time.monotonic() > deadline:
                raise NoAnswer(f"node 0 did not answer at {address} within {timeout:g} s (is "
                               "it started, and can this machine reach it? see --timeout)")
        return json.loads(member.recv_multipart()[-1])

    def standings(self):
        return (self.node0,)

    def received(self, frames):
        message = json.loads(frames[-1].bytes)
        if "restart" in message:
            self.order = message["restart"]
        else:
            self.node0.heard_from(message["beat"])

    def await_order(self):
        """Node 0's order to start again, once this node has failed: None
        where node 0 fails or is lost first, or says nothing in time."""
        deadline = time.monotonic() + LOST_AFTER + 10
        while not (self.ordered() or self.verdict()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.ordered()

    def answer(self, frames, reply):
        pass  # node 0 says only heartbeats

    def beat(self, message):
        self.socket.send_multipart([b"", message])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        self.context.term()


def meet(args, judge, stack):
    """How this node hears from the other nodes of its run: ``Alone`` where
    there are none; on node 0, its ``Lobby`` at --coordinator, which lets in
    the nodes whose options ``judge`` finds nothing to say of; on any other,
    its membership of that lobby, which tells it where JAX's coordinator
    listens.  The lobby and the membership close with ``stack``.  Returns
    (the link, a notice: the secret node 0 made, where it made one; on any
    other node, that it joined, and which workers it runs)."""
    if args.nodes == 1:
        return Alone(), None
    secret, notice = run_secret(args)  # the others prove they belong here: they hold it
    if args.node_rank == 0:
        return stack.enter_context(Lobby(args.coordinator, judge, args.nodes, secret,
                                         args.jax_coordinator)), notice
    member = stack.enter_context(Member(args.coordinator, args.node_rank, args.run_options,
                                        args.timeout, secret))
    args.jax_coordinator = member.jax_coordinator
    n = len(args.devices)
    ranks = ", ".join(map(str, range(args.node_rank * n, (args.node_rank + 1) * n)))
    return member, (f"node {args.node_rank} of {args.nodes}: joined node 0 at {args.coordinator}; "
                    f"worker{'s' * (n > 1)} {ranks} of {args.nodes * n} here, on "
                    f"{', '.join(args.devices)}")
