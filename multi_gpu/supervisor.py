"""The run's life, from its launcher: start, train, wait, restart, end.

The shape is torch elastic's agent: the run's states an ``Enum``, what
ends a launch and how a restart goes named records, and one loop,
``Supervisor.run``, with a branch per state::

    STARTING    fork a worker per device, make the run folder, leave the request
    TRAINING    watch them, and the other nodes, until they end, or something fails
    WAITING     for a lost node to come back (--max-restarts, --rejoin-timeout);
                an elastic run (--nodes MIN:MAX) then goes on without it
    RESTARTING  from the run's last checkpoint, every node, one line each
    FINISHED    exit 0
    FAILED      one line: what failed, where, and how to resume

What happens when a worker dies: ``train`` sees its exit, stops the other
workers (SIGTERM, then SIGKILL: ``launcher.stop``) and names it
(``what_failed``); with --max-restarts left, ``decide`` restarts every
worker of every node from the last checkpoint, else the run fails.

When a machine is lost: its launcher's heartbeats stop (``nodes.py``);
after ``nodes.LOST_AFTER`` s of silence every other node names it and stops
its workers.  Node 0 decides what follows, and the members follow its word:
with --max-restarts, node 0 waits for the lost node's command to be started
again (``wait``), takes it back in its place, and orders a restart; a
member that lost node 0 keeps the run's last checkpoint and knocks at
--coordinator until node 0, started again with the run's secret and
options, answers and takes the run back from it (``lobby.py``).  A member
that only lost sight of node 0 for a moment (a cable cut and restored)
knocks again too: node 0 takes it back in its place, the same member, and
orders a restart.  A loss after the run's last epoch was saved and reported
is not a failure.

How the workers are started: ``start`` forks them from this process
(``launcher.fork_workers``), each runs ``worker`` of dual_mlp.py with the
request this launcher checked, which it reads from the run folder
(``launcher.leave_the_request``).
"""
import contextlib
import dataclasses
import enum
import signal
import sys
import time

from multi_gpu import cli, files, records
from multi_gpu.cli import UsageError
from multi_gpu.elastic import regroup
from multi_gpu.files import NoRunFolder, private_coordinator, run_folder
from multi_gpu.hooks import fault_point, request_stop, stopping
from multi_gpu.launcher import (
    Worker,
    by_cause,
    fork_workers,
    leave_the_request,
    position,
    stall_patience,
    stop,
    unkillable,
)
from multi_gpu.member import NoAnswer
from multi_gpu.nodes import LOST_AFTER, SECRET_VARIABLE, NodeState, free_port, host_and_port
from multi_gpu.resume import adopt, follow, restart_point


class State(enum.Enum):
    STARTING = "starting"
    TRAINING = "training"
    WAITING = "waiting for a lost node"
    RESTARTING = "restarting"
    FINISHED = "finished"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a launch of the workers ended: its exit code; what failed, in one
    line (None: it ended well, or the run said why itself); the traceback of
    a worker that failed unexpectedly; whether a node was lost, or ended for
    good."""
    code: int
    why: str | None = None
    trace: str = ""
    lost: bool = False


@dataclasses.dataclass(frozen=True)
class Restart:
    """How the run starts again: its generation (restart N of
    --max-restarts), why, from where in words, and node 0's why in the
    other nodes' words (None on a member)."""
    generation: int
    why: str
    resumed: str
    told: str | None = None


class RunEnds(Exception):
    """The run cannot start again: why, in one line; its exit code."""

    def __init__(self, why, code=1):
        super().__init__(why)
        self.code = 128 + stopping.signum if stopping.is_set() else code


class Supervisor:
    """One node's launcher, from the checked request (``plan``) to the
    exit code: the model's parameter ``shapes``, what each worker runs
    (``start``), the run's private folder (``rundir``), and the other nodes
    (``link``: ``nodes.Alone``, node 0's ``lobby.Lobby`` or a
    ``member.Member``)."""

    def __init__(self, plan, shapes, start, rundir, link):
        self.plan, self.shapes, self.start_worker = plan, shapes, start
        self.rundir, self.link, self.member = rundir, link, bool(plan.node_rank)
        self.outcome, self.workers, self.made = Outcome(1), [], False
        self.launch = contextlib.ExitStack()  # the workers and their folder, while they run

    def run(self):
        """The run's life, a branch per state; returns the exit code."""
        state = State.RESTARTING if self.member and self.link.back else State.STARTING
        with self.launch:
            while True:
                try:
                    if state is State.STARTING:
                        state = self.start()
                    elif state is State.TRAINING:
                        state = self.train()
                    elif state is State.WAITING:
                        state = self.wait()
                    elif state is State.RESTARTING:
                        state = self.restart()
                    elif state is State.FINISHED:
                        return 0
                    else:
                        return self.fail()
                except RunEnds as e:
                    self.outcome = Outcome(2 if self.outcome.code == 2 else e.code, str(e),
                                           self.outcome.trace)
                    state = State.FAILED

    # -- STARTING ------------------------------------------------------------------------

    def start(self):
        """Fork the workers, then make the run folder and leave the request
        there.  In that order, wherever this launcher dies (even by SIGKILL),
        a worker is there to remove the folder: each waits for the request
        only while its launcher lives, and one that finds itself orphaned, or
        that Linux tells, removes the folder before it goes (``run_worker``).
        The name is unguessable and shown nowhere another user can read, and
        the folder is made exclusively (``files.make_folder``): one that is
        there already is someone else's, and is left as it is."""
        cli.install_stop_handler(request_stop)
        files.keep_descriptors()
        Worker.quiet = False
        self.workers, self.made = fork_workers(self.plan, self.start_worker, self.rundir), False
        self.launch.callback(self.end_launch)
        fault_point("launcher", "spawned")
        try:
            files.make_folder(self.rundir)
        except FileExistsError:
            cli.say(f"error: the run folder {self.rundir} exists already, made by someone "
                    "else: the run stops and leaves it as it is", file=sys.stderr)
            return self.ended(Outcome(1))
        self.made = True
        fault_point("launcher", "folder")
        problem = leave_the_request(self.plan, self.rundir)
        if problem:
            cli.say(f"error: {problem}", file=sys.stderr)
            return self.ended(Outcome(1))
        return State.TRAINING

    def end_launch(self):
        """The launch's workers stopped (those still running), its folder removed."""
        stop(self.workers)
        why = self.made and files.remove_folder(self.rundir)
        if why:
            cli.say(f"error: the run folder {self.rundir} could not be removed ({why}): "
                    "remove it by hand", file=sys.stderr)

    def ended(self, outcome):
        """The launch is over: its workers stopped, its folder removed; the
        state that follows ``outcome``."""
        self.launch.close()
        self.outcome = outcome
        if outcome.why is None:
            return State.FINISHED if outcome.code == 0 else State.FAILED
        return self.decide()

    # -- TRAINING ------------------------------------------------------------------------

    def train(self):
        """Until the workers all end well, or one fails or stops running, or
        another node is lost, or node 0 orders the run to start again, or a
        member lost and back, or the other nodes bring this node 0 the run
        they kept.  Meanwhile node 0's checkpoint goes to the others at each
        save, and node 0 says whom it waits for while a node has not joined."""
        plan, link, workers = self.plan, self.link, self.workers
        patience, meeting = stall_patience(plan.timeout), time.monotonic() + plan.timeout
        turn, woke = time.monotonic(), time.time()
        while not stopping.is_set():
            if time.monotonic() - turn > 1.0:  # this launcher was kept from running
                woke = time.time()
            turn = time.monotonic()
            link.share_saved(plan.save)
            link.say_who_is_missing(meeting, plan.timeout)
            codes = [w.proc.poll() for w in workers]
            if all(code == 0 for code in codes):
                link.tell(NodeState.DONE)
                return self.ended(Outcome(0))
            failed = [w for w, code in zip(workers, codes) if code not in (None, 0)]
            stalled = [w for w, code in zip(workers, codes)
                       if code is None and w.stalled(self.rundir, patience, woke)]
            verdict, order = link.verdict(), link.ordered()
            kept, back = link.kept_by_others(), link.came_back()
            if order or kept or back:  # the run starts again: a node failed, or came back
                left = stop(workers)
                why = order["why"] if order else back or f"{kept['who']} kept the run"
                return self.ended(Outcome(1, f"{why}{unkillable(left)}"))
            if failed or stalled or verdict:
                outcome = self.what_failed(failed, stalled, verdict, patience)
                if outcome:  # else Ctrl-C reached the workers first: the run is stopping
                    return self.ended(outcome)
            time.sleep(0.05)
        left = stop(workers)
        if stopping.signum == signal.SIGPIPE:  # our standard output closed (``| head``)
            link.tell(NodeState.FAILED, "its output was closed (SIGPIPE)", final=True)
            return self.ended(Outcome(128 + signal.SIGPIPE))
        interrupted = f"interrupted ({signal.Signals(stopping.signum).name})"
        link.tell(NodeState.FAILED, interrupted, final=True)
        cli.say(f"{interrupted}{records.resume_hint(plan, self.shapes)}{unkillable(left)}",
                file=sys.stderr)
        return self.ended(Outcome(128 + stopping.signum))

    def what_failed(self, failed, stalled, verdict, patience):
        """Stop the workers, and say what failed first, where (None where
        Ctrl-C reached the workers first)."""
        workers, link = self.workers, self.link
        at = position(self.rundir, workers[0].rank)
        left = stop(workers)
        if verdict and all(w.finished(self.rundir) for w in workers):
            # every worker here had trained the last epoch and written all (node 0: the
            # checkpoint and the summary): the run is finished, whatever JAX's shutdown, the
            # workers' last exchange, would have said
            link.tell(NodeState.DONE)
            cli.say(f"notice: {verdict}, after the last epoch was trained and written: the "
                    "run is finished", file=sys.stderr)
            return Outcome(0)
        failed = by_cause(failed)
        if any(w.proc.returncode == 128 + signal.SIGPIPE for w in failed):
            return Outcome(128 + signal.SIGPIPE)  # stdout was closed: end as quietly
        if failed and all(w.proc.returncode in (130, 143) for w in failed) and not verdict:
            stopping.signum = failed[0].proc.returncode - 128  # Ctrl-C reached them first
            return None
        # a collective that broke under us: it raised, or JAX's runtime aborted (SIGABRT)
        if failed and not (verdict or stalled) and link.others and \
                (failed[0].proc.returncode > 0 or failed[0].proc.returncode == -signal.SIGABRT) \
                and not failed[0].said_why():
            verdict = another_nodes_word(link)
            if link.ordered():
                return Outcome(1, link.ordered()["why"])
        trace, why = "", verdict
        if not why and failed and failed[0].said_why() and any(
                "did not all meet at the coordinator" in line for line in failed[0].tail):
            why = link.never_joined()  # node 0: the nodes it waited for, not JAX's address
        if not why and stalled:
            why = f"worker {stalled[0].rank} (device {stalled[0].dev}) stopped: silent for " \
                f"{patience:g} s"
        elif not why:
            trace, cause = failed[0].cause()
            why = f"worker {failed[0].rank} (device {failed[0].dev}) failed: {cause}"
        at = "" if " at epoch " in why else at  # another node's word says where already
        return Outcome(2 if Worker.BAD_INPUT in why else 1, f"{why}{at}{unkillable(left)}",
                       trace, bool(verdict) and link.gone())

    def decide(self):
        """A launch failed: may the run start again, and from where?  Node 0
        decides; a member tells it, and follows its order."""
        why, plan, link = self.outcome.why, self.plan, self.link
        if not self.member:
            kept = link.kept_by_others()  # this is node 0 started again: the others kept the run
            generation = (kept["generation"] if kept else link.generation) + 1
            if self.outcome.code == 2 or link.door_ended():  # bad input fails again; a door
                raise RunEnds(why)                            # gone, nobody reaches this node
            if generation > plan.max_restarts:
                raise RunEnds(f"{why}, but the run has restarted {kept['generation']} times "
                              f"already (--max-restarts {plan.max_restarts})" if kept else
                              used_up(why, plan))
            lost = self.outcome.lost
            if not (lost or link.present()):  # a worker broke as a node went: the node's word
                why, lost = link.verdict() or why, True
            self.outcome = dataclasses.replace(self.outcome, why=why, lost=lost)
            return State.WAITING if lost or kept else State.RESTARTING
        if not link.ordered():
            link.tell(NodeState.FAILED, why)  # node 0 decides whether the run starts again
        if self.outcome.code == 2:
            raise RunEnds(why)
        if link.generation >= plan.max_restarts:
            raise RunEnds(used_up(why, plan))
        if not (self.outcome.lost or link.node0.lost()):
            link.await_order()
        if not link.ordered() and link.node0.lost():
            self.outcome = dataclasses.replace(self.outcome, why=why if self.outcome.lost
                                               else link.verdict())
            return State.WAITING
        return State.RESTARTING

    # -- WAITING -------------------------------------------------------------------------

    def wait(self):
        """Node 0: until every other node has a member in the lobby that
        stands (a lost one came back), for at most --rejoin-timeout seconds;
        the members are told, and wait too.  A member: knock again at node
        0's address, with what it kept of the run, until node 0 is back."""
        plan, link, why = self.plan, self.link, self.outcome.why
        if self.member:
            elastic = " (an elastic run goes on without any node but node 0, whose address " \
                "is the run's)" if plan.min_nodes < plan.nodes else ""
            cli.say(f"{why}: waiting up to {plan.rejoin_timeout:g} s for node 0 to come back "
                    f"at {plan.coordinator}{elastic} (its command again, there or on a "
                    f"replacement machine at that address, with the run's secret in "
                    f"{SECRET_VARIABLE} or --secret-file)", file=sys.stderr)
            try:
                link.rejoin(plan.rejoin_timeout)
            except NoAnswer as e:
                raise RunEnds(f"{why}; {e}" if "let it in" in str(e) else
                              f"{why}; node 0 did not come back within {plan.rejoin_timeout:g} "
                              "s (--rejoin-timeout)") from None
            except UsageError as e:
                raise RunEnds(f"{why}; {e}") from None
            return State.RESTARTING
        if self.outcome.lost:
            missing = " and ".join(link.missing())
            waiting = (f"{why}: waiting up to {plan.rejoin_timeout:g} s for {missing} to come "
                       "back (its command again, there or on a replacement machine)")
            cli.say(waiting, file=sys.stderr)
            link.tell(NodeState.WAITING, waiting)
        deadline = time.monotonic() + plan.rejoin_timeout
        while not link.present():
            if stopping.is_set():
                raise RunEnds(f"{why}; interrupted while waiting for "
                              f"{' and '.join(link.missing())}")
            if time.monotonic() > deadline:
                return self.go_on_without(link.missing_ranks())
            time.sleep(0.05)
        return State.RESTARTING

    def go_on_without(self, ranks):
        """Node 0, --rejoin-timeout past: an elastic run goes on without the
        nodes ``ranks`` while --nodes MIN are left, from its last checkpoint;
        any other run ends."""
        plan, why = self.plan, self.outcome.why
        gone = f"{' and '.join(f'node {r}' for r in ranks)} did not come back within " \
            f"{plan.rejoin_timeout:g} s (--rejoin-timeout)"
        if len(plan.world) - len(ranks) < plan.min_nodes:
            fewest = f": fewer than {plan.min_nodes} nodes (--nodes " \
                f"{plan.min_nodes}:{plan.nodes}) are left" if plan.min_nodes < plan.nodes else ""
            raise RunEnds(f"{why}; {gone}{fewest}")
        self.link.leave_out(ranks)
        self.outcome = dataclasses.replace(self.outcome, why=f"{why}; {gone}", lost=False)
        return State.RESTARTING

    # -- RESTARTING ----------------------------------------------------------------------

    def restart(self):
        """Say how the run starts again, in a new run folder; node 0 tells
        the others where, a member follows node 0's order."""
        again = self.follow_order() if self.member else self.plan_restart()
        if again is None:
            return State.WAITING
        cli.say(f"{again.why}: restarting every worker {again.resumed} (restart "
                f"{again.generation} of {self.plan.max_restarts})", file=sys.stderr)
        try:
            old, (self.rundir, _) = self.rundir, run_folder(self.plan, self.shapes)
        except NoRunFolder as e:
            raise RunEnds(f"{again.why}; no restart: {e}") from None
        if self.member:
            self.link.restart(again.generation)
        else:
            self.order_restart(again, old)
        return State.STARTING

    def plan_restart(self):
        """Node 0: from the checkpoint the others kept (this node 0 came
        back), else from this run's last checkpoint."""
        link, why = self.link, self.outcome.why
        kept = link.kept_by_others()
        generation = (kept["generation"] if kept else link.generation) + 1
        if kept:
            try:
                self.plan, resumed = adopt(self.plan, self.shapes, link)
            except records.CheckpointError as e:
                raise RunEnds(str(e)) from None
            return Restart(generation, why, resumed,
                           f"node 0 ({host_and_port(self.plan.coordinator)[0]}) came back")
        why = f"{why}, and came back" if self.outcome.lost else why
        if self.plan.min_nodes < self.plan.nodes:  # elastic: the nodes standing now
            self.plan, changes = regroup(self.plan, [0, *link.standing_ranks()])
            why = f"{why}: {changes}" if changes else why
        try:
            self.plan, resumed = restart_point(self.plan, self.shapes)
            return Restart(generation, why, resumed, why)
        except (UsageError, records.CheckpointError) as e:
            raise RunEnds(f"{why}; no restart: {e}") from None

    def follow_order(self):
        """A member: node 0's order to start again, followed (RunEnds where
        none comes; None where node 0 was lost meanwhile)."""
        link = self.link
        order = link.ordered() or link.await_order()
        if not order and link.node0.lost():  # lost as this node came back: knock again
            self.outcome = dataclasses.replace(self.outcome, why=link.verdict())
            return None
        if not order:
            raise RunEnds(link.verdict() or self.outcome.why or
                          "node 0 gave no order to start again")
        try:
            self.plan, resumed = follow(self.plan, order, self.shapes)
            return Restart(order["generation"], order["why"], resumed)
        except (UsageError, records.CheckpointError) as e:
            raise RunEnds(f"{order['why']}; no restart: {e}") from None

    def order_restart(self, again, old):
        """Node 0's restart: JAX's coordinator where the new run folder is, or
        at a new port (the last one's may linger); the other nodes told."""
        plan, link = self.plan, self.link
        if plan.jax_coordinator == private_coordinator(old):
            plan = dataclasses.replace(plan, jax_coordinator=private_coordinator(self.rundir))
        elif plan.nodes > 1:
            host = host_and_port(plan.coordinator)[0]
            plan = dataclasses.replace(plan, jax_coordinator=f"{host}:{free_port(host)}")
        self.plan = plan
        if plan.nodes > 1:
            link.order_restart(again.generation, again.told, plan.jax_coordinator,
                               plan.resume_epoch, plan.checked_resume if plan.resume else None,
                               plan.world)
        else:
            link.restart(again.generation)

    # -- FAILED --------------------------------------------------------------------------

    def fail(self):
        """Say what failed, in one line, and how to resume; the exit code."""
        why = self.outcome.why
        if why is not None:
            self.link.tell(NodeState.FAILED, why, final=True)
            cli.say(f"{self.outcome.trace}error: {why}"
                    f"{records.resume_hint(self.plan, self.shapes)}", file=sys.stderr)
        return self.outcome.code


def another_nodes_word(link):
    """Did another node fail or go first?  Its word (``link.verdict``) or
    node 0's order, once either comes, within the time a node is lost in."""
    deadline = time.monotonic() + LOST_AFTER + 1
    verdict = link.verdict()
    while not (verdict or link.ordered()) and time.monotonic() < deadline:
        time.sleep(0.05)
        verdict = link.verdict()
    return verdict


def used_up(why, plan):
    """A failure that ends the run because it may start again no more: said,
    where it had restarts to use (none asked for says nothing new)."""
    return f"{why}; the run's restarts are used up (--max-restarts {plan.max_restarts})" \
        if plan.max_restarts else why
