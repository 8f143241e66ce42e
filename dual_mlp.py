#!/usr/bin/env python
"""Train the tutorial's MLP on two workers that average their weights after every step.

A re-creation of "Multi-GPU using Theano and PyCUDA" (dual_mlp.py, University
of Guelph, 2014), on PyTensor, PyCUDA and pyzmq::

    THEANO_FLAGS=mode=FAST_RUN,floatX=float32 python dual_mlp.py 0 1    # GPUs 0 and 1
    python dual_mlp.py cpu cpu                                          # no GPU needed

This process is the launcher: it checks the request, starts two workers (this
same file, with ``--worker``), watches them, and stops both if either fails.
Worker k holds a full replica of the MLP, trains on the minibatches whose
index is k modulo 2, and after every step of its own:

  1. train    one SGD step on its minibatch;
  2. publish  copies its weights into its send buffer, whose address never moves;
  3. barrier  waits until the peer has published too (a zmq message each way);
  4. copy     copies the peer's send buffer into its receive buffer
              (GPU: a peer-to-peer copy of a CUDA IPC buffer; CPU: host memory);
  5. barrier  waits until the peer has copied ours, so neither send buffer is
              overwritten while the other still reads it;
  6. average  sets its weights to (mine + peer's) / 2.

Both replicas then hold identical weights, and the pair has taken one SGD step
on a minibatch of twice the size: the mean of two minibatch gradients is the
gradient of their union's mean cost.
"""
import argparse
import collections
import ctypes
import datetime
import importlib.util
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from contextlib import ExitStack

import theano_flags  # noqa: F401  (maps THEANO_FLAGS onto PyTensor; must precede it)
import numpy as np
import pytensor

import datasets
import mlp
from exchange import CudaDevice, HostDevice, Interrupted, Layout, Peer, PeerError
from logistic_sgd import load_data

# -----------------------------------------------------------------------------
# configuration: the 2014 demo's shared_args
EPOCHS = 10
BATCH_SIZE = 5000          # per worker
LEARNING_RATE = 0.13
N_HIDDEN = 500
L1, L2 = 0.0, 0.0001
SEED = 1234
SHIPPED_BATCH_SIZE = 100   # the shipped 3,000 training digits hold no two minibatches of 5,000
TIMEOUT = 120.0            # seconds a worker waits for its peer at a barrier
# -----------------------------------------------------------------------------


class UsageError(Exception):
    """A request that cannot run; the launcher prints it on one line, exit 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def positive(kind):
    def parse(text):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def non_negative(text):
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n")[0], epilog=(
        "THEANO_FLAGS is honoured (mapped onto PyTensor's flags; floatX defaults to float32). "
        "See README.md for the data choices and the GPU set-up."))
    p.add_argument("devices", nargs="*", metavar="DEV",
                   help="two devices, each a GPU index or 'cpu' (default: 0 1 when two GPUs "
                        "are usable, else cpu cpu); '0 0' puts both workers on one GPU")
    p.add_argument("--epochs", type=positive(int), default=EPOCHS,
                   help="passes over the training set (default: %(default)s)")
    p.add_argument("--batch-size", type=positive(int), default=None,
                   help=f"minibatch size per worker (default: {BATCH_SIZE}; "
                        f"{SHIPPED_BATCH_SIZE} on the shipped digits)")
    p.add_argument("--learning-rate", type=positive(float), default=LEARNING_RATE,
                   help="SGD step size (default: %(default)s)")
    p.add_argument("--n-hidden", type=positive(int), default=N_HIDDEN,
                   help="hidden units (default: %(default)s)")
    p.add_argument("--l1", type=non_negative, default=L1,
                   help="L1 weight penalty (default: %(default)s)")
    p.add_argument("--l2", type=non_negative, default=L2,
                   help="squared L2 weight penalty (default: %(default)s)")
    p.add_argument("--dataset", metavar="PATH",
                   help="mnist.pkl.gz or a folder of MNIST-format IDX files, e.g. "
                        "/usr/share/datasets/fashion-mnist (default: ./mnist.pkl.gz if "
                        "present, else the 5,000 digits shipped in data/)")
    p.add_argument("--avg", choices=("theano", "pycuda", "cpu"), default="theano",
                   help="how to average: 'theano' a compiled PyTensor function; 'pycuda' "
                        "in place on the buffers (a CUDA kernel on GPUs, NumPy on the CPU); "
                        "'cpu' through host memory (default: %(default)s)")
    p.add_argument("--save", metavar="PATH", help="checkpoint (.npz) written after every "
                   "epoch, atomically: current and best-validation weights, training state")
    p.add_argument("--resume", metavar="PATH", help="continue from a --save checkpoint")
    p.add_argument("--json", metavar="PATH", help="write a summary of the run as JSON")
    p.add_argument("--check", action="store_true", help="after every exchange, measure how "
                   "far the replicas differ (max_replica_diff; costs one more exchange)")
    p.add_argument("--seed", type=int, default=SEED,
                   help="weight initialisation seed (default: %(default)s)")
    p.add_argument("--staged", action="store_true",
                   help="GPUs: copy the weights through host memory, the fallback used "
                        "where the two GPUs cannot reach each other's memory")
    p.add_argument("--timeout", type=positive(float), default=TIMEOUT,
                   help="seconds a worker waits for its peer at a barrier before it gives "
                        "up (default: %(default)s)")
    p.add_argument("--worker", nargs=2, metavar=("RANK", "RUNDIR"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -----------------------------------------------------------------------------
# the launcher: check everything first, so bad input starts no process

def usable_gpus():
    """(number of GPUs the GPU path can use, why none); starts no CUDA context."""
    if importlib.util.find_spec("jax") is None:
        return 0, "JAX is not installed"
    try:
        import pycuda.driver as drv
        drv.init()
        return drv.Device.count(), "no GPU found"
    except ImportError:
        return 0, "PyCUDA is not installed"
    except Exception as e:  # pycuda.driver.Error: no driver, no device
        return 0, f"CUDA does not start ({e})"


def choose_devices(requested):
    if len(requested) not in (0, 2):
        raise UsageError(f"give two devices (e.g. '0 1' or 'cpu cpu'), not {len(requested)}")
    for dev in requested:
        if dev != "cpu" and not dev.isdigit():
            raise UsageError(f"unknown device '{dev}': a device is a GPU index or 'cpu'")
    if requested and (requested[0] == "cpu") != (requested[1] == "cpu"):
        raise UsageError("both workers run on GPUs or both on the CPU, not one of each")
    if requested == ["cpu", "cpu"]:
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
    import pycuda.driver as drv
    return a == b or drv.Device(a).can_access_peer(drv.Device(b))


def check_request(args):
    """Resolve defaults and check every input; returns the notices to print."""
    notices = []
    args.devices, notice = choose_devices(args.devices)
    notices.append(notice)
    if args.devices[0] != "cpu":
        if pytensor.config.floatX != "float32":
            raise UsageError("the GPU path runs in float32: drop floatX from the flags")
        a, b = map(int, args.devices)
        if not args.staged and not peer_access(a, b):
            notices.append(f"warning: GPUs {a} and {b} cannot access each other's memory: "
                           "the weights go through host memory (slower, same numbers)")
            args.staged = True
    args.dataset, notice = datasets.resolve(args.dataset)
    notices.append(notice)
    n_train = len(datasets.read(args.dataset)[0][0])
    if args.batch_size is None:
        args.batch_size = SHIPPED_BATCH_SIZE if args.dataset == datasets.SHIPPED else BATCH_SIZE
        if args.dataset == datasets.SHIPPED:
            notices.append(f"batch size {args.batch_size} per worker, so that each worker "
                           f"gets {n_train // args.batch_size // 2} minibatches per epoch")
    if n_train < 2 * args.batch_size:
        raise UsageError(f"batch size {args.batch_size} is too large: the training set has "
                         f"{n_train} images, and each of the two workers needs a minibatch")
    for path in (args.save, args.json):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            raise UsageError(f"cannot write {path}: folder {folder} does not exist")
    if args.resume:
        shapes = mlp.parameter_shapes(datasets.N_PIXELS, args.n_hidden, datasets.N_CLASSES)
        _, _, state = mlp.load_checkpoint(args.resume, shapes)
        if state["epoch"] >= args.epochs:
            raise UsageError(f"{args.resume} is already at epoch {state['epoch']}: "
                             f"ask for more --epochs")
    return [n for n in notices if n]


def worker_environment(dev):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if dev == "cpu":
        # two workers share the cores: each gets half, or they fight over all of them
        threads = str(max(1, (os.cpu_count() or 2) // 2))
        env.update(JAX_PLATFORMS="cpu", OMP_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads,
                   MKL_NUM_THREADS=threads, NUMBA_NUM_THREADS=threads)
    else:
        # the worker sees its own GPU only; JAX takes memory as it needs it,
        # not 75% up front, so that two workers can share a GPU
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpu = visible.split(",")[int(dev)] if visible else dev
        env.update(CUDA_VISIBLE_DEVICES=gpu, JAX_PLATFORMS="cuda",
                   XLA_PYTHON_CLIENT_PREALLOCATE="false")
    return env


class Worker:
    """A worker process seen from the launcher; its stderr is passed through
    and its last lines kept, to say why it failed."""

    def __init__(self, rank, dev, rundir):
        self.rank, self.dev = rank, dev
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", str(rank), rundir],
            env=worker_environment(dev), stderr=subprocess.PIPE, text=True)
        self.tail = collections.deque(maxlen=20)
        self.pump = threading.Thread(target=self._pass_stderr, daemon=True)
        self.pump.start()

    def _pass_stderr(self):
        for line in self.proc.stderr:
            sys.stderr.write(line)
            self.tail.append(line.rstrip())

    def cause(self):
        """The last line of its error output, or how it ended."""
        self.pump.join(timeout=2)
        code = self.proc.returncode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        last = next((line for line in reversed(self.tail) if line.strip()), None)
        return f"{last.strip()} ({how})" if last and code > 0 else how


def stop(workers, grace=2.0):
    """SIGTERM every worker still running, SIGKILL what is left after ``grace``."""
    for w in workers:
        if w.proc.poll() is None:
            w.proc.terminate()
    deadline = time.monotonic() + grace
    for w in workers:
        try:
            w.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


def launch(args):
    """Start both workers and wait; if one fails, stop the other at once."""
    # a private directory for the sockets and buffers: no fixed port, no clash
    # between two runs, nothing reachable from the network
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    rundir = tempfile.mkdtemp(prefix="dual_mlp-", dir=shm)
    workers = []
    try:
        with open(os.path.join(rundir, "config.json"), "w") as f:
            json.dump(vars(args), f)
        workers = [Worker(rank, dev, rundir) for rank, dev in enumerate(args.devices)]
        while True:
            codes = [w.proc.poll() for w in workers]
            if all(code == 0 for code in codes):
                return 0
            failed = [w for w, code in zip(workers, codes) if code not in (None, 0)]
            if failed:
                stop(workers)
                if all(w.proc.returncode in (130, -signal.SIGINT) for w in failed):
                    raise KeyboardInterrupt
                w = failed[0]
                print(f"error: worker {w.rank} (device {w.dev}) failed: {w.cause()}",
                      file=sys.stderr)
                return 1
            time.sleep(0.05)
    except KeyboardInterrupt:
        stop(workers)
        kept = f"; last checkpoint kept in {args.save}" if args.save and \
            os.path.exists(args.save) else ""
        print(f"interrupted{kept}", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(rundir, ignore_errors=True)


# -----------------------------------------------------------------------------
# the worker

def storage(shared):
    """The array a shared variable holds now (a jax.Array on a GPU)."""
    return shared.container.storage[0]


def place(shared, value):
    """Set a shared variable's array without a copy back to NumPy (set_value
    would make one), so GPU arrays stay on the GPU."""
    shared.container.storage[0] = value


class StepClock:
    """Sums the time between laps under each lap's name.  A barrier's time is
    split in two: the barrier itself, and waiting for a peer that arrived
    later (which a faster worker does whatever the exchange costs)."""

    def __init__(self):
        self.totals = collections.defaultdict(float)
        self.last = time.perf_counter()

    def start(self):
        self.last = time.perf_counter()

    def lap(self, name, waited=0.0):
        now = time.perf_counter()
        self.totals[name] += now - self.last - waited
        self.totals["waiting"] += waited
        self.last = now

    def total(self):
        return sum(self.totals.values())


def make_average(kind, params, peer_weights, layout, transport, device):
    """The ``--avg`` variants; each sets every parameter to (mine + peer's) / 2."""
    if kind == "theano":
        return pytensor.function([], [], mode=device.mode, updates=[
            (p, (p + q) / 2) for p, q in zip(params, layout.views(peer_weights))])
    if kind == "pycuda":
        return lambda: device.average_in_place([storage(p) for p in params], transport.recv,
                                               layout)

    def through_host():
        peer = layout.views(device.to_host(transport.recv))
        for p, q in zip(params, peer):
            place(p, device.put((device.to_host(storage(p)) + q) / 2))
    return through_host


def warm_up(model, average, device):
    """Call every compiled function once, then restore the weights: numba and
    JAX compile on the first call, which must not land inside a timed step
    or make the peer wait at a barrier."""
    saved = [device.to_host(storage(p)).copy() for p in model.params]
    model.train_model(0)
    model.validate_model()
    model.test_model()
    average()
    device.wait([storage(p) for p in model.params])
    for p, value in zip(model.params, saved):
        place(p, device.put(value))


def replica_diff(model, transport, peer, layout, device):
    """Max |my weights - peer's| after an exchange: one more publish and copy."""
    transport.publish([storage(p) for p in model.params])
    peer.barrier()
    transport.fetch()
    peer.barrier()
    theirs = layout.views(device.to_host(transport.recv))
    return max(float(np.max(np.abs(device.to_host(storage(p)) - q)))
               for p, q in zip(model.params, theirs))


def fault_point(rank, where):
    """The fault tests' hook: DUAL_MLP_FAULT=RANK:WHERE:HOW makes worker RANK
    fail on reaching WHERE (start, train, exchange) by HOW (raise, oom, kill)."""
    spec = os.environ.get("DUAL_MLP_FAULT", "").split(":")
    if spec[:2] != [str(rank), where]:
        return
    if spec[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if spec[2] == "oom":
        np.empty(1 << 60, np.uint8)  # raises MemoryError, as a real allocation failure would
    raise RuntimeError(f"fault injected at {where}")


def die_with_parent():
    """Ask Linux to SIGTERM this worker if the launcher dies, even by SIGKILL."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker(rank, rundir):
    with open(os.path.join(rundir, "config.json")) as f:
        args = types.SimpleNamespace(**json.load(f))
    log = print if rank == 0 else (lambda *a, **k: None)  # only worker 0 prints
    dev, peer_dev = args.devices[rank], args.devices[1 - rank]

    with ExitStack() as cleanup:
        device = HostDevice() if dev == "cpu" else CudaDevice(int(dev))
        cleanup.callback(device.close)

        data = load_data(args.dataset)
        for split in data:
            for shared in split:
                place(shared, device.put(storage(shared)))  # resident on the device
        t0 = time.perf_counter()
        log(f"... building the model; compiling with PyTensor's "
            f"{'JAX' if device.mode == 'JAX' else 'default'} backend on {device.name} "
            f"(the first run compiles for a minute or so; later runs use the cache)")
        model = mlp.Model(data, args.batch_size, args.n_hidden, args.learning_rate, args.l1,
                          args.l2, args.seed, mode=device.mode)
        for p in model.params:
            place(p, device.put(storage(p)))

        layout = Layout([storage(p).shape for p in model.params], pytensor.config.floatX)
        transport = device.transport(rundir, rank, layout, args.staged)
        cleanup.callback(transport.close)
        peer_weights = pytensor.shared(np.zeros(layout.size, layout.dtype), name="peer")
        place(peer_weights, transport.recv)
        average = make_average(args.avg, model.params, peer_weights, layout, transport, device)
        warm_up(model, average, device)
        log(f"... compiled in {time.perf_counter() - t0:.1f} s")

        state = dict(epoch=0, best_validation_error=np.inf, test_error=np.inf,
                     validation_errors=[])
        best_params = [device.to_host(storage(p)).copy() for p in model.params]
        if args.resume:
            current, best_params, state = mlp.load_checkpoint(args.resume, layout.shapes)
            for p, value in zip(model.params, current):
                place(p, device.put(value))
            log(f"... resumed from {args.resume} at epoch {state['epoch']}")

        # The handshake: swap buffer handles once, and check that both
        # replicas start from the same weights.
        fault_point(rank, "start")
        peer = Peer(rundir, rank, args.timeout, stopping, device.spin)
        cleanup.callback(peer.close)
        start = float(sum(device.to_host(storage(p)).sum(dtype=np.float64)
                          for p in model.params))
        theirs = peer.exchange({"handle": transport.handle(), "start": start})
        if theirs["start"] != start:
            raise PeerError("the two replicas start from different weights")
        transport.connect(theirs["handle"])

        n_steps = model.n_train_batches // 2
        log(f"... training: {n_steps} steps per epoch on each worker, {args.batch_size} "
            f"examples per worker per step, devices {dev} and {peer_dev}, --avg {args.avg}, "
            f"weights through {transport.route}")
        clock = StepClock()
        max_diff, steps_run, start_time = 0.0, 0, time.perf_counter()
        for epoch in range(state["epoch"] + 1, args.epochs + 1):
            epoch_start = clock.total()
            for step in range(n_steps):
                if stopping.is_set():
                    raise Interrupted
                clock.start()
                fault_point(rank, "train")
                model.train_model(2 * step + rank)            # 1. my own minibatch
                values = [storage(p) for p in model.params]
                device.wait(values)
                clock.lap("train")
                transport.publish(values)                     # 2. into my send buffer
                clock.lap("publish")
                clock.lap("barrier", waited=peer.barrier())   # 3. both published
                fault_point(rank, "exchange")
                transport.fetch()                             # 4. the peer's, into recv
                clock.lap("copy")
                clock.lap("barrier", waited=peer.barrier())   # 5. both copied
                average()                                     # 6. (mine + peer's) / 2
                device.wait([storage(p) for p in model.params])
                clock.lap("average")
                if args.check:
                    max_diff = max(max_diff, replica_diff(model, transport, peer, layout, device))
            steps_run += n_steps
            epoch_time = clock.total() - epoch_start

            if rank == 0:
                this_validation_error = float(model.validate_model())
                state["validation_errors"].append(this_validation_error)
                if this_validation_error < state["best_validation_error"]:
                    state["best_validation_error"] = this_validation_error
                    state["test_error"] = float(model.test_model())
                    best_params = [device.to_host(storage(p)).copy() for p in model.params]
                state["epoch"] = epoch
                log(f"epoch {epoch}, minibatch {n_steps}/{n_steps}, validation error "
                    f"{this_validation_error * 100.:f} %   "
                    f"({2 * n_steps * args.batch_size / epoch_time:,.0f} samples/s)")
                if args.save:
                    mlp.save_checkpoint(args.save, [device.to_host(storage(p))
                                                    for p in model.params], best_params, **state)

        if rank != 0:
            return
        wall = time.perf_counter() - start_time
        step_us = {k: 1e6 * v / steps_run for k, v in clock.totals.items()}
        step_us["exchange"] = sum(step_us[k] for k in ("publish", "barrier", "waiting", "copy"))
        step_ms = {k: step_us[k] / 1000 for k in ("train", "exchange", "average")}
        samples_per_s = 2 * steps_run * args.batch_size / clock.total()
        log(f"Optimization complete. Best validation score of "
            f"{state['best_validation_error'] * 100.:f} % with test performance "
            f"{state['test_error'] * 100.:f} %")
        log(f"The code ran for {steps_run / n_steps / wall:.2f} epochs/s, "
            f"{samples_per_s:,.0f} samples/s (both workers)")
        log("mean time per step: train {train:.3f} ms, exchange {exchange:.3f} ms, "
            "average {average:.3f} ms".format(**step_ms))
        log("exchange = publish {publish:.0f} us + barriers {barrier:.0f} us + waiting for the "
            "peer {waiting:.0f} us + copy {copy:.0f} us".format(**step_us))
        if args.check:
            log(f"max difference between the replicas after an exchange: {max_diff:g}")
        if args.json:
            summary = dict(
                config={k: v for k, v in vars(args).items() if k != "worker"},
                command=args.command,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                host=platform.node(), devices=[dev, peer_dev], device_name=device.description,
                backend=type(pytensor.compile.mode.get_mode(device.mode).linker).__name__,
                transport=type(transport).__name__, floatX=pytensor.config.floatX,
                versions=dict(python=platform.python_version(), numpy=np.__version__,
                              pytensor=pytensor.__version__),
                validation_errors=state["validation_errors"],
                best_validation_error=state["best_validation_error"],
                test_error=state["test_error"], epochs_run=steps_run // n_steps,
                steps_per_epoch=n_steps, wall_time_s=wall, samples_per_s=samples_per_s,
                step_ms=step_ms, step_us=step_us, exchange_us_per_step=step_us["exchange"],
                average_us_per_step=step_us["average"])
            if args.check:
                summary["max_replica_diff"] = max_diff
            with datasets.atomic_write(args.json) as f:
                f.write(json.dumps(summary, indent=2).encode())


class StopRequest:
    """Set by SIGINT (Ctrl-C) or SIGTERM (the launcher stopping us, or Linux
    when the launcher dies).  The worker stops at the next step or while it
    waits for its peer, never inside a compiled call or a checkpoint write,
    and unwinds: buffers, IPC mappings and sockets are closed on the way out.
    A plain attribute, not a threading.Event: a signal handler must take no
    lock, or a second signal arriving inside it deadlocks the worker."""

    signum = 0

    def is_set(self):
        return self.signum != 0


stopping = StopRequest()


def request_stop(signum, frame):
    stopping.signum = signum


def run_worker(rank, rundir):
    launcher = os.getppid()
    die_with_parent()
    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        worker(rank, rundir)
    except Interrupted:
        sys.exit(128 + stopping.signum)
    except (PeerError, mlp.CheckpointError, datasets.DatasetError) as e:
        print(f"worker {rank}: error: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        # Told to stop, or orphaned: the launcher may be dying too, and the
        # files there are of no use to the peer any more (it has them open).
        if stopping.is_set() or os.getppid() != launcher:
            shutil.rmtree(rundir, ignore_errors=True)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return run_worker(int(args.worker[0]), args.worker[1])
    try:
        notices = check_request(args)
    except (UsageError, datasets.DatasetError, mlp.CheckpointError) as e:
        print(f"dual_mlp.py: error: {e}", file=sys.stderr)
        return 2
    for notice in notices:
        print(notice)
    args.command = shlex.join(["python", "dual_mlp.py"] + (sys.argv[1:] if argv is None else argv))
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
