"""Node 0's lobby: who joins a run of several machines, who comes back to
it, what they hear.  Every other node is a member of it (``member.py``).

The lobby listens at ``--coordinator`` through a door, a process of its
own (``door.py``); what comes through is one of three jobs, a class each:

``Admission``  who may come in: a knock judged, let in or refused in one
               line; a member of this run that knocks again, taken back
``Roll``       who stands: each member's ``nodes.Standing``, heard from its
               heartbeats; who is lost, missing, or never joined
``Orders``     the run's checkpoint and its restarts: node 0's checkpoint
               to every member at each save, node 0's order to start
               again, the copies the members kept for a node 0 started again

With ``--max-restarts``, a node that was lost may come back in its place,
node 0 too: the members kept the run's last checkpoint, and give it to
node 0 started again.
"""
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import zmq

from multi_gpu import cli, door, files, records
from multi_gpu.cli import UsageError
from multi_gpu.member import Member, send_or_drop
from multi_gpu.nodes import (
    SECRET_VARIABLE,
    Alone,
    Heartbeats,
    NodeState,
    Standing,
    check_port,
    curve_keys,
    host_and_port,
    run_secret,
)
from multi_gpu.resume import differences

# bytes: a node's options fit many times over; one that comes back to a run adds the run's
# checkpoint, in base64
LOBBY_MESSAGE_LIMIT = 1 << 16
WAITING_SAID_S = 15            # node 0 says whom it waits for this often
WITHOUT_THE_SECRET = ("it does not hold this run's secret: a node of another run, or of the run "
                      "this node 0 was started again for without that run's secret (then start "
                      f"it again with it, in {SECRET_VARIABLE} or --secret-file)")


class Admission:
    """Who may come in.  A node first proves it holds the run's secret (the
    door's CURVE handshake: a stranger learns nothing); then it shows its
    run options and its node rank (``member.hello``), and is let in only
    where they are node 0's (``options``) and the rank is free; it is
    then told where JAX's coordinator listens, and the run's name.  Where
    the run takes nodes back (``returns``: --max-restarts), a node of a rank
    that was lost is let in again in its place, and told to wait for node
    0's order to start again; a member of this very run that knocks again
    (it lost sight of node 0 for a moment) is the same member, taken back,
    and the run starts again (``came_back``)."""

    def admit(self, options, nodes, returns):
        self.options, self.nodes, self.returns = options, nodes, returns
        self.world = tuple(range(nodes))  # the ranks training now: all, or fewer (elastic)
        self.joining = {}  # rank -> (node 0's saved epoch as it knocked, why): left, and back
        self.identities = {}  # rank -> its member's zmq identity: members by rank, at once
        self.refusals = set()
        self.returned = {}  # rank -> the words of a member of this run that came back

    def knocked(self, frames, message):
        """A knock: let in, or refused in one line (and said, once); or the
        word of a node whose own command was refused (``member.cannot_start``)."""
        if isinstance(message, dict) and isinstance(message.get("cannot_start"), str):
            rank = message.get("node_rank")
            self.say_once(f"node 0: node {rank if type(rank) is int else '?'} at "
                          f"{frames[1].bytes.decode()} cannot start: its command was refused "
                          f"there: {message['cannot_start'][:300]}")
            return self.answer(frames, {"why": None, "heard": True})
        why, address = self.judge(message), frames[1].bytes.decode()  # as the door saw it
        if why:
            theirs, mine = why if isinstance(why, tuple) else (why, why)
            self.say_refused(address, message, mine)
            return self.answer(frames, {"why": theirs})
        rank, kept = message["node_rank"], message.get("kept")
        joins = rank not in self.world  # a node an elastic run went on without: taken back
        back = self.drop_lost(rank) or bool(kept) or joins
        with self.lock:
            if kept and kept["run"] == self.run and kept["generation"] >= self.generation:
                # a member of this very run that lost sight of node 0 for a moment: its
                # workers are gone, so the run starts again, it too (an earlier generation's
                # member takes the order it missed instead)
                self.returned.setdefault(rank, f"node {rank} ({address}) lost sight of node "
                                         "0 and knocked again")
            if joins:  # at the end of the epoch the workers train now (``came_back``)
                self.joining[rank] = (self.saved_epoch, f"node {rank} ({address}) came back")
            identity = frames[0].bytes
            # heard from at the generation it beats: a node started again beats 0 until it
            # follows an order, and one an elastic run takes in waits a while for it
            self.members[identity] = Standing(rank, address, self.listened,
                                              kept["generation"] if kept else 0)
            self.identities[rank] = identity
            theirs = self.announced(rank, address, kept)
            # back: it takes the order node 0's workers run now, or waits for the next (none
            # where node 0 waits for it: that order's workers are gone)
            current = self.last_order if self.standing is NodeState.RUNNING else None
            self.answer(frames, {"why": None, "jax_coordinator": self.jax_coordinator,
                                 "run": self.run, "back": back, "send_kept": theirs,
                                 "order": current if back and not joins else None,
                                 "joins": joins})

    def judge(self, visitor):
        """Why a visitor may not join, in its words, or (in its words, in node
        0's) where they differ; None: it may."""
        rank, options = visitor["node_rank"], dict(visitor["options"])
        if type(rank) is not int or not 0 < rank < self.nodes:
            return f"node rank {str(rank)[:20]} is not one of 1..{self.nodes - 1}"
        differ = differences(self.options, options, self.options)
        if differ:  # node 0's values "there", as the visitor reads it; node 0 reads the reverse
            return (f"node 0 runs other options: {differ}",
                    f"it runs other options: {differences(options, self.options, self.options)}")
        kept = visitor.get("kept")
        if kept is not None and not (isinstance(kept, dict) and isinstance(kept.get("run"), str)
                                     and type(kept.get("generation")) is int
                                     and type(kept.get("size", 0)) is int):
            return "what it kept of the run is not what a node keeps"
        there = self.members[self.identities[rank]] if rank in self.identities else None
        ours = kept is not None and kept["run"] == self.run  # this run's member, knocking again
        if there and not there.gone() and not ours:
            return (f"node {rank} of the run at {self.address} has joined already: is another "
                    "run using this --coordinator?")
        if there and not self.returns:
            return f"node {rank} was lost, and this run takes no node back (--max-restarts 0)"
        return None

    def say_refused(self, address, visitor, why):
        """Node 0 says, once for each node and reason, whom it refused and why."""
        rank = visitor.get("node_rank") if isinstance(visitor, dict) else None
        who = f"node {rank}" if type(rank) is int else "a node"
        self.say_once(f"node 0: refused {who}{f' at {address}' if address else ''}: {why}")

    def say_once(self, line):
        if line not in self.refusals and len(self.refusals) < 1000:  # a flood says a little
            self.refusals.add(line)
            cli.say(line)

    def drop_lost(self, rank):
        """Forget the lost member of ``rank``, if any (it came back)."""
        identity = self.identities.pop(rank, None)
        return identity is not None and self.members.pop(identity, None) is not None

    def came_back(self):
        """Why the run must start again: a member of it came back since this
        generation began, or a node an elastic run went on without came back
        and node 0 has saved an epoch since (not the last but one: the
        workers stopped may save one more, and the last ends the run) (None:
        neither)."""
        with self.lock:
            for rank, (since, why) in list(self.joining.items()):
                standing = self.members.get(self.identities.get(rank))
                if standing is None or standing.gone():  # lost again while it waited
                    self.drop_lost(rank)
                    del self.joining[rank]
                    cli.say(f"node 0: {why}, and was lost again before it was taken in: the "
                            f"run goes on with {cli.counted(len(self.world), 'node')}")
                elif since != self.saved_epoch < self.options["epochs"] - 1:
                    self.returned[rank] = f"{why}, taken in at an epoch's end"
                    del self.joining[rank]
            return next(iter(self.returned.values()), None)


class Roll:
    """Who stands: a ``nodes.Standing`` of each member, by its zmq identity,
    heard from its heartbeats; whom node 0 still waits for."""

    def standings(self):
        """The members of the world: a node waiting to be taken in is none yet
        (``came_back``)."""
        return [s for s in list(self.members.values()) if s.rank in self.world]

    def beat(self, message):
        for identity in list(self.members):
            send_or_drop(self.socket, [identity, b"", message])

    def present(self):
        """Has every node of the run a member here that stands?"""
        return not self.missing()

    def missing(self):
        """The nodes of the world with no member here that stands, or whose
        copy of the run's checkpoint is still on its way, in words."""
        return [f"node {r}" for r in self.missing_ranks()]

    def missing_ranks(self):
        standing = set(self.standing_ranks())
        with self.lock:
            coming = {rank for rank, k in self.kept.items() if k["checkpoint"] is None}
        return [r for r in self.world[1:] if r not in standing - coming]

    def standing_ranks(self):
        """The ranks of the members here that stand."""
        return [s.rank for s in list(self.members.values()) if not s.gone()]

    def leave_out(self, ranks):
        """An elastic run goes on without the nodes ``ranks``: their members
        are forgotten, and one that knocks again is taken back at a restart."""
        for rank in ranks:
            self.drop_lost(rank)
        self.world = tuple(r for r in self.world if r not in ranks)

    def unjoined(self):
        """The nodes that never joined, in words."""
        return " and ".join(f"node {r}" for r in self.world[1:] if r not in self.identities)

    def never_joined(self):
        """Which nodes never joined, in a sentence (None: every one did)."""
        never = self.unjoined()
        return never and f"{never} never joined node 0 at {self.address}"

    def say_who_is_missing(self, until, timeout):
        """Now and then while a node has not joined (every ``WAITING_SAID_S``
        s, or twice within a ``timeout`` shorter): which, and how long the
        workers wait for it still (until ``until``, monotonic)."""
        never = self.unjoined()
        if never and time.monotonic() - self.waited > min(WAITING_SAID_S, timeout / 2):
            self.waited = time.monotonic()
            left = max(0, until - time.monotonic())
            cli.say(f"node 0: waiting for {never} to join at {self.address} ({left:.0f} s more; "
                    "see --timeout)")

    def door_ended(self):
        """Why no other node can reach this one any more: the door's process
        ended (killed, say), in words; None while it runs."""
        code = self.door.poll()
        if code is None:
            return None
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return (f"node 0's door, the lobby's socket at {self.address} (pid {self.door.pid}), "
                f"ended ({how}): no other node can reach this one")

    def verdict(self):
        return self.door_ended() or super().verdict()

    def gone(self):
        return bool(self.door_ended()) or super().gone()


class Orders:
    """The run's checkpoint and its restarts: node 0's checkpoint, sent to
    every member at each save (each keeps the run's last); node 0's order to
    start again; and, on a node 0 started again, the copies of the run's
    checkpoint the members kept (announced as they knock, sent once let in)."""

    def keep(self, shapes):
        self.shapes = shapes  # the model's: the checkpoints of this run are of it
        self.kept, self.last_order, self.saved = {}, None, None  # rank -> what it kept
        self.saved_epoch = None  # of node 0's last checkpoint of this run

    def announced(self, rank, address, kept):
        """A knock that names what its node kept of a run not this node 0's
        (node 0 started again: the run is the others'): its checkpoint is
        to come (``received_kept``).  Returns whether it is."""
        theirs = bool(kept) and kept.get("run") != self.run
        if theirs:
            self.kept[rank] = dict(kept, rank=rank, who=f"node {rank} ({address})",
                                   checkpoint=None if kept.get("size") else "")
        return theirs

    def received_kept(self, standing, checkpoint):
        """A member's copy of the run's checkpoint, as its knock announced it."""
        standing.spoke()
        with self.lock:
            kept = self.kept.get(standing.rank)
            if kept is not None and kept["checkpoint"] is None and isinstance(checkpoint, str) \
                    and len(checkpoint) == kept["size"]:
                kept["checkpoint"] = checkpoint

    def kept_by_others(self, every=False):
        """What the other nodes kept of the run that was this node 0's before
        it was lost (this node 0 started again, with the run's secret): the
        newest of it, or None where no node brought any (``every``: all of
        it, newest first)."""
        with self.lock:
            kept = [dict(k) for k in self.kept.values() if k["checkpoint"] is not None]
        kept.sort(key=lambda k: (k["generation"], k.get("epoch") or 0), reverse=True)
        return kept if every else next(iter(kept), None)

    def restart(self, generation):
        super().restart(generation)
        self.returned = {}

    def adopt(self, run):
        """This node 0 goes on with the run ``run`` the others kept."""
        with self.lock:
            self.run, self.kept = run, {}

    def share_saved(self, path):
        """Node 0's checkpoint at ``path``, once more, to every member, where
        this run wrote it anew (``records.written_by``): each keeps the run's
        last, for a node 0 started again on a machine without it."""
        try:
            st = os.stat(path)
        except (OSError, TypeError):
            return
        if (st.st_ino, st.st_mtime_ns, st.st_size) == self.saved:
            return
        self.saved = (st.st_ino, st.st_mtime_ns, st.st_size)
        try:
            raw = records.read_checkpoint(path, self.shapes)
        except records.CheckpointError:
            return
        run, epoch = records.written_by(path, self.shapes, raw)
        if run == self.run:
            self.saved_epoch = epoch
            message = {"saved": dict(run=run, epoch=epoch,
                                     checkpoint=base64.b64encode(raw).decode())}
            with self.lock:
                self.outbox.append(json.dumps(message).encode())

    def order_restart(self, generation, why, jax_coordinator, resume_epoch, checkpoint, world):
        """Start the run again, every node of the ``world`` (the ranks that
        train now): where JAX's coordinator listens now, and the checkpoint's
        bytes (None: from the first epoch), which the other machines may not
        hold."""
        self.world = tuple(world)
        self.restart(generation)
        if not why.startswith("node "):
            why = f"node 0 ({host_and_port(self.address)[0]}): {why}"
        order = dict(generation=generation, why=why, jax_coordinator=jax_coordinator,
                     resume_epoch=resume_epoch, run=self.run, world=list(world),
                     checkpoint=checkpoint and base64.b64encode(checkpoint).decode())
        with self.lock:
            self.last_order = order
            self.outbox.append(json.dumps({"restart": order}).encode())


class Lobby(Admission, Roll, Orders, Heartbeats):
    """Node 0's lobby at ``address`` (``--coordinator``), for a run of
    ``nodes`` machines, its ``Admission`` judged by node 0's ``options`` and the run's
    ``secret``, its members told where JAX's coordinator listens (a port of
    node 0's own choosing, or a socket in node 0's private run folder where
    every node is on this machine) and the run's name.  The socket itself
    is in a process of its own (``door``), so that no number of a stranger's
    connections takes a descriptor of the launcher's; messages are bounded,
    and a connection that does not finish its handshake within seconds is
    dropped.  What comes through, the door passes on to the lobby."""

    def __init__(self, address, options, nodes, secret, jax_coordinator, *, run, returns,
                 shapes):
        self.address, self.run, self.jax_coordinator = address, run, jax_coordinator
        self.members, self.waited = {}, time.monotonic()
        self.admit(options, nodes, returns)
        self.keep(shapes)
        check_port(address)
        self.door, inner = self.open_door(secret)
        self.door_folder = os.path.dirname(inner)
        context = zmq.Context()
        lobby = context.socket(zmq.PAIR)
        for option in (zmq.SNDHWM, zmq.RCVHWM):  # neither side waits on the other
            lobby.setsockopt(option, 0)
        lobby.connect(f"ipc://{inner}")
        self.start_beating(context, lobby)

    def open_door(self, secret):
        """Start the door (``door.py``) at this lobby's address: (the door's
        process, the socket in a private folder of its own where it passes
        on what comes through)."""
        public, private = curve_keys(secret)
        limit = LOBBY_MESSAGE_LIMIT + 2 * records.checkpoint_bytes(self.shapes, itemsize=8)
        settings = dict(address=self.address, public=public.decode(), private=private.decode(),
                        message_limit=limit, nodes=self.nodes,
                        folder_prefix=files.folder_name(os.getpid(), files.DOOR_TAIL))
        # a session of its own: a terminal's Ctrl-C is the launcher's, which closes the door
        opened = subprocess.Popen([sys.executable, door.__file__], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, start_new_session=True)
        with opened.stdout:
            try:
                opened.stdin.write(json.dumps(settings).encode() + b"\n")
                opened.stdin.flush()
                answer = json.loads(opened.stdout.readline() or '{"error": "it ended"}')
            except (OSError, ValueError) as e:
                answer = {"error": str(e)}
        if answer["error"]:
            self.close_door(opened)
            raise UsageError(f"cannot listen on {self.address} ({answer['error'].lower()}): "
                             "see --coordinator")
        files.check_folder(os.path.dirname(answer["lobby"]))
        return opened, answer["lobby"]

    @staticmethod
    def close_door(opened, folder=None, bye=False):
        """The door ends as its input closes, and removes its folder; it is
        killed if it does not end within 10 s (a busy machine), and its
        folder removed here.  ``bye``: the lobby has said all, and the door
        passes on what it said first (``door.relay``)."""
        with contextlib.suppress(OSError):  # a door that is gone already
            try:
                if bye:
                    opened.stdin.write(door.BYE)
            finally:
                opened.stdin.close()
        try:
            opened.wait(timeout=10)
        except subprocess.TimeoutExpired:
            opened.kill()
            opened.wait()
        if folder:  # the door's, checked as it opened
            shutil.rmtree(folder, ignore_errors=True)

    def answer(self, frames, reply):
        send_or_drop(self.socket, [frames[0].bytes, b"", json.dumps(reply).encode()])

    def received(self, frames):
        identity, message = frames[0].bytes, json.loads(frames[-1].bytes)
        if identity == b"" and message.get("denied"):  # the door's word: its handshake failed
            return self.say_refused(None, None, WITHOUT_THE_SECRET)
        if identity in self.members and "kept" in message:  # the checkpoint it announced
            return self.received_kept(self.members[identity], message["kept"])
        if identity in self.members:  # a member's heartbeat
            return self.members[identity].heard_from(message["beat"])
        self.knocked(frames, message)

    def __enter__(self):
        return self

    def said_all(self):
        send_or_drop(self.socket, [door.ALL_SAID])  # behind node 0's last words, on their way

    def __exit__(self, *exc):
        self.stop_beating()
        self.context.term()  # its last words gone through to the door,
        self.close_door(self.door, self.door_folder, bye=True)  # and on from there


def meet(args, shapes, stack):
    """How this node hears from the other nodes of its run: ``Alone`` where
    there are none; on node 0, its ``Lobby`` at --coordinator, which lets in
    the nodes given the same options (``args.run_options``); on any other,
    its membership of that lobby, which tells it where JAX's coordinator
    listens, and the run's name (``Member.jax_coordinator``, ``Member.run``).  The lobby and the
    membership close with ``stack``.  Returns (the link, a notice: the
    secret node 0 made, where it made one; on any other node, that it
    joined, or came back, and which workers it runs)."""
    if args.nodes == 1:
        return Alone(), None
    secret, notice = run_secret(args)  # the others prove they belong here: they hold it
    if args.node_rank == 0:
        return stack.enter_context(Lobby(args.coordinator, args.run_options, args.nodes, secret,
                                         args.jax_coordinator, run=args.run_id,
                                         returns=args.max_restarts > 0, shapes=shapes)), notice
    member = stack.enter_context(Member(args.coordinator, args.node_rank, args.run_options,
                                        args.timeout, secret))
    n = len(args.devices)
    ranks = ", ".join(map(str, range(args.node_rank * n, (args.node_rank + 1) * n)))
    how = "back in node 0's run" if member.back else "joined node 0"
    return member, (f"node {args.node_rank} of {args.nodes}: {how} at {args.coordinator}; "
                    f"worker{'s' * (n > 1)} {ranks} of {args.nodes * n} here, on "
                    f"{', '.join(args.devices)}")
