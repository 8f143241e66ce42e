"""Node 0's door: the lobby's public socket, in a process of its own.

Anyone who can reach ``--coordinator`` may open connections to it, as many
as they like, and each takes a descriptor of the process that listens until
zmq drops it (a handshake not finished within ``HANDSHAKE_MS``).  Were that
process the launcher, a stranger's thousand connections would leave it no
descriptor of its own: no library to import, no pipe to a worker, no
checkpoint to write.  So the lobby's socket lives here, in a process whose
descriptors are its alone: a flood fills this table (the kernel holds the
connections past it until zmq drops the first ones), and the launcher never
notices.  What passes ZeroMQ's CURVE handshake with the run's key goes on
to the lobby (``lobby.Lobby``), on a zmq socket in a private folder the
door makes (``mkdtemp``: exclusively, mode 0700) and removes as it ends,
with the address it came from; what the lobby sends goes out.  A folder
left by a door killed with its launcher is a dead run's, which the next
run drops (``files.drop_folders_of_dead_runs``).

The lobby runs this file as a script, ``python door.py``: it imports zmq
alone, reads its settings as one JSON line on its standard input, answers
one JSON line on its standard output once it listens (where the lobby
finds it, or why it cannot listen), and ends when its standard input
closes or says BYE: the launcher ended, however it ended.
"""
import collections
import json
import os
import shutil
import sys
import tempfile
import time

import zmq
import zmq.auth.thread

HANDSHAKE_MS = 5000  # a connection that has not proved itself by then is dropped
ALL_SAID = b"all said"  # the lobby's word, after its last words, that they were all
BYE = b"."  # the launcher's, before it closes the door's input: it closed the lobby
LAST_WORDS_S = 5.0  # at most, for the lobby's last words after its BYE (a busy machine)
DENIED = b'{"denied": true}'  # to the lobby: a knock's handshake failed


class OnlyTheRun:
    """The door's ZAP policy: a client is let in only with the run's key."""

    def __init__(self, public):
        self.public = public

    def callback(self, domain, key):
        return key == self.public


def open_door(context, settings):
    """The public ROUTER socket at ``settings["address"]``, under CURVE with
    the run's key pair: a stranger's handshake fails before a byte of a
    message is read.  Messages are bounded, and every node may knock at
    once: past zmq's backlog of 100 the kernel drops their SYNs, which come
    again 1 s, 3 s, 7 s later (1024 nodes: all in after 2.8 s, not 0.9)."""
    public, private = settings["public"].encode(), settings["private"].encode()
    door = context.socket(zmq.ROUTER)
    door.curve_secretkey, door.curve_publickey, door.curve_server = private, public, True
    for option, value in ((zmq.LINGER, 1000), (zmq.MAXMSGSIZE, settings["message_limit"]),
                          (zmq.HANDSHAKE_IVL, HANDSHAKE_MS),
                          (zmq.BACKLOG, max(100, settings["nodes"]))):
        door.setsockopt(option, value)
    door.bind(f"tcp://{settings['address']}")
    return door


class Relay:
    """What passes through the door: a member's word to the lobby as [its
    identity, the address it came from, the word], the lobby's to its members
    as the lobby sends it (identity first).  No queue is bounded, so that
    neither side waits on the other: a member's words wait here while the
    lobby cannot take them (it connects after the door opens; closed, it
    takes none, and a send to it would wait for ever)."""

    def __init__(self, door, lobby):
        self.door, self.lobby, self.said = door, lobby, False
        self.for_lobby = collections.deque()

    def to_lobby(self, frames):
        address = frames[-1].get("Peer-Address") or "address unknown"
        self.for_lobby.append([frames[0].bytes, address.encode(), frames[-1].bytes])
        self.flush()

    def flush(self):
        """The members' words, as far as the lobby takes them now."""
        while self.for_lobby:
            try:
                self.lobby.send_multipart(self.for_lobby[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self.for_lobby.popleft()

    def to_members(self, frames):
        if len(frames) == 1 and frames[0].bytes == ALL_SAID:
            self.said = True
        else:
            self.door.send_multipart(frames)

    def last_words(self, bye):
        """What the lobby said last, passed on up to its ALL_SAID: for up to
        ``LAST_WORDS_S`` once its launcher said ``bye``, 0.2 s where the
        launcher was killed."""
        deadline = time.monotonic() + (LAST_WORDS_S if bye else 0.2)
        while not self.said and self.lobby.poll(max(0.0, deadline - time.monotonic()) * 1000):
            pass_on(self.lobby, self.to_members)


def relay(door, lobby, launcher):
    """Pass messages both ways (``Relay``) until the launcher's pipe closes.
    A launcher that closed its lobby says BYE: its last words, which reach
    this process by another way than the pipe, go out first, up to the
    lobby's ALL_SAID (a machine so busy that they come seconds later still
    sends them); a launcher killed says nothing, and what it said is passed
    on within 0.2 s.  A handshake that failed (a knock without the run's
    secret: its key does not open the door's) goes to the lobby as ``DENIED``."""
    poller = zmq.Poller()
    for socket in (door, lobby, launcher):
        poller.register(socket, zmq.POLLIN)
    failed = door.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    poller.register(failed, zmq.POLLIN)
    passing = Relay(door, lobby)
    while True:
        events = dict(poller.poll(100 if passing.for_lobby else None))
        if failed in events:  # the lobby says it (zmq knows not whose: the address is the door's)
            failed.recv_multipart()
            passing.for_lobby.append([b"", b"", DENIED])
        passing.flush()
        if door in events:
            pass_on(door, passing.to_lobby)
        if lobby in events:
            pass_on(lobby, passing.to_members)
        if launcher in events:
            return passing.last_words(os.read(launcher, 1) == BYE)


def pass_on(source, send):
    """What has come in at ``source``, each message to ``send``: a few
    thousand at most, so that the other side's turn comes."""
    for _ in range(4096):
        try:
            send(source.recv_multipart(zmq.NOBLOCK, copy=False))
        except zmq.Again:
            return


def main():
    settings = json.loads(sys.stdin.buffer.readline())
    # named by the lobby after the launcher, as the run folder is (``files.folder_name``)
    folder = tempfile.mkdtemp(prefix=settings["folder_prefix"])
    context = zmq.Context()
    auth = zmq.auth.thread.ThreadAuthenticator(context)
    try:
        auth.start()
        auth.configure_curve_callback("*", OnlyTheRun(settings["public"].encode()))
        lobby = context.socket(zmq.PAIR)
        for option in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
            lobby.setsockopt(option, 0)
        lobby.bind(f"ipc://{folder}/lobby.sock")
        try:
            door = open_door(context, settings)
        except zmq.ZMQError as e:
            print(json.dumps({"error": e.strerror}), flush=True)
            return 1
        print(json.dumps({"error": None, "lobby": f"{folder}/lobby.sock"}), flush=True)
        relay(door, lobby, sys.stdin.fileno())
        return 0
    finally:
        auth.stop()
        context.destroy()  # each socket with its own linger: the members' last words go out
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
