"""Nothing lost, no silent death, round four: runs that diverge, pipes that
close first, launchers killed mid-write, frozen workers, gzip bombs, memory
limits of containers, full folders, odd interpreters and limits, and the
benchmarks' own arguments.  Each ends in one of two ways: it works, or it
stops in one line, non-zero, with nothing lost and nothing left behind."""
import contextlib
import glob
import gzip
import hashlib
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import (
    PACED,
    ROOT,
    as_a_terminal_starts,
    child_running,
    dual,
    environment,
    finish,
    leftover_workers,
    mlp_one_epoch,
    run_directories,
    script,
    start_dual,
    wait_for,
    wait_until_training,
    workers_of,
)
from multi_gpu import datasets

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, mounts)")


def one_line(out, code, *words):
    lines = out.stderr.strip().splitlines()
    assert out.returncode == code and len(lines) == 1 and "Traceback" not in out.stderr, \
        (out.returncode, out.stderr)
    for w in words:
        assert w in lines[0], out.stderr


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.parametrize("option", [("--learning-rate", 1e30), ("--l2", 1e30)])
def test_a_tutorial_run_that_diverges_stops_in_one_line_and_keeps_the_good_model(tmp_path,
                                                                                option):
    model = tmp_path / "m.npz"
    shutil.copyfile(mlp_one_epoch()[0] / "m.npz", model)  # an epoch of mlp.py's
    before = digest(model)
    out = script("mlp.py", "--epochs", 2, *option, "--save", model)
    one_line(out, 1, "no longer finite (NaN or inf): the training diverged",
             "--save's file, if any, is left as it was")
    assert digest(model) == before


def pipeline(command, log):
    """``command 2>&1 | tee log`` in a session of its own, as a terminal runs
    it, Ctrl-C's signals at their defaults (a test runner's worker may
    ignore them, and a shell keeps an ignored signal ignored): (the shell,
    the launcher's pid)."""
    shell = subprocess.Popen(as_a_terminal_starts(["sh", "-c", f"{command} 2>&1 | tee {log} "
                                                                ">/dev/null"]),
                             env=environment(), start_new_session=True)
    launcher = wait_for(lambda: child_running(shell, "dual_mlp.py"), 30, "the launcher")
    return shell, launcher


@pytest.mark.parametrize("exchange", ["p2p", "xla"])
def test_ctrl_c_through_tee_leaves_no_lock_and_no_run_folder(tmp_path, exchange):
    """Ctrl-C reaches ``tee`` and the launcher at once; ``tee`` goes first,
    and the launcher's last line meets a closed pipe: it still stops its
    workers, releases the checkpoint's lock and removes the run folder."""
    ckpt, log = tmp_path / "ck.npz", tmp_path / "log"
    shell, launcher = pipeline(f"{sys.executable} {ROOT / 'dual_mlp.py'} cpu cpu --exchange "
                               f"{exchange} --epochs 100000 --save {ckpt}", log)
    try:
        wait_for(lambda: log.exists() and "epoch 1/" in log.read_text(), 120, "a first epoch")
        tee = next(p for p in psutil.Process(shell.pid).children() if p.name() == "tee")
        tee.send_signal(signal.SIGINT)
        wait_for(lambda: gone(tee), 10, "tee to end")
        os.killpg(shell.pid, signal.SIGINT)
        launcher.wait(30)  # (not this process's child: its exit code is the shell's to see)
        wait_for(lambda: not leftover_workers(), 10, "the workers to exit")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.npz", "log"]
        assert not set_of_runs_of(launcher.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()


def gone(process):
    """Ended: a zombie counts (its parent, a shell, reaps it when it gets to it)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def set_of_runs_of(pid):
    """The run folders of the launcher ``pid`` (not a dead run's of an
    earlier process that had the same pid)."""
    from conftest import OLDER_FOLDERS, run_folders
    return {p for p in run_folders() - OLDER_FOLDERS if p.name.startswith(f"dual_mlp-{pid}-")}


def held_mid_write(ckpt):
    """A run of ``--save ckpt`` whose worker 0 holds still (the fault hook)
    with its first checkpoint written but not yet in place: (the launcher,
    worker 0)."""
    proc = start_dual("cpu", "cpu", "--epochs", 1000, "--save", ckpt,
                      env={"DUAL_MLP_FAULT": "0:save:stop"})
    worker0 = wait_for(lambda: next((w for w in workers_of(proc)
                                     if w.status() == psutil.STATUS_STOPPED), None), 120,
                       "worker 0 to hold still mid-write")
    assert any(p.name.endswith(".tmp") for p in ckpt.parent.iterdir())
    return proc, worker0


def test_a_launcher_killed_while_worker_0_writes_leaves_no_temporary(tmp_path):
    """Worker 0 holds still with its checkpoint written but not yet in
    place; the launcher is SIGKILLed; worker 0 then goes on, finds itself
    orphaned, and removes its half-done temporary and the run folder."""
    proc, worker0 = held_mid_write(tmp_path / "ck.npz")
    proc.kill()
    proc.wait()  # not its output: worker 0, held still, writes to it still
    worker0.send_signal(signal.SIGCONT)
    proc.communicate(timeout=60)
    wait_for(lambda: not leftover_workers(), 15, "the orphaned workers to exit")
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert not set_of_runs_of(proc.pid)
    for leftover in tmp_path.glob(".ck.npz.lock"):  # the killed launcher's own: taken over next
        leftover.unlink()


def test_a_worker_killed_as_it_writes_leaves_no_temporary(tmp_path):
    """Worker 0 SIGKILLed with its first checkpoint written but not yet in
    place: the run ends naming it, and its half-done temporary (the
    checkpoint's size) goes with the run."""
    proc, worker0 = held_mid_write(tmp_path / "ck.npz")
    worker0.send_signal(signal.SIGKILL)
    code, _, err = finish(proc, timeout=15)
    assert code == 1 and "worker 0 (device cpu) failed: killed by SIGKILL" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing written yet: no file"


@contextlib.contextmanager
def frozen(pid):
    """``pid`` frozen, as ``docker pause`` freezes a container: a freezer
    cgroup (v1 or v2); SIGKILL does not end it until it is thawed."""
    v1, v2 = "/sys/fs/cgroup/freezer", "/sys/fs/cgroup"
    if os.path.isdir(v1):
        group, state, frozen_, thawed = os.path.join(v1, f"dual_mlp_test_{pid}"), \
            "freezer.state", "FROZEN", "THAWED"
        tasks = "tasks"
    elif os.path.exists(os.path.join(v2, "cgroup.freeze")) or os.path.exists(
            os.path.join(v2, "cgroup.controllers")):
        group, state, frozen_, thawed, tasks = os.path.join(v2, f"dual_mlp_test_{pid}"), \
            "cgroup.freeze", "1", "0", "cgroup.procs"
    else:
        pytest.skip("no freezer cgroup here")
    os.mkdir(group)
    try:
        with open(os.path.join(group, tasks), "w") as f:
            f.write(str(pid))
        with open(os.path.join(group, state), "w") as f:
            f.write(frozen_)
        yield
    finally:
        with open(os.path.join(group, state), "w") as f:
            f.write(thawed)
        wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() ==
                 psutil.STATUS_ZOMBIE, 15, "the thawed worker to die")
        with contextlib.suppress(OSError):
            os.rmdir(group)


@ROOT_ONLY
def test_a_frozen_worker_is_named_and_the_run_ends_within_its_timeout(tmp_path):
    """A worker that cannot be killed (frozen) keeps the launcher for no more
    than the timeout and its grace: it names the worker it leaves, and has
    released the checkpoint's lock and removed the run folder."""
    ckpt = tmp_path / "ck.npz"
    proc = start_dual("cpu", "cpu", "--epochs", 100000, "--timeout", 3, "--save", ckpt,
                      env=PACED)
    wait_until_training(proc)
    wait_for(ckpt.exists, 60, "a checkpoint")
    worker1 = workers_of(proc)[1]
    with frozen(worker1.pid):
        code, took, err = finish(proc, timeout=30)
        last = err.strip().splitlines()[-1]
        assert code == 1 and f"worker 1 (pid {worker1.pid}) cannot be stopped (frozen?)" in last
        assert not (tmp_path / ".ck.npz.lock").exists() and not set_of_runs_of(proc.pid)
    print(f"the launcher ended {took:.1f} s after the freeze was noticed: {last}")


def memory_cgroup(limit):
    """A memory cgroup of ``limit`` bytes (v1 or v2), and the line that puts
    a shell's command into it."""
    for root, name, cap in (("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "tasks"),
                            ("/sys/fs/cgroup", "memory.max", "cgroup.procs")):
        if os.path.exists(os.path.join(root, name if root.endswith("memory") else
                                       "cgroup.controllers")):
            group = os.path.join(root, f"dual_mlp_test_{os.getpid()}_{time.monotonic_ns()}")
            os.mkdir(group)
            with open(os.path.join(group, name), "w") as f:
                f.write(str(limit))
            return group, f"echo $$ > {os.path.join(group, cap)} && exec"
    pytest.skip("no memory cgroup here")


def in_memory_cgroup(limit, command, tmp_path):
    group, enter = memory_cgroup(limit)
    try:
        return subprocess.run(["sh", "-c", f"{enter} {command}"], capture_output=True, text=True,
                              timeout=300, env=environment(), cwd=tmp_path)
    finally:
        wait_for(lambda: not open(os.path.join(group, "tasks" if "memory/" in group
                                               else "cgroup.procs")).read().strip(), 10,
                 "the cgroup to empty")
        os.rmdir(group)


def gzip_bomb(path, gib):
    """``gib`` GiB of zeros, gzipped (a few MB)."""
    zeros = bytes(16 << 20)
    with gzip.open(path, "wb", compresslevel=1) as f:
        for _ in range(gib * 64):
            f.write(zeros)


@ROOT_ONLY
def test_gzip_bombs_are_refused_in_one_line_within_a_containers_memory(tmp_path):
    """In a 1 GiB memory cgroup: a .pkl.gz that expands to 2 GiB, and an IDX
    file whose header declares 4.1 M images, are refused in one line by every
    script that reads data, none of them ended by the OOM killer (137)."""
    bomb = tmp_path / "bomb.pkl.gz"
    gzip_bomb(bomb, 2)
    folder = tmp_path / "idx"
    folder.mkdir()
    for name in datasets.IDX_FILES:
        datasets.write_idx(str(folder / name), np.zeros((10, 28, 28) if "images" in name
                                                         else (10,), np.uint8))
    with gzip.open(folder / "train-images-idx3-ubyte.gz", "wb") as f:  # a header, no data
        f.write(b"\0\0\x08\x03" + (4100000).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2)
    for data, words in ((bomb, "expands to more than"), (folder, "IDX header says")):
        for command in (f"{sys.executable} -m multi_gpu.datasets check {data}",
                        f"{sys.executable} {ROOT / 'dual_mlp.py'} cpu cpu --dataset {data}",
                        f"{sys.executable} {ROOT / 'mlp.py'} --dataset {data}"):
            out = in_memory_cgroup(1 << 30, f"env PYTHONPATH={ROOT} {command}", tmp_path)
            assert out.returncode in (1, 2) and words in out.stderr, (command, out.returncode,
                                                                       out.stderr[-500:])
            assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_launcher_whose_open_files_run_out_still_removes_its_run_folder():
    """Where the launcher's open files fill up as it runs (a stranger's
    connections held open to node 0's lobby at ``ulimit -n 1024``; here its
    limit lowered to what it holds, mid-run): the run ends as it would, exit
    0, and its run folder still goes (the launcher kept a few descriptors
    back for that; the clean-up failed without a word before)."""
    before = run_directories()
    proc = start_dual("cpu", "cpu", "--epochs", 3)
    wait_until_training(proc)
    held = {int(fd) for fd in os.listdir(f"/proc/{proc.pid}/fd")}
    lowest_free = min(set(range(len(held) + 1)) - held)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (lowest_free, hard))
    code, _, err = finish(proc, timeout=120)
    assert code == 0 and err == "", err
    assert run_directories() - before == set()


def test_an_address_space_limit_is_counted_by_every_reader(tmp_path):
    """Under ``ulimit -v`` (what batch schedulers set) the pickle reader asks
    for no buffer larger than what it has read (one read of its whole limit
    was a MemoryError before a byte), and its limit counts the address space
    left: the Quick start's data trains, and a gzip bomb is refused in one
    line by every script that reads data."""
    bomb = tmp_path / "bomb.pkl.gz"
    gzip_bomb(bomb, 1)
    limited = "ulimit -v 1500000 && exec env PYTHONPATH={root} {python} {command}"
    for command, code in (("-m multi_gpu.datasets check " + str(bomb), 1),  # the check failed
                          (f"{ROOT / 'dual_mlp.py'} cpu cpu --dataset {bomb}", 2)):
        out = subprocess.run(["sh", "-c", limited.format(root=ROOT, python=sys.executable,
                                                         command=command)],
                             capture_output=True, text=True, timeout=120, env=environment())
        one_line(out, code, "expands to more than", "GiB")
    for name in ("mlp.py", "dual_mlp.py"):
        out = subprocess.run(["sh", "-c", f"ulimit -v 4000000 && exec {sys.executable} "
                              f"{ROOT / name} --epochs 1"], capture_output=True, text=True,
                             timeout=300, env=environment(), cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert "Optimization complete" in out.stdout


@ROOT_ONLY
def test_the_memory_check_sees_a_containers_limit(tmp_path):
    """In a 1.5 GiB memory cgroup on a larger machine, a model too big for
    the cgroup is refused before it is built (built, it meets the OOM killer)."""
    for command, words in ((f"{ROOT / 'mlp.py'} --n-hidden 100000 --epochs 1",
                            "the model with --n-hidden 100000 needs about"),
                           (f"{ROOT / 'dual_mlp.py'} cpu cpu --n-hidden 60000 --epochs 1",
                            "the model with --n-hidden 60000 needs about")):
        out = in_memory_cgroup(3 << 29, f"{sys.executable} {command}", tmp_path)
        one_line(out, 2, words, "GiB available")


def test_n_hidden_1_trains_under_the_compiled_average(tmp_path):
    out = dual("cpu", "cpu", "--n-hidden", 1, "--epochs", 1, "--check")
    assert out.returncode == 0, out.stderr
    assert "max difference between the replicas after an exchange: 0" in out.stdout


def test_staged_on_cpu_workers_is_one_line():
    one_line(dual("cpu", "cpu", "--staged", timeout=60), 2,
             "--staged moves GPU workers' weights through host memory")


def dev_shm_filled(tmp_path, fault, stopped, fill_mb):
    """``dual_mlp.py cpu cpu`` in a private 40 MB /dev/shm, stopped by
    DUAL_MLP_FAULT=``fault``: once ``stopped`` (shell; it sets W, the
    process the fault stopped, from L, the launcher's pid) holds and W is
    stopped, ``fill_mb`` MB of /dev/shm are taken and W goes on.  Returns
    the launcher's exit code and the lines of its error output."""
    run = f"""mount -t tmpfs -o size=40m tmpfs /dev/shm || exit 99
{sys.executable} {ROOT / 'dual_mlp.py'} cpu cpu --epochs 2 2> {tmp_path / 'err'} &
L=$!
until {stopped} && [ "$(ps -o stat= -p $W | cut -c1)" = T ]; do sleep 0.05; done
dd if=/dev/zero of=/dev/shm/filler bs=1M count={fill_mb} 2>/dev/null
kill -CONT $W; wait $L; echo $? > {tmp_path / 'code'}"""
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", run],
                         capture_output=True, text=True, timeout=120,
                         env=environment({"DUAL_MLP_FAULT": fault}))
    if out.returncode == 99:
        pytest.skip(f"no mount namespace here: {out.stderr.strip()}")
    return ((tmp_path / "code").read_text().strip(),
            (tmp_path / "err").read_text().strip().splitlines())


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="needs root and unshare, for a small /dev/shm of its own")
@pytest.mark.parametrize("left_mb, who", [(0, "error: no room left in the run folder"),
                                          (18, "failed: worker")])
def test_a_dev_shm_filled_after_the_room_check_is_one_line(tmp_path, left_mb, who):
    """A neighbour fills /dev/shm (40 MB) between the launcher's check and
    the workers' buffers: the launcher (nothing left) or a worker (room for
    the request and the data's copy, 15.7 MB, not for the weights, 12.7)
    says so in one line, naming the folder."""
    code, err = dev_shm_filled(tmp_path, "launcher:folder:stop", "W=$L",
                               40 - left_mb if left_mb else 100)
    assert code == "1" and len(err) == 1, err
    assert who in err[0] and "error: no room left in the run folder /dev/shm/dual_mlp-" in err[0]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="needs root and unshare, for a small /dev/shm of its own")
def test_a_dev_shm_filled_as_a_worker_compiles_is_one_line(tmp_path):
    """A neighbour fills /dev/shm as worker 0 compiles, worker 1 waiting for
    it: PyTensor writes each compiled graph's source into the run folder,
    and its error names no file; worker 0 says in one line that the run
    folder has no room (it was a traceback ending in a bare OSError)."""
    code, err = dev_shm_filled(
        tmp_path, "0:compile:stop", "W=$(pgrep -P $L -x 'dual_mlp w0') && "
        "ls /dev/shm/dual_mlp-*/weights1.bin >/dev/null 2>&1", 100)
    assert code == "1" and len(err) == 1, err
    assert "failed: worker 0: error: no room left in the run folder /dev/shm/dual_mlp-" in err[0]


@ROOT_ONLY
def test_an_output_folder_made_read_only_mid_run_leaves_no_traceback(tmp_path):
    """The folder of --save turns read-only during the run (a read-only bind
    mount over it): the epochs' writes fail with a warning, and Ctrl-C ends
    the run in its own words, with no traceback of its lock's removal."""
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = start_dual("cpu", "cpu", "--epochs", 100000, "--save", disk / "ck.npz", env=PACED)
    try:
        wait_until_training(proc)
        wait_for((disk / "ck.npz").exists, 60, "a checkpoint")
        if subprocess.run(["mount", "--bind", str(disk), str(disk)]).returncode or \
                subprocess.run(["mount", "-o", "remount,bind,ro", str(disk)]).returncode:
            pytest.skip("no read-only bind mount here")
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        code, _, err = finish(proc, timeout=30)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    assert code == 130 and "Traceback" not in err, err
    last = err.strip().splitlines()[-2:]
    assert last[0].startswith("interrupted (SIGINT)") and last[1].startswith(
        "warning: could not remove the lock"), err
    (disk / ".ck.npz.lock").unlink()  # beneath the mount: left, as the warning said


@pytest.mark.parametrize("how, env, runs", [
    (["-OO"], {}, True),                   # no docstrings: --help read them; a whole run
    (["-I"], {}, False),                   # the scripts' folder, where the package is, off the path
    # the same, and the workers inherit it: a whole run; with every warning an error (a
    # worker's error output left unclosed said so), and JAX asked for 4 CPU devices a process
    ([], {"PYTHONSAFEPATH": "1", "PYTHONWARNINGS": "error", "JAX_NUM_CPU_DEVICES": "4"}, True)])
def test_the_scripts_run_under_odd_interpreter_flags(how, env, runs, tmp_path):
    """Each script answers --help and (where the flag reaches further) runs,
    and says nothing it would not say otherwise."""
    for name, args in (("dual_mlp.py", ["cpu", "cpu", "--epochs", "1"]),
                       ("mlp.py", ["--epochs", "1"]), ("logistic_sgd.py", ["--epochs", "1"])):
        for extra in ([], ["--help"]) if runs and name == "dual_mlp.py" else (["--help"],):
            out = subprocess.run([sys.executable, *how, str(ROOT / name), *args, *extra],
                                 cwd=tmp_path, capture_output=True, text=True, timeout=300,
                                 env=environment(env))
            assert out.returncode == 0 and "Traceback" not in out.stderr, (how, name,
                                                                          out.stderr[-800:])
            assert "Exception ignored" not in out.stderr, out.stderr[-800:]


PYENV = os.path.expanduser(os.environ.get("PYENV_ROOT", "~/.pyenv"))


@pytest.mark.parametrize("script", ["dual_mlp.py", "mlp.py", "logistic_sgd.py"])
def test_another_python_or_one_without_the_packages_is_one_line(script, tmp_path):
    """A Python without the requirements (here: site-packages off, -S; a venv
    not activated reads the same), and a Python older than 3.11 where one is
    at hand (pyenv's): one line saying what to do, exit 2, no traceback."""
    out = subprocess.run([sys.executable, "-S", str(ROOT / script)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, env=environment())
    one_line(out, 2, f"{script}: error: numpy, pytensor, jax and zmq are not installed for "
             f"this Python ({sys.executable}): activate the project's venv")
    older = sorted(glob.glob(f"{PYENV}/versions/3.10.*/bin/python3.10"))
    if older:
        out = subprocess.run([older[-1], str(ROOT / script)], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60, env=environment())
        one_line(out, 2, f"{script}: error: Python 3.11 to 3.13 runs it, and this is Python "
                 "3.10.")


def test_a_limit_of_open_files_too_low_to_raise_is_one_line():
    out = subprocess.run(["sh", "-c", f"ulimit -n 12 && exec {sys.executable} "
                          f"{ROOT / 'dual_mlp.py'} cpu cpu --epochs 1"], capture_output=True,
                         text=True, timeout=60, env=environment())
    one_line(out, 2, "ulimit -n 12: the run needs about 128 open files")


def test_xla_flags_that_are_not_flags_are_one_line(tmp_path):
    one_line(dual("cpu", "cpu", env={"XLA_FLAGS": "not a flag"}, timeout=60), 2,
             "XLA_FLAGS: 'not' is not a flag (each starts with --")
    # one XLA does not know: its runtime's words, without its log's stamp, and nothing left;
    # bad input, though XLA reads it only as a worker starts: exit 2, and no restart
    out = dual("cpu", "cpu", "--max-restarts", 1, env={"XLA_FLAGS": "--xla_no_such_flag=1"},
               timeout=60)
    one_line(out, 2, "failed: XLA's runtime: Unknown flag in XLA_FLAGS: --xla_no_such_flag=1")
    assert not re.search(r"^F\d{4} ", out.stderr, re.M), out.stderr
    # a tutorial script, one process: asked before XLA ends it, and nothing left in TMPDIR
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = script("mlp.py", "--epochs", 1, env={"XLA_FLAGS": "--xla_no_such_flag=1",
                                               "TMPDIR": str(tmp)}, timeout=60)
    one_line(out, 2, "mlp.py: error: XLA_FLAGS: XLA does not know --xla_no_such_flag=1")
    assert list(tmp.iterdir()) == []


@pytest.mark.parametrize("env, words", [
    ({"THEANO_FLAGS": "compiledir="}, "compiledir is empty: name a folder"),
    ({"HOME": "", "PYTENSOR_FLAGS": ""}, "HOME='' is not a folder's full path"),
    ({"HOME": "/proc/nope", "PYTENSOR_FLAGS": ""},
     "PyTensor cannot keep its compiled code in /proc/nope/.pytensor, under HOME")])
def test_an_unusable_cache_folder_is_named_and_nothing_lands_in_the_current_folder(
        tmp_path, env, words):
    for name in ("dual_mlp.py", "mlp.py"):
        out = script(name, env=env, cwd=tmp_path, timeout=60)
        one_line(out, 2, words)
        assert list(tmp_path.iterdir()) == []


def test_a_tutorial_script_killed_leaves_no_temporary_folder_and_no_lock(tmp_path):
    private = tmp_path / "tmp"
    private.mkdir()
    proc = subprocess.Popen([sys.executable, str(ROOT / "mlp.py"), "--epochs", "1000", "--save",
                             str(tmp_path / "m.npz")], stdout=subprocess.PIPE, text=True,
                            env=environment({"TMPDIR": str(private)}))
    for line in proc.stdout:
        if line.startswith("epoch 1,"):
            break
    proc.terminate()
    proc.communicate(timeout=30)
    assert list(private.iterdir()) == [] and not (tmp_path / ".m.npz.lock").exists()


@pytest.mark.parametrize("args, words", [
    (["--out", "README.md"], "--out README.md is a file"),
    (["--average-every", "0"], "argument --average-every: must be a positive integer, got 0"),
    (["--target", "1.5"], "argument --target: must be a number above 0 and below 1"),
    (["--epochs", "0"], "argument --epochs: must be a positive integer"),
    (["--dataset", "/no/fashion-mnist"], "dataset not found: /no/fashion-mnist (Debian's"),
    (["--tables-from", "/no/such.json"], "--tables-from /no/such.json: No such file"),
])
def test_the_accuracy_benchmark_checks_its_arguments_before_it_runs_anything(args, words):
    out = script("bench.accuracy", "--cpu", *args, timeout=60)
    assert out.returncode == 2 if "--tables-from" not in args else out.returncode == 1
    assert words in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "$ " not in out.stdout  # no run started


def test_tables_from_a_file_that_is_not_a_results_file_is_one_line(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    for name in ("bench.accuracy", "bench.compare", "bench.step_cost"):
        out = script(name, "--tables-from", empty, timeout=60)
        assert out.returncode == 1 and out.stderr.strip().splitlines() == [
            f"python -m {name}: error: --tables-from {empty}: not a results file of "
            f"{name.split('.')[1]}.py"], out.stderr


def test_a_batch_of_one_trains_without_a_rewrite_traceback():
    for name in ("mlp.py", "logistic_sgd.py"):
        out = script(name, "--batch-size", 1, "--epochs", 1, timeout=300)
        assert out.returncode == 0 and out.stderr == "", (name, out.stderr[-1500:])


def closed_folders(*paths):
    """The folders above ``paths``, top down, that another user may not enter
    (no search bit for others): root's home, a clone made in ``mktemp -d``."""
    found = []
    for path in paths:
        for folder in reversed(Path(path).resolve().parents):
            if not os.stat(folder).st_mode & 0o001 and folder not in found:
                found.append(folder)
    return found


def as_nobody(nproc, command, tmp_path):
    """``command`` as uid 65534 (root is held to no process limit) under
    ``ulimit -u nproc``, HOME a folder of its own.  The repository, and this
    Python, may lie in folders no other user may enter (root's home, a clone
    in a folder of mode 0700): in a private mount namespace, an open folder
    is laid over each, holding each of its entries (each keeps its own
    mode), and nothing else sees the change."""
    if not all(map(shutil.which, ("unshare", "setpriv", "prlimit"))):
        pytest.skip("needs unshare, setpriv and prlimit, to run as another user")
    real = tmp_path / "root"
    real.mkdir(exist_ok=True)  # a mount point in the namespace alone
    home = tempfile.mkdtemp(prefix="dual_mlp-tests-nobody-", dir="/tmp")  # that user may write
    os.chmod(home, 0o777)
    lay_open = [f"mount --bind / {real}"] + [
        f"mount -t tmpfs -o mode=755 tmpfs {folder} && for e in {real}{folder}/.[!.]* "
        f"{real}{folder}/*; do [ -e \"$e\" ] || continue; n={folder}/${{e##*/}}; if [ -d "
        "\"$e\" ]; then mkdir \"$n\"; else touch \"$n\"; fi; mount --bind \"$e\" \"$n\"; done"
        for folder in closed_folders(ROOT / "dual_mlp.py", sys.executable, sys.prefix)]
    nobody = (f"setpriv --reuid=65534 --regid=65534 --clear-groups prlimit --nproc={nproc} "
              f"env HOME={home} PYTENSOR_FLAGS=base_compiledir={home}")
    try:
        out = subprocess.run(["unshare", "--mount", "sh", "-c", f"{' && '.join(lay_open)} && "
                              f"cd {home} && exec {nobody} {shlex.join(map(str, command))}"],
                             capture_output=True, text=True, timeout=120, env=environment())
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if "mount" in out.stderr and out.returncode:
        pytest.skip(f"no mount namespace here: {out.stderr.strip()}")
    return out


@ROOT_ONLY
def test_a_process_limit_too_low_for_the_threads_is_one_line(tmp_path):
    """``ulimit -u`` counts threads, and a worker's XLA starts dozens: too
    low a limit is said before any worker starts, not as a thread that
    could not start deep inside one; the tutorial's script says it before
    NumPy's BLAS starts its threads (it printed BLAS's lines, or XLA's abort)."""
    out = as_nobody(40, [sys.executable, ROOT / "dual_mlp.py", "cpu", "cpu"], tmp_path)
    one_line(out, 2, "ulimit -u 40: this user runs", "threads already, and the run needs about")
    for nproc in (1, 8):
        out = as_nobody(nproc, [sys.executable, ROOT / "mlp.py", "--epochs", 1], tmp_path)
        one_line(out, 2, f"mlp.py: error: ulimit -u {nproc}: this user runs",
                 "threads already, and mlp.py needs about")


def test_a_benchmark_killed_mid_run_leaves_no_temporary_folder(tmp_path):
    """SIGTERM (``timeout``, a killed job) ends a benchmark through its
    clean-up: its tiled data and its compiled graphs' sources go with it."""
    private = tmp_path / "tmp"
    private.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "bench.scaling", "--cpu", "--out",
                             str(tmp_path / "out")], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=environment({"TMPDIR": str(private)}))
    for line in proc.stdout:
        if line.startswith("$ "):  # a run of the demo has started
            break
    time.sleep(1)
    proc.terminate()
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    wait_for(lambda: not leftover_workers(), 15, "the demo's workers to go")
    assert list(private.iterdir()) == []


def test_a_tutorial_run_whose_folder_goes_names_its_outputs_and_keeps_its_summary(tmp_path):
    """mlp.py's --save and --json folder removed while it trains: the summary
    it could not write is shown on stdout, the line names the file asked for
    (not a temporary or a lock), exit 1."""
    folder = tmp_path / "out"
    folder.mkdir()
    proc = subprocess.Popen([sys.executable, str(ROOT / "mlp.py"), "--epochs", "6", "--save",
                             str(folder / "m.npz"), "--json", str(folder / "s.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=environment())
    for line in proc.stdout:
        if line.startswith("epoch 1,"):
            shutil.rmtree(folder)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert f"could not write {folder / 's.json'}" in err and '"validation_errors"' in out, err
