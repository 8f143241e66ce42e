"""--trace: the timeline a run writes of its own phases, on the CPU (the GPU
orderings' run on the device: tests/test_gpu.py)."""
import collections
import json
import os

import pytest

from conftest import ROOT, dual, refused, run_once

HOST_PHASES = ["train", "publish", "signal", "copy", "signal", "average"]


@pytest.fixture(scope="module")
def traced():
    """One run of three CPU workers, traced for 8 steps of its second epoch
    (the workers' summary beside it), serving the tests below (made once:
    ``run_once``)."""
    folder, out = run_once("traced", "cpu", "cpu", "cpu", "--epochs", 3, "--trace",
                           "{folder}/run.json", "--trace-steps", 8, "--json",
                           "{folder}/summary.json")
    return folder, json.loads((folder / "run.json").read_text()), out


def spans(document):
    """{worker: [its complete events, in time order]}"""
    by = collections.defaultdict(list)
    for e in document["traceEvents"]:
        if e["ph"] == "X":
            by[e["pid"]].append(e)
    return {w: sorted(es, key=lambda e: e["ts"]) for w, es in by.items()}


def test_the_trace_is_trace_event_json_with_a_process_per_worker(traced):
    folder, document, out = traced
    assert {e["ph"] for e in document["traceEvents"]} == {"M", "X"}
    names = {e["pid"]: e["args"]["name"] for e in document["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "worker 0 (cpu)", 1: "worker 1 (cpu)", 2: "worker 2 (cpu)"}
    for e in document["traceEvents"]:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0 and isinstance(e["args"]["step"], int)
    assert (folder / "run.png").stat().st_size > 10000
    assert f"the timeline of steps from epoch 2 is in {folder / 'run.json'}" in out.stdout


def test_every_worker_has_every_phase_of_every_traced_step_in_order(traced):
    _, document, _ = traced
    steps_per_epoch = json.loads((traced[0] / "summary.json").read_text())["steps_per_epoch"]
    first = steps_per_epoch  # the second epoch's first step, counted from 0
    for worker, events in spans(document).items():
        assert {e["args"]["step"] for e in events} == set(range(first, first + 8)), worker
        for step in range(first, first + 8):
            phases = [e["name"] for e in events if e["args"]["step"] == step
                      and not e["name"].startswith("waiting for worker")]
            assert phases == HOST_PHASES, (worker, step, phases)
        for a, b in zip(events, events[1:]):  # one track: no span overlaps the next
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (worker, a, b)
        moved = [e["args"]["bytes"] for e in events if e["name"] in ("publish", "copy")]
        assert moved and all(n == moved[0] > 1_000_000 for n in moved)


def test_no_worker_leaves_a_barrier_before_the_last_one_arrived(traced):
    """On the machine's one clock: at each signal of each step, every
    worker's leaving comes after every worker's arriving (its wait for a
    later worker, where it waited, is where it arrived)."""
    by_worker = spans(traced[1])
    barriers = collections.defaultdict(list)  # (step, which signal) -> [(arrived, left)]
    for worker, events in by_worker.items():
        count = collections.Counter()
        for i, e in enumerate(events):
            if e["name"] == "signal":
                before = events[i - 1] if i and events[i - 1]["name"].startswith(
                    "waiting for worker") else e
                step = e["args"]["step"]
                barriers[step, count[step]].append((before["ts"], e["ts"] + e["dur"]))
                count[step] += 1
    assert len(barriers) == 16
    waited = 0
    for key, visits in barriers.items():
        assert len(visits) == 3, key
        assert max(a for a, _ in visits) <= min(left for _, left in visits) + 1e-3, (key, visits)
        waited += sum(1 for a, left in visits if left - a > 0)
    assert waited


def test_the_waits_name_a_worker_that_arrived_later(traced):
    for worker, events in spans(traced[1]).items():
        for e in events:
            if e["name"].startswith("waiting for worker"):
                assert int(e["name"].split()[-1]) in {0, 1, 2} - {worker}


def test_under_the_xla_exchange_the_host_runs_ahead_of_the_device(tmp_path):
    out = dual("cpu", "cpu", "--exchange", "xla", "--epochs", 2, "--steps-per-call", 3,
               "--trace", tmp_path / "xla.json", "--trace-steps", 12)
    assert out.returncode == 0, out.stderr
    document = json.loads((tmp_path / "xla.json").read_text())
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in document["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(threads.values()) == {"host", "device"}
    for worker, events in spans(document).items():
        queued = [e for e in events if e["name"] == "queue"]
        done = [e for e in events if e["name"] == "steps"]
        assert [e["args"]["steps"] for e in queued] == [3] * 4 == [e["args"]["steps"]
                                                                   for e in done]
        # the host queued call c + 1 before the device was done with call c
        assert any(q["ts"] < d["ts"] + d["dur"] for q, d in zip(queued[1:], done)), worker


@pytest.mark.parametrize("args, words", [
    (["--trace-steps", 5], "--trace-from and --trace-steps choose what --trace PATH records"),
    (["--trace", "{tmp}/t.json", "--trace-from", 9], "--trace-from 9: the run trains epochs 1 to"),
    (["--trace", "{tmp}/t.json", "--trace-from", 0], "argument --trace-from: must be a positive"),
    (["--trace", "{tmp}/t.json", "--trace-steps", "x"], "argument --trace-steps: not a number"),
    (["--trace", "{tmp}"], "is a folder, not a file"),
    (["--trace", "{tmp}/t.png"], "a .png is the picture beside the trace"),
    (["--trace", "{tmp}/t.json", "--json", "{tmp}/t.json"], "--json and --trace name one file"),
    (["--trace", "{tmp}/t.json", "--json", "{tmp}/t.png"], "name one file"),
    (["--trace", "{data}"], "is --dataset's file: an output never overwrites an input"),
])
def test_a_bad_trace_request_is_one_line_before_anything_starts(tmp_path, args, words,
                                                                 no_leftovers, capsys):
    """By the script's main(), in this process (as typed: test_faults.py's
    test_bad_input_gets_one_line_exit_2_and_starts_nothing)."""
    from multi_gpu import datasets
    args = [str(a).format(tmp=tmp_path, data=datasets.SHIPPED) for a in args]
    out = refused(capsys, "cpu", "cpu", "--epochs", 2, *args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and words in lines[0], out.stderr
    assert "training" not in out.stdout


def test_a_trace_is_held_as_a_checkpoint_is(tmp_path, capsys):
    """A second run asking for a live run's --trace (or its picture) is
    refused (the first as typed, the second by the script's main())."""
    from conftest import finish, start_dual, wait_until_training
    live = start_dual("cpu", "cpu", "--epochs", 1000, "--trace", tmp_path / "t.json")
    try:
        wait_until_training(live)
        for output in ("t.json", "t.png"):
            out = refused(capsys, "cpu", "cpu", "--epochs", 1, "--json", tmp_path / output,
                          typed=output == "t.json")
            assert out.returncode == 2 and "is being written by another run" in out.stderr, \
                out.stderr
    finally:
        live.send_signal(2)
        finish(live, timeout=30)


def test_the_kernels_stamps_go_onto_the_hosts_clock_as_phases_in_order():
    """``trace.kernel_spans``: a GPU's stamps (``struct Stamp``, as the
    kernel writes them) become the device's phases on the host's clock,
    the clocks' drift taken out between the two readings; training only
    between two exchanges of one call; a lost stamp counted, not drawn."""
    import numpy as np

    from multi_gpu import trace
    from multi_gpu.stream_exchange import STAMP
    start, end = (1_000_000, 400_000, 300.0), (11_000_000, 410_000, 500.0)  # drift 1e-3
    clock = trace.DeviceClock(start, end)
    assert clock.to_host(1_000_000) == 600_000 and clock.to_host(11_000_000) == 10_590_000
    stamps = np.zeros(2, STAMP)
    for s, t0, last in zip(stamps, (2_000_000, 2_100_000), (1, 0)):
        s["begin"], s["published"], s["signalled"] = t0, t0 + 10_000, t0 + 11_000
        s["seen"], s["written"], s["last"], s["step"] = t0 + 30_000, t0 + 50_000, last, 1
    tracer = trace.Tracer(rank=0, first=10, count=5)
    trace.kernel_spans(tracer, [(10, 4, stamps[0]), (11, 4, stamps[1]), (12, 5, None)], 0,
                       1024, (start, 32), (end, 32))
    names = [(s["step"], s["name"]) for s in tracer.spans]
    assert names == [(10, "publish"), (10, "signal"), (10, "waiting for worker 1"),
                     (10, "copy + average"), (11, "train"), (11, "publish"), (11, "signal"),
                     (11, "copy + average")]
    assert all(s["track"] == trace.DEVICE for s in tracer.spans)
    assert tracer.spans[0]["start"] == clock.to_host(2_000_000) == 1_599_000
    assert tracer.spans[4]["end"] - tracer.spans[4]["start"] == clock.to_host(2_100_000) - \
        clock.to_host(2_050_000)
    assert tracer.about["stamps_lost"] == 1 and tracer.about["device_clock_error_us"] == 0.5
    assert tracer.about["device_clock_tick_ns"] == 32
    assert round(tracer.about["device_clock_drift_ppm"]) == 1000


@pytest.mark.parametrize("make, words", [
    (os.mkfifo, "is not a regular file (a device, FIFO or socket)"),
    (os.mkdir, "is a folder, not a file")])
def test_what_sits_where_the_trace_picture_goes_is_refused_before_anything_starts(
        tmp_path, make, words, capsys, no_leftovers):
    """The picture beside --trace PATH is an output, checked as --json is: a
    FIFO there hung the run before any worker started, a folder failed it
    after training (by the script's main())."""
    make(tmp_path / "t.png")
    out = refused(capsys, "cpu", "cpu", "--trace", tmp_path / "t.json")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"dual_mlp.py: error: {tmp_path / 't.png'} {words}: an output goes only to a regular "
        "file" if "FIFO" in words else f"dual_mlp.py: error: {tmp_path / 't.png'} {words}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.png"]


@pytest.mark.parametrize("resumed, epochs, window", [(0, 1, 1), (0, 5, 2), (3, 5, 5), (3, 4, 4)])
def test_the_trace_starts_at_the_second_epoch_a_run_trains(resumed, epochs, window):
    """A run resumed at epoch 3 for --epochs 5 traces its fifth (the second
    it trains), and is never refused for a --trace-from nobody gave."""
    import argparse
    from multi_gpu import launcher
    args = argparse.Namespace(trace="t.json", trace_from=None, trace_steps=None,
                              resume_epoch=resumed, epochs=epochs)
    launcher.check_trace(args, 15)
    assert args.trace_from == window


def test_a_trace_is_drawn_again_from_a_chosen_step(traced):
    """``python -m multi_gpu.trace PATH.json --first STEP``: the picture
    again, from that step; a step the trace does not hold is one line."""
    import subprocess
    import sys
    folder, document, _ = traced
    picture = folder / "run.png"
    before = picture.read_bytes()
    first = min(e["args"]["step"] for e in document["traceEvents"] if e["ph"] == "X")
    command = [sys.executable, "-m", "multi_gpu.trace", str(folder / "run.json")]
    drawn = subprocess.run(command + ["--first", str(first + 3), "--steps", "2"],
                           capture_output=True, text=True, cwd=ROOT)
    assert drawn.returncode == 0 and f"wrote {picture}" in drawn.stdout, drawn.stderr
    assert picture.read_bytes() != before
    refused = subprocess.run(command + ["--first", str(first + 100)], capture_output=True,
                             text=True, cwd=ROOT)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert f"the trace holds steps {first} to {first + 7}" in refused.stderr
