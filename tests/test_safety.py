"""Nothing lost, nobody in: outputs that would destroy inputs, shared paths
and ports, runs beside other runs, orphans, diverging runs, unclear ends.
Real processes, real files, real sockets."""
import hashlib
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from conftest import (
    LAUNCHERS,
    PACED,
    ROOT,
    SHAPES,
    STOPS_WITHIN,
    TOKEN,
    dual,
    environment,
    finish,
    interrupted,
    kill_one_worker,
    leftover_workers,
    refused,
    run_directories,
    script,
    start_checkpointing,
    start_dual,
    start_node,
    two_epochs,
    wait_for,
    wait_until_training,
    workers_of,
)
from conftest import splits as conftest_splits
from multi_gpu import cli, datasets, records
from multi_gpu.nodes import free_port


def one_line(out, code, *words):
    lines = out.stderr.strip().splitlines()
    assert out.returncode == code and len(lines) == 1, out.stderr
    for w in words:
        assert w in lines[0], out.stderr


def cpu_workers(name):
    """What the script ``name`` is given to run on the CPU: dual_mlp.py its
    two workers' devices, a tutorial script nothing."""
    return ["cpu", "cpu"] if name == "dual_mlp.py" else []


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_an_output_never_overwrites_an_input_or_another_output(tmp_path, no_leftovers, capsys,
                                                               one_epoch_checkpoint):
    """The first request by the script, as typed; the others by its main()."""
    data = tmp_path / "D.pkl.gz"
    shutil.copy(datasets.SHIPPED, data)
    before = digest(data)
    (tmp_path / "link.pkl.gz").symlink_to(data)
    checkpoint = digest(one_epoch_checkpoint(tmp_path / "c.npz"))
    cases = [
        (["--dataset", data, "--save", data], "--save", "is --dataset's file"),
        (["--dataset", data, "--json", tmp_path / "link.pkl.gz"], "--json", "is --dataset's"),
        (["--save", tmp_path / "x", "--json", tmp_path / "x"], "--save and --json name one file"),
        (["--epochs", 2, "--resume", tmp_path / "c.npz", "--json", tmp_path / "c.npz"],
         "--json", "is --resume's file")]
    for i, (args, *words) in enumerate(cases):
        one_line(refused(capsys, "cpu", "cpu", *args, typed=i == 0), 2, *words)
    for option in ("--save", "--json"):
        one_line(script("mlp.py", "--dataset", data, option, tmp_path / "link.pkl.gz"), 2,
                 "an output never overwrites an input")
    assert digest(data) == before and digest(tmp_path / "c.npz") == checkpoint
    # continuing a checkpoint in place is what --save beside --resume is for
    out = dual("cpu", "cpu", "--epochs", 2, "--resume", tmp_path / "c.npz", "--save",
               tmp_path / "c.npz")
    assert out.returncode == 0, out.stderr
    assert records.load_checkpoint(str(tmp_path / "c.npz"), SHAPES,
                                   records.TRAINING_STATE)[2]["epoch"] == 2


def test_a_second_run_on_a_held_checkpoint_is_refused_and_touches_nothing(tmp_path,
                                                                          no_leftovers, capsys):
    ckpt = tmp_path / "m.npz"
    live = start_checkpointing(ckpt, "cpu", "cpu", "--epochs", 1000, env=PACED)
    writing = tmp_path / f".m.npz.{live.pid}.halfdone.tmp"  # the live run's write in progress
    writing.write_bytes(b"half a checkpoint")
    for name in ("dual_mlp.py", "mlp.py"):  # the demo's as typed, the tutorial's by its main()
        out = refused(capsys, *cpu_workers(name), "--epochs", 1, "--save", ckpt, name=name,
                      typed=name == "dual_mlp.py")
        one_line(out, 2, f"{ckpt} is being written by another run (pid {live.pid})")
    assert writing.exists() and live.poll() is None
    live.send_signal(signal.SIGINT)
    assert finish(live, timeout=10)[0] == 130
    out = dual("cpu", "cpu", "--epochs", 1, "--save", ckpt)  # nobody holds it now
    assert out.returncode == 0, out.stderr
    assert not writing.exists()  # a dead run's temporary, cleared by the new holder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.npz"]


def ours_alive():
    return [p for p in leftover_workers() if p.status() != psutil.STATUS_ZOMBIE]


def orphans_and_folder_go(proc, when):
    """The workers of the killed launcher ``proc`` exit and take its run folder."""
    wait_for(lambda: not ours_alive(), 15, f"the orphans to exit ({when})")
    wait_for(lambda: not [d for d in run_directories() if f"-{proc.pid}-" in d.name], 5,
             f"the run folder of a launcher killed {when} to go")


@pytest.mark.parametrize("exchange", ["p2p", "xla"])
def test_a_launcher_killed_at_any_moment_of_start_up_leaves_no_worker_and_no_folder(
        exchange, no_leftovers):
    for delay in (0.0, 0.1, 0.3, 0.6, 1.0, 1.5, 2.0, 3.0, 4.5):
        proc = start_dual("cpu", "cpu", *(["cpu"] if exchange == "xla" else []), "--exchange",
                          exchange, "--epochs", 1000, env=PACED)
        time.sleep(delay)
        proc.kill()  # the launcher alone: its workers must notice and go
        proc.communicate()
        orphans_and_folder_go(proc, f"after {delay} s")


@pytest.mark.parametrize("where", ["spawned", "folder"])
def test_a_launcher_killed_once_its_workers_start_leaves_no_worker_and_no_folder(where,
                                                                                 no_leftovers):
    """The moments that a kill at a random time seldom hits (CI's once did): the
    workers started, the run folder not yet made, or made with no request in it."""
    proc = start_dual("cpu", "cpu", "--epochs", 1000,
                      env={"DUAL_MLP_FAULT": f"launcher:{where}:kill"})
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    orphans_and_folder_go(proc, f"at {where}")


def ignores_sigpipe(pid):
    mask = re.search(r"SigIgn:\s*([0-9a-f]+)", open(f"/proc/{pid}/status").read())[1]
    return bool(int(mask, 16) >> (signal.SIGPIPE - 1) & 1)


def test_a_workers_write_to_a_dead_launchers_pipe_fails_instead_of_ending_it(no_leftovers):
    """A worker's error output is a pipe to its launcher.  Once the launcher
    is gone, a write there (JAX's runtime logs as its peers go) must not end
    the worker by SIGPIPE before it has removed the run folder: a launcher
    killed at the wrong moment left its folder so, in CI.  Nor the launcher,
    which holds locks and workers: ``| head`` still ends a run quietly, worker
    0 ending on the closed pipe (test_a_closed_stdout_pipe_ends_quietly), and
    a closed pipe at its shutdown does not keep it from cleaning up
    (test_ctrl_c_through_tee_leaves_no_lock_and_no_run_folder)."""
    proc = start_dual("cpu", "cpu", "--epochs", 1000, env=PACED)
    wait_until_training(proc)
    try:
        assert [ignores_sigpipe(w.pid) for w in workers_of(proc)] == [True, True]
        assert ignores_sigpipe(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        finish(proc, timeout=15)


def listening(processes):
    found = []
    for p in processes:
        found += [(p.pid, c.laddr.ip) for c in p.net_connections("inet")
                  if c.status == psutil.CONN_LISTEN]
    return found


def test_every_socket_of_a_one_machine_run_is_on_the_loopback(no_leftovers):
    for exchange in ("xla", "p2p"):
        proc = start_dual("cpu", "cpu", "--exchange", exchange, "--epochs", 1000, env=PACED)
        wait_until_training(proc)
        found = listening([psutil.Process(proc.pid)] + workers_of(proc))
        assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for _, ip in found), found
        if exchange == "xla":
            assert found  # the coordinator and gloo do listen, there
        else:
            assert found == []  # peer to peer on one machine: ipc:// sockets only
        proc.send_signal(signal.SIGINT)
        finish(proc, timeout=15)


def test_a_foreign_run_on_a_live_runs_port_is_refused_and_the_live_run_goes_on(no_leftovers):
    port = free_port()
    live = [start_node(port, rank, "--epochs", 1000, env=PACED) for rank in (1, 0)]
    wait_until_training(live[1])
    for rank, words in ((1, "has joined already: is another run using this --coordinator?"),
                        (0, f"cannot listen on 127.0.0.1:{port}")):
        foreign = start_node(port, rank, "--epochs", 1000)
        code, _, err = finish(foreign, timeout=60)
        assert code == 2 and len(err.strip().splitlines()) == 1 and words in err, err
    try:
        time.sleep(0.5)
        assert all(p.poll() is None for p in live)  # still training
        said = []  # node 0 says whom it refused, then trains on
        while len(said) < 30 and not (said and said[-1].startswith("epoch ") and any(
                line.startswith("node 0: refused node 1 at 127.0.0.1: ") for line in said)):
            said.append(live[1].stdout.readline())
        assert said[-1].startswith("epoch "), said
    finally:
        for p in live:
            p.send_signal(signal.SIGINT)
        for p in live:
            finish(p, timeout=15)


def test_a_node_given_another_option_is_refused_in_one_line(no_leftovers):
    port = free_port()
    node0 = start_node(port, 0, "--epochs", 2, "--timeout", 8)
    # each side reads "there" as the other's value, "here" as its own
    refused_nodes = [(start_node(port, 1, *args, "--timeout", 8, **kw), words, node0_words)
                     for args, kw, words, node0_words in (
                         (("--epochs", 3), {}, "--epochs 2 there, 3 here",
                          "--epochs 3 there, 2 here"),
                         (("--epochs", 2), dict(devices=("cpu", "cpu")),
                          "workers per node 1 there, 2 here (every node gives the same number "
                          "of devices)", "workers per node 2 there, 1 here (every node gives "
                          "the same number of devices)"))]
    for node1, words, _ in refused_nodes:
        code, _, err = finish(node1, timeout=60)
        assert code == 2 and err.strip().splitlines() == [
            f"dual_mlp.py: error: refused by node 0 at 127.0.0.1:{port}: node 0 runs other "
            f"options: {words}"]
    # its partner never came: node 0 says whom it refused and why, as it does, whom it
    # waits for meanwhile, and, in its one error line, which node never came (not JAX's
    # coordinator's socket)
    code, _, err = finish(node0, timeout=60)
    assert code == 1 and err.strip().splitlines() == [
        f"error: node 1 never joined node 0 at 127.0.0.1:{port}"], err
    said = node0.out.splitlines()
    assert sorted(line for line in said if line.startswith("node 0: refused ")) == sorted(
        f"node 0: refused node 1 at 127.0.0.1: it runs other options: {words}"
        for _, _, words in refused_nodes), node0.out
    assert any(line.startswith(f"node 0: waiting for node 1 to join at 127.0.0.1:{port} (")
               for line in said), node0.out


def test_a_taken_port_is_one_line(no_leftovers):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = dual("cpu", "cpu", "--nodes", 2, "--node-rank", 0, "--coordinator",
                   f"127.0.0.1:{port}", timeout=60)
        one_line(out, 2, f"cannot listen on 127.0.0.1:{port} (address already in use)")


def test_a_diverging_run_stops_in_one_line_and_keeps_the_last_good_checkpoint(tmp_path,
                                                                             no_leftovers):
    ckpt = tmp_path / "m.npz"
    shutil.copyfile(two_epochs() / "m.npz", ckpt)
    out = dual("cpu", "cpu", "--epochs", 5, "--resume", ckpt, "--save", ckpt,
               "--learning-rate", 1e6)
    assert "notice: the learning rate changes from 0.13 to 1000000.0 at epoch 3" in out.stdout
    one_line(out, 1, "no longer finite (NaN or inf): the training diverged",
             "is --learning-rate 1e+06 too large?")
    diverged = int(re.search(r"after epoch (\d+) the", out.stderr).group(1))
    current, _, state = records.load_checkpoint(str(ckpt), SHAPES, records.TRAINING_STATE)
    assert 2 <= state["epoch"] == diverged - 1 and all(np.isfinite(w).all() for w in current)


def test_resuming_with_another_configuration_is_refused_naming_it(tmp_path, no_leftovers, capsys,
                                                                 one_epoch_checkpoint):
    """The first request by the script, as typed; the others by its main()."""
    ckpt = one_epoch_checkpoint(tmp_path / "m.npz")
    other = tmp_path / "other.pkl.gz"
    (tx, ty), valid, test = datasets.read(datasets.SHIPPED)
    datasets.write_pickle(((tx[::-1].copy(), ty[::-1].copy()), valid, test), str(other))
    for i, (args, words) in enumerate([
            (["cpu", "cpu", "--batch-size", 50], "--batch-size 100 there, 50 here"),
            (["cpu", "cpu", "--dataset", other, "--batch-size", 100], "data set (fingerprint)"),
            (["cpu", "cpu", "--l2", 0.01], "--l2 0.0001 there, 0.01 here")]):
        one_line(refused(capsys, *args, "--epochs", 2, "--resume", ckpt, typed=i == 0), 2,
                 f"{ckpt} was trained otherwise: {words}")


def test_a_checkpoint_with_odd_entries_is_refused_in_one_line(tmp_path, no_leftovers, capsys):
    """The first request by the script, as typed; the others by its main()."""
    good = [np.zeros(s, np.float32) for s in SHAPES]
    nan = [w.copy() for w in good]
    nan[0][0, 0] = np.nan
    cases = [(dict(epoch=[1]), "epoch is a 1-d array"),
             (dict(validation_errors=0.1), "validation_errors is a 0-d array"),
             (dict(params=nan), "params_0 holds no finite weights")]
    for i, (change, words) in enumerate(cases):
        state = dict(epoch=1, best_validation_error=0.1, test_error=0.1, validation_errors=[0.1])
        params = change.pop("params", good)
        state.update(change)
        records.save_checkpoint(str(tmp_path / "odd.npz"), params, good, **state)
        one_line(refused(capsys, "cpu", "cpu", "--epochs", 3, "--resume", tmp_path / "odd.npz",
                         typed=i == 0), 2, words)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="needs root and unshare, to give a run a small /dev/shm of its own")
def test_a_small_dev_shm_moves_the_buffers_to_disk_with_a_notice(no_leftovers):
    run = (f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} "
           f"{ROOT / 'dual_mlp.py'} cpu cpu --epochs 1")
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", run],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, DUAL_MLP_TESTS=TOKEN))
    if "mount" in out.stderr and out.returncode:
        pytest.skip(f"no mount namespace here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    assert "notice: /dev/shm has 1 MB free, the run needs" in out.stdout
    assert "its buffers go to a folder on disk" in out.stdout


def test_ctrl_c_under_the_xla_exchange_is_one_line(no_leftovers):
    proc = start_dual("cpu", "cpu", "--exchange", "xla", "--epochs", 1000, env=PACED)
    wait_until_training(proc)
    proc.send_signal(signal.SIGINT)
    code, _, err = finish(proc, timeout=15)
    assert code == 130 and err.strip().splitlines() == ["interrupted (SIGINT)"], err


def test_the_fault_test_passes_beside_another_run_and_leaves_it_alone(tmp_path, no_leftovers):
    """A demo of someone else's on the same machine: the tests neither count
    its workers and folders nor touch them."""
    other = start_dual("cpu", "cpu", "--epochs", 1000, env=PACED, mine=False)
    try:
        # meanwhile: each trains a shorter while
        proc = start_dual("cpu", "cpu", "--epochs", 1000, env=PACED)
        wait_until_training(other)
        theirs = workers_of(other)
        wait_until_training(proc)
        kill_one_worker(proc, 1, "cpu")
        assert other.poll() is None and all(w.is_running() for w in theirs)
        assert not (set(theirs) & set(leftover_workers()))
    finally:
        other.send_signal(signal.SIGINT)
        assert finish(other, timeout=15)[0] == 130
    assert other.pid not in LAUNCHERS


# --- round three (issue 32): what is not a regular file, empty and out-of-range values,
# the signals that end a process by default

@pytest.mark.parametrize("option", ["--json", "--save"])
def test_an_output_that_is_not_a_regular_file_is_refused_and_left_as_it_is(tmp_path, option):
    """A FIFO stands in for a device node (/dev/null, /dev/zero): the finished
    run's rename would replace it with a file, for everyone who writes there."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    out = dual("cpu", "cpu", "--epochs", 1, option, fifo, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"dual_mlp.py: error: argument {option}: {fifo} is not a regular file (a device, FIFO "
        "or socket): an output goes only to a regular file (see --help)"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to make a device node of its own")
@pytest.mark.parametrize("option", ["--json", "--save"])
def test_a_device_node_as_an_output_is_refused_and_stays_a_device(tmp_path, option):
    """A node of /dev/null's own device (1, 3), made in the test's folder:
    the machine's /dev/null is never at stake."""
    node = tmp_path / "null"
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    for name in ("dual_mlp.py", "mlp.py"):
        out = script(name, *cpu_workers(name), "--epochs", 1,
                     option, node, timeout=60)
        one_line(out, 2, f"{node} is not a regular file (a device, FIFO or socket)")
        assert stat.S_ISCHR(os.stat(node).st_mode)


@pytest.mark.parametrize("output", ["/dev/stderr", "/dev/stdout", "/proc/self/fd/1"])
def test_a_process_descriptor_as_an_output_is_refused_before_training(output, capsys):
    """/dev/stderr and the like name whatever a process holds open there (a
    regular file, as root, at times): the run was taken, trained, then
    failed to write (and as root its rename would replace /dev's link)."""
    for option in ("--save", "--json"):
        out = refused(capsys, "cpu", "cpu", "--epochs", 1, option, output)
        one_line(out, 2, f"argument {option}: {output} is a device's or a process's descriptor")


def test_a_fifo_as_resume_is_refused_before_it_is_opened(tmp_path):
    fifo = tmp_path / "ck.npz"
    os.mkfifo(fifo)
    out = dual("cpu", "cpu", "--resume", fifo, timeout=60)  # opened, it would block for ever
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"dual_mlp.py: error: {fifo}: not a regular file"]


@pytest.mark.parametrize("name", ["dual_mlp.py", "mlp.py"])
@pytest.mark.parametrize("args,why", [
    (("--dataset", ""), "argument --dataset: empty: name a data set, or leave the option out "
                        "for the default"),
    (("--seed", "-1"), "argument --seed: must be an integer from 0 to 2**32 - 1, got -1"),
    (("--seed", "99999999999"), "argument --seed: must be an integer from 0 to 2**32 - 1, got "
                                "99999999999")])
def test_an_empty_dataset_or_a_seed_numpy_cannot_take_is_one_line(name, args, why, capsys):
    """By each script's main() in this process (argparse's errors as typed:
    test_cli.py), where no interpreter's start can outlast a limit on a
    busy machine (beside two other suites, one took over 60 s)."""
    out = refused(capsys, *args, name=name)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"{name}: error: {why} (see --help)"]


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGUSR1])
def test_a_hangup_or_user_signal_stops_the_run_in_one_line_and_frees_its_checkpoint(
        tmp_path, no_leftovers, signum):
    """A closed terminal's SIGHUP (or a SIGUSR1) ended the launcher silently,
    its workers orphaned and the checkpoint's lock left behind.  Every other
    signal that would end it silently (SIGQUIT, SIGALRM, ...) is caught by
    the same handler, the launcher's and each worker's: Linux says so."""
    ckpt = tmp_path / "m.npz"
    proc = start_checkpointing(ckpt, "cpu", "cpu", "--epochs", 1000, env=PACED)
    for pid in (proc.pid, *(w.pid for w in workers_of(proc))):
        with open(f"/proc/{pid}/status") as f:
            caught = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
        assert all(caught >> (s - 1) & 1 for s in cli.STOP_SIGNALS), (pid, hex(caught))
    proc.send_signal(signum)
    code, took, err = finish(proc, timeout=STOPS_WITHIN + 10)
    assert code == 128 + signum and took < STOPS_WITHIN
    interrupted(err, signal.Signals(signum).name, ckpt)
    assert not (tmp_path / ".m.npz.lock").exists()
    assert records.load_checkpoint(str(ckpt), SHAPES, records.TRAINING_STATE)[2]["epoch"] >= 1


def test_a_run_started_under_nohup_outlives_its_terminal(no_leftovers):
    """nohup starts a command with SIGHUP ignored: the launcher keeps it so
    (it set its own handler, and a closed terminal ended the run, exit 129),
    and the run trains on to its end."""
    from conftest import STARTED
    proc = subprocess.Popen(["nohup", sys.executable, str(ROOT / "dual_mlp.py"), "cpu", "cpu",
                             "--epochs", "4"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=environment(),
                            start_new_session=True)
    STARTED.append(proc)
    LAUNCHERS.add(proc.pid)  # nohup becomes the launcher
    wait_until_training(proc)
    proc.send_signal(signal.SIGHUP)
    code, _, err = finish(proc, timeout=120)
    assert code == 0, err


def test_what_sits_where_a_lock_goes_is_never_truncated_or_deleted(tmp_path, capsys):
    """A symlink or a user's file named as the lock, or an output named as
    the lock of another: one line each, and every file left as it was (the
    first request by the script, as typed; the others by its main())."""
    data, ckpt, lock = tmp_path / "data.bin", tmp_path / "m.npz", tmp_path / ".m.npz.lock"
    data.write_bytes(b"precious" * 100)
    lock.symlink_to(data)
    out = dual("cpu", "cpu", "--epochs", 1, "--save", ckpt, timeout=60)
    one_line(out, 2, f"{lock}, where {ckpt}'s lock goes, cannot be used")
    assert data.read_bytes() == b"precious" * 100 and lock.is_symlink()
    lock.unlink()
    lock.write_bytes(b"a user's notes")
    out = refused(capsys, "--epochs", 1, "--save", ckpt, name="mlp.py")
    one_line(out, 2, f"{lock} exists and is not a lock this demo made")
    assert lock.read_bytes() == b"a user's notes"
    lock.unlink()
    out = refused(capsys, "cpu", "cpu", "--epochs", 1, "--save", ckpt, "--json", lock)
    one_line(out, 2, f"{lock} is the lock file of {ckpt}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.bin"]


def test_no_run_removes_a_temporary_it_did_not_make(tmp_path):
    """Only a dead run's temporaries of the same name go: a live process's,
    named for a longer name (m.npz beside m), and a user's look-alike stay."""
    keep = [tmp_path / f".m.npz.{os.getpid()}.abcdefgh.tmp", tmp_path / ".m.npz.notes.tmp"]
    for path in keep:
        path.write_bytes(b"keep")
    for save in ("m", "m.npz"):
        out = script("mlp.py", "--epochs", 1, "--save", tmp_path / save, timeout=120)
        assert out.returncode == 0, out.stderr
    assert all(path.read_bytes() == b"keep" for path in keep)


def test_a_summary_may_not_overwrite_a_live_runs_checkpoint(tmp_path, no_leftovers, capsys):
    ckpt = tmp_path / "m.npz"
    live = start_checkpointing(ckpt, "cpu", "cpu", "--epochs", 1000, env=PACED)
    for name in ("dual_mlp.py", "mlp.py"):  # the demo's as typed, the tutorial's by its main()
        out = refused(capsys, *cpu_workers(name), "--epochs", 1, "--json", ckpt, name=name,
                      typed=name == "dual_mlp.py")
        one_line(out, 2, f"{ckpt} is being written by another run (pid {live.pid})")
    live.send_signal(signal.SIGINT)
    assert finish(live, timeout=10)[0] == 130
    assert records.load_checkpoint(ckpt, SHAPES, records.TRAINING_STATE)[2]["epoch"] >= 1


@pytest.mark.parametrize("name", ["dual_mlp.py", "mlp.py"])
def test_a_name_too_long_for_its_temporary_is_refused_before_anything_runs(tmp_path, name):
    out = script(name, *cpu_workers(name), "--epochs", 1,
                 "--save", tmp_path / ("c" * 245), timeout=60)
    one_line(out, 2, "the name is too long: at most")
    assert not list(tmp_path.iterdir())


def on_a_small_disk(disk, size, command):
    """``command`` (sh) with ``disk`` a tmpfs of ``size`` of its own, in a
    private mount namespace (skipped where there is none)."""
    disk.mkdir()
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          f"mount -t tmpfs -o size={size} tmpfs {disk} && {command}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, DUAL_MLP_TESTS=TOKEN))
    if "mount" in out.stderr and out.returncode:
        pytest.skip(f"no mount namespace here: {out.stderr.strip()}")
    return out


SMALL_DISK = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="needs root and unshare, to give a run a small disk "
                                       "of its own")


@SMALL_DISK
@pytest.mark.parametrize("name", ["dual_mlp.py", "mlp.py"])
def test_a_disk_without_room_for_a_checkpoint_is_found_before_training(tmp_path, name):
    disk = tmp_path / "disk"
    out = on_a_small_disk(disk, "2m", f"{sys.executable} {ROOT / name} "
                          f"{' '.join(cpu_workers(name))} --epochs 1 "
                          f"--save {disk}/m.npz")
    one_line(out, 2, f"cannot write {disk}/m.npz: no space left on device")
    assert "training" not in out.stdout


@SMALL_DISK
@pytest.mark.parametrize("name,args,ends", [
    ("dual_mlp.py", "cpu cpu --epochs 2 --batch-size 20",
     ["could not write {disk}/m.npz (No space left on device)"] * 2 +
     ["no checkpoint could be written to {disk}/m.npz"]),
    # mlp.py writes at its end: enough epochs for the filler to come first on a busy machine
    ("mlp.py", "--epochs 50", ["mlp.py: error: could not write {disk}/m.npz: No space left"])])
def test_a_disk_that_fills_mid_run_is_a_failure_naming_the_file(tmp_path, name, args, ends):
    """A disk that fills once training has begun: dual_mlp.py warns at every
    epoch and, as it could write no checkpoint at all, exits 1 saying so;
    mlp.py, which writes once at the end, exits 1 naming the file."""
    disk = tmp_path / "disk"
    run = f"{sys.executable} {ROOT / name} {args} --save {disk}/m.npz"
    fill = f"dd if=/dev/zero of={disk}/fill bs=64k 2>/dev/null"
    out = on_a_small_disk(disk, "4m", f"{{ {run}; echo exit=$?; }} | while IFS= read -r line; "
                          "do echo \"$line\"; case \"$line\" in "
                          f"'... training'*) {fill};; esac; done")
    assert "exit=1" in out.stdout, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == len(ends), out.stderr
    for line, words in zip(lines, ends):
        assert words.format(disk=disk) in line, out.stderr


def test_a_checkpoint_holds_exactly_what_the_demo_writes(tmp_path, no_leftovers, capsys):
    """An extra array, a member that is not an array, a config that is not
    a JSON object or lacks a field, a zip that declares more than a
    checkpoint holds: one line each, before any worker starts (the first
    request by the script, as typed; the others by its main())."""
    import zipfile
    good = [np.zeros(s, np.float32) for s in SHAPES]
    state = dict(epoch=1, best_validation_error=0.1, test_error=0.1, validation_errors=[0.1])
    config = dict(batch_size=100, learning_rate=0.13, n_hidden=500, l1=0.0, l2=0.0001,
                  average_every=1, workers=2, dataset="x")
    path = tmp_path / "odd.npz"

    def save(**more):
        records.save_checkpoint(str(path), good, good, **{**state, "config": config, **more})

    def with_member(name, data):
        save()
        with zipfile.ZipFile(path, "a") as z:
            z.writestr(name, data, compress_type=zipfile.ZIP_DEFLATED)

    def lacking(key):
        save(config={k: v for k, v in config.items() if k != key})

    cases = [(lambda: save(extra=np.zeros(10)),
              "holds extra, which no checkpoint of this demo has"),
             (lambda: with_member("notes.txt", "hi"), "holds notes.txt, which is not an array"),
             (lambda: with_member("big.npy", b"\0" * (256 << 20)),
              "more than any checkpoint of this model"),
             (lambda: save(config=[1, 2]), "its config is not a JSON object"),
             (lambda: lacking("learning_rate"), "its config has learning_rate = None"),
             (lambda: save(config=dict(config, n_hidden="500")), "its config has n_hidden = '500'")]
    for i, (write, words) in enumerate(cases):
        write()
        one_line(refused(capsys, "cpu", "cpu", "--epochs", 3, "--resume", path, typed=i == 0), 2,
                 words)


def test_a_checkpoint_rewritten_as_the_run_starts_is_resumed_as_it_was_checked(
        tmp_path, no_leftovers, one_epoch_checkpoint):
    """The launcher reads --resume once: whatever writes the file after its
    check (here, while the launcher is held stopped between that read and
    its workers' load), both workers resume the version that was checked,
    and the file is left as the writer left it."""
    ckpt, after = one_epoch_checkpoint(tmp_path / "m.npz"), tmp_path / "after.npz"
    _, _, checked = records.load_checkpoint(str(ckpt), SHAPES, records.TRAINING_STATE)
    proc = start_dual("cpu", "cpu", "--epochs", 2, "--resume", ckpt, "--save", after,
                      env={"DUAL_MLP_FAULT": "launcher:spawned:stop"})
    wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, 120,
             "the launcher to stop itself once it has read the checkpoint")
    ckpt.write_bytes(b"a writer's half-written file")
    os.kill(proc.pid, signal.SIGCONT)
    code, _, err = finish(proc, timeout=300)
    assert code == 0, err
    _, _, resumed = records.load_checkpoint(str(after), SHAPES, records.TRAINING_STATE)
    assert resumed["epoch"] == 2
    assert resumed["validation_errors"][0] == checked["validation_errors"][0]
    assert ckpt.read_bytes() == b"a writer's half-written file"


def test_a_data_set_rewritten_as_the_run_starts_is_trained_on_as_it_was_checked(
        tmp_path, no_leftovers, one_epoch_checkpoint):
    """The launcher reads --dataset once, checks it, fingerprints it, and
    hands the workers that copy: a file rewritten after the check (every
    training label shifted by one, while the launcher is held stopped) is
    not what they train on (issue 49.1: 97.6 % validation error)."""
    data = tmp_path / "d.pkl.gz"
    shutil.copy(datasets.SHIPPED, data)
    (tx, ty), valid, test = datasets.read(datasets.SHIPPED)
    _, _, uninterrupted = records.load_checkpoint(
        str(one_epoch_checkpoint(tmp_path / "m.npz")), SHAPES, (*records.TRAINING_STATE, "config"))
    proc = start_dual("cpu", "cpu", "--epochs", 1, "--dataset", data, "--batch-size", 100,
                      "--save", tmp_path / "tt.npz",
                      env={"DUAL_MLP_FAULT": "launcher:spawned:stop"})
    wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, 120,
             "the launcher to stop itself once it has checked the data")
    datasets.write_pickle((((tx, (ty + 1) % 10)), valid, test), str(data))
    os.kill(proc.pid, signal.SIGCONT)
    code, _, err = finish(proc, timeout=300)
    assert code == 0, err
    _, _, trained = records.load_checkpoint(str(tmp_path / "tt.npz"), SHAPES,
                                            (*records.TRAINING_STATE, "config"))
    assert trained["validation_errors"][0] == uninterrupted["validation_errors"][0] < 0.5
    assert trained["config"]["dataset"] == uninterrupted["config"]["dataset"]


THREADS = "not a number of threads (a positive integer): set it to one, or unset it"


@pytest.mark.parametrize("name,env,args,why", [
    ("dual_mlp.py", {"OMP_NUM_THREADS": "abc"}, (), f"OMP_NUM_THREADS=abc: {THREADS}"),
    ("mlp.py", {"OMP_NUM_THREADS": "abc"}, (), f"OMP_NUM_THREADS=abc: {THREADS}"),
    ("mlp.py", {"NUMBA_NUM_THREADS": "0"}, (), f"NUMBA_NUM_THREADS=0: {THREADS}"),
    ("dual_mlp.py", {"DUAL_MLP_FAULT": "0:train"}, ("cpu", "cpu"),
     "DUAL_MLP_FAULT=0:train: expected RANK:WHERE:HOW (the fault tests' hook)"),
    ("dual_mlp.py", {}, ("cpu", "cpu", "--exchange", "xla", "--timeout", "1e10"),
     "argument --timeout: must be a number of seconds above 0, at most 1e6, got 1e10")])
def test_a_variable_or_a_timeout_nothing_can_take_is_one_line(name, env, args, why):
    out = script(name, *args, "--epochs", 1, env=env, timeout=60)
    one_line(out, 2, f"{name}: error: {why}")


@pytest.mark.parametrize("name", ["dual_mlp.py", "mlp.py"])
def test_a_closed_stdout_ends_quietly(name, tmp_path):
    """Started with its standard output closed (``>&-``), a run trains and
    writes its files, with nothing on its error output."""
    run = (f"exec {sys.executable} {ROOT / name} {' '.join(cpu_workers(name))} "
           f"--epochs 1 --json {tmp_path / 'run.json'} >&-")
    out = subprocess.run(["sh", "-c", run], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, DUAL_MLP_TESTS=TOKEN))
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert (tmp_path / "run.json").exists()


def test_divergence_is_caught_by_its_cost_and_names_what_was_large(tmp_path, no_leftovers):
    """Weights that grow huge but finite make the cost infinite: the run stops
    there, and the message names --l2 or the learning rate, whichever was
    large.  Pixels beyond float32's range are refused at once."""
    import gzip
    import pickle
    (tx, ty), valid, test = [(x.astype(np.float64), y) for x, y in conftest_splits()]
    path = tmp_path / "scaled.pkl.gz"
    path.write_bytes(gzip.compress(pickle.dumps(((tx * 1e300, ty), valid, test))))
    out = dual("cpu", "cpu", "--epochs", 3, "--batch-size", 10, "--dataset", path)
    one_line(out, 2, "train images hold values beyond float32's range (up to")
    for args, words in ((("--learning-rate", 1e6, "--batch-size", 500),
                         "the cost is no longer finite (NaN or inf): the training "
                         "diverged; is --learning-rate 1e+06 too large?"),
                        (("--l2", 1e30), "--l2 1e+30 is too large for --learning-rate 0.13: each "
                                         "step scales the weights by 1 - 2 * rate * l2")):
        one_line(dual("cpu", "cpu", "--epochs", 3, *args), 1, words)


@pytest.mark.parametrize("name", ["dual_mlp.py", "mlp.py"])
def test_a_model_too_big_for_memory_is_refused_before_it_is_built(name):
    """(Built, it would end in the kernel's OOM killer: exit 137, no word.)"""
    out = script(name, *cpu_workers(name), "--n-hidden",
                 20000000, "--epochs", 1, timeout=300)  # a start-up beside a busy suite
    one_line(out, 2, "the model with --n-hidden 20000000 needs about", "GiB available")


def test_a_run_whose_folder_vanishes_stops_in_one_line(no_leftovers):
    """A cleaner of temporary files takes the run folder mid-run: the workers
    notice within a heartbeat, and the run ends in one line, not a hang."""
    proc = start_dual("cpu", "cpu", "--epochs", 100000, "--timeout", 600, env=PACED)
    wait_until_training(proc)
    (folder,) = [d for d in run_directories() if f"-{proc.pid}-" in d.name]
    shutil.rmtree(folder, ignore_errors=True)  # what the run, noticing, removes is gone already
    code, seconds, err = finish(proc, timeout=30)
    assert code == 1 and seconds < 10, err
    assert len(err.strip().splitlines()) == 1 and "was removed while the run was using it" in err


@pytest.mark.parametrize("name", ["dual_mlp.py", "mlp.py"])
def test_a_run_leaves_nothing_in_the_temporary_folder(tmp_path, name):
    """PyTensor writes each compiled graph's source to a temporary file it
    never removes (about 40 a run): they go into the run's own folder.
    (mlp.py under Numba: in test_dual.py's Numba test, after the run that
    compiled Numba's ops.)"""
    private = tmp_path / "tmp"
    private.mkdir()
    out = script(name, *cpu_workers(name), "--epochs", 1, env={"TMPDIR": str(private)},
                 timeout=300)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in private.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="needs root and unshare, to give a run a full /dev/shm of its own")
def test_a_deep_tmpdir_with_a_full_dev_shm_moves_the_sockets_to_tmp(tmp_path, no_leftovers):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    run = (f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} "
           f"{ROOT / 'dual_mlp.py'} cpu cpu --epochs 1")
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", run],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, DUAL_MLP_TESTS=TOKEN, TMPDIR=str(deep)))
    if "mount" in out.stderr and out.returncode:
        pytest.skip(f"no mount namespace here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    assert f"notice: {deep} is too deep a folder for the run's sockets" in out.stdout
    assert not list(deep.iterdir())


@pytest.mark.parametrize("mask,mode", [(0o077, 0o600), (0o022, 0o644), (0o002, 0o664)])
def test_an_output_takes_the_mode_the_users_umask_gives(tmp_path, mask, mode):
    """Every output is written through ``files.atomic_write`` (checkpoints,
    summaries, traces and their pictures, data files): its mode is what the
    user's umask gives a new file, as ``open()`` would make it, not 0644."""
    from multi_gpu import files
    old = os.umask(mask)
    try:
        assert files.umask() == mask
        with files.atomic_write(tmp_path / "out.json") as f:
            f.write(b"{}")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "out.json").st_mode & 0o777 == mode


def test_a_run_beside_another_of_the_same_user_says_they_share_the_cores(no_leftovers):
    """Two demos at once: the second says, as it starts, that the first's
    launcher runs on this machine too, and that the runs share its cores."""
    from conftest import PACED, start_dual, wait_until_training
    first = start_dual("cpu", "cpu", "--epochs", 1000, env=PACED)
    try:
        wait_until_training(first)
        out = dual("cpu", "cpu", "--epochs", 1, timeout=300)
        assert out.returncode == 0, out.stderr
        notice = next((line for line in out.stdout.splitlines()
                       if re.match(r"notice: \d+ other dual_mlp\.py launchers? of yours", line)),
                      "")
        assert re.search(rf"\(pid [\d, ]*\b{first.pid}\b[\d, ]*\): (its|their) workers share the "
                         r"cores, and each run is slower than alone$", notice), out.stdout
    finally:
        os.killpg(first.pid, signal.SIGINT)  # a Ctrl-C: it stops, and removes its folders
        first.communicate(timeout=120)
