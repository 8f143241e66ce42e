"""Nobody else gets in: another user of the machine (played by uid 65534,
``nobody``, through ``setpriv`` where the tests run as root), a stranger at
node 0's lobby or at JAX's coordinator (on 127.0.0.1 only), data that only
looks the same."""
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import psutil
import pytest

from conftest import (
    PACED,
    SECRET,
    SHAPES,
    dual,
    finish,
    leftover_workers,
    refused,
    run_folder_of,
    start_dual,
    wait_for,
    workers_of,
)
from multi_gpu import datasets, files, records
from multi_gpu.nodes import free_port

NOBODY = 65534
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                             reason="needs root, to act as another user (setpriv)")


def as_nobody(*command, **kw):
    """``command`` run as another user of this machine (uid and gid 65534)."""
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           *command], capture_output=True, text=True, timeout=60, **kw)


def their_python():
    """A Python the other user can run (this one may live in a folder of
    root's alone), for the few lines of the standard library they try."""
    for python in (sys.executable, "/usr/bin/python3"):
        if os.path.exists(python) and as_nobody(python, "-c", "print(1)").stdout.strip() == "1":
            return python
    pytest.skip("no Python that another user can run here")


def name_in_memory(pid, pattern):
    """What matches ``pattern`` (bytes) in a process's writable memory, read
    as root can (/proc/PID/mem): where a name no file or command line shows
    lies."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if not perms.startswith("rw"):
                continue
            start, end = (int(x, 16) for x in span.split("-"))
            try:
                mem.seek(start)
                found = re.search(pattern, mem.read(end - start))
            except (OSError, OverflowError, ValueError):
                continue
            if found:
                return found.group().decode()
    raise AssertionError(f"{pattern!r} is nowhere in process {pid}'s memory")


def workers_and_run_folder(proc):
    """A launcher's two workers and its run folder, once they are there."""
    workers = wait_for(lambda: len(workers_of(proc)) == 2 and workers_of(proc), 60,
                       "the workers to start")
    return workers, run_folder_of(proc)


@AS_ROOT
def test_another_user_can_neither_learn_nor_take_the_run_folder(tmp_path):
    """The launcher is held (SIGSTOP) between starting its workers and making
    the folder: the moment another user would need the folder's name.  It is
    on no command line and in no environment, only in the processes' memory
    (the workers are forked), which is not theirs to read.  Even a stranger
    who had it and made the folder first (with a request of their choosing,
    and heartbeat files that are links to a root-only file) gets nothing: the
    run stops in one line and leaves their folder and the linked file as
    they were."""
    precious = tmp_path / "precious"
    precious.write_text("root's own")
    precious.chmod(0o600)
    proc = start_dual("cpu", "cpu", "--epochs", 1000,
                      env={"DUAL_MLP_FAULT": "launcher:spawned:stop"})
    try:
        wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, 60,
                 "the launcher to stop itself")
        workers = wait_for(lambda: len(workers_of(proc)) == 2 and workers_of(proc), 60,
                           "the workers to start")
        folder = name_in_memory(workers[0].pid, rb"/(?:dev/shm|tmp)/dual_mlp-%d-[0-9a-f]{16}"
                                % proc.pid)  # where run_folders() looks; another prefix is noise
        for p in [psutil.Process(proc.pid)] + workers:
            assert not any(os.path.basename(folder) in arg for arg in p.cmdline()), p.cmdline()
        for secret in ("environ", "mem"):
            peek = as_nobody("cat", f"/proc/{workers[0].pid}/{secret}")
            assert peek.returncode != 0 and "Permission denied" in peek.stderr, peek
        plant = as_nobody("sh", "-c", f"mkdir -m 755 {folder} && echo '{{}}' > {folder}/config.json"
                                      f" && ln -s {precious} {folder}/alive-0"
                                      f" && ln -s {precious} {folder}/alive-1")
        assert plant.returncode == 0, plant.stderr
        os.kill(proc.pid, signal.SIGCONT)
        code, _, err = finish(proc, timeout=60)
        assert code == 1 and err.strip().splitlines() == [
            f"error: the run folder {folder} exists already, made by someone else: the run "
            "stops and leaves it as it is"], err
        wait_for(lambda: not leftover_workers(), 10, "the workers to exit")
        assert sorted(os.listdir(folder)) == ["alive-0", "alive-1", "config.json"]
        assert os.stat(folder).st_uid == NOBODY and precious.read_text() == "root's own"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_folder_or_file_that_is_not_this_users_alone_is_neither_trusted_nor_removed(tmp_path):
    """``files.check_folder`` before a byte is read: a link to a good folder,
    a folder others can enter, another user's folder (as root); ``remove_folder``
    leaves each as it is; a file is made only where nothing is, links included."""
    good = tmp_path / "good"
    files.make_folder(str(good))
    files.check_folder(str(good))
    link = tmp_path / "link"
    link.symlink_to(good)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    cases = [(link, "is not a folder (a symbolic link?)"), (shared, "has mode 755, not 700")]
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, NOBODY, NOBODY)
        cases.append((theirs, f"belongs to uid {NOBODY}"))
    for path, words in cases:
        with pytest.raises(files.NotPrivate, match=re.escape(words)):
            files.check_folder(str(path))
        files.remove_folder(str(path))
        assert path.exists()
    target = tmp_path / "target"
    target.write_text("kept")
    (good / "alive-0").symlink_to(target)
    with pytest.raises(FileExistsError):
        files.new_file(str(good / "alive-0"))
    with pytest.raises(OSError):
        files.open_file(str(good / "alive-0"))  # a link is not followed
    assert target.read_text() == "kept"
    files.remove_folder(str(good))
    assert not good.exists() and target.exists()


def test_a_weak_secret_is_one_line(no_leftovers):
    out = dual("cpu", "cpu", "--nodes", 2, "--node-rank", 1, "--coordinator",
               f"127.0.0.1:{free_port()}", env={"DUAL_MLP_SECRET": "short"}, timeout=60)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "dual_mlp.py: error: the run's secret is too short to keep strangers out: at least 16 "
        "characters"], out.stderr


def test_a_secret_file_that_is_no_secret_is_refused_in_one_line(tmp_path, capsys):
    """A folder, bytes that are not text, an empty file (node 0 would make
    its own secret, and the nodes given the file be refused), the file
    named as --trace too (the trace would overwrite the secret), one longer
    than a secret (it was cut to 4096 bytes without a word, and the nodes
    given it whole refused), a link to the secret (refused as a link)."""
    (tmp_path / "folder").mkdir(mode=0o700)
    for name, content in (("binary", b"\xff\xfe" * 20), ("empty", b""), ("sec.json", SECRET),
                          ("long", "x" * 5000)):
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else
                                      content.encode())
        (tmp_path / name).chmod(0o600)
    (tmp_path / "link").symlink_to(tmp_path / "sec.json")
    node0 = ("cpu", "--nodes", 2, "--coordinator", f"127.0.0.1:{free_port()}")
    for args, words in (
            (("--secret-file", tmp_path / "folder"), "must be a regular file of yours"),
            (("--secret-file", tmp_path / "binary"), "does not hold text"),
            (("--secret-file", tmp_path / "empty"), "is empty: put the run's secret in it"),
            (("--secret-file", tmp_path / "sec.json", "--trace", tmp_path / "sec.json"),
             "--trace " + str(tmp_path / "sec.json") + " is --secret-file's file"),
            (("--secret-file", tmp_path / "long"), "holds more than 4096 bytes"),
            (("--secret-file", tmp_path / "link"), "a symbolic link: name the file itself")):
        out = refused(capsys, *node0, *args)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and words in out.stderr, \
            (args, out.stderr)


def test_a_secret_file_others_can_read_is_refused(tmp_path, no_leftovers):
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o644)
    out = dual("cpu", "cpu", "--nodes", 2, "--node-rank", 1, "--coordinator",
               f"127.0.0.1:{free_port()}", "--secret-file", secret, timeout=60)
    assert out.returncode == 2 and "must be a regular file of yours that nobody else can read" \
        in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("named", [False, True])
def test_the_one_machine_coordinator_is_out_of_other_users_reach(no_leftovers, named):
    """``--exchange xla`` on one machine: JAX's coordinator listens on a Unix
    socket inside the private run folder, not on a TCP port another user
    could reach, also where --coordinator names one on the loopback (which
    the run says); as another user a connection to it fails, and the run
    goes on to its end."""
    address = ("--coordinator", f"127.0.0.1:{free_port()}") if named else ()
    # paced (8 epochs of at least 1.5 s): the stranger's interpreter, started on a busy
    # machine, knocks while the run lives
    proc = start_dual("cpu", "cpu", "--exchange", "xla", "--epochs", 8, *address, env=PACED)
    try:
        said = wait_for(lambda: next((
            line for line in iter(proc.stdout.readline, "")
            if line.startswith(("notice: --coordinator", "... training"))), None), 60, "training")
        assert said.startswith("notice: --coordinator 127.0.0.1:") == named, said
        _, folder = workers_and_run_folder(proc)
        coordinator = os.path.join(folder, "coordinator.sock")
        wait_for(lambda: os.path.exists(coordinator), 60, "the coordinator's socket")
        if os.geteuid() == 0 and shutil.which("setpriv"):
            knock = as_nobody(their_python(), "-c", "import socket; s = socket.socket("
                              f"socket.AF_UNIX); s.connect({coordinator!r})")
            assert knock.returncode != 0 and "PermissionError" in knock.stderr, knock.stderr
    finally:
        code, _, err = finish(proc, timeout=120)
    assert code == 0, err


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_a_checkpoint_of_data_that_differs_in_a_few_labels_is_refused_and_left_as_it_was(
        tmp_path, no_leftovers):
    """The fingerprint hashes every byte: five labels changed, none of them
    among the rows an older fingerprint sampled, make another data set.
    Resumed on it, with --save naming the same file, the run is refused in
    one line and the checkpoint stays as it was."""
    splits = datasets.read(datasets.SHIPPED)
    data = tmp_path / "digits.pkl.gz"
    datasets.write_pickle(splits, str(data))
    ckpt = tmp_path / "m.npz"
    out = dual("cpu", "cpu", "--epochs", 1, "--dataset", data, "--batch-size", 100, "--save", ckpt)
    assert out.returncode == 0, out.stderr
    (x, y), valid, test = splits
    y = y.copy()
    for i in (1, 2, 3, 4, 5):  # rows 0, 11, 22, ... were the ones sampled
        y[i] = (y[i] + 1) % 10
    poisoned = tmp_path / "poisoned.pkl.gz"
    datasets.write_pickle(((x, y), valid, test), str(poisoned))
    assert datasets.fingerprint(datasets.read_checked(str(poisoned))) != \
        datasets.fingerprint(datasets.read_checked(str(data)))
    before = digest(ckpt)
    out = dual("cpu", "cpu", "--epochs", 2, "--dataset", poisoned, "--batch-size", 100, "--resume",
               ckpt, "--save", ckpt, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert f"{ckpt} was trained otherwise: data set (fingerprint)" in out.stderr
    assert digest(ckpt) == before


def test_the_fingerprint_changes_with_any_byte_of_any_split():
    splits = [(np.arange(12, dtype=np.uint8).reshape(3, 4), np.arange(3, dtype=np.int32))
              for _ in range(3)]
    seen = {datasets.fingerprint(splits)}
    for s in range(3):
        for k in range(2):
            changed = [tuple(a.copy() for a in split) for split in splits]
            changed[s][k].flat[-1] += 1
            seen.add(datasets.fingerprint(changed))
    assert len(seen) == 7 and all(f.startswith("sha256:") for f in seen)


def test_an_older_checkpoints_sampled_fingerprint_is_refused_in_one_line(tmp_path, no_leftovers,
                                                                        one_epoch_checkpoint):
    """A checkpoint of the 256-row fingerprint cannot be checked against a
    data set: it is refused in one line, not resumed on whatever is given."""
    ckpt = one_epoch_checkpoint(tmp_path / "m.npz")
    params, best, state = records.load_checkpoint(str(ckpt), SHAPES, records.TRAINING_STATE)
    state["config"]["dataset"] = "9839d20ad9612422"  # as the older fingerprint looked
    records.save_checkpoint(str(ckpt), params, best, **state)
    out = dual("cpu", "cpu", "--epochs", 2, "--resume", ckpt, timeout=60)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"dual_mlp.py: error: {ckpt} was written by an older version of the demo, whose data "
        "set fingerprint sampled 256 rows: this one cannot tell whether it was trained on this "
        "data set; start anew"], out.stderr
