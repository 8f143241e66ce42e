"""A node's membership of node 0's lobby (``lobby.Lobby``), on every node
but node 0: its knock, its heartbeats, what it keeps of the run.

A node knocks at --coordinator on one zmq connection under ZeroMQ's CURVE
security, keyed by the run's secret (``nodes.curve_keys``): it first proves
that it holds the secret, then shows its options and rank (``hello``), and
is let in or refused in one line.  From then on it beats to node 0 and
hears node 0's heartbeats (``nodes.Heartbeats``), keeps the run's
checkpoint as node 0 sends it at each save, and follows node 0's order
where the run starts again.  Node 0 lost, it knocks again with what it
kept, until node 0 comes back (``rejoin``).
"""
import contextlib
import json
import re
import sys
import time

import zmq

from multi_gpu import cli
from multi_gpu.cli import UsageError
from multi_gpu.hooks import stopping
from multi_gpu.nodes import (
    LOST_AFTER,
    SECRET_VARIABLE,
    Heartbeats,
    Standing,
    curve_keys,
    host_and_port,
    run_secret,
)


def hello(node_rank, options, kept=None):
    """What a node says as it knocks at node 0's lobby: its rank and options;
    where it comes back to a run, what it kept of it (``Member.kept``): the
    run's name, its generation, and the epoch and size of the checkpoint it
    holds, not the checkpoint itself, which follows once the node is let in
    (a knock stays small, whatever the model: node 0 judges the options
    first, then takes a checkpoint of its own model's size)."""
    if kept:
        kept = {k: v for k, v in kept.items() if k != "checkpoint"} | (
            {"size": len(kept["checkpoint"])} if kept.get("checkpoint") else {})
    return json.dumps(dict(node_rank=node_rank, options=options, kept=kept)).encode()


KNOCK_S = 10.0  # seconds a knock waits for node 0's answer before it is made again
TOLD_S = 2.0    # seconds a node whose command was refused gives node 0 to hear why


def knocker(context, secret):
    """A node's socket to node 0's lobby, under CURVE keyed by the run's
    ``secret``, not yet connected; what is unsent goes with it when closed."""
    public, private = curve_keys(secret)
    member = context.socket(zmq.DEALER)
    member.curve_serverkey, member.curve_publickey, member.curve_secretkey = public, public, \
        private
    member.setsockopt(zmq.LINGER, 0)
    return member


def cannot_start(args, why):
    """Node ``args.node_rank`` > 0, its own command refused (``why``), tells
    node 0 so where it can (the run's secret at hand, node 0 listening), for
    up to ``TOLD_S`` s: node 0 says it at once, instead of waiting out
    --timeout for a node that is not coming."""
    if not (args.nodes > 1 and args.node_rank > 0):
        return
    context = zmq.Context()
    try:
        member = knocker(context, run_secret(args)[0])
        member.connect(f"tcp://{args.coordinator}")
        member.send_multipart([b"", json.dumps(dict(node_rank=args.node_rank,
                                                    cannot_start=why)).encode()])
        member.poll(TOLD_S * 1000)
    except (UsageError, zmq.ZMQError, ValueError, TypeError):
        pass  # no secret, no address: node 0 cannot be told, and the line here says why
    finally:
        context.destroy(linger=0)


class NoAnswer(Exception):
    """Node 0 never answered: a run that did not happen (the launcher exits 1)."""


class Member(Heartbeats):
    """Node ``node_rank`` of a run, from the moment node 0's lobby at
    ``address`` lets it in (``Lobby``): ``jax_coordinator`` is where JAX's
    coordinator listens; node 0's heartbeats are heard, this node's sent.
    It keeps the run's last checkpoint, as node 0 sends it at each save
    (``kept``): node 0, lost and started again, takes it back from here.
    ``back``: let in again after it was lost, it waits for node 0's order."""

    def __init__(self, address, node_rank, options, timeout, secret):
        self.address, self.node_rank, self.options = address, node_rank, options
        self.secret, self.context, self.kept = secret, zmq.Context(), None
        try:
            self.join(timeout)
        except BaseException:
            self.context.term()
            raise

    def join(self, timeout, kept=None):
        """Knock at node 0's lobby and wait ``timeout`` s for its answer; then beat."""
        import zmq.utils.monitor
        member = knocker(self.context, self.secret)
        monitor = member.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                            | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        try:
            try:
                member.connect(f"tcp://{self.address}")
                member.send_multipart([b"", hello(self.node_rank, self.options, kept)])
                answer = self.answer_of(member, monitor, self.address, timeout, kept)
            finally:
                member.disable_monitor()
                monitor.close()
            if answer["why"]:
                raise UsageError(f"refused by node 0 at {self.address}: {answer['why']}")
        except BaseException:
            member.close()
            raise
        self.jax_coordinator, self.run, self.back = answer["jax_coordinator"], answer["run"], \
            answer["back"]
        self.order = answer["order"] or self.order
        self.joins = answer.get("joins") is True  # an elastic run's: taken in at an epoch's end
        if answer.get("send_kept") and kept and kept.get("checkpoint"):
            member.send_multipart([b"", json.dumps({"kept": kept["checkpoint"]}).encode()])
        self.node0 = Standing(0, host_and_port(self.address)[0], self.listened, self.generation)
        self.start_beating(self.context, member)

    def rejoin(self, timeout):
        """Node 0 was lost: knock again at its address, with what this node
        kept of the run, until node 0 (started again, or back) lets it in,
        for at most ``timeout`` s (NoAnswer).  A knock unanswered for
        ``KNOCK_S`` is made again, on a new connection (a node 0 lost again as
        it was knocked at took the knock with it).  A refusal ends the wait
        (UsageError), unless this node keeps the run's last checkpoint, which
        must not go with it: it says why, once, and knocks again."""
        self.stop_beating()
        deadline, refused = time.monotonic() + timeout, None
        while True:
            left = deadline - time.monotonic()
            try:
                return self.join(max(0.0, min(left, KNOCK_S)),
                                 dict(self.kept or {}, run=self.run, generation=self.generation))
            except NoAnswer:
                if left > KNOCK_S:
                    continue
                if refused:
                    raise NoAnswer(f"node 0 did not let it in within {timeout:g} s "
                                   f"(--rejoin-timeout): {refused}") from None
                raise NoAnswer(f"node 0 did not come back within {timeout:g} s") from None
            except UsageError as e:
                if stopping.is_set() or not (self.kept and self.kept.get("checkpoint")):
                    raise
                if str(e) != refused:
                    cli.say(f"node {self.node_rank}: {e}; this node keeps the run's last "
                            f"checkpoint (epoch {self.kept.get('epoch')}): it knocks again until "
                            "node 0 comes back with the run's secret and options", file=sys.stderr)
                    refused = str(e)
                if time.monotonic() > deadline:
                    raise NoAnswer(f"node 0 did not let it in within {timeout:g} s "
                                   f"(--rejoin-timeout): {refused}") from None
                time.sleep(1.0)

    @staticmethod
    def answer_of(member, monitor, address, timeout, kept):
        """Node 0's answer to a knock (``kept``: from a node coming back)."""
        deadline = time.monotonic() + timeout
        while not member.poll(100):
            if monitor.poll(0):
                raise UsageError(f"refused by node 0 at {address}: the handshake failed: " + (
                    "node 0 there does not hold this run's secret (node 0 started again needs "
                    f"it: in {SECRET_VARIABLE} or --secret-file on its command)" if kept else
                    "this node does not hold the run's secret (give it the one node 0 printed, "
                    f"in {SECRET_VARIABLE} or --secret-file)"))
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
            # the run's name too: a node 0 started again goes on with the run it adopted
            self.order, self.run = message["restart"], message["restart"]["run"]
            self.joins = False
            if message["restart"]["checkpoint"]:
                self.kept = {k: message["restart"][k] for k in ("checkpoint", "run")}
                self.kept["epoch"] = message["restart"]["resume_epoch"]
        elif "saved" in message:
            self.kept = message["saved"]
        else:
            self.node0.heard_from(message["beat"])
            return
        self.node0.spoke()  # an order or a checkpoint

    def await_order(self):
        """Node 0's order to start again, once this node has failed, or came
        back: None where node 0 fails or is lost first, or says nothing in
        time.  While node 0 waits for a lost node to come back, so does this
        one, and says so once; one that an elastic run takes in waits for the
        end of the epoch node 0 trains."""
        deadline, said = time.monotonic() + LOST_AFTER + 10, None
        while not (self.ordered() or self.verdict() or stopping.is_set()):
            waiting = self.node0.waiting
            if waiting or self.joins:
                deadline = time.monotonic() + LOST_AFTER + 10
            if waiting and waiting != said and not self.awaited_in(waiting):
                cli.say(f"node {self.node_rank}: {waiting}", file=sys.stderr)
                said = waiting
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return self.ordered()

    def awaited_in(self, waiting):
        """Whether node 0's words, said before this node came back, wait for
        this node itself: not for this node to repeat."""
        awaited = re.search(r"waiting up to \S+ s for (.*?) to come back", waiting)
        return bool(awaited) and f"node {self.node_rank}" in re.split(r", | and ",
                                                                    awaited.group(1))

    def answer(self, frames, reply):
        pass  # node 0 says only heartbeats

    def beat(self, message):
        send_or_drop(self.socket, [b"", message])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop_beating()
        self.context.term()


def send_or_drop(socket, frames):
    """Send, or drop what cannot go now (the other end gone: its door, its
    connection): the listening thread that sends must never wait, or its
    seconds, which time every silence, would stop (``Heartbeats.listened``)."""
    with contextlib.suppress(zmq.Again):
        socket.send_multipart(frames, zmq.NOBLOCK)
