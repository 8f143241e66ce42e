"""A run never hangs and never loses its work: real processes, real signals."""
import json
import os
import re
import shutil
import signal
import time

import numpy as np
import pytest

from conftest import (
    PACED,
    SHAPES,
    STOPS_WITHIN,
    assert_identical_checkpoints,
    corrupt_cases,
    dual,
    finish,
    interrupted,
    kill_one_worker,
    refused,
    run_directories,
    run_once,
    start_checkpointing,
    start_dual,
    two_epochs,
    wait_for,
    wait_until_training,
    workers_of,
)
from multi_gpu import files, records
from multi_gpu.devices import usable_gpus


@pytest.mark.parametrize("fault,cause", [
    ("1:start:raise", "RuntimeError: fault injected at start"),
    ("0:train:kill", "killed by SIGKILL"),
    ("1:train:raise", "RuntimeError: fault injected at train"),
    ("1:exchange:kill", "killed by SIGKILL"),
    ("0:exchange:oom", "Unable to allocate"),
    ("1:train:hint", "RuntimeError: fault injected at train (exit code 1)"),  # not the HINT line
])
def test_a_dying_worker_stops_the_run_and_is_named(no_leftovers, fault, cause):
    out = dual("cpu", "cpu", "--epochs", 3, env={"DUAL_MLP_FAULT": fault}, timeout=120)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    rank = fault.split(":")[0]
    assert last.startswith(f"error: worker {rank} (device cpu) failed: ") and cause in last


def test_the_worker_named_is_the_cause_not_a_peer_that_failed_after_it():
    """Both workers fail with a traceback: worker 1 raised, and worker 0's
    send, between its poll and its send, found worker 1's socket gone
    (zmq.Again): the launcher names the one whose error came first, whatever
    its rank.  A signal's kill, then our own one-line words, come before."""
    import types

    from multi_gpu.launcher import by_cause

    def worker(rank, code, said, at):
        return types.SimpleNamespace(rank=rank, proc=types.SimpleNamespace(returncode=code),
                                     said_why=lambda: said, last_word=at)
    raised, peer_gone = worker(1, 1, False, 10.0), worker(0, 1, False, 10.2)
    assert by_cause([peer_gone, raised]) == [raised, peer_gone]
    killed, worded = worker(2, -9, False, 11.0), worker(3, 1, True, 12.0)
    assert by_cause([peer_gone, raised, worded, killed]) == [killed, worded, raised, peer_gone]


def test_launcher_stops_within_10_s_of_a_worker_killed_from_outside(no_leftovers):
    proc = start_dual("cpu", "cpu", "--epochs", 1000, env=PACED)
    wait_until_training(proc)
    took = kill_one_worker(proc, 1, "cpu")
    print(f"launcher stopped {took:.2f} s after the worker was killed")


def test_a_stalled_peer_is_reported_after_the_timeout(no_leftovers):
    proc = start_dual("cpu", "cpu", "--epochs", 1000, "--timeout", 2, env=PACED)
    wait_until_training(proc)
    workers_of(proc)[1].send_signal(signal.SIGSTOP)
    code, took, err = finish(proc, timeout=15)
    assert code == 1
    assert "worker 1 did not reach barrier" in err and "within 2 s" in err


@pytest.mark.parametrize("target", ["group", "launcher"])
def test_ctrl_c_stops_everything_and_keeps_the_checkpoint(tmp_path, no_leftovers, target):
    ckpt = tmp_path / "m.npz"
    proc = start_checkpointing(ckpt, "cpu", "cpu", "--epochs", 1000, env=PACED)
    time.sleep(0.3)
    if target == "group":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    code, took, err = finish(proc, timeout=STOPS_WITHIN + 10)
    assert code == 130 and took < STOPS_WITHIN
    interrupted(err, "SIGINT", ckpt)
    _, _, state = records.load_checkpoint(str(ckpt), SHAPES)
    assert state["epoch"] >= 1


def test_killing_the_launcher_takes_its_workers_along(no_leftovers):
    proc = start_dual("cpu", "cpu", "--epochs", 1000, env=PACED)
    wait_until_training(proc)
    workers = workers_of(proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    wait_for(lambda: not any(w.is_running() and w.status() != "zombie" for w in workers),
             10, "the orphaned workers to stop")


def test_a_worker_left_without_launcher_and_peer_still_exits(no_leftovers):
    """Its peer gone, a zmq PAIR socket blocks a plain send forever: the
    worker must still notice the launcher's death and leave."""
    proc = start_dual("cpu", "cpu", "--epochs", 1000, env=PACED)
    wait_until_training(proc)
    survivor, victim = workers_of(proc)
    proc.send_signal(signal.SIGKILL)  # the launcher first: it is not there to clean up
    victim.send_signal(signal.SIGKILL)
    proc.communicate()
    wait_for(lambda: not survivor.is_running() or survivor.status() == "zombie", 10,
             "the worker left alone to exit")


def test_two_runs_at_once_both_succeed(tmp_path, no_leftovers):
    runs = [start_dual("cpu", "cpu", "--epochs", 2, "--json", tmp_path / f"{i}.json")
            for i in range(2)]
    for run in runs:
        code, _, err = finish(run, timeout=300)
        assert code == 0, err
    for i in range(2):
        assert json.loads((tmp_path / f"{i}.json").read_text())["epochs_run"] == 2


def bad_requests(tmp_path):
    yield ["gpu0", "gpu1"], "unknown device 'gpu0'"
    yield ["0", "1"], "GPU asked for, but none is usable"
    yield ["cpu", "cpu", "--batch-size", "1501"], "batch size 1501 is too large"
    for option in ("--epochs", "--batch-size", "--n-hidden"):
        yield ["cpu", "cpu", option, "0"], f"argument {option}: must be a positive integer"
    yield ["cpu", "cpu", "--learning-rate", "-0.1"], "argument --learning-rate: must be a positive"
    yield ["cpu", "cpu", "--epochs", "ten"], "argument --epochs: not a number: ten"
    for path, words in corrupt_cases(tmp_path).values():
        yield ["cpu", "cpu", "--dataset", path], words
    yield ["cpu", "cpu", "--resume", tmp_path / "none.npz"], "checkpoint not found"
    (tmp_path / "junk.npz").write_bytes(b"junk")
    yield ["cpu", "cpu", "--resume", tmp_path / "junk.npz"], "not a readable checkpoint"


def test_bad_input_gets_one_line_exit_2_and_starts_nothing(tmp_path, no_leftovers, capsys):
    """The first request by the script, as typed; the others by its main()."""
    if usable_gpus()[0]:
        pytest.skip("the no-GPU errors need a machine without a usable GPU (see test_gpu.py)")
    for i, (args, words) in enumerate(bad_requests(tmp_path)):
        out = refused(capsys, *args, typed=i == 0)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2, (args, out.stderr)
        assert len(lines) == 1 and words in lines[0], (args, out.stderr)
        assert "... building" not in out.stdout, args  # no worker was started


def test_checkpoint_writes_are_atomic(tmp_path):
    path = tmp_path / "m.npz"
    params = [np.full(s, 1.0, np.float32) for s in SHAPES]
    records.save_checkpoint(str(path), params, params, epoch=1)

    class Crash(Exception):
        pass
    with pytest.raises(Crash):
        with files.atomic_write(str(path)) as f:
            f.write(b"half a checkpoint")
            raise Crash
    current, _, state = records.load_checkpoint(str(path), SHAPES)
    assert state["epoch"] == 1 and all((p == 1.0).all() for p in current)
    assert os.listdir(tmp_path) == ["m.npz"]  # no temporary file left behind


def test_a_run_killed_at_any_moment_leaves_a_loadable_checkpoint(tmp_path):
    ckpt = tmp_path / "m.npz"
    before = run_directories()
    for delay in (0.05, 0.17, 0.31):  # checkpoints are written every ~0.3 s here
        proc = start_dual("cpu", "cpu", "--epochs", 1000, "--save", ckpt, env=PACED)
        wait_until_training(proc)
        wait_for(ckpt.exists, 60, "a checkpoint")
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGKILL)  # launcher and workers at once, mid-write maybe
        proc.communicate()
        _, _, state = records.load_checkpoint(str(ckpt), SHAPES)
        assert state["epoch"] >= 1
        # a write cut short leaves at most its hidden temporary beside the checkpoint
        assert all(p.name == "m.npz" or p.name.startswith(".m.npz.") for p in tmp_path.iterdir())
    for leftover in run_directories() - before:  # nobody was left alive to remove it
        shutil.rmtree(leftover)


def four_epochs():
    """An uninterrupted run of four epochs' checkpoint (made once: ``run_once``)."""
    folder, _ = run_once("four_epochs", "cpu", "cpu", "--epochs", 4, "--save",
                         "{folder}/full.npz")
    return folder / "full.npz"


def test_a_resume_without_epochs_goes_on_to_the_epochs_its_run_asked_for(tmp_path,
                                                                         one_epoch_checkpoint):
    """A run stopped at epoch 1 of the 40 it asked for goes on to 40, and
    says so; one that finished what it asked goes to the default; --epochs
    given is what it says (the request as the launcher checks it)."""
    import dual_mlp
    from multi_gpu import request
    ckpt = one_epoch_checkpoint(tmp_path / "m.npz")
    params, best, state = records.load_checkpoint(str(ckpt), SHAPES,
                                                  (*records.TRAINING_STATE, "config"))
    assert state["config"]["epochs"] == 1  # the run's own --epochs, recorded
    stopped = tmp_path / "stopped.npz"
    records.save_checkpoint(str(stopped), params, best, **dict(state, config=dict(
        state["config"], epochs=40)))
    for path, given, epochs, words in (
            (stopped, [], 40, f"notice: --resume {stopped}: trains on to epoch 40, as its run "
                              "asked (see --epochs)"),
            (ckpt, [], dual_mlp.EPOCHS, f"notice: --resume {ckpt}: trains on to epoch "
                                        f"{dual_mlp.EPOCHS}, the default (see --epochs)"),
            (stopped, ["--epochs", 5], 5, None)):
        args = dual_mlp.parse_args(["cpu", "cpu", "--resume", str(path), *map(str, given)])
        plan, notices = request.check_request(
            args, SHAPES, command="python dual_mlp.py", batch_size=dual_mlp.BATCH_SIZE,
            shipped_batch_size=dual_mlp.SHIPPED_BATCH_SIZE,
            steps_per_call=dual_mlp.STEPS_PER_CALL, epochs=dual_mlp.EPOCHS,
            choices=dual_mlp.CHOICES)
        assert plan.epochs == epochs and plan.trained_with["epochs"] == epochs
        assert args.epochs == (given[1] if given else None)  # the parsed options, untouched
        assert [n for n in notices if "--resume" in n] == ([words] if words else []), notices


def test_resumed_run_ends_with_the_same_weights_as_an_uninterrupted_one(tmp_path):
    full = four_epochs()
    shutil.copyfile(two_epochs() / "m.npz", tmp_path / "half.npz")
    out = dual("cpu", "cpu", "--epochs", 4, "--resume", tmp_path / "half.npz", "--save",
               tmp_path / "resumed.npz")
    assert out.returncode == 0, out.stderr
    assert "resumed from" in out.stdout and "epoch 3/4:" in out.stdout
    assert "epoch 1/4:" not in out.stdout
    assert_identical_checkpoints(full, tmp_path / "resumed.npz")
    out = dual("cpu", "cpu", "--epochs", 4, "--resume", full)
    assert out.returncode == 2 and "already at epoch 4" in out.stderr


def test_the_last_message_before_a_close_is_delivered(tmp_path):
    """A worker that sends its last message (the final --check exchange) and
    closes its socket at once must not lose it: the peer would wait for it
    until its timeout (seen once in CI, as worker 0 stalled in the replica check)."""
    import threading

    import numpy as np

    import dual_mlp
    from multi_gpu.sockets import Peer
    big = np.arange(16 << 20, dtype=np.float32)  # 64 MB: still in flight at the close
    got = {}

    def last_to_finish():
        peer = Peer(str(tmp_path), 0, 2, timeout=30)
        got["array"] = dual_mlp.swap(peer, "small")[1]
        peer.close()

    thread = threading.Thread(target=last_to_finish)
    thread.start()
    peer = Peer(str(tmp_path), 1, 2, timeout=30)
    assert dual_mlp.swap(peer, big)[0] == "small"
    peer.close()  # at once, as a worker that has finished
    thread.join(40)
    assert not thread.is_alive() and np.array_equal(got["array"], big)


def test_a_barrier_timeout_names_the_worker_that_stopped_not_one_waiting_for_it(tmp_path):
    """Three workers; worker 2 stops after its message of a barrier reached
    worker 0 but not worker 1.  Worker 0 passes that barrier and, at the
    next, waits first for worker 1, who only waits for worker 2: the stall
    must be named after the worker whose heartbeat stopped (seen in CI as
    "worker 1 did not reach barrier 2").  Here worker 1 keeps its heartbeat
    and never answers, worker 2's heartbeat is a minute old."""
    import dual_mlp
    from multi_gpu.sockets import Peer, PeerError
    from multi_gpu.worker import heartbeat_path
    for rank in (1, 2):
        open(heartbeat_path(str(tmp_path), rank), "w").close()
    stale = time.time() - 60
    os.utime(heartbeat_path(str(tmp_path), 2), (stale, stale))
    peer = Peer(str(tmp_path), 0, 3, timeout=0.5)
    try:
        with pytest.raises(PeerError, match=r"^worker 2 did not reach barrier 1 within 0.5 s"):
            dual_mlp.barrier(peer)
    finally:
        peer.close()


def test_max_restarts_brings_a_killed_worker_back_to_the_uninterrupted_weights(
        tmp_path, no_leftovers, one_epoch_checkpoint):
    """--max-restarts 1, as torchrun's, where --save holds another run's
    checkpoint (the run says at its start that it replaces it): a worker
    SIGKILLed at a random step of the run's first epochs, every worker
    starts again from this run's own last checkpoint, or from the start
    before its first, never from the other run's; the launcher says so in
    one line, and the run ends exit 0 with the weights of a run never
    interrupted, bit for bit."""
    import random
    ckpt = tmp_path / "restarted.npz"
    params, best, state = records.load_checkpoint(
        str(one_epoch_checkpoint(tmp_path / "other.npz")), SHAPES, records.TRAINING_STATE)
    records.save_checkpoint(str(ckpt), [p / 2 for p in params], best, **state)  # another run's
    # paced: beside two other suites an unpaced run of four epochs had ended before the kill
    proc = start_dual("cpu", "cpu", "--epochs", 4, "--save", ckpt, "--max-restarts", 1,
                      env=PACED)
    said = "".join(read_until_training(proc))
    assert f"notice: --save {ckpt} holds another run's checkpoint (epoch 1): this run replaces " \
        "it" in said, said
    time.sleep(random.uniform(0, 0.15))  # four paced epochs take seconds
    victim = random.choice(workers_of(proc))
    victim.send_signal(signal.SIGKILL)
    code, _, err = finish(proc, timeout=120)
    assert code == 0, err
    restarts = [line for line in err.splitlines() if "restarting every worker" in line]
    assert len(restarts) == 1 and "failed: killed by SIGKILL" in restarts[0], err
    assert restarts[0].endswith("(restart 1 of 1)")
    print(restarts[0])
    assert_identical_checkpoints(ckpt, four_epochs(), records.TRAINING_STATE)


def read_until_training(proc):
    """What the launcher printed up to worker 0's '... training' line, that line too."""
    said = []
    for line in proc.stdout:
        said.append(line)
        if line.startswith("... training"):
            return said
    raise AssertionError(f"run ended before training: {proc.stderr.read()}")


def test_a_restart_past_the_trace_window_still_writes_the_trace(tmp_path, no_leftovers):
    """--trace with its window in the first epoch, a worker killed in the
    second: the restart, from the run's last checkpoint, says that the
    window moves to the epoch it trains first, and the trace and its picture
    are written, of that window; the weights are the uninterrupted run's."""
    ckpt, traced = tmp_path / "t.npz", tmp_path / "t.json"
    # paced: on a busy machine an unpaced run had ended before the kill reached it
    proc = start_dual("cpu", "cpu", "--epochs", 4, "--save", ckpt, "--max-restarts", 1,
                      "--trace", traced, "--trace-from", 1, "--trace-steps", 5, env=PACED)
    wait_for(lambda: next((line for line in iter(proc.stdout.readline, "")
                           if line.startswith("epoch 2/")), None), 120, "epoch 2")
    workers_of(proc)[1].send_signal(signal.SIGKILL)
    code, _, err = finish(proc, timeout=120)
    assert code == 0, err
    restart = next(line for line in err.splitlines() if "restarting every worker" in line)
    resumed = re.search(rf"from {re.escape(str(ckpt))} at epoch (\d), --trace now from epoch "
                        r"(\d) \(its window was behind the restart\)", restart)
    assert resumed and int(resumed[2]) == int(resumed[1]) + 1, restart
    document = json.loads(traced.read_text())
    assert document["otherData"]["window"]["epoch"] == int(resumed[2])
    assert traced.with_suffix(".png").exists()
    assert_identical_checkpoints(ckpt, four_epochs(), records.TRAINING_STATE)


def test_a_worker_still_compiling_past_the_timeout_is_waited_for(no_leftovers):
    """A worker held back before it makes its links (``1:start:slow``: as a
    first Numba compile on a busy machine, for longer than --timeout), its
    heartbeat going on: the other waits for it at the handshake, worker 0
    says so once, and the run ends exit 0 (it ended at the timeout, naming
    a worker that had not stalled)."""
    from multi_gpu.hooks import SLOW_S
    timeout = SLOW_S // 3
    out = dual("cpu", "cpu", "--epochs", 1, "--timeout", timeout,
               env={"DUAL_MLP_FAULT": "1:start:slow"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count(f"worker 0: notice: worker 1 is still compiling after {timeout} s: "
                            "the handshake waits for it") == 1, out.stderr


def test_node_0_started_again_takes_the_newest_kept_copy_that_checks_out(capsys):
    """Node 0 started again, the others' copies of the run's checkpoint:
    one that does not check out (truncated, at a later epoch than the good
    one) is said and left; the next newest that checks out is taken, and
    the plan resumes from it, as the run its file names (the node knew the
    run by the name a node 0 started again gave it before it adopted it)."""
    import base64
    import types

    import dual_mlp
    from multi_gpu import request, resume
    raw = (two_epochs() / "m.npz").read_bytes()
    run, epoch = records.written_by("m.npz", SHAPES, raw)
    plan, _ = request.check_request(
        dual_mlp.parse_args(["cpu", "cpu", "--epochs", "4"]), SHAPES, command="python dual_mlp.py",
        batch_size=dual_mlp.BATCH_SIZE, shipped_batch_size=dual_mlp.SHIPPED_BATCH_SIZE,
        steps_per_call=dual_mlp.STEPS_PER_CALL, epochs=dual_mlp.EPOCHS, choices=dual_mlp.CHOICES)
    copies = [dict(who="node 2 (10.0.0.3)", rank=2, run=run, generation=0, epoch=epoch + 1,
                   checkpoint=base64.b64encode(raw[:len(raw) // 2]).decode()),
              dict(who="node 1 (10.0.0.2)", rank=1, run="0123456789abcdef", generation=0,
                   epoch=epoch, checkpoint=base64.b64encode(raw).decode())]
    adopted = []
    link = types.SimpleNamespace(kept_by_others=lambda every: copies, adopt=adopted.append)
    resumed, words = resume.adopt(plan, SHAPES, link)
    assert words == f"from node 1's copy of the run's checkpoint at epoch {epoch}"
    assert resumed.run_id == run and resumed.resume_epoch == epoch and adopted == [run]
    assert resumed.checked_resume == raw and plan.resume is None  # a new plan; the old as it was
    said = capsys.readouterr().err
    assert said.startswith("node 0: node 2 (10.0.0.3) kept the run, but ") and \
        said.rstrip().endswith(": its copy is not taken"), said


def test_a_failure_past_the_last_restart_says_the_restarts_are_used_up(no_leftovers):
    """--max-restarts 1 and a worker that fails in every launch: the run
    restarts once, saying it is its last, then ends in one line that says
    its restarts are used up."""
    out = dual("cpu", "cpu", "--epochs", 1, "--max-restarts", 1,
               env={"DUAL_MLP_FAULT": "1:train:raise"}, timeout=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and "(restart 1 of 1)" in lines[0], out.stderr
    assert lines[-1].startswith("error: worker 1 (device cpu) failed: ") and lines[-1].endswith(
        "; the run's restarts are used up (--max-restarts 1)"), out.stderr
