"""The benchmark script itself, on its CPU subset: real runs, real figures."""
import json
import time

import pytest

from conftest import head_of, made_once, script, unchanged
from multi_gpu.datasets import SHIPPED


def bench_module(name):
    """bench/<name>.py, imported by its name."""
    import importlib
    return importlib.import_module(f"bench.{name}")


def test_compare_cpu_puts_the_demo_beside_the_references_and_the_floor(clone):
    """At one batch (bench/README's command in a fresh clone, cut to its
    smallest): every system a CPU user would pick, each measured or saying
    why not (PyTorch is not among the test requirements), the floor, and the
    demo's exchange set against it, in the table too; into out/, which git
    ignores."""
    out = script("bench.compare", "--cpu", "--batches", 100, "--steps", 12, tree=clone)
    assert out.returncode == 0, out.stderr
    made = clone / "out"
    result = json.loads((made / "compare_cpu.json").read_text())
    assert result["complete"] is True and result["command"] == (
        "python -m bench.compare --cpu --batches 100 --steps 12")  # as typed, in the clone
    assert result["commit"] == head_of(clone)
    assert result["cores"] and len(result["load"]) == 3
    systems = {f["system"]: f for f in result["figures"]}
    demos = {"one process (mlp.py), twice the batch", "demo cpu cpu",
             "demo cpu cpu --average-every 4", "demo cpu cpu --exchange xla"}
    assert demos <= set(systems)
    for name in demos:
        f = systems[name]
        assert f["samples_per_s"] > 0 and f["steps"] >= 12 and f["batch"] == 100
        assert 0 < f["validation_error"] < 0.9  # it trained: chance is 0.9
    refs = ("PyTorch, one process on every core, twice the batch",
            "PyTorch DDP over gloo, two processes", "JAX jit over two CPU devices, one process")
    for name in refs:  # measured, or said why not
        assert name in systems or f"{name} @ 100" in result.get("not_run", {}), name
    floor, demo = result["floor"], systems["demo cpu cpu"]
    assert floor["us"] == floor["copy_us"] + floor["average_us"] > 0
    assert 0 < demo["exchange_us"] < demo["step_us"] and demo["train_us"] > 0
    assert f"the floor and {demo['exchange_us'] / demo['train_us']:.2f}x its train phase" \
        in out.stdout
    assert (made / "compare_cpu.png").stat().st_size > 10000
    assert "| demo cpu cpu | 2 |" in out.stdout
    assert unchanged(clone)


def test_the_training_set_is_tiled_for_enough_steps_per_epoch_at_every_batch(tmp_path):
    """The demo drains its queue at every epoch's validation; the references
    never do.  Each batch size gets a tiling with at least the steps asked
    for per epoch, written once however often it is asked for."""
    from multi_gpu import datasets
    compare = bench_module("compare")
    tiles = compare.Tiles(SHIPPED, str(tmp_path), 4)
    n = len(datasets.read(SHIPPED)[0][0])
    for global_batch in (n // 6, n // 2, n // 2 + 100, n):
        path, n_train = tiles(global_batch)
        assert n_train // global_batch >= 4
        assert len(datasets.read(path)[0][0]) == n_train
    assert tiles(n // 6)[1] == n and tiles(n // 2 - 100) == tiles(n // 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x1", "x2", "x3", "x4"]
    # a batch that would need more copies than memory allows gets the most allowed
    capped = compare.Tiles(SHIPPED, str(tmp_path / "x4"), 4, max_repeat=3)
    assert capped(n)[1] == 3 * n


def test_compare_stops_at_a_missing_data_set_before_it_runs_anything(tmp_path):
    out = script("bench.compare", "--cpu", "--out", tmp_path, "--dataset", tmp_path / "none")
    assert out.returncode == 2 and "$ " not in out.stdout
    assert out.stderr.strip().splitlines() == [
        f"python -m bench.compare: error: dataset not found: {tmp_path / 'none'} (python -m "
        "multi_gpu.datasets download fetches MNIST into ./mnist.pkl.gz; leave --dataset out for "
        "the 5,000 shipped digits) (see --help)"]
    assert not (tmp_path / "compare_cpu.json").exists()


def test_compare_refuses_to_measure_beside_another_process_on_the_gpus(tmp_path):
    """A test run left training on the GPUs once made every reference several
    times slower; the benchmark must stop instead of recording that."""
    import os
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho '4242, python, 1200 MiB'\n")
    fake.chmod(0o755)
    out = script("bench.compare", "--cpu", "--out", tmp_path,
                 env={"PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"})
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "python -m bench.compare: error: the GPUs are busy (pid, name, memory: 4242, python, "
        "1200 MiB): stop those processes first; figures measured beside them would be wrong"]
    assert not (tmp_path / "compare_cpu.json").exists()


def test_exchange_bench_refuses_a_rate_past_the_link_and_wrong_data():
    import pytest
    bench = bench_module("exchange")
    good = dict(bytes=1 << 20, gbps=300.0, data_checked=True)
    bench.refuse([good], 450.0, "two processes")  # a possible figure passes
    with pytest.raises(SystemExit, match="1,048,576 bytes is past the link's 450 GB/s: a timing"):
        bench.refuse([good, dict(good, gbps=1600.0)], 450.0, "two processes")
    with pytest.raises(SystemExit, match="the copied data is wrong at 1,048,576 bytes"):
        bench.refuse([dict(good, data_checked=False)], 450.0, "one process")


def test_exchange_bench_sizes_span_4_kb_to_the_maximum_and_the_mlp():
    bench = bench_module("exchange")
    sizes = bench.sizes(256)
    assert sizes[0] == 4096 and sizes[-1] == 256 << 20 and bench.MLP_BYTES in sizes
    assert bench.MLP_BYTES == 397510 * 4
    assert all(bench.repeats(s) >= 10 for s in sizes)


def test_exchange_bench_help_and_bad_values():
    out = script("bench.exchange", "--help")
    assert out.returncode == 0 and "--link-gbps" in out.stdout
    out = script("bench.exchange", "--max-mb", "3")
    assert out.returncode == 2 and "power of two" in out.stderr


def test_accuracy_cpu_subset_records_curves_and_when_each_system_reached_the_target(clone):
    out = script("bench.accuracy", "--cpu", "--epochs", 4, "--target", 0.85, "--average-every", 1,
                 4, tree=clone)
    assert out.returncode == 0, out.stderr
    assert unchanged(clone)
    made = clone / "out"
    result = json.loads((made / "accuracy_cpu.json").read_text())
    assert result["complete"] is True and result["target"] == 0.85
    demo, one, local = result["systems"]
    assert local["system"] == "demo cpu cpu --average-every 4" and local["average_every"] == 4
    assert local["averages"] == 4 * 4 and demo["averages"] == 4 * 15  # 15 steps an epoch
    assert [p["epoch"] for p in local["curve"]] == [1, 2, 3, 4]
    for s in (demo, one):
        assert [p["epoch"] for p in s["curve"]] == [1, 2, 3, 4]
        times = [p["train_s"] for p in s["curve"]]
        assert times == sorted(times) and times[0] > 0
        # reached at the first epoch whose best-validation test accuracy is >= 85 %
        first = next(p for p in s["curve"] if p["test_error"] <= 0.15)
        assert s["reached"]["epoch"] == first["epoch"]
        assert s["reached"]["train_s"] == first["train_s"]
    # the same minibatches of 200 in the same order: two workers follow one process
    for a, b in zip(demo["curve"], one["curve"]):
        assert abs(a["validation_error"] - b["validation_error"]) <= 0.003
    assert (made / "accuracy_cpu.png").stat().st_size > 10000


@pytest.fixture(scope="module")
def mlp_curve():
    """mlp.py's learning curve at batch 100, two epochs, once for the references
    (``made_once``)."""
    def make(folder):
        out = script("mlp.py", "--batch-size", 100, "--epochs", 2, "--learning-rate", 0.1,
                     "--l2", 0, "--json", folder / "m.json")
        assert out.returncode == 0, out.stderr
        return json.loads((folder / "m.json").read_text())["curve"]
    return made_once("mlp_curve", make)[1]


@pytest.mark.parametrize("system,k", [("jax", 1), ("jax", 4), ("pytensor", 4)])
def test_jax_reference_trains_the_tutorial_model_like_mlp_py(system, k, mlp_curve, tmp_path):
    """The reference's learning curve is mlp.py's: same weights, minibatches and
    order, one step or K steps a call (30 steps an epoch: calls of 4 and 2);
    it leaves nothing in the temporary folder (PyTensor's compiled sources
    neither)."""
    out = script("bench.references", system, "--curve", "--dataset", SHIPPED, "--batches", 100,
                 "--epochs", 2, "--learning-rate", 0.1, "--l2", 0, "--steps-per-call", k,
                 env={"TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert list(tmp_path.iterdir()) == []
    reference = json.loads(out.stdout.strip().splitlines()[-1])["curve"]
    assert len(reference) == len(mlp_curve) == 2  # a point an epoch
    for a, b in zip(reference, mlp_curve):
        assert abs(a["validation_error"] - b["validation_error"]) <= 0.002
        assert abs(a["test_error"] - b["test_error"]) <= 0.002


def test_an_optional_reference_that_fails_is_reported_not_fatal(capsys):
    import sys

    import pytest
    compare = bench_module("compare")
    with pytest.raises(compare.Failed, match="^no compiler here$"):
        compare.run([sys.executable, "-c", "import sys; sys.exit('no compiler here')"],
                    optional=True)
    with pytest.raises(SystemExit, match="failed \\(exit 1\\)"):
        compare.run([sys.executable, "-c", "import sys; sys.exit('boom')"])
    document = dict(command="python bench/compare.py", date="2026-11-30", device="x",
                    figures=[dict(system="demo", batch=500, gpus=2, samples_per_s=1e6,
                                  step_us=100.0)],
                    not_run={"PyTorch torch.compile, one GPU": "no compiler here"})
    assert "PyTorch torch.compile, one GPU: did not run here (no compiler here)" in \
        compare.table(document)


def test_scaling_cpu_measures_each_worker_count_with_identical_replicas(clone):
    # two counts show the mechanics (three workers' identical replicas: test_xla's tests)
    out = script("bench.scaling", "--cpu", "--workers", 1, 2, tree=clone)
    assert out.returncode == 0, out.stderr
    assert unchanged(clone)
    made = clone / "out"
    result = json.loads((made / "scaling_cpu.json").read_text())
    assert result["workers"] == [1, 2]
    assert result["max_replica_diff"] == {"2": 0.0}
    seen = {(f["system"], f["workers"]): f for f in result["figures"]}
    for n in (1, 2):
        for system in ("the demo (mlp.py on one, --exchange xla on more)",
                       "JAX jit over a mesh of the same devices"):
            f = seen[system, n]
            assert f["samples_per_s"] > 0
            assert f["efficiency"] == (1.0 if n == 1 else
                                       f["samples_per_s"] / (n * seen[system, 1]["samples_per_s"]))
    assert ("the demo, peer to peer", 2) in seen
    assert (made / "scaling_cpu.png").stat().st_size > 10000
    # the table: one row per system, a column per worker count, peer to peer from 2 on
    assert "| system | batch per worker | 1 worker | 2 workers |" in out.stdout
    two = seen["the demo, peer to peer", 2]
    assert (f"| the demo, peer to peer | 100 |  | {two['samples_per_s'] / 1e3:.1f} k "
            f"({two['efficiency']:.2f}) |") in out.stdout


def test_step_profile_cpu_times_both_steps_and_names_their_kernels(clone):
    out = script("bench.step_profile", "--cpu", tree=clone)
    assert out.returncode == 0, out.stderr
    assert unchanged(clone)
    made = clone / "out"
    result = json.loads((made / "step_profile_cpu.json").read_text())
    assert result["command"].startswith("python -m bench.step_profile") and result["batch"] == 500
    assert set(result["systems"]) == {"PyTensor's step (the demo's)", "hand-written JAX step"}
    for system in result["systems"].values():
        assert system["step_us"] > 0
        # the step's matrix products are among its kernels, the costliest first
        assert any("dot" in k["kernel"] or "fusion" in k["kernel"] for k in system["kernels"])
        times = [k["us_per_step"] for k in system["kernels"]]
        assert times == sorted(times, reverse=True) and times[-1] > 0


def test_step_cost_cpu_times_the_plain_written_out_and_both_ordered_steps_and_counts_exchanges(
        clone):
    """On the CPU the GPU-ordered exchange is a host echo (no kernels), and
    ``--exchange xla`` runs in a world of one over gloo: the script's runs of
    dual_mlp.GpuOrdered and XlaOrdered, their figures and the once-a-step
    counts are what is tested, at one K that holds the local SGD's interval
    of 4 (the CPU's defaults are 1, 10 and 12: the same code at other K)."""
    k = 4
    started = time.monotonic()
    out = script("bench.step_cost", "--cpu", "--steps-per-call", k, "--rounds", 3, tree=clone)
    took = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    assert unchanged(clone)
    made = clone / "out"
    result = json.loads((made / "step_cost_cpu.json").read_text())
    assert result["command"].startswith("python -m bench.step_cost") and result["target"] == 1.15
    assert took / 2 < result["wall_s"] < took  # what its command costs, start-up and all
    seen = {(f["system"], f["steps_per_call"]): f for f in result["figures"]}
    ordered_systems = ("GPU-ordered step, loopback", "--exchange xla, a world of one")
    local = "GPU-ordered step, --average-every 4"  # at the K that are multiples of 4 only
    assert set(seen) == {(s, k) for s in ("plain step", "plain step, written out", local,
                                          *ordered_systems)}
    plain = seen["plain step", k]
    for ordered in ordered_systems:
        assert seen[ordered, k]["exchange_steps"] == seen[ordered, k]["steps_run"] >= 40
    for other in (*(seen[s, k] for s in ordered_systems), seen["plain step, written out", k]):
        assert other["over_plain"] == other["step_us"] / plain["step_us"]
    assert plain["step_us"] > 0 and plain["host_us_per_step"] > 0
    f = seen[local, k]  # the exchange once every four steps
    assert f["exchange_steps"] == f["averages_run"] == f["steps_run"] // 4 and f["steps_run"] >= 40
    for f in result["figures"]:  # each figure the median of its rounds, the systems in turn
        assert len(f["step_us_rounds"]) == result["rounds"] == 3
        assert f["step_us"] == sorted(f["step_us_rounds"])[1]
    assert f"| 100 | {k} |" in out.stdout


@pytest.mark.parametrize("name, args", [
    ("gpu_tests", []), ("trace_cost", ["--devices", 0, 0]), ("compare", []), ("exchange", []),
    ("host_time", ["--dataset", SHIPPED]), ("step_profile", [])])
def test_a_gpu_benchmark_without_a_gpu_is_one_line_and_writes_nothing(tmp_path, name, args):
    import shutil
    if shutil.which("nvidia-smi"):
        pytest.skip(f"a GPU machine: bench.{name} runs there")
    out = script(f"bench.{name}", *args, "--out", tmp_path / "results", timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"python -m bench.{name}: error: no GPU here (nvidia-smi lists none): nothing was "
        "measured and no result was written; on a CPU, the benchmarks that have one take --cpu"]
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("name,hidden,install", [
    ("lobby", "psutil", "pip install -r requirements-test.txt"),
    ("elastic", "torch", "pip install torch --index-url https://download.pytorch.org/whl/cpu "
                         "(its CPU build)"),
])
def test_a_benchmark_without_what_it_needs_says_how_to_install_it_in_one_line(name, hidden,
                                                                              install, tmp_path):
    """bench.lobby after requirements.txt alone, bench.elastic without
    PyTorch (each hidden here): one line naming what to install, exit 2, no
    traceback, nothing written (the --out folder is made, empty, as the
    arguments are checked: a run must not find it unwritable at its end)."""
    import subprocess
    import sys

    from bench.testhosts import why_no_test_hosts
    from conftest import ROOT, environment
    if name == "elastic" and why_no_test_hosts():
        pytest.skip(f"bench.elastic says first: {why_no_test_hosts()}")
    out = subprocess.run([sys.executable, "-c", f"import sys, runpy; sys.modules['{hidden}'] = "
                          f"None; runpy.run_module('bench.{name}', run_name='__main__', "
                          "alter_sys=True)", "--out", tmp_path / "out"], cwd=ROOT,
                         env=environment(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"python -m bench.{name}: error: it needs {hidden}, which is not installed: {install}"], \
        out.stderr
    assert not [path for path in tmp_path.rglob("*") if path.is_file()]


def test_trace_cost_cpu_times_the_same_run_with_and_without_the_trace(clone):
    """bench/README's command, cheap: two epochs (the first is not counted),
    one round; into out/, which git ignores."""
    out = script("bench.trace_cost", "--epochs", 2, "--rounds", 1, tree=clone)
    assert out.returncode == 0, out.stderr
    assert unchanged(clone)
    result = json.loads((clone / "out" / "trace_cost_cpu.json").read_text())
    (figure,) = result["figures"]
    assert figure["ordering"] == "--sync host" and figure["rounds_us"]["traced"]
    assert figure["ratio"] == figure["traced_us"] / figure["untraced_us"] > 0
    assert "| --sync host |" in out.stdout


def test_first_run_times_the_quick_start_cold_and_warm(clone):
    """bench/README's command, cheap: JAX alone (Numba's first compile takes
    tens of seconds), one run of each kind, each cold one in an empty HOME."""
    out = script("bench.first_run", "--backends", "jax", "--cold-runs", 1, "--warm-runs", 1,
                 "--speed-runs", 1, "--speed-epochs", 2, tree=clone)
    assert out.returncode == 0, out.stderr
    assert unchanged(clone)
    (figure,) = json.loads((clone / "out" / "first_run_cpu.json").read_text())["figures"]
    assert figure["backend"] == "JAX (the default)" and figure["linker"] == "JAXLinker"
    assert figure["cold_wall_s"] > figure["cold_compile_s"] > 0 and figure["step_us"] > 0
    assert figure["speed_vs_numba"] is None and "(Numba not run) |" in out.stdout
