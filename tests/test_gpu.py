"""The GPU path, on real GPUs (run by bench/gpu_tests.py on the two-GPU
machine); skipped where no GPU is usable."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from conftest import (
    FASHION,
    ROOT,
    SHAPES,
    dual,
    finish,
    interrupted,
    kill_one_worker,
    script,
    start_checkpointing,
    start_dual,
    wait_until_training,
    workers_of,
)
from multi_gpu import records, trace
from multi_gpu.devices import usable_gpus
from multi_gpu.launcher import worker_environment

N_GPUS = usable_gpus()[0]
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(N_GPUS == 0, reason="no usable GPU (PyCUDA + JAX with CUDA)")]
PAIR = ["0", "1"] if N_GPUS >= 2 else ["0", "0"]
SHARED = ["0", "0"]  # both workers on one GPU: what a one-GPU machine can test
TWO_GPUS = pytest.mark.skipif(N_GPUS < 2, reason="needs two GPUs")
# the GPU-ordered exchange, on two GPUs where there are, time-sliced on one GPU anyway
ORDERED_PAIRS = [pytest.param(["0", "1"], marks=TWO_GPUS, id="two-gpus"),
                 pytest.param(SHARED, id="one-gpu")]


def run_json(tmp_path, name, *args, env=None):
    out = dual(*args, "--json", tmp_path / f"{name}.json", "--save", tmp_path / f"{name}.npz",
               env=env)
    assert out.returncode == 0, out.stderr
    return json.loads((tmp_path / f"{name}.json").read_text()), out


def assert_same_weights(tmp_path, run, other, rtol, atol):
    """The final weights of two ``run_json`` runs, equal within the tolerances."""
    for a, b in zip(records.load_checkpoint(str(tmp_path / f"{run}.npz"), SHAPES)[0],
                    records.load_checkpoint(str(tmp_path / f"{other}.npz"), SHAPES)[0]):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("devices,staged", [(PAIR, False), (SHARED, False), (PAIR, True),
                                            (["0", "0", "0"], False)])
def test_ipc_copy_is_exact_for_every_parameter_shape(devices, staged):
    with tempfile.TemporaryDirectory() as rundir:
        procs = [subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "ipc_probe.py"), str(rank), str(len(devices)),
             rundir, dev] + (["--staged"] if staged else []),
            env=dict(worker_environment(dev, len(devices)),  # the probe imports the package
                     PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
            for rank, dev in enumerate(devices)]
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            assert "exact" in out


@pytest.mark.parametrize("avg,on_cpus", [("theano", "theano"), ("pycuda", "shared"),
                                         ("cpu", "cpu")])
def test_replicas_identical_and_following_the_cpu_path(tmp_path, avg, on_cpus):
    """Each --avg on GPUs against the CPUs' average of the same kind (2014's
    in-place kernel, ``pycuda``, against the CPUs' in-place mean, ``shared``)."""
    args = ("--epochs", 2, "--check")
    gpu, _ = run_json(tmp_path, "gpu", *PAIR, "--sync", "host", "--avg", avg, *args)
    cpu, _ = run_json(tmp_path, "cpu", "cpu", "cpu", "--avg", on_cpus, *args)
    assert gpu["max_replica_diff"] == 0.0
    assert gpu["backend"] == "JAXLinker" and gpu["sync"] == "host"
    assert gpu["route"] == f"CUDA IPC, peer to peer, ordered by the host, --avg {avg}"
    np.testing.assert_allclose(gpu["validation_errors"], cpu["validation_errors"], atol=0.003)
    assert_same_weights(tmp_path, "gpu", "cpu", rtol=1e-3, atol=1e-4)


def test_two_workers_on_one_gpu_fall_back_to_the_host_ordered_loop(tmp_path):
    summary, out = run_json(tmp_path, "same", "0", "0", "--epochs", 2, "--check")
    assert summary["max_replica_diff"] == 0.0 and summary["devices"] == ["0", "0"]
    assert summary["sync"] == "host"
    assert "notice: the exchange is ordered by the host (--sync host): both workers share " \
           "one GPU" in out.stdout


def test_forced_fallback_through_host_gives_the_same_weights(tmp_path):
    staged, out = run_json(tmp_path, "staged", *PAIR, "--epochs", 2, "--check", "--staged")
    direct, _ = run_json(tmp_path, "direct", *PAIR, "--epochs", 2, "--sync", "host")
    assert staged["sync"] == "host" and staged["max_replica_diff"] == 0.0
    assert "weights through host memory (staged)" in out.stdout
    why = "--staged" if N_GPUS >= 2 else "both workers share one GPU"  # both hold on one GPU
    assert f"notice: the exchange is ordered by the host (--sync host): {why}" in out.stdout
    # the same numbers moved another way; XLA's GPU reductions are not bitwise
    # repeatable from run to run, so equal to float32 rounding, not to the bit
    assert_same_weights(tmp_path, "staged", "direct", rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not FASHION.exists(), reason="needs Fashion-MNIST (FASHION_MNIST=folder)")
def test_real_data_run_error_falls(tmp_path):
    summary, _ = run_json(tmp_path, "fashion", *PAIR, "--dataset", FASHION, "--epochs", 5)
    errors = summary["validation_errors"]
    assert errors[-1] < errors[0] - 0.02 and errors[-1] < 0.5  # chance: 0.9


def gpu_of_process():
    """{pid: set of GPU indices where nvidia-smi lists the process}."""
    index = dict(line.split(", ")[::-1] for line in subprocess.check_output(
        ["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
        text=True).splitlines())
    found = {}
    for line in subprocess.check_output(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id", "--format=csv,noheader"],
            text=True).splitlines():
        pid, bus = line.split(", ")
        found.setdefault(int(pid), set()).add(int(index[bus]))
    return found


@pytest.mark.skipif(N_GPUS < 2, reason="needs two GPUs")
def test_each_worker_holds_memory_on_its_own_gpu_only_and_a_kill_stops_the_run(no_leftovers):
    proc = start_dual("0", "1", "--epochs", 100000, "--batch-size", 100)
    wait_until_training(proc)
    time.sleep(1)
    seen = gpu_of_process()
    for rank, w in enumerate(workers_of(proc)):
        assert seen.get(w.pid) == {rank}, seen
    took = kill_one_worker(proc, 1, "1")
    print(f"launcher stopped {took:.2f} s after the GPU worker was killed")


def test_gpu_index_out_of_range_is_refused():
    out = dual("0", str(N_GPUS), timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == (f"dual_mlp.py: error: GPU {N_GPUS} does not exist: this "
                                  f"machine has {N_GPUS} (0..{N_GPUS - 1})")


def test_a_benchmark_batch_larger_than_the_data_is_refused(tmp_path):
    """``bench.step_cost`` on the shipped digits (3,000 training images) at its
    default batches (5000 among them): one line, exit 2, nothing written (a
    JAX IndexError traceback before)."""
    out = script("bench.step_cost", "--out", tmp_path, timeout=300)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--batches 5000: " in out.stderr and "holds 3,000 training images" in out.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["mlp.py", "logistic_sgd.py"])
def test_the_tutorial_scripts_run_on_the_gpu_theano_flags_names(name):
    """THEANO_FLAGS=device=cuda0: on GPU 0 through PyTensor's JAX backend, and
    a GPU that is not there is one line."""
    out = script(name, "--epochs", 2, env={"THEANO_FLAGS": "device=cuda0"}, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "PyTensor's JAX backend on gpu0" in out.stdout, out.stdout  # JAX's name for it
    out = script(name, "--epochs", 1, env={"THEANO_FLAGS": f"device=cuda{N_GPUS}"}, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"{name}: error: THEANO_FLAGS device=cuda{N_GPUS}: GPU {N_GPUS} does not exist: this "
        f"machine has {N_GPUS} (cuda0..cuda{N_GPUS - 1})"), out.stderr


def test_injected_failure_inside_an_exchange_on_gpus(no_leftovers):
    out = dual(*PAIR, "--epochs", 3, env={"DUAL_MLP_FAULT": "0:exchange:raise"}, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"error: worker 0 (device {PAIR[0]}) failed: RuntimeError: fault injected at exchange")


@pytest.mark.parametrize("devices", ORDERED_PAIRS)
def test_gpu_ordered_exchange_keeps_replicas_identical_and_follows_the_host_ordered_run(
        tmp_path, devices):
    """The same arithmetic in another order of launches: the tolerance is
    float32 reordering (XLA fuses the average into the next step), nothing more;
    one step per call and the default (15 steps an epoch: calls of 10 and 5)
    alike.  The exchange ran once a step: its counter equals the steps run."""
    host, _ = run_json(tmp_path, "host", *devices, "--epochs", 3, "--sync", "host")
    for k in ("1", None):
        gpu, out = run_json(tmp_path, "gpu", *devices, "--epochs", 3, "--check", "--sync", "gpu",
                            *(["--steps-per-call", k] if k else []))
        assert gpu["sync"] == "gpu" and "ordered by the GPUs" in out.stdout
        assert gpu["max_replica_diff"] == 0.0
        assert gpu["exchange_steps"] == gpu["epochs_run"] * gpu["steps_per_epoch"] == 45
        assert gpu["steps_per_call"] == (1 if k else 10)
        if devices == SHARED:
            assert "the GPU-ordered exchange runs there time-sliced" in out.stdout
        np.testing.assert_allclose(gpu["validation_errors"], host["validation_errors"],
                                   atol=0.003)
        assert_same_weights(tmp_path, "gpu", "host", rtol=1e-3, atol=1e-5)
        print(f"exchange callbacks run: {gpu['exchange_callbacks']} in "
              f"{gpu['epochs_run'] * gpu['steps_per_epoch']} steps, {gpu['steps_per_call']} "
              f"a call; host {gpu['host_us_per_step']:.0f} us a step")


@pytest.mark.parametrize("devices", ORDERED_PAIRS)
def test_local_sgd_on_gpus_follows_the_host_ordered_run_and_the_cpu_path(tmp_path, devices):
    """--average-every 4 (15 steps an epoch: averages after 4, 8, 12 and 15),
    GPU-ordered at 12 steps a call (10 rounded up to a multiple of 4, the 3
    left at the epoch's end a round of its own): replicas identical after
    every average, the kernel run once an average, and the host-ordered run's
    and the CPU's curve and weights."""
    every = ("--epochs", 3, "--average-every", 4)
    host, _ = run_json(tmp_path, "host", *devices, *every, "--sync", "host")
    cpu, _ = run_json(tmp_path, "cpu", "cpu", "cpu", *every)
    gpu, out = run_json(tmp_path, "gpu", *devices, *every, "--check", "--sync", "gpu")
    assert gpu["max_replica_diff"] == 0.0 and gpu["steps_per_call"] == 12
    assert gpu["averages"] == host["averages"] == cpu["averages"] == 3 * 4
    assert gpu["exchange_steps"] == gpu["averages"]
    assert "The replicas averaged 12 times" in out.stdout
    for other in ("host", "cpu"):
        np.testing.assert_allclose(gpu["validation_errors"],
                                   (host if other == "host" else cpu)["validation_errors"],
                                   atol=0.003)
        assert_same_weights(tmp_path, "gpu", other, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("sync", ["gpu", "host"])
def test_three_workers_on_one_gpu_follow_the_cpu_path(tmp_path, sync):
    """The N-way exchange with three workers time-sliced on one GPU, ordered
    by the GPU (one kernel a step) or by the host (zmq barriers), against
    three CPU workers: identical replicas, the CPU path's curve and weights."""
    gpu, out = run_json(tmp_path, "gpu", "0", "0", "0", "--sync", sync, "--epochs", 2, "--check")
    cpu, _ = run_json(tmp_path, "cpu", "cpu", "cpu", "cpu", "--exchange", "p2p", "--epochs", 2)
    assert gpu["workers"] == 3 and gpu["exchange"] == "p2p" and gpu["sync"] == sync
    assert gpu["max_replica_diff"] == 0.0
    if sync == "gpu":
        assert gpu["exchange_steps"] == gpu["epochs_run"] * gpu["steps_per_epoch"] == 20
        assert "3 workers on GPU 0: the GPU-ordered exchange runs there time-sliced" in out.stdout
    np.testing.assert_allclose(gpu["validation_errors"], cpu["validation_errors"], atol=0.003)
    assert_same_weights(tmp_path, "gpu", "cpu", rtol=1e-3, atol=1e-4)


def test_the_exchange_bench_checks_the_n_way_kernel_on_one_gpu(tmp_path):
    """bench.exchange --allreduce: a world of one (its own cost), and three
    workers time-sliced on GPU 0, every result checked against the host's mean."""
    for gpus in (["0"], ["0", "0", "0"]):
        out = subprocess.run([sys.executable, "-m", "bench.exchange", "--allreduce",
                              *gpus, "--max-mb", "4", "--out", str(tmp_path)], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        result = json.loads((tmp_path / "exchange_allreduce.json").read_text())
        assert result["workers"] == len(gpus) and result["timed"] == (len(gpus) == 1)
        assert all(r["stream_exchange_checked"] for r in result["rows"])
        assert all(r.get("nccl_checked", True) for r in result["rows"])
        timed = [key in r for r in result["rows"] for key in ("stream_exchange_graph_us",
                                                              "nccl_graph_us")]
        assert all(timed) if result["timed"] else not any(timed)
        print(out.stdout.strip().splitlines()[-3:])


@pytest.mark.skipif(not FASHION.exists(), reason="needs Fashion-MNIST (FASHION_MNIST=folder)")
@pytest.mark.parametrize("system", ["torch-graph", "ddp-graph"])
def test_a_cuda_graph_reference_learns_as_eager_pytorch_does(system):
    """The references at their best train the same model: the CUDA-graph step's
    curve is eager PyTorch's (it once read freed memory for its minibatch
    rows once the first validation had taken it, and fell behind)."""
    def curve(name):
        out = subprocess.run([sys.executable, "-m", "bench.references", name,
                              "--curve", "--dataset", str(FASHION), "--batches", "100",
                              "--epochs", "3"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])["curve"]
    eager, graph = curve("torch"), curve(system)
    for a, b in zip(eager, graph, strict=True):
        assert abs(a["validation_error"] - b["validation_error"]) <= 0.002, (eager, graph)


@pytest.mark.skipif(N_GPUS < 2, reason="needs two GPUs")
def test_xla_exchange_on_two_gpus_keeps_replicas_identical(tmp_path):
    xla, out = run_json(tmp_path, "xla", "0", "1", "--exchange", "xla", "--epochs", 3, "--check")
    host, _ = run_json(tmp_path, "host", "0", "1", "--epochs", 3, "--sync", "host")
    assert xla["max_replica_diff"] == 0.0 and "XLA all-reduce" in out.stdout
    np.testing.assert_allclose(xla["validation_errors"], host["validation_errors"], atol=0.003)


@pytest.mark.parametrize("sync,devices", [
    pytest.param("gpu", ["0", "1"], marks=TWO_GPUS, id="gpu-two-gpus"),
    pytest.param("xla", ["0", "1"], marks=TWO_GPUS, id="xla-two-gpus"),
    pytest.param("gpu", SHARED, id="gpu-one-gpu"),
    pytest.param("gpu", ["0", "0", "0"], id="gpu-three-on-one-gpu")])
def test_gpu_ordered_run_killed_or_stalled_or_interrupted_stops(tmp_path, no_leftovers, sync,
                                                                devices):
    """The survivor's GPU may wait for ever on a peer that is gone: its host must not."""
    args = ["--exchange", "xla"] if sync == "xla" else ["--sync", "gpu"]
    proc = start_dual(*devices, *args, "--epochs", 100000, "--batch-size", 100, "--timeout", 3)
    wait_until_training(proc)
    took = kill_one_worker(proc, 1, devices[1])
    print(f"{sync}: launcher stopped {took:.2f} s after a worker was killed")

    proc = start_dual(*devices, *args, "--epochs", 100000, "--batch-size", 100, "--timeout", 3)
    wait_until_training(proc)
    workers_of(proc)[1].send_signal(signal.SIGSTOP)
    code, took, err = finish(proc, timeout=30)
    assert code == 1, err
    assert "no step finished within 3 s: worker 1 stopped running" in err
    print(f"{sync}: a stalled worker reported after {took:.2f} s: {err.splitlines()[-1]}")

    ckpt = tmp_path / "m.npz"
    proc = start_checkpointing(ckpt, *devices, *args, "--epochs", 100000, "--batch-size", 100)
    os.killpg(proc.pid, signal.SIGINT)
    code, took, err = finish(proc, timeout=10)
    assert code == 130
    interrupted(err, "SIGINT", ckpt)
    assert records.load_checkpoint(str(ckpt), SHAPES, records.TRAINING_STATE)[2]["epoch"] >= 1


EXCHANGE_PHASES = ["publish", "signal", "copy + average"]  # the kernel's, as it stamps them


@pytest.mark.parametrize("sync", ["host", "gpu"])
def test_a_gpu_run_traces_its_phases(tmp_path, sync):
    """--trace on a GPU (time-sliced on one where there is one): host-ordered,
    every phase of every traced step in order; GPU-ordered, the kernel's own
    stamps on the device's track, every phase of every step in order, no
    worker's GPU leaving the signal before every worker's arrived (on the
    host's clock, to within the clocks' stated error), and the host's track
    queueing a call before the device is done with the one before."""
    from test_trace import HOST_PHASES, spans
    devices = ["0", "0"] if sync == "gpu" else PAIR
    extra = ["--sync", "gpu"] if sync == "gpu" else ["--sync", "host"]
    out = dual(*devices, *extra, "--epochs", 3, "--batch-size", 100, "--trace",
               tmp_path / "t.json", "--trace-steps", 20)  # 15 steps an epoch
    assert out.returncode == 0, out.stderr
    document = json.loads((tmp_path / "t.json").read_text())
    assert (tmp_path / "t.png").stat().st_size > 10000
    barriers = {}  # step -> [(arrived, left)] of every worker's GPU
    for worker, events in spans(document).items():
        if sync == "host":
            for step in {e["args"]["step"] for e in events}:
                assert [e["name"] for e in events if e["args"]["step"] == step and not
                        e["name"] == trace.WAITING
                        and e["name"] != "validate"] == HOST_PHASES
            continue
        device = [e for e in events if e["tid"] == 1]
        assert len({e["args"]["step"] for e in device}) == 20, worker
        for step in sorted({e["args"]["step"] for e in device}):
            phases = [e for e in device if e["args"]["step"] == step]
            names = [e["name"] for e in phases if e["name"] != trace.WAITING]
            assert names in (EXCHANGE_PHASES, ["train"] + EXCHANGE_PHASES), (worker, step, names)
            named = {e["name"]: e for e in phases}
            barriers.setdefault(step, []).append(
                (named["signal"]["ts"], named["copy + average"]["ts"]))
        for a, b in zip(device, device[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (worker, a, b)
        ends = {}
        for e in device:
            ends[e["args"]["call"]] = max(ends.get(e["args"]["call"], 0), e["ts"] + e["dur"])
        queued = [e for e in events if e["name"] == "queue" and e["args"]["call"] - 1 in ends]
        assert any(q["ts"] < ends[q["args"]["call"] - 1] for q in queued), worker
    if sync == "gpu":
        about = document["otherData"]["workers"]
        assert all(a["stamps_lost"] == 0 for a in about.values()), about
        error = sum(a["device_clock_error_us"] for a in about.values())
        assert error < 50, about
        for step, visits in barriers.items():
            assert len(visits) == 2
            assert max(a for a, _ in visits) <= min(left for _, left in visits) + error, \
                (step, visits, error)
        print(f"GPU clocks: {[a['device_clock'] for a in about.values()]}")
