"""Where a run may stop or fail on purpose: stop requests and the fault tests' hook.

A stop signal (SIGINT, SIGTERM) only sets ``stopping``; a worker stops where
it may (``stop_point``, or where it waits), never inside a compiled call or a
checkpoint write.  ``fault_point`` is the fault tests' hook,
``DUAL_MLP_FAULT=RANK:WHERE:HOW``, which the launcher shares: a worker, or
the launcher, fails or pauses where a real run can.
"""
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import os
import re
import signal
import time

import numpy as np


class Interrupted(Exception):
    """This worker was asked to stop (SIGINT or SIGTERM) while it waited."""


class StopRequest:
    """Set by SIGINT (Ctrl-C) or SIGTERM (the launcher stopping us, or Linux
    when the launcher dies).  A worker stops at the next step or while it
    waits for its peer, never inside a compiled call or a checkpoint write.
    A plain attribute, not a threading.Event: a signal handler must take no
    lock, or a second signal arriving inside it deadlocks the process."""

    signum = 0

    def is_set(self):
        return self.signum != 0


stopping = StopRequest()


def request_stop(signum, frame):
    stopping.signum = signum


def stop_point(rank, where):
    """Where a step may stop: on request, or by the fault tests' hook."""
    if stopping.is_set():
        raise Interrupted
    fault_point(rank, where)


FAULT = os.environ.get("DUAL_MLP_FAULT", "").split(":")  # read once: it is on every step's path
FAULT_PLACES = ("compile", "start", "train", "exchange", "save", "spawned", "folder")
FAULT_KINDS = ("raise", "oom", "kill", "hint", "stop", "slow")
SLOW_S = 15  # seconds a "slow" fault holds a worker (slow=SECONDS: as long as asked)


def fault_spec_problem():
    """What is wrong with DUAL_MLP_FAULT (the fault tests' hook), or None."""
    if FAULT == [""]:
        return None
    how, _, seconds = FAULT[-1].partition("=")
    known = how in FAULT_KINDS and (not seconds or
                                    how == "slow" and seconds_in(seconds) is not None)
    if len(FAULT) != 3 or FAULT[1] not in FAULT_PLACES or not known or \
            not (FAULT[0].isdigit() or FAULT[0] == "launcher"):
        return (f"DUAL_MLP_FAULT={':'.join(FAULT)}: expected RANK:WHERE:HOW (the fault tests' "
                f"hook), WHERE one of {', '.join(FAULT_PLACES)}, HOW one of "
                f"{', '.join(FAULT_KINDS)} (slow=SECONDS for longer than {SLOW_S} s); unset "
                "it to run normally")
    return None


def seconds_in(text):
    """A duration given as ``SECONDS`` (``2``, ``0.05``), or None."""
    return float(text) if re.fullmatch(r"\d+(\.\d+)?", text) else None


def fault_point(rank, where):
    """The fault tests' hook: DUAL_MLP_FAULT=RANK:WHERE:HOW makes worker RANK
    fail on reaching WHERE (compile: before it opens its device, start,
    train, exchange, save: a checkpoint written but not yet in place) by HOW (raise, oom, kill,
    or hint: an error whose message ends in a hint line, as PyTensor's do),
    or pause there (stop: SIGSTOP, until the test has acted and sends SIGCONT;
    slow: ``SLOW_S`` seconds, or ``slow=SECONDS``, its heartbeat going on:
    a first compile on a busy machine)."""
    if FAULT[:2] != [str(rank), where]:
        return
    if FAULT[2].startswith("slow"):
        time.sleep(seconds_in(FAULT[2].partition("=")[2]) or SLOW_S)
        return
    if FAULT[2] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if FAULT[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if FAULT[2] == "oom":
        np.empty(1 << 60, np.uint8)  # raises MemoryError, as a real allocation failure would
    hint = "\nHINT: re-run with more detail" if FAULT[2] == "hint" else ""
    raise RuntimeError(f"fault injected at {where}{hint}")
