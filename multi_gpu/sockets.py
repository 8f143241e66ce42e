"""The zmq sockets between the workers of one machine (``Peer``).

A PAIR socket for every pair of workers, over ``ipc://`` in the run's
private folder (2014 bound TCP port 5000 on every interface).  They carry
the one-time handshake (each worker's buffer handle) and, every step, the
two signals; ``dual_mlp.py`` makes every call on them (``barrier``,
``swap``, ``wait_for_worker``).  What is here: the sockets, and how long a
wait may last (``Peer.overdue``).
"""
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import os
import sys
import time

import zmq

from multi_gpu.nodes import LOST_AFTER  # a heartbeat still for that long: a worker gone
from multi_gpu.worker import heartbeat_path, stopped_workers

HANDSHAKE = "the handshake"  # the wait that a worker still compiling does not end
STILL_STARTING_S = 1800      # how long the handshake waits for a worker still compiling


class PeerError(Exception):
    """The other worker stalled, vanished or disagreed; one line of message."""


class Peer:
    """The zmq links between the workers of one machine: a PAIR socket for
    every pair, the lower rank binding, in the run's private folder.
    A worker that has its links says so to the others (``meeting-RANK`` in
    the run folder): one whose heartbeat goes on without it is still
    compiling, which the handshake waits for past --timeout (a first Numba
    compile on a busy machine takes minutes), up to ``STILL_STARTING_S``."""

    def __init__(self, rundir, rank, n_workers, *, timeout, spin=0.0):
        """
        :param timeout: seconds to wait for another worker at any barrier
        :param spin: seconds to poll without sleeping before blocking; a
            wake-up from a blocking wait costs tens of microseconds, which
            matters next to a GPU step but would steal a CPU worker's core
        """
        self.rundir, self.rank, self.n = rundir, rank, n_workers
        self.timeout, self.spin = timeout, spin
        self.barriers = 0
        self.context = zmq.Context()
        self.sockets = {}  # the other worker's rank -> its socket
        for other in range(n_workers):
            if other == rank:
                continue
            socket = self.context.socket(zmq.PAIR)
            socket.setsockopt(zmq.LINGER, 0)
            low, high = sorted((rank, other))
            address = "ipc://" + os.path.join(rundir, f"peer-{low}-{high}.sock")
            (socket.bind if rank == low else socket.connect)(address)
            self.sockets[other] = socket
        with open(os.path.join(rundir, f"meeting-{rank}"), "x"):
            pass
        self.said_waiting = False

    def overdue(self, other, what, started, since):
        """A wait for worker ``other`` at ``what``, begun at ``started``
        (``time.monotonic``), past --timeout counted from ``since``, or whose
        other worker was seen compiling at ``since``: it goes on, and returns
        from when the timeout counts (at the handshake, from the end of the
        other's compile); or it is over: PeerError, naming the worker that
        stopped."""
        now = time.monotonic()
        if what == HANDSHAKE and self.still_compiling(other, now - started):
            return now  # no stall: its links made, a moment's work may remain before it sends
        if now - since <= self.timeout:
            return since
        # the one that stopped, rather than one that waits for it as we do
        late = stopped_workers(self.rundir, self.n, self.rank) or [other]
        waited = now - started
        raise PeerError(f"worker {late[0]} did not reach {what} within "
                        f"{self.timeout if waited < STILL_STARTING_S else waited:g} s (see "
                        "--timeout)")

    def still_compiling(self, other, waited):
        """Is worker ``other`` alive (its heartbeat, which a compile holding
        Python's lock on a busy machine delays by seconds; none yet as it
        starts), without its links yet, for less than ``STILL_STARTING_S``?
        Worker 0 says once that it waits."""
        try:
            beat = time.time() - os.path.getmtime(heartbeat_path(self.rundir, other))
        except OSError:  # not yet made: it is starting (its launcher stops us if it died)
            beat = 0.0
        starting = beat < LOST_AFTER and \
            not os.path.exists(os.path.join(self.rundir, f"meeting-{other}"))
        if starting and self.rank == 0 and not self.said_waiting:
            self.said_waiting = True
            print(f"worker 0: notice: worker {other} is still compiling after {waited:.0f} s: "
                  f"the handshake waits for it (up to {STILL_STARTING_S // 60} min)",
                  file=sys.stderr, flush=True)
        return starting and waited < STILL_STARTING_S

    def close(self):
        # Linger a moment: a message still in flight (the last --check
        # exchange, 1.6 MB) is discarded by a close without it, and the peer
        # then waits for it until its timeout.
        for socket in self.sockets.values():
            socket.close(linger=1000)
        self.context.term()
