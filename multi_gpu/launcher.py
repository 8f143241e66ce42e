"""The launcher's side of dual_mlp.py: check, start, supervise.

Everything a request could get wrong is checked (``check_request``) before
any process starts, and refused in one line (``UsageError``; the caller
exits 2).  Then ``launch`` forks one worker process per local device, each
seeing its own GPU only, passes their error output through, and if one
fails stops the others at once (SIGTERM, then SIGKILL after two seconds)
and names the worker and the line of its output that says what went wrong,
or, where ``--max-restarts`` allows, starts them all again (``supervise``).
Where the run has several nodes, it hears from the others through
``nodes.py`` (node 0's lobby, the heartbeats).  ``worker.py`` is the other
side of the process boundary.
"""
from multi_gpu import flags  # first: THEANO_FLAGS onto PyTensor's flags, before PyTensor
import base64
import collections
import contextlib
import ctypes
import functools
import importlib.util
import io
import itertools
import json
import math
import os
import re
import resource
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings

import pytensor

from multi_gpu import cli, datasets, devices, files, records
from multi_gpu.cli import UsageError
from multi_gpu.nodes import LOST_AFTER, check_port, free_port, host_and_port, on_loopback
from multi_gpu.trainer import steps_per_epoch
from multi_gpu.worker import (fault_point, fault_spec_problem, forget_the_launchers_state,
                              heartbeat_path, request_stop, stopping)


# Run in a process of its own: a launcher that started CUDA could not fork
# workers that use it (CUDA does not survive a fork), as 2014's launcher did not either.
GPU_PROBE = """
import json, pycuda.driver as drv
drv.init()
n = drv.Device.count()
print(json.dumps([[a == b or drv.Device(a).can_access_peer(drv.Device(b)) for b in range(n)]
                  for a in range(n)]))
"""


@functools.cache
def gpu_probe():
    """(which GPUs can read which one's memory, a matrix; why there are none)."""
    if importlib.util.find_spec("jax") is None:
        return [], "JAX is not installed"
    if importlib.util.find_spec("pycuda") is None:
        return [], "PyCUDA is not installed"
    try:
        out = subprocess.run([sys.executable, "-c", GPU_PROBE], capture_output=True, text=True,
                             timeout=120)
    except subprocess.TimeoutExpired:
        return [], "CUDA did not start within 120 s"
    if out.returncode:  # pycuda.driver.Error: no driver, no device
        last = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        return [], f"CUDA does not start ({last})"
    return json.loads(out.stdout), "no GPU found"


def usable_gpus():
    """(number of GPUs the GPU path can use, why none); starts no CUDA here."""
    peers, why = gpu_probe()
    return len(peers), why


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


def peer_access(a, b):
    """Can GPU a read GPU b's memory directly (NVLink or PCIe peer-to-peer)?"""
    return gpu_probe()[0][a][b]


def private_coordinator(rundir):
    """Where JAX's coordinator listens on one machine: a Unix socket in the
    run's private folder, which no other user can reach (gRPC takes
    ``unix:`` addresses), not a TCP port on the loopback, which any can."""
    return "unix:" + os.path.join(rundir, COORDINATOR_SOCKET)


COORDINATOR_SOCKET = "coordinator.sock"


def check_exchange(args, world, gpus):
    """Resolve --exchange, --sync, --avg and --staged; returns the notices."""
    shared = len(set(args.devices)) < len(args.devices)  # GPUs; CPU workers always share
    exchange_asked, sync_asked, staged_asked = args.exchange, args.sync, args.staged
    choose_exchange(args, world, gpus, shared)
    notices = around_missing_peer_access(args, world, exchange_asked) \
        if gpus and args.exchange == "p2p" and not shared else []
    if args.exchange == "xla":
        check_xla(args, gpus, shared)
        return notices
    choose_sync_and_avg(args, gpus)
    if gpus:
        notices += host_ordering(args, world, shared, sync_asked, staged_asked)
    return notices


def choose_exchange(args, world, gpus, shared):
    """--exchange by default: p2p on one machine for two workers, CPUs, or
    workers sharing GPUs; else xla."""
    if args.exchange is None:
        # measured: on CPUs the host-ordered exchange beats gloo's all-reduce at 2, 3 and 4
        # workers (bench/results/scaling_cpu.json); GPUs past two stay on NCCL until measured
        args.exchange = "p2p" if args.nodes == 1 and (world == 2 or not gpus or shared) \
            else "xla"
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
    if importlib.util.find_spec("jax") is None:
        raise UsageError("--exchange xla needs JAX: pip install jax")
    if gpus and shared:
        raise UsageError("--exchange xla needs a different GPU for every worker")


def choose_sync_and_avg(args, gpus):
    """--sync by default: gpu on GPUs, host on CPUs (its only way); --avg:
    theano on GPUs, pycuda on CPUs."""
    if args.staged and not gpus:
        raise UsageError("--staged moves GPU workers' weights through host memory: CPU "
                         "workers' weights are in host memory already")
    if args.sync is None:
        args.sync = "gpu" if gpus else "host"
    if args.sync == "gpu" and not gpus:
        raise UsageError("--sync gpu orders the exchange on GPU streams: on CPUs the host "
                         "orders it (--sync host)")
    if args.sync == "gpu" and args.avg:
        raise UsageError("--avg chooses how the host-ordered loop averages: add --sync host")
    # measured: on CPUs the mean read where the workers summed it is the fastest
    # (bench/results/compare_cpu.json); on GPUs the 2014 default
    args.avg = args.avg or ("theano" if gpus else "pycuda")


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


# the options that shape the training: a checkpoint records them, and every
# node of a run must be given the same (with the data set's fingerprint)
# (what a checkpoint's config holds of each, in this order)
CONFIG_KINDS = dict(batch_size=int, learning_rate=(int, float), n_hidden=int, l1=(int, float),
                    l2=(int, float), average_every=int, workers=int, dataset=str)
TRAINED_WITH = tuple(CONFIG_KINDS)
# Every option of dual_mlp.py is one of two kinds, named once here.  What the workers
# compute or exchange: every node of a run must be given the same, or it is refused at the
# lobby (a node that alone asked for --check, say, would wait for ever on the others).
RUN_OPTIONS = TRAINED_WITH + ("epochs", "seed", "exchange", "sync", "avg", "steps_per_call",
                              "staged", "nodes", "local_workers", "platform", "resume_epoch",
                              "max_restarts", "check")
# A node's own, which the nodes may give differently: its outputs, its waits, its place
# (its devices count as workers per node and platform, its --resume as the resumed epoch).
NODE_OWN = ("devices", "save", "resume", "json", "trace", "trace_from", "trace_steps",
            "timeout", "node_rank", "secret_file", "coordinator")


def option_name(key):
    return {"workers": "workers in all", "dataset": "data set (fingerprint)",
            "local_workers": "workers per node", "resume_epoch": "resumed epoch",
            "platform": "devices (cpu or GPUs)"}.get(key, "--" + key.replace("_", "-"))


def differences(theirs, mine, keys):
    """'--batch-size 100 there, 50 here; ...' for the keys whose values differ."""
    differ = [k for k in keys if theirs.get(k) != mine.get(k)]
    if "local_workers" in differ:  # the rest follow from it (workers in all, steps a call)
        return (f"workers per node {theirs['local_workers']} there, {mine['local_workers']} "
                "here (every node gives the same number of devices)")
    return "; ".join(f"{option_name(k)} {theirs.get(k)} there, {mine.get(k)} here"
                     for k in differ)


def check_resume(args, shapes, epochs=None):
    """The checkpoint fits the model's parameter ``shapes``, is not finished,
    and was trained as this run asks (the learning rate may change, with a
    notice).  Without --epochs, the run goes on to the epochs the
    checkpoint's run asked for (``epochs``, the default, where it does not
    say), and says so.  Returns the notices."""
    # read once (a FIFO refused before it is opened), checked, and handed to the
    # workers as that one version (``launch``), whatever writes the file meanwhile
    args.checked_resume = records.read_checkpoint(args.resume, shapes)
    _, _, state = records.load_checkpoint(args.resume, shapes, records.TRAINING_STATE,
                                          raw=args.checked_resume)
    saved, notices = state.get("config"), []
    asked = (saved or {}).get("epochs")
    if args.epochs is None:
        known = type(asked) is int and asked > state["epoch"]
        args.epochs = asked if known else epochs
        notices.append(f"notice: --resume {args.resume}: trains on to epoch {args.epochs}, "
                       + ("as its run asked" if known else "the default") + " (see --epochs)")
    if state["epoch"] >= args.epochs:
        raise UsageError(f"{args.resume} is already at epoch {state['epoch']}: "
                         f"ask for more --epochs")
    args.resume_epoch = state["epoch"]
    if saved is not None:
        saved.setdefault("average_every", 1)  # checkpoints from before --average-every
        odd = [k for k in TRAINED_WITH if not isinstance(saved.get(k), CONFIG_KINDS[k])
               or isinstance(saved.get(k), bool)] + sorted(set(saved) - set(TRAINED_WITH) -
                                                          {"epochs"})
        if asked is not None and type(asked) is not int:
            odd.append("epochs")
        if odd:
            raise records.CheckpointError(
                f"{args.resume}: its config has {odd[0]} = {saved.get(odd[0])!r}, not one this "
                "demo writes: not a checkpoint of dual_mlp.py")
    if saved is None:
        return notices + [f"notice: {args.resume} does not record how it was trained (an "
                          "older checkpoint): resuming with the options given"]
    if not saved["dataset"].startswith(datasets.FINGERPRINT):
        raise UsageError(f"{args.resume} was written by an older version of the demo, whose "
                         "data set fingerprint sampled 256 rows: this one cannot tell whether "
                         "it was trained on this data set; start anew")
    fixed = [k for k in TRAINED_WITH if k != "learning_rate"]
    if differences(saved, args.trained_with, fixed):
        raise UsageError(f"{args.resume} was trained otherwise: "
                         f"{differences(saved, args.trained_with, fixed)} (the checkpoint "
                         "there, this run here): resume with its options, or start anew")
    if saved["learning_rate"] != args.learning_rate:
        notices.append(f"notice: the learning rate changes from {saved['learning_rate']} to "
                       f"{args.learning_rate} at epoch {state['epoch'] + 1}")
    return notices


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


def check_limits(n_local):
    """Raise this process's limit of open files to what a run needs (its
    workers inherit it), or refuse the run in one line where the hard limit
    is too low; and refuse it where the user's limit of processes (``ulimit
    -u``, threads counted) leaves too little room: either would end a worker
    deep in zmq or XLA.  (Root is held to no process limit.)"""
    files_needed = 64 + 32 * n_local  # sockets, pipes, mapped buffers, XLA's own
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


def check_request(args, shapes, batch_size, shipped_batch_size, steps_per_call, epochs):
    """Resolve defaults and check every input; returns the notices to print.
    ``shapes`` are the model's parameters' (a checkpoint must hold them),
    ``batch_size`` is the default per worker, ``shipped_batch_size`` the one
    on the shipped digits (too few for two minibatches of the default),
    ``steps_per_call`` the default of the device-ordered exchanges,
    ``epochs`` the default of --epochs."""
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
    check_limits(len(args.devices))
    notices.append(notice)
    world, gpus = args.nodes * len(args.devices), args.devices[0] != "cpu"
    notices += check_exchange(args, world, gpus)
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
    too_big = devices.memory_problem(shapes, len(args.devices), sum(x.size for x, _ in splits))
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


def worker_environment(dev, n_local, one_machine=True):
    env = dict(os.environ)
    if one_machine:  # NCCL's bootstrap sockets on the loopback, where nobody else reaches
        env["NCCL_SOCKET_IFNAME"] = "lo"
    if dev == "cpu":
        # the workers share the cores: each gets its part, or they fight over all of them
        threads = str(max(1, (os.cpu_count() or 2) // n_local))
        env.update(dict.fromkeys(flags.THREAD_VARIABLES, threads), JAX_PLATFORMS="cpu")
        if threads == "1":  # a core each: XLA would split every op over all of them
            env["XLA_FLAGS"] = " ".join(filter(None, (env.get("XLA_FLAGS"),
                                                      "--xla_cpu_multi_thread_eigen=false")))
    else:
        # the worker sees its own GPU only; JAX takes memory as it needs it,
        # not 75% up front, so that two workers can share a GPU
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpu = visible.split(",")[int(dev)] if visible else dev
        env.update(CUDA_VISIBLE_DEVICES=gpu, JAX_PLATFORMS="cuda",
                   XLA_PYTHON_CLIENT_PREALLOCATE="false")
    return env


def preload():
    """Import, once, what every worker imports: each is forked from the
    launcher and finds it loaded (a second of CPU a worker).  JAX is
    imported, not started: no backend, so none of its threads, and no CUDA
    (JAX itself warns at a fork once a backend runs)."""
    import jax  # noqa: F401
    import pytensor.link.jax.dispatch  # noqa: F401


def text_stream(fd, like):
    """A new, unbuffered text stream on ``fd``, written as ``like`` was."""
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), line_buffering=True,
                            write_through=True, encoding=getattr(like, "encoding", None),
                            errors=getattr(like, "errors", None))


class Forked:
    """A worker process, forked from the launcher as 2014's
    ``multiprocessing.Process`` children were, with the part of
    ``subprocess.Popen``'s interface the launcher uses.  The child runs
    ``start()`` as a new process would: its error output a pipe to the
    launcher, no descriptor, signal handler or clean-up of the launcher's,
    the environment ``env``, and fresh standard streams (a lock of the
    launcher's threads' is not its)."""

    def __init__(self, start, env, name):
        reader, writer = os.pipe()
        for stream in filter(None, (sys.stdout, sys.stderr)):  # or the child writes it again
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        # no stop signal's handler of the launcher's may run in the child
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, cli.STOP_SIGNALS)
        with warnings.catch_warnings():
            # Python warns at any fork beside threads: here NumPy's BLAS's, idle,
            # (and the lobby's, on several nodes), whose locks the child never takes
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            self._become_worker(start, env, name, writer, blocked)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        os.close(writer)
        with contextlib.suppress(OSError):  # set on both sides: no signal finds it between
            os.setpgid(pid, pid)
        self.pid, self.returncode = pid, None
        self.stderr = os.fdopen(reader, errors="replace")

    @staticmethod
    def _become_worker(start, env, name, writer, blocked):
        code = 1
        try:
            # A process group of its own: a terminal's Ctrl-C reaches the launcher
            # alone, which stops every worker, whatever each is doing just then.
            os.setpgid(0, 0)
            os.dup2(writer, 2)
            os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            for signum in cli.STOP_SIGNALS:
                signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            forget_the_launchers_state()
            os.environ.clear()
            os.environ.update(env)
            import jax  # JAX read JAX_PLATFORMS as the launcher imported it
            jax.config.update("jax_platforms", env.get("JAX_PLATFORMS"))
            # (descriptor 1 is open: /dev/null where the launcher started without, flags.py)
            sys.stdout, sys.stderr = text_stream(1, sys.stdout), text_stream(2, sys.stderr)
            with contextlib.suppress(OSError, AttributeError):  # ps, top and pgrep show it
                ctypes.CDLL(None).prctl(15, name.encode()[:15])  # PR_SET_NAME
            code = start()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else bool(print(e.code, file=sys.stderr))
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os._exit(code or 0)

    def poll(self):
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, signum):
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


class Worker:
    """A worker process seen from the launcher.  One process speaks: worker
    0's warnings and notices pass through to the terminal; every other line
    of error output is kept, to say why a worker failed (with its traceback
    where it failed unexpectedly), and nothing passes once the run is being
    stopped (JAX's runtime logs pages of fatal lines as its peers go)."""

    # what names a failure: our own one-line errors, a Python exception, a
    # fatal log line of JAX's runtime (glog: F1130 12:00:00.000 123 file.cc:80] ...,
    # whose words are told as XLA's)
    FATAL = re.compile(r"F\d{4} \S+ +\d+ \S+\] (.*)")
    # XLA reads XLA_FLAGS only as a worker starts: a flag it does not know is bad input all the same
    BAD_INPUT = "XLA's runtime: Unknown flag in XLA_FLAGS"
    ERROR = re.compile(rf"(worker \d+: error: .*|[\w.]*(Error|Exception)\b.*|{FATAL.pattern})")
    SPOKEN = re.compile(r"worker 0: (warning|notice): .*")
    quiet = False  # set for every worker once the run is being stopped

    def __init__(self, start, index, rank, dev, rundir, n_local, one_machine):
        """Fork the worker: ``start(index, launcher's pid, rundir)`` in it.  The
        run folder's name is passed in memory: a command line is every user's
        to read in /proc."""
        self.rank, self.dev = rank, dev
        self.proc = Forked(functools.partial(start, index, os.getpid(), rundir),
                           worker_environment(dev, n_local, one_machine), f"dual_mlp w{rank}")
        self.tail = collections.deque(maxlen=200)
        self.pump = threading.Thread(target=self._pass_stderr, daemon=True)

    def _pass_stderr(self):
        for line in self.proc.stderr:
            if not Worker.quiet and self.SPOKEN.fullmatch(line.rstrip()):
                cli.say(line, end="", file=sys.stderr)
            self.tail.append(line.rstrip())

    def stalled(self, rundir, patience):
        """Has its heartbeat (``worker.Watchdog``) been still for ``patience``
        seconds while it trains (its heartbeat names a step)?  Before its
        first step --timeout governs, as it does meeting and compiling, where
        a call into JAX may hold Python's lock for seconds; after its last, it
        only exits."""
        path = heartbeat_path(rundir, self.rank)
        try:
            if time.time() - os.stat(path).st_mtime < patience:
                return False
            with open(path) as f:
                return len(f.read(32).split()) == 2  # "EPOCH STEP", not "done" or nothing
        except OSError:
            return False

    def said_why(self):
        """Did it end with one of our own one-line errors?"""
        self.pump.join(timeout=2)
        return any(line.startswith(f"worker {self.rank}: error: ") for line in self.tail)

    def cause(self):
        """The line of its error output that says what went wrong, how it
        ended, and before them its traceback where it failed unexpectedly."""
        self.pump.join(timeout=2)
        code = self.proc.returncode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        lines = [line for line in self.tail if line.strip()]
        errors = [line.strip() for line in lines if self.ERROR.fullmatch(line.strip())]
        last = (errors or [line.strip() for line in lines] or [None])[-1]
        fatal = last and self.FATAL.fullmatch(last)
        last = f"XLA's runtime: {fatal.group(1)}" if fatal else last
        trace = lines[max(i for i, line in enumerate(lines) if line.startswith("Traceback")):-1] \
            if any(line.startswith("Traceback") for line in lines) else []
        return "".join(line + "\n" for line in trace), f"{last} ({how})" if last else how


def stop(workers, grace=2.0):
    """SIGTERM every worker still running, SIGKILL what is left after
    ``grace``, and wait ``grace`` more for those; returns the ones that would
    not die even so (frozen: ``docker pause``, a freezer cgroup, a stall in
    the kernel), which the launcher names and leaves instead of waiting for
    them without a word."""
    Worker.quiet = True
    for w in workers:
        if w.proc.poll() is None:
            w.proc.terminate()
    deadline = time.monotonic() + grace
    for w in workers:
        try:
            w.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
    deadline = time.monotonic() + grace
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(max(0.0, deadline - time.monotonic()))
    return [w for w in workers if w.proc.poll() is None]


def unkillable(left):
    """What the launcher adds to its last line about workers it could not stop."""
    return "".join(f"; worker {w.rank} (pid {w.proc.pid}) cannot be stopped (frozen?) and is "
                   "left as it is" for w in left)


SOCKET_PATH_MAX = 107  # an ipc:// socket's path, in bytes (Linux's sun_path, less its NUL)


RUN_FOLDER_NAME = re.compile(r"dual_mlp-(\d+)-[0-9a-f]{16}")  # after its launcher's pid
STALE_AFTER = 60  # seconds without a heartbeat: a run folder nobody is left to remove


def drop_folders_of_dead_runs(parent):
    """Remove the run folders of this user's earlier runs in ``parent`` that
    nobody was left to remove (the launcher SIGKILLed with its workers, a
    machine's processes killed at once): its launcher is gone and nothing in
    it changed for ``STALE_AFTER`` s.  /dev/shm is memory."""
    with contextlib.suppress(OSError), os.scandir(parent) as entries:
        for entry in entries:
            found = RUN_FOLDER_NAME.fullmatch(entry.name)
            if not found or records.alive(int(found.group(1))):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                if not entry.is_dir(follow_symlinks=False) or st.st_uid != os.getuid():
                    continue
                last = max([st.st_mtime] + [os.lstat(os.path.join(entry.path, f)).st_mtime
                                            for f in os.listdir(entry.path)])
            except OSError:  # another run removed it meanwhile
                continue
            if time.time() - last > STALE_AFTER:
                shutil.rmtree(entry.path, ignore_errors=True)


def run_folder(args, shapes):
    """Where the run's private folder for its sockets, buffers and heartbeats
    will be (``launch`` makes it): in shared memory where it has room for
    them, else on disk; named after this launcher, so that nobody mistakes
    it for another run's, and unguessable.  Dead runs' folders there go."""
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    for parent in {shm, tempfile.gettempdir()} - {None}:
        drop_folders_of_dead_runs(parent)
    n_params = sum(math.prod(s) for s in shapes)
    data = sum(a.nbytes for split in getattr(args, "checked_data", ()) for a in split)
    needed = 4 * len(args.devices) * n_params * 4 + data + (1 << 20)  # weights, data, room
    notice = None
    if shm and shutil.disk_usage(shm).free < needed:
        notice = (f"notice: /dev/shm has {shutil.disk_usage(shm).free >> 20} MB free, the run "
                  f"needs {needed >> 20} MB there: its buffers go to a folder on disk")
        shm = None
    folder = shm or tempfile.gettempdir()
    name = f"dual_mlp-{os.getpid()}-{secrets.token_hex(8)}"
    n = len(args.devices)
    socket = os.path.join(folder, name, max(f"peer-{n - 2}-{n - 1}.sock", COORDINATOR_SOCKET,
                                            key=len))  # the longest path
    if len(socket.encode()) > SOCKET_PATH_MAX:
        if folder == "/tmp" or not os.access("/tmp", os.W_OK):
            raise UsageError(f"{folder} is too deep a folder for the run's sockets (a path of "
                             f"{len(socket.encode())} bytes; Linux takes {SOCKET_PATH_MAX}): "
                             "set TMPDIR to a shorter one")
        notice = (f"notice: {folder} is too deep a folder for the run's sockets: its "
                  "buffers and sockets go to /tmp")
        folder = "/tmp"
    if shutil.disk_usage(folder).free < needed:
        raise UsageError(f"{folder} has {shutil.disk_usage(folder).free >> 20} MB free, the "
                         f"run needs {needed >> 20} MB for its buffers")
    return os.path.join(folder, name), notice


def launch(args, shapes, start, rundir, link):
    """Fork the workers (each runs ``start(INDEX, LAUNCHER_PID, RUN_FOLDER)``),
    then make the run folder and leave the request there, and watch them and
    the other nodes (``link``); if a worker fails or stops running, or
    another node does, or node 0 orders the run to start again, stop the
    others at once.  Returns (the exit
    code, the traceback of a worker that failed unexpectedly, what failed
    in one line: None where the run ended, or said why itself; whether a
    node was lost, or ended for good).

    In that order, wherever this launcher dies (even by SIGKILL), a worker
    is there to remove the folder: each waits for the request only while
    its launcher lives, and one that finds itself orphaned, or that Linux
    tells, removes the folder before it goes (``run_worker``).  The name is
    unguessable and shown nowhere another user can read, and the folder is
    made exclusively (``files.make_folder``): one that is there already is
    someone else's, and is left as it is."""
    cli.install_stop_handler(request_stop)
    files.keep_descriptors()
    made = False
    Worker.quiet = False
    try:
        workers = fork_workers(args, start, rundir)
        fault_point("launcher", "spawned")
        try:
            files.make_folder(rundir)
        except FileExistsError:
            stop(workers)
            cli.say(f"error: the run folder {rundir} exists already, made by someone else: the "
                    "run stops and leaves it as it is", file=sys.stderr)
            return 1, "", None, False
        made = True
        fault_point("launcher", "folder")
        problem = leave_the_request(args, rundir)
        if problem:
            cli.say(f"error: {problem}", file=sys.stderr)
            return 1, "", None, False
        ended = watch(workers, rundir, link, stall_patience(args.timeout))
        if ended:
            return ended
        left = stop(workers)
        link.tell("failed", f"interrupted ({signal.Signals(stopping.signum).name})", final=True)
        cli.say(f"interrupted ({signal.Signals(stopping.signum).name})"
                f"{resume_hint(args, shapes)}{unkillable(left)}", file=sys.stderr)
        return 128 + stopping.signum, "", None, False
    finally:
        why = made and files.remove_folder(rundir)
        if why:
            cli.say(f"error: the run folder {rundir} could not be removed ({why}): remove it "
                    "by hand", file=sys.stderr)


def fork_workers(args, start, rundir):
    """A worker for each of this node's devices, forked from here."""
    preload()
    n_local, workers = len(args.devices), []
    for i, dev in enumerate(args.devices):
        workers.append(Worker(start, i, args.node_rank * n_local + i, dev, rundir, n_local,
                              args.one_machine))
    for w in workers:  # once every fork is done: no thread of ours to fork beside
        w.pump.start()
    return workers


def leave_the_request(args, rundir):
    """The run's request in its folder, for the workers: the checkpoint to
    resume and the data set as ``check_request`` read and checked them
    (whatever the files hold now), and ``config.json``, whole or not at
    all.  Returns what went wrong, in one line, or None."""
    request = os.path.join(rundir, "config.json")
    try:
        if args.resume:
            args.resume_copy = os.path.join(rundir, "resume.npz")
            with files.new_file(args.resume_copy) as f:
                f.write(args.checked_resume)
        args.dataset_copy = os.path.join(rundir, datasets.RUN_COPY)
        with files.new_file(args.dataset_copy) as f:
            datasets.write_run_copy(f, args.checked_data)
        with files.new_file(request + ".part", text=True) as f:
            json.dump({k: v for k, v in vars(args).items()
                       if k not in ("checked_resume", "checked_data")}, f)
        os.replace(request + ".part", request)
    except FileNotFoundError:
        return f"the run folder {rundir} was removed as the run started (a cleaner of " \
            "temporary files?)"
    except OSError as e:
        if e.errno not in files.NO_ROOM:
            raise
        return files.no_room(e, rundir)
    return None


def watch(workers, rundir, link, patience):
    """Until the workers all end well, or one fails or stops running, or
    another node is lost, or node 0 orders the run to start again: the
    launch's result (``launch``); None once the run is asked to stop."""
    while not stopping.is_set():
        codes = [w.proc.poll() for w in workers]
        if all(code == 0 for code in codes):
            link.tell("done")
            return 0, "", None, False
        failed = [w for w, code in zip(workers, codes) if code not in (None, 0)]
        stalled = [w for w, code in zip(workers, codes)
                   if code is None and w.stalled(rundir, patience)]
        verdict, order = link.verdict(), link.ordered()
        if order:  # node 0 starts the run again: another node failed
            left = stop(workers)
            return 1, "", f"{order['why']}{unkillable(left)}", False
        if failed or stalled or verdict:
            return what_failed(workers, failed, stalled, verdict, link, rundir, patience)
        time.sleep(0.05)
    return None


def what_failed(workers, failed, stalled, verdict, link, rundir, patience):
    """Stop the workers, and say what failed first, where (the launch's
    result); None where Ctrl-C reached the workers first."""
    at = position(rundir, workers[0].rank)
    left = stop(workers)
    # the cause first: a worker killed by a signal, then one that said what went
    # wrong in our own words; the others' errors may only follow from theirs
    failed.sort(key=lambda w: (w.proc.returncode > 0, not w.said_why()))
    if any(w.proc.returncode == 128 + signal.SIGPIPE for w in failed):
        return 128 + signal.SIGPIPE, "", None, False  # stdout was closed: end as quietly
    if failed and all(w.proc.returncode in (130, 143) for w in failed) and not verdict:
        stopping.signum = failed[0].proc.returncode - 128  # Ctrl-C reached them first
        return None
    if failed and not (verdict or stalled) and link.others and \
            failed[0].proc.returncode > 0 and not failed[0].said_why():
        verdict = another_nodes_word(link)  # a collective that broke under us
        if link.ordered():
            return 1, "", link.ordered()["why"], False
    trace, why = "", verdict
    if not verdict and stalled:
        why = f"worker {stalled[0].rank} (device {stalled[0].dev}) stopped: silent for " \
            f"{patience:g} s"
    elif not verdict:
        trace, cause = failed[0].cause()
        why = f"worker {failed[0].rank} (device {failed[0].dev}) failed: {cause}"
    at = "" if " at epoch " in why else at  # another node's word says where already
    return 2 if Worker.BAD_INPUT in why else 1, trace, f"{why}{at}{unkillable(left)}", \
        bool(verdict) and link.gone()


def another_nodes_word(link):
    """Did another node fail or go first?  Its word (``link.verdict``) or
    node 0's order, once either comes, within the time a node is lost in."""
    deadline = time.monotonic() + LOST_AFTER + 1
    verdict = link.verdict()
    while not (verdict or link.ordered()) and time.monotonic() < deadline:
        time.sleep(0.05)
        verdict = link.verdict()
    return verdict


def stall_patience(timeout):
    """Seconds a worker's heartbeat may stop before its launcher calls it
    stopped (SIGSTOP, a frozen container): ``LOST_AFTER``; where --timeout
    is shorter, a little more than it, so that the worker waiting for it
    names it first."""
    return LOST_AFTER if timeout >= LOST_AFTER else timeout + 3


def position(rundir, rank):
    """' at epoch E, step S': the step worker ``rank`` began last, by its
    heartbeat (``worker.Watchdog``); empty before its first."""
    try:
        with open(heartbeat_path(rundir, rank)) as f:
            epoch, step = map(int, f.read(64).split())
    except (OSError, ValueError):
        return ""
    return f" at epoch {epoch}, step {step}" if epoch else ""


def supervise(args, shapes, start, rundir, link):
    """Run the workers (``launch``); where one fails or stops, and
    ``--max-restarts`` allows, start them all again from the run's last
    checkpoint, every node, saying so in one line each time: node 0
    decides, and tells the others where to start (``Lobby.order_restart``);
    a node lost ends the run.  Where the run fails for good, its last line
    says what failed, where, and how to resume.  Returns the exit code."""
    for restart in range(1, args.max_restarts + 2):
        code, trace, why, lost = launch(args, shapes, start, rundir, link)
        if why is None:
            break
        if args.node_rank and not link.ordered():
            link.tell("failed", why)  # node 0 decides whether the run starts again
        if restart > args.max_restarts or lost or code == 2:  # bad input fails again
            break
        try:
            order = link.ordered() or (link.await_order() if args.node_rank else None)
            if args.node_rank and not order:
                why = link.verdict() or why
                break
            resumed = follow(args, order, shapes) if order else restart_point(args, shapes)
        except (UsageError, records.CheckpointError) as e:
            why += f"; no restart: {e}"
            break
        cli.say(f"{order['why'] if order else why}: restarting every worker {resumed} (restart "
                f"{restart} of {args.max_restarts})", file=sys.stderr)
        old, (rundir, _) = rundir, run_folder(args, shapes)
        if order:
            link.restart(order["generation"])
        else:
            order_restart(args, link, restart, why, old, rundir)
    if why is not None:
        link.tell("failed", why, final=True)
        cli.say(f"{trace}error: {why}{resume_hint(args, shapes)}", file=sys.stderr)
    return code


def order_restart(args, link, restart, why, old, rundir):
    """Node 0's restart: JAX's coordinator where the new run folder is, or
    at a new port (the last one's may linger); the other nodes told."""
    if args.jax_coordinator == private_coordinator(old):
        args.jax_coordinator = private_coordinator(rundir)
    elif args.nodes > 1:
        host = host_and_port(args.coordinator)[0]
        args.jax_coordinator = f"{host}:{free_port(host)}"
    if args.nodes > 1:
        link.order_restart(restart, why, args.jax_coordinator, args.resume_epoch,
                           args.checked_resume if args.resume else None)


def restart_point(args, shapes):
    """Make the request resume where a restart starts: from the run's last
    checkpoint (--save) once there is one, else where the run began (its
    --resume, or the first epoch).  Returns where, in words."""
    if args.save and os.path.exists(args.save):
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
    if args.trace and args.trace_from <= args.resume_epoch:
        args.trace = None  # its window is behind the restart: trained already
    return f"from {args.resume} at epoch {args.resume_epoch}" if args.resume else \
        "from the first epoch"


def resume_hint(args, shapes):
    """What the last line of a failed run adds: the run's last checkpoint
    and the command that resumes from it; node R > 0: node 0's."""
    if args.node_rank:
        return "; resume from node 0's last checkpoint (--resume)" if args.nodes > 1 else ""
    if not (args.save and os.path.exists(args.save)):
        return ""
    try:
        epoch = records.load_checkpoint(args.save, shapes)[2]["epoch"]
    except records.CheckpointError:
        return ""
    words, near = shlex.split(args.command), os.path.relpath(args.save)
    shown = args.save if near.startswith("..") else near  # as the user would type it here
    if "--resume" in words:
        del words[words.index("--resume"):words.index("--resume") + 2]
    return f"; resume (epoch {epoch}): {shlex.join(words + ['--resume', shown])}"
