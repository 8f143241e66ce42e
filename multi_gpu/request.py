"""The request, checked before any process starts: everything a request
could get wrong is refused in one line (``UsageError``; the caller exits
2), and what it leaves to the hardware is chosen here (``check_exchange``:
the exchange, its ordering and its average by the devices at hand).
``check_request`` is the one call; ``launcher.py`` then runs what it let
through.
"""
from multi_gpu import flags  # first: THEANO_FLAGS onto PyTensor's flags, before PyTensor
import itertools
import os
import resource
import secrets
import sys

import pytensor

from multi_gpu import cli, datasets, lobby, locks, member, memory, records, xla_runtime
from multi_gpu.cli import UsageError
from multi_gpu.resume import TRAINED_WITH, check_resume
from multi_gpu.devices import peer_access, usable_gpus
from multi_gpu.files import NoRunFolder, private_coordinator, run_folder
from multi_gpu.nodes import check_port, free_port, host_and_port, on_loopback
from multi_gpu.trainer import steps_per_epoch
from multi_gpu.hooks import fault_spec_problem


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
                         "requirements (pip install -r requirements-gpu.txt) or pass 'cpu cpu'")
    for dev in requested:
        if int(dev) >= count:
            raise UsageError(f"GPU {dev} does not exist: this machine has {count} "
                             f"(0..{count - 1})")
    return requested, None


def check_exchange(args, world, gpus, choices):
    """Resolve --exchange, --sync, --avg and --staged (``choices``: their
    defaults, by machine); returns the notices."""
    shared = len(set(args.devices)) < len(args.devices)  # GPUs; CPU workers always share
    exchange_asked, sync_asked, staged_asked = args.exchange, args.sync, args.staged
    choose_exchange(args, world, gpus, shared, choices)
    notices = around_missing_peer_access(args, world, exchange_asked) \
        if gpus and args.exchange == "p2p" and not shared else []
    if args.exchange == "xla":
        check_xla(args, gpus, shared)
        return notices
    choose_sync_and_avg(args, gpus, choices)
    if gpus:
        notices += host_ordering(args, world, shared, sync_asked, staged_asked)
    return notices


def choose_exchange(args, world, gpus, shared, choices):
    """--exchange by default (``choices``): one machine's, for two workers,
    CPUs, or workers sharing GPUs; else several's."""
    if args.exchange is None:
        # measured: on CPUs the host-ordered exchange beats gloo's all-reduce at 2, 3 and 4
        # workers (bench/results/scaling_cpu.json); GPUs past two stay on NCCL until measured
        one = args.nodes == 1 and (world == 2 or not gpus or shared)
        p2p, xla = choices["exchange"]  # in CHOICES' order: p2p's case, then xla's
        args.exchange = choices["exchange"][p2p if one else xla]
    if args.exchange == "p2p" and args.nodes > 1:
        raise UsageError("--exchange p2p joins the workers of one machine: use --exchange xla "
                         "on several machines")


def around_missing_peer_access(args, world, exchange_asked):
    """Two GPUs of the run that cannot read each other's memory: past two
    workers, and where nothing of p2p's was asked for, xla; else the weights
    through host memory (--staged).  Returns the notices."""
    used = list(map(int, args.devices))
    pair = next(((a, b) for a, b in itertools.combinations(used, 2)
                 if not peer_access(a, b)), None)
    if pair and world > 2 and not exchange_asked and not (args.sync or args.avg):
        args.exchange = "xla"
        return [f"notice: GPUs {pair[0]} and {pair[1]} cannot reach each other's memory: the "
                "workers average with --exchange xla"]
    if pair and not args.staged:
        args.staged = True
        return [f"warning: GPUs {pair[0]} and {pair[1]} cannot access each other's memory: "
                "the weights go through host memory (slower, same numbers)"]
    return []


def check_xla(args, gpus, shared):
    if args.sync or args.avg or args.staged:
        raise UsageError("--sync, --avg and --staged choose how --exchange p2p works; "
                         "--exchange xla averages inside the compiled step")
    problem = xla_runtime.jax_problem(cpu=not gpus)
    if problem:
        raise UsageError(problem)
    if gpus and shared:
        raise UsageError("--exchange xla needs a different GPU for every worker")


def choose_sync_and_avg(args, gpus, choices):
    """--sync and --avg by default: ``choices``' for the hardware."""
    if args.staged and not gpus:
        raise UsageError("--staged moves GPU workers' weights through host memory: CPU "
                         "workers' weights are in host memory already")
    hardware = "gpu" if gpus else "cpu"
    args.sync = args.sync or choices["sync"][hardware]
    if args.sync == "gpu" and not gpus:
        raise UsageError("--sync gpu orders the exchange on GPU streams: on CPUs the host "
                         "orders it (--sync host)")
    if args.sync == "gpu" and args.avg:
        raise UsageError("--avg chooses how the host-ordered loop averages: add --sync host")
    args.avg = args.avg or choices["avg"][hardware]
    here, there, in_place = ("GPUs", "CPUs", "pycuda") if gpus else ("CPUs", "GPUs", "shared")
    if args.avg in ("pycuda", "shared") and args.avg != in_place:
        raise UsageError(f"--avg {args.avg} averages in place on {there}: on {here}, "
                         f"--avg {in_place} does")


def host_ordering(args, world, shared, sync_asked, staged_asked):
    """GPUs the GPU-ordered exchange cannot join peer to peer (shared, or
    through host memory) are ordered by the host, unless --sync gpu was asked
    for on one shared GPU (time-sliced: for testing).  Returns the notices."""
    why = (("both workers share one GPU" if world == 2 else "workers share a GPU") if shared
           else "--staged" if staged_asked else "no peer access" if args.staged else None)
    if args.sync == "gpu" and shared and sync_asked and not args.staged:
        return [f"notice: {world} workers on GPU {args.devices[0]}: the GPU-ordered exchange "
                "runs there time-sliced, each worker's kernel waiting for the others' turns; "
                "correct, and slow: for testing where one GPU is all there is"]
    if args.sync == "gpu" and why:
        args.sync = "host"
        return [f"notice: the exchange is ordered by the host (--sync host): {why}"]
    return []


def check_nodes(args):
    if not 0 <= args.node_rank < args.nodes:
        raise UsageError(f"--node-rank {args.node_rank} is out of range: 0..{args.nodes - 1} "
                         f"for --nodes {args.nodes}")
    if args.coordinator:
        if host_and_port(args.coordinator) is None:
            raise UsageError(f"--coordinator {args.coordinator}: expected HOST:PORT, "
                             "e.g. 10.0.0.1:29500")
    elif args.nodes > 1:
        raise UsageError("--nodes > 1 needs --coordinator HOST:PORT: an address of node 0 "
                         "that every node can reach")


# Every option of dual_mlp.py is one of two kinds, named once here.  What the workers
# compute or exchange: every node of a run must be given the same, or it is refused at the
# lobby (a node that alone asked for --check, say, would wait for ever on the others).
RUN_OPTIONS = TRAINED_WITH + ("epochs", "seed", "exchange", "sync", "avg", "steps_per_call",
                              "staged", "nodes", "local_workers", "platform", "resume_epoch",
                              "max_restarts", "check")
# A node's own, which the nodes may give differently: its outputs, its waits, its place
# (its devices count as workers per node and platform, its --resume as the resumed epoch).
NODE_OWN = ("devices", "save", "resume", "json", "trace", "trace_from", "trace_steps",
            "timeout", "rejoin_timeout", "node_rank", "secret_file", "coordinator")


def check_outputs(args):
    """No output overwrites an input or another output of this run.  Node
    R > 0 writes its workers' trace beside node 0's, PATH.nodeR.json: on one
    machine, or one shared file system, the nodes' traces do not meet."""
    if args.node_rank and (args.save or args.json):
        raise UsageError(f"{'--save' if args.save else '--json'}: node 0 keeps the run's "
                         "checkpoint and summary; give it to node 0 only")
    if args.trace and args.node_rank:
        stem, ext = os.path.splitext(args.trace)
        args.trace = f"{stem}.node{args.node_rank}{ext}"
    if args.trace and trace_picture(args.trace) == args.trace:
        raise UsageError(f"--trace {args.trace}: a .png is the picture beside the trace; name "
                         "the trace PATH.json")
    why = cli.clash({"--dataset": datasets.files_of(args.dataset), "--resume": [args.resume],
                     "--secret-file": [args.secret_file]},
                    {"--save": [args.save], "--json": [args.json], "--trace": [args.trace],
                     "--trace's picture": [trace_picture(args.trace)]},
                    allowed={("--save", "--resume")})
    if why:
        raise UsageError(why)
    if args.trace and not args.trace.endswith(".json"):
        raise UsageError(f"--trace {args.trace}: a trace is JSON: name it PATH.json (its "
                         "picture goes beside it, PATH.png)")


def trace_picture(path):
    """Where --trace's picture goes: beside the trace, PATH.png for PATH.json."""
    return os.path.splitext(path)[0] + ".png" if path else None


def check_trace(args, n_steps):
    """The window of --trace: --trace-from an epoch this run trains (default
    the second it trains, a resumed run's too; its only one, of a run of
    one), --trace-steps within the run; returns the notices."""
    if not args.trace:
        if args.trace_from or args.trace_steps:
            raise UsageError("--trace-from and --trace-steps choose what --trace PATH records")
        return []
    epoch = args.trace_from or min(args.resume_epoch + 2, args.epochs)
    if not args.resume_epoch < epoch <= args.epochs:
        raise UsageError(f"--trace-from {epoch}: the run trains epochs {args.resume_epoch + 1} "
                         f"to {args.epochs}")
    args.trace_from, args.trace_steps = epoch, args.trace_steps or 50
    left = (args.epochs - epoch + 1) * n_steps
    if args.trace_steps > left:
        return [f"notice: --trace-steps {args.trace_steps}: the run has {left} steps from "
                f"epoch {epoch} on; it traces those"]
    return []


def check_steps_per_call(args, n_steps, default):
    """Resolve --steps-per-call: ``default`` (rounded up to a multiple of
    --average-every), never more than an epoch of ``n_steps``; one for the
    host-ordered loop.  A call of K steps ends on an average, so a K less
    than an epoch must be a multiple of H.  Returns the notices."""
    every, notices = args.average_every, []
    if every > n_steps:
        notices.append(f"notice: --average-every {every} is more than an epoch ({n_steps} steps): "
                       "the replicas average once an epoch, at its end")
    if args.exchange == "p2p" and args.sync == "host":
        if args.steps_per_call:
            raise UsageError("--steps-per-call: the host-ordered 2014 loop (--sync host) takes "
                             "one step per call; K steps per call need --sync gpu or "
                             "--exchange xla")
        args.steps_per_call = 1
        return notices
    asked = args.steps_per_call
    if asked and asked % every and asked < n_steps:
        raise UsageError(f"--steps-per-call {asked} is not a multiple of --average-every "
                         f"{every}: a compiled call of K steps ends on an average")
    args.steps_per_call = min(asked or -(-default // every) * every, n_steps)
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


def check_request(args, shapes, *, batch_size, shipped_batch_size, steps_per_call, epochs,
                  choices):
    """Resolve defaults and check every input; returns the notices to print.
    ``shapes`` are the model's parameters' (a checkpoint must hold them),
    ``batch_size`` is the default per worker, ``shipped_batch_size`` the one
    on the shipped digits (too few for two minibatches of the default),
    ``steps_per_call`` the device-ordered exchanges' default, ``epochs``
    --epochs', ``choices`` those of --exchange, --sync and --avg."""
    notices = []
    fault = fault_spec_problem()
    if fault:
        raise UsageError(fault)
    if flags.DEVICE:
        notices.append(f"warning: THEANO_FLAGS: 'device={flags.DEVICE_ASKED}' is ignored: "
                       "dual_mlp.py takes its devices as arguments (dual_mlp.py 0 1)")
    check_nodes(args)
    check_xla_flags()
    args.devices, notice = choose_devices(args.devices, args.nodes)
    check_limits(len(args.devices), args.nodes)
    notices.append(notice)
    world, gpus = args.nodes * len(args.devices), args.devices[0] != "cpu"
    notices += check_exchange(args, world, gpus, choices)
    if gpus and pytensor.config.floatX != "float32":
        raise UsageError("the GPU path runs in float32: drop floatX from the flags")
    args.dataset, notice = datasets.resolve(args.dataset)
    notices.append(notice)
    check_outputs(args)
    # read once and checked: the workers train on this very copy (``launch``)
    splits = args.checked_data = datasets.read_checked(args.dataset)
    n_train = len(splits[0][0])
    if args.batch_size is None:
        args.batch_size = shipped_batch_size if args.dataset == datasets.SHIPPED else batch_size
        if args.dataset == datasets.SHIPPED:
            steps = steps_per_epoch(n_train // args.batch_size, world)
            notices.append(f"batch size {args.batch_size} per worker, so that each worker "
                           f"gets {cli.counted(steps, 'minibatch', 'minibatches')} per epoch")
    if n_train < world * args.batch_size:
        raise UsageError(f"batch size {args.batch_size} is too large: the training set has "
                         f"{n_train} images, and each of the {world} workers needs a minibatch")
    notices += check_steps_per_call(args, steps_per_epoch(n_train // args.batch_size, world),
                                    steps_per_call)
    too_big = memory.memory_problem(shapes, len(args.devices), sum(x.size for x, _ in splits))
    if too_big:
        raise UsageError(too_big)
    args.trained_with = dict({k: getattr(args, k) for k in TRAINED_WITH[:-2]}, workers=world,
                             dataset=datasets.fingerprint(splits))
    args.resume_epoch = 0
    if args.resume:
        notices += check_resume(args, shapes, epochs)
    elif args.epochs is None:
        args.epochs = epochs
    args.trained_with["epochs"] = args.epochs  # recorded, for a --resume without --epochs
    # the run's name, in each checkpoint it writes: a restart takes only its own run's
    args.run_id = secrets.token_hex(8)
    notices.append(records.replaced_checkpoint(args.save, args.resume, shapes))
    notices += check_trace(args, steps_per_epoch(n_train // args.batch_size, world))
    args.local_workers, args.platform = len(args.devices), "gpu" if gpus else "cpu"
    args.run_options = {k: args.trained_with[k] if k in TRAINED_WITH else getattr(args, k)
                        for k in RUN_OPTIONS}
    notices.append(place_coordinator(args))
    return [n for n in notices if n]


def place_coordinator(args):
    """Where JAX's coordinator listens (``args.jax_coordinator``), and
    whether every node is on this machine (``args.one_machine``: one node,
    or nodes meeting on the loopback).  On one machine, a socket in node 0's
    private run folder, which no other user can reach (set once the folder
    is named: ``private_coordinator``), where a TCP port on the loopback
    would be any local user's to connect to and end the run; across
    machines, on node 0 at a port of its own choosing, which the lobby
    tells only the run's nodes; on one node where --coordinator names an
    address beyond the loopback, there.  Returns a notice."""
    args.one_machine = args.nodes == 1 or on_loopback(args.coordinator)
    args.jax_coordinator, notice = None, None
    if args.nodes > 1 and args.node_rank == 0:
        check_port(args.coordinator)
        if not args.one_machine:
            host = host_and_port(args.coordinator)[0]
            args.jax_coordinator = f"{host}:{free_port(host)}"
    elif args.coordinator and args.exchange == "xla" and args.nodes == 1:
        check_port(args.coordinator)
        if on_loopback(args.coordinator):
            notice = (f"notice: --coordinator {args.coordinator} is on the loopback, where any "
                      "user of this machine could reach it: JAX's coordinator listens on a "
                      "socket in the run's private folder instead")
        else:
            args.jax_coordinator = args.coordinator
    return notice


def prepare(args, shapes, run, **defaults):
    """The run made ready, or refused in one line (SystemExit: 2, or 1 where
    another node did not answer): the request checked (``check_request``,
    with ``defaults``: batch size, the shipped digits', steps per call,
    epochs, the exchange's choices), its outputs held (``run``: an ExitStack
    that releases them), its private folder named, JAX's coordinator placed,
    the other nodes met; and what it has to say, said: node 0 speaks for the
    run, every other node says that it joined.  Returns (the run folder, the
    other nodes' link)."""
    try:
        notices = check_request(args, shapes, **defaults)
        run.enter_context(locks.hold(args.save, args.json, args.trace,
                                       trace_picture(args.trace),
                                       room=records.checkpoint_bytes(shapes)))
        rundir, folder_notice = run_folder(args, shapes)
        if args.exchange == "xla" and not args.jax_coordinator and not args.node_rank:
            args.jax_coordinator = private_coordinator(rundir)
        link, notice = lobby.meet(args, shapes, run)
        notices.append(notice)
    except (UsageError, NoRunFolder, datasets.DatasetError, records.CheckpointError,
            member.NoAnswer) as e:
        cli.say(f"dual_mlp.py: error: {e}", file=sys.stderr)
        raise SystemExit(1 if isinstance(e, member.NoAnswer) else 2) from None
    for said in notices + [folder_notice] if args.node_rank == 0 else [notice]:
        if said:
            cli.say(said, file=sys.stderr if said.startswith("warning:") else sys.stdout)
    return rundir, link
