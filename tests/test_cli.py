"""As a new user meets the scripts: bad paths, bad flags, bad numbers,
signals at any moment, closed pipes, full disks.  Nothing ends in a
traceback, nothing of a finished run is lost."""
import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import mlp
from conftest import (
    LAUNCHERS,
    PACED,
    ROOT,
    SHAPES,
    STOPS_WITHIN,
    dual,
    environment,
    finish,
    interrupted,
    mlp_one_epoch,
    refused,
    script,
    start_checkpointing,
    wait_for,
)
from multi_gpu import cli, records


@contextlib.contextmanager
def mounted_tmpfs(path, options):
    """A real tmpfs at ``path`` (root only): read-only, or tiny to fill it."""
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs",
                                            str(path)], capture_output=True).returncode:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)])


@pytest.fixture
def read_only(tmp_path):
    """A folder no file can be created in: a read-only mount where we are
    root (permission bits do not stop root), else a folder without write bits."""
    folder = tmp_path / "ro"
    with mounted_tmpfs(folder, "ro,size=1m") as mounted:
        if not mounted:
            folder.chmod(0o555)
        yield folder


def one_line_error(out, *words):
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for w in words:
        assert w in lines[0], out.stderr


def test_output_paths_are_checked_before_any_training(tmp_path, read_only, no_leftovers,
                                                      capsys):
    """dual_mlp.py's first request as typed, its others by its main()."""
    one_line_error(dual("cpu", "cpu", "--json", tmp_path), "argument --json:", "is a folder")
    one_line_error(refused(capsys, "cpu", "cpu", "--save", tmp_path), "argument --save:",
                   "is a folder")
    for option in ("--json", "--save"):
        one_line_error(refused(capsys, "cpu", "cpu", option, read_only / "x"),
                       f"cannot write into {read_only}")
        one_line_error(refused(capsys, "cpu", "cpu", option, tmp_path / "none" / "x"),
                       "does not exist")
    one_line_error(script("mlp.py", "--epochs", 1, "--save", "/nonexistent/dir/m.npz"),
                   "argument --save:", "folder /nonexistent/dir does not exist")
    one_line_error(refused(capsys, "--json", read_only / "m.json", name="mlp.py"),
                   "cannot write into")


def fill(folder):
    """Write into ``folder`` until its file system is full."""
    with contextlib.suppress(OSError), open(folder / "filler", "wb") as f:
        while True:
            f.write(b"x" * 4096)
            f.flush()


def test_a_full_disk_keeps_the_previous_checkpoint_and_prints_the_summary(tmp_path):
    """The checks before training pass (an empty file fits); the writes later
    do not: the previous checkpoint is kept, the summary printed, and the run,
    whose checkpoint is not of its last epoch, ends exit 1 saying which
    epoch the file holds (it ended exit 0)."""
    disk = tmp_path / "small"
    with mounted_tmpfs(disk, "size=96k") as mounted:
        if not mounted:
            pytest.skip("needs root, to mount a small tmpfs")
        # --n-hidden 10: a 64 kB checkpoint; a second one does not fit beside the first
        out = dual("cpu", "cpu", "--n-hidden", 10, "--epochs", 3, "--save", disk / "m.npz")
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.count("could not write") == 2 and "Optimization complete" in out.stdout
        assert f"{disk / 'm.npz'} holds epoch 1, not epoch 3, the last one trained (see the " \
            "warnings above)" in out.stderr.strip().splitlines()[-1], out.stderr
        assert "(No space left on device): the previous one is kept" in out.stderr
        _, _, state = records.load_checkpoint(str(disk / "m.npz"),
                                              mlp.parameter_shapes(784, 10, 10),
                                              records.TRAINING_STATE)
        assert state["epoch"] == 1  # the first, intact
        fill(disk)  # full now: found before anything trains
        out = dual("cpu", "cpu", "--epochs", 1, "--json", disk / "run.json")
        one_line_error(out, f"cannot write {disk / 'run.json'}: no space left on device")
        assert not [p for p in disk.iterdir() if p.name.endswith((".tmp", ".lock"))]


def test_resume_refuses_a_file_of_another_script_naming_what_is_missing(tmp_path, capsys):
    """The first request by the script, as typed; the others by its main()."""
    shutil.copyfile(mlp_one_epoch()[0] / "m.npz", tmp_path / "final.npz")
    one_line_error(dual("cpu", "cpu", "--resume", tmp_path / "final.npz"),
                   "not a dual_mlp.py checkpoint", "validation_errors", "mlp.py --save")
    params = [np.zeros(s, np.float32) for s in SHAPES]
    records.save_checkpoint(str(tmp_path / "odd.npz"), params, params[:3], epoch=1,
                        best_validation_error=0.1, test_error=0.1, validation_errors=[0.1])
    one_line_error(refused(capsys, "cpu", "cpu", "--resume", tmp_path / "odd.npz"), "no best_3")
    records.save_checkpoint(str(tmp_path / "wide.npz"), params, params, epoch=1,
                        best_validation_error=0.1, test_error=0.1, validation_errors=[0.1])
    one_line_error(refused(capsys, "cpu", "cpu", "--n-hidden", 20, "--resume",
                           tmp_path / "wide.npz"),
                   "params_0 has shape (784, 500), the model (784, 20)")


@pytest.mark.parametrize("name", ["dual_mlp.py", "mlp.py", "logistic_sgd.py"])
def test_bad_flags_are_refused_in_one_line_naming_the_flag(name):
    for flags, words in [("foo", "'foo' is not of the form name=value"),
                         ("mode=FOO", "mode=FOO"), ("floatX=float16", "floatX=float16"),
                         ("floatX=int8", "floatX=int8"), ("optimizer=bogus", "optimizer=bogus"),
                         ("device=tpu0", "device=tpu0"),
                         ("base_compiledir=/proc/x", "base_compiledir=/proc/x")]:
        # (without the tests' own compile folder, which PYTENSOR_FLAGS would give it)
        one_line_error(script(name, env={"THEANO_FLAGS": flags, "PYTENSOR_FLAGS": ""},
                              timeout=60), words)
    one_line_error(script(name, env={"PYTENSOR_FLAGS": "linker=xyz"}, timeout=60), "linker=xyz")


@pytest.mark.parametrize("name,option,value,words", [
    ("mlp.py", "--epochs", "-1", "must be a positive integer"),
    ("mlp.py", "--batch-size", "0", "must be a positive integer"),
    ("mlp.py", "--n-hidden", "-3", "must be a positive integer"),
    ("mlp.py", "--learning-rate", "inf", "must be a positive, finite number"),
    ("mlp.py", "--l2", "nan", "must be a finite number >= 0"),
    ("logistic_sgd.py", "--epochs", "-1", "must be a positive integer"),
    ("logistic_sgd.py", "--batch-size", "0", "must be a positive integer"),
    ("logistic_sgd.py", "--learning-rate", "nan", "must be a positive, finite number"),
    ("dual_mlp.py", "--l2", "nan", "must be a finite number >= 0"),
    ("dual_mlp.py", "--learning-rate", "inf", "must be a positive, finite number"),
    ("dual_mlp.py", "--timeout", "-5", "must be a number of seconds above 0, at most 1e6"),
])
def test_bad_numbers_are_refused_in_one_line(name, option, value, words, capsys):
    """By each script's main() in this process: argparse's checks (each
    script's one-line error as typed: the tests below and beside)."""
    one_line_error(refused(capsys, option, value, name=name), f"argument {option}: {words}")


def test_a_batch_larger_than_the_data_is_refused_by_the_tutorial_scripts():
    one_line_error(script("mlp.py", "--batch-size", 5000), "larger than the training set")
    one_line_error(script("logistic_sgd.py", "--batch-size", 5000), "larger than the training set")


def test_sigterm_to_the_launcher_stops_all_in_one_line_and_keeps_the_checkpoint(tmp_path,
                                                                               no_leftovers):
    ckpt = tmp_path / "m.npz"
    proc = start_checkpointing(ckpt, "cpu", "cpu", "--epochs", 1000, env=PACED)
    proc.send_signal(signal.SIGTERM)
    code, took, err = finish(proc, timeout=STOPS_WITHIN + 10)
    assert code == 143 and took < STOPS_WITHIN
    interrupted(err, "SIGTERM", ckpt)
    assert records.load_checkpoint(str(ckpt), SHAPES, records.TRAINING_STATE)[2]["epoch"] >= 1


@pytest.mark.parametrize("name", ["dual_mlp.py", "mlp.py"])
def test_a_signal_at_any_moment_of_start_up_gives_no_traceback(name, no_leftovers):
    """From the script's own first import (NumPy's, under PyTensor's) on.
    Python's first milliseconds are its own, before the script's first line
    can take SIGINT's default back: a Ctrl-C there ends in a traceback of
    Python's, or, as CPython checks whether argv[0] is an import path, is
    lost (here, of 150 sent 6 to 22 ms after the start, two)."""
    rng = random.Random(7)
    for delay in [0.0, 0.05, 0.15] + [rng.uniform(0.2, 4.0) for _ in range(4)]:
        sig = rng.choice([signal.SIGINT, signal.SIGTERM])
        proc = subprocess.Popen([sys.executable, str(ROOT / name), "--epochs", "1000"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True,
                                env=environment(PACED if name == "dual_mlp.py" else None))
        LAUNCHERS.add(proc.pid)
        maps = Path(f"/proc/{proc.pid}/maps")
        wait_for(lambda maps=maps: "_multiarray_umath" in maps.read_text(), 60, "NumPy to load")
        time.sleep(delay)
        os.killpg(proc.pid, sig)  # as a terminal's Ctrl-C reaches the whole group
        out, err = proc.communicate(timeout=30)
        assert "Traceback" not in err, (delay, err)
        assert proc.returncode in (128 + sig, -sig), (delay, proc.returncode, err)
        assert err.strip().splitlines()[-1:] in ([], ["interrupted"]) or \
            err.strip().splitlines()[-1].startswith("interrupted ("), (delay, err)


@pytest.mark.parametrize("name,read", [("dual_mlp.py", 0), ("dual_mlp.py", 7), ("mlp.py", 3)])
def test_a_closed_stdout_pipe_ends_quietly(name, read, no_leftovers):
    """As ``python dual_mlp.py | head -3`` does: lines read, then the pipe
    closed, before the launcher's first line (the workers not forked yet:
    they would have written to /dev/null) or after worker 0's first epoch."""
    proc = subprocess.Popen([sys.executable, str(ROOT / name), "--epochs", "1000"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=environment())
    LAUNCHERS.add(proc.pid)
    lines = [proc.stdout.readline() for _ in range(read)]
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=60)  # 1000 epochs would take minutes
    assert len(lines) == read and all(line.endswith("\n") for line in lines)
    assert err == "", err
    assert proc.returncode in (128 + signal.SIGPIPE, -signal.SIGPIPE)


def test_a_stray_temporary_of_an_interrupted_checkpoint_write_is_removed(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid nobody has now: the interrupted run's
    (tmp_path / f".m.npz.{gone.pid}.abc12345.tmp").write_bytes(b"half a checkpoint")
    (tmp_path / ".other.npz.x.tmp").write_bytes(b"not ours")
    out = dual("cpu", "cpu", "--epochs", 1, "--save", tmp_path / "m.npz")
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.npz.x.tmp", "m.npz"]


def test_a_long_compile_shows_a_heartbeat():
    said, start = [], time.perf_counter()
    with cli.heartbeat("compiling the model (the first run takes a minute)", said.append,
                       every=0.05):
        time.sleep(0.32)
    took = time.perf_counter() - start
    assert said[0] == "... compiling the model (the first run takes a minute)"
    assert len(said) >= 6 and all(s.startswith("... still compiling the model: ")
                                  for s in said[1:-1])
    shown = re.fullmatch(r"\.\.\. compiled in (\d+\.\d) s", said[-1])  # nothing from a cache
    assert shown and 0.3 <= float(shown[1]) <= round(took, 1), (said[-1], took)


def test_help_explains_every_option():
    out = script("dual_mlp.py", "--help")
    assert out.returncode == 0
    for option in ("--exchange", "--sync", "--avg", "--nodes", "--node-rank", "--coordinator",
                   "--timeout", "--save", "--resume", "--check"):
        assert option in out.stdout
    assert "--worker" not in out.stdout


@pytest.mark.parametrize("name,device", [("mlp.py", "cuda0"), ("logistic_sgd.py", "gpu")])
def test_a_gpu_asked_by_theano_flags_where_jax_has_no_cuda_is_one_line(name, device):
    """THEANO_FLAGS=device=cuda0 (or Theano's old 'gpu') on a machine whose JAX
    has no CUDA (CI's, a laptop's): one line that says why and what to do,
    naming the flag as it was typed, exit 2; both tutorial scripts alike."""
    import importlib.metadata
    if any((d.metadata["Name"] or "").lower().startswith("jax-cuda")
           for d in importlib.metadata.distributions()):
        pytest.skip("this JAX has CUDA: the GPU tests run device=cuda0")
    out = script(name, "--epochs", 1, env={"THEANO_FLAGS": f"device={device}"}, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"{name}: error: THEANO_FLAGS device={device}: this JAX has no CUDA support (pip install "
        "-r requirements-gpu.txt on a machine with an NVIDIA GPU), or leave device= out to run "
        "on the CPU"], out.stderr


def test_flags_pytensor_refuses_or_does_not_know_are_named_as_typed():
    """A bad value is one line naming the variable and flag as the user typed
    them; an unknown flag one warning line, not PyTensor's two-line warning
    with its source path."""
    out = script("mlp.py", "--help", env={"THEANO_FLAGS": "mode=NOPE"})
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.startswith("mlp.py: error: THEANO_FLAGS: mode=NOPE: "), out.stderr
    out = script("mlp.py", "--help", env={"THEANO_FLAGS": "mode=FAST_RUN,foo=1"})
    assert out.returncode == 0
    assert out.stderr.strip().splitlines() == [
        "warning: THEANO_FLAGS: 'foo' is not a PyTensor flag: ignored"], out.stderr


def test_dual_mlp_names_the_device_flag_as_typed_and_counts_one_step_as_one():
    """THEANO_FLAGS=device=gpu is Theano's spelling: the warning quotes it so;
    1,500 a worker on the shipped 3,000 digits is one step an epoch."""
    out = dual("--epochs", 1, "--batch-size", 1500, env={"THEANO_FLAGS": "device=gpu"})
    assert out.returncode == 0, out.stderr
    assert "warning: THEANO_FLAGS: 'device=gpu' is ignored: dual_mlp.py takes its devices" \
        in out.stderr
    assert ", 1 step per epoch;" in out.stdout
    assert "epoch 1/1: 1 step per worker (2 minibatches of 1500)" in out.stdout, out.stdout


def test_a_run_slower_or_emptier_than_it_need_be_says_why(tmp_path):
    """Three CPU workers on the one core this process may use, floatX=float64
    and a learning rate of 100: a notice for each of the first two as the
    run starts, and, the model having learnt nothing (its error a guess's),
    a remark beside the result that names the learning rate."""
    import subprocess
    import sys
    command = [sys.executable, "-c", "import os, sys; os.sched_setaffinity(0, {min("
               "os.sched_getaffinity(0))}); os.execv(sys.executable, [sys.executable, "
               "*sys.argv[1:]])", str(ROOT / "dual_mlp.py"), "cpu", "cpu", "cpu", "--epochs",
               "1", "--learning-rate", "100"]
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=environment({"THEANO_FLAGS": "floatX=float64"}))
    assert out.returncode == 0, out.stderr
    assert "notice: 3 CPU workers on 1 core (those this process may use): each gets a part " \
        "of one, and together they run no faster than 1 worker would\n" in out.stdout, out.stdout
    assert "notice: floatX=float64: the demo's models are written for float32" in out.stdout
    assert re.search(r"^Optimization complete\. Best validation error \d+\.\d\d %, test error of "
                     r"that model \d+\.\d\d %; near a guess's 90 %: the model learnt nothing, "
                     r"which a learning rate too large does \(try one smaller than 100\)$",
                     out.stdout, re.M), out.stdout


def test_the_total_wall_time_counts_the_start_up_of_python_too():
    """``report.since_start`` counts from the process's start, as the kernel
    does: a second slept before its module is imported is in it."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import time; time.sleep(1.0); from multi_gpu "
                          "import report; print(report.since_start())"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=environment())
    assert out.returncode == 0, out.stderr
    assert 1.0 <= float(out.stdout) < 60, out.stdout
