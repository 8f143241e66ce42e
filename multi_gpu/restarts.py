"""Where a run starts again: ``--max-restarts``, on one machine or several.

``supervise`` runs the workers (``launcher.launch``) and, where one fails
or stops, and ``--max-restarts`` allows, starts them all again, every node,
from the last checkpoint this run wrote, saying so in one line each time.
Node 0 decides, and tells the others where to start (``Lobby.order_restart``).

A node lost is waited for: the others say so, and when its command is
started again, there or on a replacement machine with the same
``--node-rank``, it is let in again in its place and the run starts again
(``--rejoin-timeout`` bounds the wait).  Node 0 too: its members keep the
run's last checkpoint, knock again at ``--coordinator`` until node 0,
started again with the run's secret, answers, and give it what they kept.
Each return counts as a restart.  Past them, the run ends in one line that
says what failed, where, and how to resume.
"""
import base64
import sys
import time

from multi_gpu import cli, records
from multi_gpu.cli import UsageError
from multi_gpu.launcher import launch
from multi_gpu.lobby import NoAnswer
from multi_gpu.nodes import free_port, host_and_port
from multi_gpu.request import check_resume, private_coordinator, run_folder
from multi_gpu.hooks import stopping


class RunEnds(Exception):
    """The run cannot start again: why, in one line; its exit code."""

    def __init__(self, why, code=1):
        super().__init__(why)
        self.code = 128 + stopping.signum if stopping.is_set() else code


def supervise(args, shapes, start, rundir, link):
    """Run the workers until the run ends well, or cannot start again;
    returns the exit code."""
    code, trace, why = 1, "", None
    try:
        if args.node_rank and link.back:  # came back: node 0's order first
            rundir = started_again(args, shapes, link, rejoined(args, shapes, link), rundir)
        while True:
            code, trace, why, lost = launch(args, shapes, start, rundir, link)
            if why is None:
                break
            again = member_again if args.node_rank else node0_again
            rundir = started_again(args, shapes, link, again(args, shapes, link, why, lost,
                                                              code), rundir)
    except RunEnds as e:
        code, why = e.code if code != 2 else code, str(e)
    if why is not None:
        link.tell("failed", why, final=True)
        cli.say(f"{trace}error: {why}{records.resume_hint(args, shapes)}", file=sys.stderr)
    return code


def started_again(args, shapes, link, how, rundir):
    """Say how the run starts again, in a new run folder; node 0 tells the
    others where.  Returns the new run folder."""
    generation, why, resumed, told = how
    cli.say(f"{why}: restarting every worker {resumed} (restart {generation} of "
            f"{args.max_restarts})", file=sys.stderr)
    old, (rundir, _) = rundir, run_folder(args, shapes)
    if args.node_rank:
        link.restart(generation)
    else:
        order_restart(args, link, generation, told, old, rundir)
    return rundir


def node0_again(args, shapes, link, why, lost, code):
    """Node 0, its workers stopped: may the run start again, and from where?
    (generation, why, from where in words, why in the others' words)."""
    kept = link.kept_by_others()  # this is node 0 started again: the others kept the run
    generation = (kept["generation"] if kept else link.generation) + 1
    if code == 2:  # bad input fails again
        raise RunEnds(why)
    if generation > args.max_restarts:
        raise RunEnds(why if not kept else f"{why}, but the run has restarted "
                      f"{kept['generation']} times already (--max-restarts {args.max_restarts})")
    if not (lost or link.present()):  # a worker broke as a node went: the node's word
        why, lost = link.verdict() or why, True
    if lost or kept:
        wait_for_the_others(args, link, why, lost)
        kept = link.kept_by_others()
    if kept:
        resumed = adopt(args, shapes, link, kept)
        where = host_and_port(args.coordinator)[0]
        return generation, why, resumed, f"node 0 ({where}) came back"
    why = f"{why}, and came back" if lost else why
    try:
        return generation, why, restart_point(args, shapes), why
    except (UsageError, records.CheckpointError) as e:
        raise RunEnds(f"{why}; no restart: {e}") from None


def wait_for_the_others(args, link, why, lost):
    """Node 0: until every other node has a member in the lobby that stands
    (a lost one came back), for at most --rejoin-timeout seconds; the
    members are told, and wait too."""
    if lost:
        missing = " and ".join(link.missing())
        waiting = (f"{why}: waiting up to {args.rejoin_timeout:g} s for {missing} to come back "
                   f"(its command again, there or on a replacement machine)")
        cli.say(waiting, file=sys.stderr)
        link.tell("waiting", waiting)
    deadline = time.monotonic() + args.rejoin_timeout
    while not link.present():
        if stopping.is_set():
            raise RunEnds(f"{why}; interrupted while waiting for {' and '.join(link.missing())}")
        if time.monotonic() > deadline:
            raise RunEnds(f"{why}; {' and '.join(link.missing())} did not come back within "
                          f"{args.rejoin_timeout:g} s (--rejoin-timeout)")
        time.sleep(0.05)


def adopt(args, shapes, link, kept):
    """Node 0 started again goes on with the run the others kept: its name,
    and its last checkpoint (checked as --resume is), or where it began.
    Returns from where, in words."""
    args.run_id = kept["run"]
    link.adopt(kept["run"])
    raw = kept.get("checkpoint") and base64.b64decode(kept["checkpoint"])
    if not raw:
        args.resume, args.resume_epoch = None, 0
        return resumed_at(args)
    args.resume = f"node {kept['rank']}'s copy of the run's checkpoint"
    try:
        run, epoch = records.written_by(args.resume, shapes, raw)
        if (run, epoch) != (kept["run"], kept.get("epoch")):
            raise records.CheckpointError(f"{args.resume} is not the run's checkpoint it says")
        check_resume(args, shapes, raw=raw)
    except (UsageError, records.CheckpointError) as e:
        raise RunEnds(f"{kept['who']} kept the run, but {e}") from None
    return resumed_at(args)


def member_again(args, shapes, link, why, lost, code):
    """Node R > 0, its workers stopped: node 0 decides.  Where node 0 is
    lost (now, or while this node waits for its word), knock again at its
    address until it is back (--rejoin-timeout).  (generation, why, from
    where in words, None)."""
    if not link.ordered():
        link.tell("failed", why)  # node 0 decides whether the run starts again
    if code == 2 or link.generation >= args.max_restarts:
        raise RunEnds(why)
    if not (lost or link.node0.lost()):
        link.await_order()
    if not link.ordered() and link.node0.lost():
        why = why if lost else link.verdict()
        cli.say(f"{why}: waiting up to {args.rejoin_timeout:g} s for node 0 to come back at "
                f"{args.coordinator} (its command again, there or on a replacement machine "
                "at that address, with the run's secret)", file=sys.stderr)
        try:
            link.rejoin(args.rejoin_timeout)
        except NoAnswer:
            raise RunEnds(f"{why}; node 0 did not come back within {args.rejoin_timeout:g} s "
                          "(--rejoin-timeout)") from None
        except UsageError as e:
            raise RunEnds(f"{why}; {e}") from None
    return rejoined(args, shapes, link, why)


def rejoined(args, shapes, link, why=None):
    """Node R > 0: node 0's order to start again, followed (RunEnds where
    none comes).  (generation, why, from where in words, None)."""
    order = link.ordered() or link.await_order()
    if not order:
        raise RunEnds(link.verdict() or why or "node 0 gave no order to start again")
    try:
        return order["generation"], order["why"], follow(args, order, shapes), None
    except (UsageError, records.CheckpointError) as e:
        raise RunEnds(f"{order['why']}; no restart: {e}") from None


def order_restart(args, link, generation, why, old, rundir):
    """Node 0's restart: JAX's coordinator where the new run folder is, or
    at a new port (the last one's may linger); the other nodes told."""
    if args.jax_coordinator == private_coordinator(old):
        args.jax_coordinator = private_coordinator(rundir)
    elif args.nodes > 1:
        host = host_and_port(args.coordinator)[0]
        args.jax_coordinator = f"{host}:{free_port(host)}"
    if args.nodes > 1:
        link.order_restart(generation, why, args.jax_coordinator, args.resume_epoch,
                           args.checked_resume if args.resume else None)
    else:
        link.restart(generation)


def restart_point(args, shapes):
    """Make the request resume where a restart starts: from this run's last
    checkpoint (--save) once it wrote one, else where the run began (its
    --resume, or the first epoch).  Returns where, in words."""
    if args.save and records.written_by(args.save, shapes)[0] == args.run_id:
        args.resume = args.save
    if args.resume:
        check_resume(args, shapes)
    return resumed_at(args)


def follow(args, order, shapes):
    """Node R > 0: make the request resume where node 0's ``order`` says,
    from the bytes of node 0's checkpoint, checked here as a file given to
    --resume is (a checkpoint of this model, at the epoch the order names).
    Returns where, in words."""
    args.jax_coordinator, args.resume_epoch = order["jax_coordinator"], order["resume_epoch"]
    args.checked_resume = order["checkpoint"] and base64.b64decode(order["checkpoint"])
    args.resume = "node 0's checkpoint" if order["checkpoint"] else None
    if args.resume:
        _, _, state = records.load_checkpoint(args.resume, shapes, records.TRAINING_STATE,
                                              raw=args.checked_resume)
        if state["epoch"] != args.resume_epoch:
            raise records.CheckpointError(f"node 0's checkpoint is at epoch {state['epoch']}, "
                                          f"its order says {args.resume_epoch}")
    return resumed_at(args)


def resumed_at(args):
    """From where the restart trains, in words; a --trace window behind it
    moves to the restart's first epoch, and the words say so."""
    moved = ""
    if args.trace and args.trace_from <= args.resume_epoch:
        args.trace_from = args.resume_epoch + 1
        moved = f", --trace now from epoch {args.trace_from} (its window was behind the restart)"
    where = f"from {args.resume} at epoch {args.resume_epoch}" if args.resume else \
        "from the first epoch"
    return where + moved
