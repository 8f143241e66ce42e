"""The request, checked before any process starts: everything a request
could get wrong is refused in one line (``UsageError``; the caller exits
2), and what it leaves to the hardware is chosen here (``check_exchange``:
the exchange, its ordering and its average by the devices at hand).
``check_request`` is the one call: it makes the run's ``Plan``, frozen,
which ``supervisor.py`` then runs.
"""
import multi_gpu.flags as flags  # first: THEANO_FLAGS onto PyTensor's flags, before PyTensor

import argparse
import dataclasses
import itertools
import os
import resource
import secrets
import sys
import typing

import pytensor

from multi_gpu import cli, datasets, files, lobby, locks, member, memory, records, xla_runtime
from multi_gpu.cli import UsageError
from multi_gpu.devices import cpu_notices, peer_access, usable_gpus
from multi_gpu.elastic import check_range
from multi_gpu.files import NoRunFolder, private_coordinator, run_folder
from multi_gpu.hooks import fault_spec_problem
from multi_gpu.nodes import check_port, free_port, host_and_port, on_loopback
from multi_gpu.resume import TRAINED_WITH, check_resume
from multi_gpu.trainer import steps_per_epoch


def check_device_names(requested, nodes):
    """At least two workers in the whole run, each device a GPU index or
    'cpu', all of one kind."""
    if len(requested) * nodes == 1:
        raise UsageError("give at least two devices (e.g. '0 1' or 'cpu cpu'), or one on "
                         "each of several machines (--nodes)")
    for dev in requested:
        if dev != "cpu" and not dev.isdigit():
            raise UsageError(f"unknown device '{dev}': a device is a GPU index or 'cpu'")
    if len({dev == "cpu" for dev in requested}) > 1:
        raise UsageError("all workers run on GPUs or all on the CPU, not a mix")


def choose_devices(requested, nodes=1):
    """The devices of this node's workers; at least two workers in the whole
    run (a machine of one GPU is one node of several: ``--nodes``)."""
    check_device_names(requested, nodes)
    if requested and requested[0] == "cpu":
        return requested, None
    count, why = usable_gpus()
    if not requested:
        if count >= 2:
            return ["0", "1"], None
        return ["cpu", "cpu"], f"no two usable GPUs ({why if count == 0 else '1 GPU'}): " \
                               "running both workers on the CPU"
    if count == 0:
        raise UsageError(f"GPU asked for, but none is usable: {why}. Install the GPU "
                         "requirements (requirements-gpu.txt, then requirements-pycuda.txt: "
                         "README.md's GPU path) or pass 'cpu cpu'")
    for dev in requested:
        if int(dev) >= count:
            raise UsageError(f"GPU {dev} does not exist: this machine has {count} "
                             f"(0..{count - 1})")
    return requested, None


def check_exchange(draft, world, gpus, choices):
    """Resolve --exchange, --sync, --avg and --staged (``choices``: their
    defaults, by machine); returns the notices."""
    shared = len(set(draft.devices)) < len(draft.devices)  # GPUs; CPU workers always share
    exchange_asked, sync_asked, staged_asked = draft.exchange, draft.sync, draft.staged
    choose_exchange(draft, world, gpus, shared, choices)
    notices = around_missing_peer_access(draft, world, exchange_asked) \
        if gpus and draft.exchange == "p2p" and not shared else []
    if draft.exchange == "xla":
        check_xla(draft, gpus, shared)
        return notices
    choose_sync_and_avg(draft, gpus, choices)
    if gpus:
        notices += host_ordering(draft, world, shared, sync_asked, staged_asked)
    return notices


def choose_exchange(draft, world, gpus, shared, choices):
    """--exchange by default (``choices``): one machine's, for two workers,
    CPUs, or workers sharing GPUs; else several's."""
    if draft.exchange is None:
        # measured: on CPUs the host-ordered exchange beats gloo's all-reduce at 2, 3 and 4
        # workers (bench/results/scaling_cpu.json); GPUs past two stay on NCCL until measured
        one = draft.nodes == 1 and (world == 2 or not gpus or shared)
        p2p, xla = choices["exchange"]  # in CHOICES' order: p2p's case, then xla's
        draft.exchange = choices["exchange"][p2p if one else xla]
    if draft.exchange == "p2p" and draft.nodes > 1:
        raise UsageError("--exchange p2p joins the workers of one machine: use --exchange xla "
                         "on several machines")


def around_missing_peer_access(draft, world, exchange_asked):
    """Two GPUs of the run that cannot read each other's memory: past two
    workers, and where nothing of p2p's was asked for, xla; else the weights
    through host memory (--staged).  Returns the notices."""
    used = list(map(int, draft.devices))
    pair = next(((a, b) for a, b in itertools.combinations(used, 2)
                 if not peer_access(a, b)), None)
    if pair and world > 2 and not exchange_asked and not (draft.sync or draft.avg):
        draft.exchange = "xla"
        return [f"notice: GPUs {pair[0]} and {pair[1]} cannot reach each other's memory: the "
                "workers average with --exchange xla"]
    if pair and not draft.staged:
        draft.staged = True
        return [f"warning: GPUs {pair[0]} and {pair[1]} cannot access each other's memory: "
                "the weights go through host memory (slower, same numbers)"]
    return []


def check_xla(draft, gpus, shared):
    if draft.sync or draft.avg or draft.staged:
        raise UsageError("--sync, --avg and --staged choose how --exchange p2p works; "
                         "--exchange xla averages inside the compiled step")
    problem = xla_runtime.jax_problem(cpu=not gpus)
    if problem:
        raise UsageError(problem)
    if gpus and shared:
        raise UsageError("--exchange xla needs a different GPU for every worker")


def choose_sync_and_avg(draft, gpus, choices):
    """--sync and --avg by default: ``choices``' for the hardware."""
    if draft.staged and not gpus:
        raise UsageError("--staged moves GPU workers' weights through host memory: CPU "
                         "workers' weights are in host memory already")
    hardware = "gpu" if gpus else "cpu"
    draft.sync = draft.sync or choices["sync"][hardware]
    if draft.sync == "gpu" and not gpus:
        raise UsageError("--sync gpu orders the exchange on GPU streams: on CPUs the host "
                         "orders it (--sync host)")
    if draft.sync == "gpu" and draft.avg:
        raise UsageError("--avg chooses how the host-ordered loop averages: add --sync host")
    draft.avg = draft.avg or choices["avg"][hardware]
    here, there, in_place = ("GPUs", "CPUs", "pycuda") if gpus else ("CPUs", "GPUs", "shared")
    if draft.avg in ("pycuda", "shared") and draft.avg != in_place:
        raise UsageError(f"--avg {draft.avg} averages in place on {there}: on {here}, "
                         f"--avg {in_place} does")


def host_ordering(draft, world, shared, sync_asked, staged_asked):
    """GPUs the GPU-ordered exchange cannot join peer to peer (shared, or
    through host memory) are ordered by the host, unless --sync gpu was asked
    for on one shared GPU (time-sliced: for testing).  Returns the notices."""
    why = (("both workers share one GPU" if world == 2 else "workers share a GPU") if shared
           else "--staged" if staged_asked else "no peer access" if draft.staged else None)
    if draft.sync == "gpu" and shared and sync_asked and not draft.staged:
        return [f"notice: {world} workers on GPU {draft.devices[0]}: the GPU-ordered exchange "
                "runs there time-sliced, each worker's kernel waiting for the others' turns; "
                "correct, and slow: for testing where one GPU is all there is"]
    if draft.sync == "gpu" and why:
        draft.sync = "host"
        return [f"notice: the exchange is ordered by the host (--sync host): {why}"]
    return []


def check_nodes(draft):
    draft.min_nodes = draft.min_nodes or draft.nodes
    draft.world = tuple(range(draft.nodes))  # the nodes training now, by rank (elastic.py)
    if draft.min_nodes < draft.nodes:
        check_range(draft)
    if not 0 <= draft.node_rank < draft.nodes:
        raise UsageError(f"--node-rank {draft.node_rank} is out of range: 0..{draft.nodes - 1} "
                         f"for --nodes {draft.nodes}")
    if draft.coordinator:
        if host_and_port(draft.coordinator) is None:
            raise UsageError(f"--coordinator {draft.coordinator}: expected HOST:PORT, "
                             "e.g. 10.0.0.1:29500")
    elif draft.nodes > 1:
        raise UsageError("--nodes > 1 needs --coordinator HOST:PORT: an address of node 0 "
                         "that every node can reach")


# Every option of dual_mlp.py is one of two kinds, named once here.  What the workers
# compute or exchange: every node of a run must be given the same, or it is refused at the
# lobby (a node that alone asked for --check, say, would wait for ever on the others).
RUN_OPTIONS = TRAINED_WITH + ("epochs", "seed", "exchange", "sync", "avg", "steps_per_call",
                              "staged", "nodes", "min_nodes", "local_workers", "platform",
                              "resume_epoch", "max_restarts", "check")
# A node's own, which the nodes may give differently: its outputs, its waits, its place
# (its devices count as workers per node and platform, its --resume as the resumed epoch).
NODE_OWN = ("devices", "save", "resume", "json", "trace", "trace_from", "trace_steps",
            "timeout", "rejoin_timeout", "node_rank", "secret_file", "coordinator")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The request, checked: every option as given or as resolved (its
    default, the machine's choice), and what the checks found.  Made once
    (``check_request``), handed down to the supervisor and, as the run
    folder's ``config.json``, to the workers; a restart makes a new one
    (``dataclasses.replace``), resuming from elsewhere."""
    # what it trains, and how (the options)
    devices: list          # this node's: a GPU index or "cpu" each, one worker each
    epochs: int
    batch_size: int        # per worker
    learning_rate: float
    n_hidden: int
    l1: float
    l2: float
    seed: int
    dataset: str           # resolved: a path, or the shipped digits
    average_every: int
    exchange: str          # "p2p" or "xla"
    sync: str | None       # p2p: "gpu" or "host"
    avg: str | None        # --sync host: "theano", "pycuda", "shared" or "cpu"
    staged: bool
    steps_per_call: int
    check: bool
    # what it leaves, and where it starts (the options)
    save: str | None
    resume: str | None     # a path, or what a restart resumes from, in words
    json: str | None
    trace: str | None
    trace_from: int | None
    trace_steps: int | None
    # how long it waits, how often it starts again, its machines (the options)
    timeout: float
    max_restarts: int
    rejoin_timeout: float
    nodes: int             # the most; and the fewest the run goes on with
    min_nodes: int
    node_rank: int
    secret_file: str | None
    coordinator: str | None
    # what the checks found
    command: str           # as typed: a failed run's last line gives it back
    resume_epoch: int      # the epoch it resumes from (0: the first)
    trained_with: dict     # what its checkpoints record (``resume.TRAINED_WITH``)
    run_id: str            # its name, in every checkpoint it writes
    local_workers: int
    platform: str          # "cpu" or "gpu"
    run_options: dict      # what every node must be given the same (``RUN_OPTIONS``)
    one_machine: bool      # every node on this machine
    jax_coordinator: str | None
    world: tuple           # the nodes training now, by rank: all, or those left (elastic.py)
    checked_resume: bytes | None  # the checkpoint to resume, as read and checked
    checked_data: tuple    # the data set, as read and checked: what the workers train on


def check_outputs(draft):
    """No output overwrites an input or another output of this run.  Node
    R > 0 writes its workers' trace beside node 0's, PATH.nodeR.json: on one
    machine, or one shared file system, the nodes' traces do not meet."""
    if draft.node_rank and (draft.save or draft.json):
        raise UsageError(f"{'--save' if draft.save else '--json'}: node 0 keeps the run's "
                         "checkpoint and summary; give it to node 0 only")
    if draft.trace and draft.node_rank:
        stem, ext = os.path.splitext(draft.trace)
        draft.trace = f"{stem}.node{draft.node_rank}{ext}"
    if draft.trace and trace_picture(draft.trace) == draft.trace:
        raise UsageError(f"--trace {draft.trace}: a .png is the picture beside the trace; name "
                         "the trace PATH.json")
    why = cli.clash({"--dataset": datasets.files_of(draft.dataset), "--resume": [draft.resume],
                     "--secret-file": [draft.secret_file]},
                    {"--save": [draft.save], "--json": [draft.json], "--trace": [draft.trace],
                     "--trace's picture": [trace_picture(draft.trace)]},
                    allowed={("--save", "--resume")})
    if why:
        raise UsageError(why)
    if draft.trace and not draft.trace.endswith(".json"):
        raise UsageError(f"--trace {draft.trace}: a trace is JSON: name it PATH.json (its "
                         "picture goes beside it, PATH.png)")


def trace_picture(path):
    """Where --trace's picture goes: beside the trace, PATH.png for PATH.json."""
    return os.path.splitext(path)[0] + ".png" if path else None


def check_trace(draft, n_steps):
    """The window of --trace: --trace-from an epoch this run trains (default
    the second it trains, a resumed run's too; its only one, of a run of
    one), --trace-steps within the run; returns the notices."""
    if not draft.trace:
        if draft.trace_from or draft.trace_steps:
            raise UsageError("--trace-from and --trace-steps choose what --trace PATH records")
        return []
    epoch = draft.trace_from or min(draft.resume_epoch + 2, draft.epochs)
    if not draft.resume_epoch < epoch <= draft.epochs:
        raise UsageError(f"--trace-from {epoch}: the run trains epochs {draft.resume_epoch + 1} "
                         f"to {draft.epochs}")
    draft.trace_from, draft.trace_steps = epoch, draft.trace_steps or 50
    left = (draft.epochs - epoch + 1) * n_steps
    if draft.trace_steps > left:
        return [f"notice: --trace-steps {draft.trace_steps}: the run has {left} steps from "
                f"epoch {epoch} on; it traces those"]
    return []


def check_steps_per_call(draft, n_steps, default):
    """Resolve --steps-per-call: ``default`` (rounded up to a multiple of
    --average-every), never more than an epoch of ``n_steps``; one for the
    host-ordered loop.  A call of K steps ends on an average, so a K less
    than an epoch must be a multiple of H.  Returns the notices."""
    every, notices = draft.average_every, []
    if every > n_steps:
        notices.append(f"notice: --average-every {every} is more than an epoch ({n_steps} steps): "
                       "the replicas average once an epoch, at its end")
    if draft.exchange == "p2p" and draft.sync == "host":
        if draft.steps_per_call:
            raise UsageError("--steps-per-call: the host-ordered 2014 loop (--sync host) takes "
                             "one step per call; K steps per call need --sync gpu or "
                             "--exchange xla")
        draft.steps_per_call = 1
        return notices
    asked = draft.steps_per_call
    if asked and asked % every and asked < n_steps:
        raise UsageError(f"--steps-per-call {asked} is not a multiple of --average-every "
                         f"{every}: a compiled call of K steps ends on an average")
    draft.steps_per_call = min(asked or -(-default // every) * every, n_steps)
    if asked and asked > n_steps:
        notices.append(f"notice: --steps-per-call {asked} is more than an epoch: {n_steps} steps "
                       "per call")
    return notices


def check_limits(n_local, nodes):
    """Raise this process's limit of open files to what a run needs (its
    workers inherit it), or refuse the run in one line where the hard limit
    is too low; and refuse it where the user's limit of processes (``ulimit
    -u``, threads counted) leaves too little room: either would end a worker
    deep in zmq or XLA.  (Root is held to no process limit.)"""
    # sockets, pipes, mapped buffers, XLA's own; node 0's lobby, a connection each other node
    files_needed = 64 + 32 * n_local + nodes - 1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < files_needed:
        if hard != resource.RLIM_INFINITY and hard < files_needed:
            raise UsageError(f"ulimit -n {soft}: the run needs about {files_needed} open files "
                             f"(this user may raise it to {hard} only)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (files_needed, hard))
    too_few = flags.threads_problem(flags.THREADS_PER_PROCESS * n_local + 16, "the run")
    if too_few:
        raise UsageError(too_few)


def check_xla_flags():
    """XLA takes a word of XLA_FLAGS that is not a --flag as the name of a
    file to read its flags from, and fails naming the file: say what is wrong."""
    odd = next((w for w in os.environ.get("XLA_FLAGS", "").split() if not w.startswith("--")),
               None)
    if odd:
        raise UsageError(f"XLA_FLAGS: {odd!r} is not a flag (each starts with --, e.g. "
                         "--xla_force_host_platform_device_count=2)")


def check_request(args, shapes, *, command, batch_size, shipped_batch_size, steps_per_call,
                  epochs, choices):
    """The parsed options ``args`` checked, every default resolved: (the
    ``Plan``, the notices to print).  ``shapes`` are the model's parameters'
    (a checkpoint must hold them), ``command`` the command line as typed (a
    failed run's last line gives it back), ``batch_size`` is the default per
    worker, ``shipped_batch_size`` the one on the shipped digits (too few for
    two minibatches of the default), ``steps_per_call`` the device-ordered
    exchanges' default, ``epochs`` --epochs', ``choices`` those of
    --exchange, --sync and --avg.  The checks fill in a draft of the plan,
    from the options as parsed (which stay as they were), and the plan is
    made from it once, at the end, frozen."""
    draft = argparse.Namespace(**vars(args), command=command, checked_resume=None)
    notices = []
    fault = fault_spec_problem()
    if fault:
        raise UsageError(fault)
    if flags.DEVICE:
        notices.append(f"warning: THEANO_FLAGS: 'device={flags.DEVICE_ASKED}' is ignored: "
                       "dual_mlp.py takes its devices as arguments (dual_mlp.py 0 1)")
    check_nodes(draft)
    check_xla_flags()
    draft.devices, notice = choose_devices(draft.devices, draft.nodes)
    check_limits(len(draft.devices), draft.nodes)
    notices.append(notice)
    world, gpus = draft.nodes * len(draft.devices), draft.devices[0] != "cpu"
    notices += check_exchange(draft, world, gpus, choices)
    if gpus and pytensor.config.floatX != "float32":
        raise UsageError("the GPU path runs in float32: drop floatX from the flags")
    notices += [*cpu_notices(draft.devices, pytensor.config.floatX), files.running_beside()]
    draft.dataset, notice = datasets.resolve(draft.dataset)
    notices.append(notice)
    check_outputs(draft)
    # read once and checked: the workers train on this very copy (``leave_the_request``)
    splits = draft.checked_data = datasets.read_checked(draft.dataset)
    notices.append(datasets.named(draft.dataset, splits, draft))
    n_train = len(splits[0][0])
    if draft.batch_size is None:
        draft.batch_size = shipped_batch_size if draft.dataset == datasets.SHIPPED else batch_size
        if draft.dataset == datasets.SHIPPED:
            steps = steps_per_epoch(n_train // draft.batch_size, world)
            notices.append(f"batch size {draft.batch_size} per worker, so that each worker "
                           f"gets {cli.counted(steps, 'minibatch', 'minibatches')} per epoch")
    if n_train < world * draft.batch_size:
        raise UsageError(f"batch size {draft.batch_size} is too large: the training set has "
                         f"{n_train} images, and each of the {world} workers needs a minibatch")
    notices += check_steps_per_call(draft, steps_per_epoch(n_train // draft.batch_size, world),
                                    steps_per_call)
    too_big = memory.memory_problem(shapes, len(draft.devices), sum(x.size for x, _ in splits))
    if too_big:
        raise UsageError(too_big)
    draft.trained_with = dict({k: getattr(draft, k) for k in TRAINED_WITH[:-2]}, workers=world,
                             dataset=datasets.fingerprint(splits))
    draft.resume_epoch = 0
    if draft.resume:
        resumed, more = check_resume(draft, shapes, epochs)
        vars(draft).update(resumed)
        notices += more
    elif draft.epochs is None:
        draft.epochs = epochs
    draft.trained_with["epochs"] = draft.epochs  # recorded, for a --resume without --epochs
    # the run's name, in each checkpoint it writes: a restart takes only its own run's
    draft.run_id = secrets.token_hex(8)
    node0_again = draft.nodes > 1 and draft.node_rank == 0 and draft.max_restarts > 0
    notices.append(records.replaced_checkpoint(draft.save, draft.resume, shapes, node0_again))
    notices += check_trace(draft, steps_per_epoch(n_train // draft.batch_size, world))
    draft.local_workers, draft.platform = len(draft.devices), "gpu" if gpus else "cpu"
    draft.run_options = {k: draft.trained_with[k] if k in TRAINED_WITH else getattr(draft, k)
                        for k in RUN_OPTIONS}
    notices.append(place_coordinator(draft))
    plan = Plan(**{field.name: getattr(draft, field.name) for field in dataclasses.fields(Plan)})
    return plan, [n for n in notices if n]


def place_coordinator(draft):
    """Where JAX's coordinator listens (``draft.jax_coordinator``), and
    whether every node is on this machine (``draft.one_machine``: one node,
    or nodes meeting on the loopback).  On one machine, a socket in node 0's
    private run folder, which no other user can reach (set once the folder
    is named: ``private_coordinator``), where a TCP port on the loopback
    would be any local user's to connect to and end the run; across
    machines, on node 0 at a port of its own choosing, which the lobby
    tells only the run's nodes; on one node where --coordinator names an
    address beyond the loopback, there.  Returns a notice."""
    draft.one_machine = draft.nodes == 1 or on_loopback(draft.coordinator)
    draft.jax_coordinator, notice = None, None
    if draft.nodes > 1 and draft.node_rank == 0:
        check_port(draft.coordinator)
        if not draft.one_machine:
            host = host_and_port(draft.coordinator)[0]
            draft.jax_coordinator = f"{host}:{free_port(host)}"
    elif draft.coordinator and draft.exchange == "xla" and draft.nodes == 1:
        check_port(draft.coordinator)
        if on_loopback(draft.coordinator):
            notice = (f"notice: --coordinator {draft.coordinator} is on the loopback, where any "
                      "user of this machine could reach it: JAX's coordinator listens on a "
                      "socket in the run's private folder instead")
        else:
            draft.jax_coordinator = draft.coordinator
    return notice


class Prepared(typing.NamedTuple):
    """A run made ready (``prepare``)."""
    plan: Plan
    rundir: str  # its private folder, named, not made yet
    link: object  # the other nodes: nodes.Alone, lobby.Lobby or member.Member


def prepare(args, shapes, run, **defaults):
    """The run made ready, or refused in one line (SystemExit: 2, or 1 where
    another node did not answer): the parsed options ``args`` checked
    (``check_request``, with ``defaults``: the command line, batch size, the
    shipped digits', steps per call, epochs, the exchange's choices), its
    outputs held (``run``: an ExitStack that releases them), its private
    folder named, JAX's coordinator placed, the other nodes met; and what it
    has to say, said: node 0 speaks for the run, every other node says that
    it joined.  Returns it ``Prepared``."""
    meeting = False
    try:
        plan, notices = check_request(args, shapes, **defaults)
        run.enter_context(locks.hold(plan.save, plan.json, plan.trace,
                                     trace_picture(plan.trace),
                                     room=records.checkpoint_bytes(shapes)))
        rundir, folder_notice = run_folder(plan, shapes)
        if plan.exchange == "xla" and not plan.jax_coordinator and not plan.node_rank:
            plan = dataclasses.replace(plan, jax_coordinator=private_coordinator(rundir))
        meeting = True  # from here on, node 0 hears from this node itself
        link, notice = lobby.meet(plan, shapes, run)
        if plan.node_rank:  # node 0 told it where JAX's coordinator is, and the run's name
            plan = dataclasses.replace(plan, jax_coordinator=link.jax_coordinator,
                                       run_id=link.run)
        notices.append(notice)
    except (UsageError, NoRunFolder, datasets.DatasetError, records.CheckpointError,
            member.NoAnswer) as e:
        if not meeting:  # this node's own command refused: node 0 is told, not left waiting
            member.cannot_start(args, str(e))
        cli.say(f"dual_mlp.py: error: {e}", file=sys.stderr)
        raise SystemExit(1 if isinstance(e, member.NoAnswer) else 2) from None
    for said in notices + [folder_notice] if plan.node_rank == 0 else [notice]:
        if said:
            cli.say(said, file=sys.stderr if said.startswith("warning:") else sys.stdout)
    return Prepared(plan, rundir, link)
