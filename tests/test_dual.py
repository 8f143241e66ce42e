"""dual_mlp.py end to end on the CPU: two real worker processes, real zmq
sockets, the shipped MNIST digits."""
import json
import re

import numpy as np
import pytest

import mlp
from conftest import FASHION, SHAPES, dual, mlp_one_epoch, script
from logistic_sgd import load_data
from multi_gpu import datasets, records


def load(path):
    return records.load_checkpoint(str(path), SHAPES)


def test_two_workers_equal_one_process_with_twice_the_batch(tmp_path):
    """The averaging identity: after each exchange both replicas hold the
    weights one SGD step on the union of their two minibatches would give.
    Worker k trains on minibatch 2t + k of size B; one process with batch 2B
    trains on exactly those rows at step t."""
    B, lr = 50, 0.13
    out = dual("cpu", "cpu", "--batch-size", B, "--epochs", 2, "--learning-rate", lr,
               "--save", tmp_path / "dual.npz")
    assert out.returncode == 0, out.stderr
    out = script("mlp.py", "--batch-size", 2 * B, "--epochs", 2, "--learning-rate", lr,
                 "--save", tmp_path / "single.npz")
    assert out.returncode == 0, out.stderr
    (dual_params, _, dual_state), (single_params, _, _) = load(tmp_path / "dual.npz"), \
        load(tmp_path / "single.npz")
    assert dual_state["epoch"] == 2
    start = mlp.Model(load_data(datasets.SHIPPED), 2 * B, mode="FAST_COMPILE").get_params()
    for a, b, p0 in zip(dual_params, single_params, start):
        assert np.abs(b - p0).max() > 1e-3  # 60 steps moved them
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize("avg", ["theano", "shared", "cpu"])
def test_check_reports_identical_replicas(tmp_path, avg):
    out = dual("cpu", "cpu", "--avg", avg, "--epochs", 1, "--check", "--json",
               tmp_path / "run.json")
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "run.json").read_text())
    assert summary["max_replica_diff"] == 0.0
    assert summary["config"]["avg"] == avg
    assert "max difference between the replicas after an exchange: 0" in out.stdout


def test_default_run_on_the_shipped_digits_learns(tmp_path):
    out = dual("--epochs", 4, "--json", tmp_path / "run.json", "--save", tmp_path / "m.npz")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any("using the 5,000 shipped MNIST digits" in line for line in lines)
    assert any("batch size 100 per worker" in line for line in lines)
    assert any("running both workers on the CPU" in line for line in lines)
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in epochs] == [f"epoch {e}/4" for e in range(1, 5)]
    assert all("15 steps per worker (30 minibatches of 100), validation error" in line
               for line in epochs)
    assert "it can come out lower than validation" in out.stdout
    assert lines[-1].startswith("total wall time ")
    summary = json.loads((tmp_path / "run.json").read_text())
    errors = summary["validation_errors"]
    assert len(errors) == 4 and errors[-1] < errors[0]
    assert errors[-1] < 0.3 and summary["test_error"] < 0.3  # chance is 0.9
    for key in ("wall_time_s", "samples_per_s", "exchange_us_per_step"):
        assert summary[key] > 0
    assert summary["config"]["batch_size"] == 100 and "max_replica_diff" not in summary
    assert summary["exchange"] == "p2p" and summary["sync"] == "host"
    assert summary["config"]["avg"] == "shared"
    phases_add_up(summary["step_us"])
    assert any(line.startswith("Trained at ") and ": train " in line for line in lines)
    params, best, state = load(tmp_path / "m.npz")
    assert state["epoch"] == 4 and state["validation_errors"] == pytest.approx(errors)
    assert state["best_validation_error"] == min(errors)


@pytest.mark.skipif(not FASHION.exists(), reason="needs Debian's dataset-fashion-mnist")
def test_runs_on_fashion_mnist_idx_files(tmp_path):
    """It names the data set it read, and says that the digits' defaults do
    not fit it, and what does."""
    out = dual("cpu", "cpu", "--dataset", FASHION, "--batch-size", 2500, "--epochs", 1,
               "--json", tmp_path / "run.json")
    assert out.returncode == 0, out.stderr
    assert f"data: Fashion-MNIST from {FASHION}: 50,000 training, 10,000 validation, 10,000 " \
        "test images; the tutorial's defaults, for the digits, leave it near 25 % error: " \
        "README's accuracy table trains it with --batch-size 100 --learning-rate 0.1 --l2 0 " \
        "--epochs 120\n" in out.stdout, out.stdout
    summary = json.loads((tmp_path / "run.json").read_text())
    assert summary["steps_per_epoch"] == 10
    assert summary["validation_errors"][0] < 0.5


def test_theano_flags_are_honoured_and_gpu_flags_only_warned_about(tmp_path):
    out = dual("cpu", "cpu", "--epochs", 1, "--json", tmp_path / "run.json",
               env={"THEANO_FLAGS": "mode=FAST_COMPILE,floatX=float32,device=cuda0"})
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("'device=cuda0' is ignored: dual_mlp.py takes its devices") == 1
    summary = json.loads((tmp_path / "run.json").read_text())
    assert summary["backend"] == "VMLinker"  # FAST_COMPILE's, not the default JAX


def test_tutorial_scripts_run_alone():
    """logistic_sgd.py on its own, under the CPU's default (JAX); mlp.py's
    run, and both under Numba: test_cpu_workers_compile_with_jax_and_keep_it_numba_one_flag_away."""
    out = script("logistic_sgd.py", "--epochs", 2)
    assert out.returncode == 0, out.stderr
    assert "epoch 2, minibatch 30/30, validation error" in out.stdout
    assert "with PyTensor's JAX backend on cpu" in out.stdout  # the CPU's default


# five runs, three of them compiling Numba's ops (90 s of CPU cold): past the suite's 600 s
# beside another suite on two cores
@pytest.mark.timeout(1500)
def test_cpu_workers_compile_with_jax_and_keep_it_numba_one_flag_away(tmp_path):
    """The CPU's default backend is PyTensor's JAX, and the 2014 command's
    mode=FAST_RUN means the default: XLA's programs are kept in the user's
    PyTensor cache for the next run (the default's own first run, flags
    unset: the README's Quick start, test_readme.py).  THEANO_FLAGS=mode=NUMBA
    trains the same model to the same errors, up to float rounding.  Under
    Numba, mlp.py compiles the model's ops first, and leaves nothing in the
    temporary folder (the other scripts and backends:
    test_safety.py::test_a_run_leaves_nothing_in_the_temporary_folder); the
    workers then find most of them in Numba's cache (cold, each compiles them
    all: 50 s of CPU), and the tutorial's logistic regression is one flag
    away too, and learns."""
    private = tmp_path / "tmp"
    private.mkdir()
    out = script("mlp.py", "--epochs", 1, "--save", tmp_path / "numba.npz",
                 env={"THEANO_FLAGS": "mode=NUMBA", "TMPDIR": str(private)})
    assert out.returncode == 0, out.stderr
    assert "with PyTensor's Numba backend on cpu" in out.stdout
    assert sorted(p.name for p in private.iterdir()) == []
    # its first epoch is JAX's, to float32 rounding (measured: 1.5e-7): both start from the
    # same weights, the warm-up's step undone
    jax, printed = mlp_one_epoch()
    assert "epoch 1, minibatch 150/150, validation error" in printed.stdout  # mlp.py on its own
    assert "with PyTensor's JAX backend on cpu" in printed.stdout  # the CPU's default
    for a, b in zip(*(records.load_checkpoint(str(path), SHAPES)[0]
                      for path in (tmp_path / "numba.npz", jax / "m.npz"))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)
    home = tmp_path / "home"
    home.mkdir()
    runs = {}
    for name, env in (("fast_run", {"HOME": str(home), "THEANO_FLAGS": "mode=FAST_RUN"}),
                      ("numba", {"THEANO_FLAGS": "mode=NUMBA"})):
        out = dual("cpu", "cpu", "--epochs", 1, "--json", tmp_path / f"{name}.json", env=env)
        assert out.returncode == 0, out.stderr
        runs[name] = json.loads((tmp_path / f"{name}.json").read_text())
        runs[name]["stdout"] = out.stdout
    assert runs["fast_run"]["backend"] == "JAXLinker"
    assert runs["numba"]["backend"] == "NumbaLinker"
    for name, backend in (("fast_run", "JAX"), ("numba", "Numba")):
        assert f"... compiling the model with PyTensor's {backend} backend on cpu" in \
            runs[name]["stdout"]
    kept = home / ".pytensor" / "jax_cache"
    assert kept.is_dir() and len(list(kept.iterdir())) >= 4  # train, validate, test, average
    assert runs["fast_run"]["validation_errors"] == pytest.approx(
        runs["numba"]["validation_errors"], abs=0.003)
    out = script("logistic_sgd.py", "--epochs", 2, env={"THEANO_FLAGS": "mode=NUMBA"})
    assert out.returncode == 0, out.stderr
    assert "with PyTensor's Numba backend on cpu" in out.stdout
    errors = [float(e) for e in re.findall(r"epoch \d, minibatch 30/30, validation error "
                                           r"([\d.]+) %", out.stdout)]
    assert len(errors) == 2 and errors[1] < 25.0  # chance: 90 %


def phases_add_up(us):
    """The host-ordered loop's phases, each timed around its own call, are
    the step: what is left between them (the minibatch's index, the loop) is
    a small part of it."""
    phases = sum(us[k] for k in ("train", "publish", "signal", "waiting", "copy", "average"))
    assert 0.9 * us["step"] <= phases <= us["step"], us
    assert us["exchange"] == pytest.approx(us["publish"] + us["signal"] + us["copy"] +
                                           us["average"])


def test_a_cpu_runs_phases_add_up_to_its_step_under_the_compiled_average(tmp_path):
    """(Under the default --avg: the default run's test, above.)"""
    out = dual("cpu", "cpu", "--avg", "theano", "--epochs", 4, "--json", tmp_path / "run.json")
    assert out.returncode == 0, out.stderr
    phases_add_up(json.loads((tmp_path / "run.json").read_text())["step_us"])
