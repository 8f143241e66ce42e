"""--trace: the timeline a run writes of its own phases, on the CPU (the GPU
orderings' run on the device: tests/test_gpu.py)."""
import collections
import copy
import json
import os
import signal
import subprocess
import sys

import psutil
import pytest

from conftest import ROOT, as_a_terminal_starts, dual, environment, refused, run_once, wait_for
from multi_gpu import trace

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
                      and e["name"] != trace.WAITING
                      and e["name"] != "validate"]
            assert phases == HOST_PHASES, (worker, step, phases)
        for a, b in zip(events, events[1:]):  # one track: no span overlaps the next
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (worker, a, b)
        moved = [e["args"]["bytes"] for e in events if e["name"] in ("publish", "copy")]
        assert moved and all(n == moved[0] > 1_000_000 for n in moved)
    # worker 0 validated the first epoch before the window's first step, where the others
    # wait for it: drawn there, and the window says where it starts
    validated = [(w, e["args"]["step"]) for w, es in spans(document).items() for e in es
                 if e["name"] == "validate"]
    assert validated == [(0, first)], validated
    assert document["otherData"]["window"] == dict(epoch=2, steps=8, first_step=first,
                                                   steps_per_epoch=steps_per_epoch)


def test_no_worker_leaves_a_barrier_before_the_last_one_arrived(traced):
    """On the machine's one clock: at each signal of each step, every
    worker's leaving comes after every worker's arriving (its wait for a
    later worker, where it waited, is where it arrived)."""
    by_worker = spans(traced[1])
    barriers = collections.defaultdict(list)  # (step, which signal) -> [(arrived, left)]
    for events in by_worker.values():
        count = collections.Counter()
        for i, e in enumerate(events):
            if e["name"] == "signal":
                before = events[i - 1] if i and events[i - 1]["name"] == trace.WAITING else e
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
    waits = 0
    for worker, events in spans(traced[1]).items():
        for e in events:
            if e["name"] == "waiting for a later worker":  # the summary's and README's words
                assert e["args"]["worker"] in {0, 1, 2} - {worker}
                waits += 1
    assert waits


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
    (["--trace", "{tmp}/trace.txt"], "a trace is JSON: name it PATH.json"),
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
    from conftest import PACED, finish, start_dual, wait_until_training
    live = start_dual("cpu", "cpu", "--epochs", 1000, "--trace", tmp_path / "t.json",
                      env=PACED)
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
    assert names == [(10, "publish"), (10, "signal"), (10, trace.WAITING),
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

    from multi_gpu import request
    args = argparse.Namespace(trace="t.json", trace_from=None, trace_steps=None,
                              resume_epoch=resumed, epochs=epochs)
    request.check_trace(args, 15)
    assert args.trace_from == window


def test_a_trace_is_drawn_again_from_a_chosen_step(traced):
    """``python -m multi_gpu.trace PATH.json --first STEP``: the picture
    again, from that step; a step the trace does not hold is one line."""
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


def damaged(document):
    """Files that are not a trace this project wrote, each named: a trace's
    document damaged one way, or bytes that are no trace at all."""
    def edit(change):
        d = copy.deepcopy(document)
        change(d, next(e for e in d["traceEvents"] if e["ph"] == "X"))
        return json.dumps(d)
    return {
        "no events": '{"traceEvents": []}',
        "no phases": edit(lambda d, x: d.update(traceEvents=[e for e in d["traceEvents"]
                                                             if e["ph"] == "M"])),
        "a phase without its worker": edit(lambda d, x: x.pop("pid")),
        "no otherData": edit(lambda d, x: d.pop("otherData")),
        "a NaN time": edit(lambda d, x: x.update(ts=float("nan"))),
        "a time as text": edit(lambda d, x: x.update(dur="1")),
        "another kind of event": edit(lambda d, x: x.update(ph="B")),
        "a phase name of 1 MB": edit(lambda d, x: x.update(name="x" * (1 << 20))),
        "a phase name no font draws": edit(lambda d, x: x.update(name="\ud800")),
        "nested 200000 deep": "[" * 200000,
        "not UTF-8": b"\xff\xfe{",
        "70 MB of a name": b'{"traceEvents": [{"name": "' + b"n" * (70 << 20) + b'"}]}',
    }


def test_the_trace_tool_refuses_what_is_not_a_trace_in_one_line(traced, tmp_path, capsys):
    """``python -m multi_gpu.trace`` reads only a trace this project wrote,
    checked before it is used, within bounded time and memory: anything else
    (damaged, not JSON, a FIFO, a device, a folder) is one line, exit 2,
    and no picture; a "$" in a trace's names is drawn as a "$" (not
    matplotlib's mathematics); a picture of more phases than it can show is
    one line too."""
    _, document, _ = traced
    cases = {}
    for name, text in damaged(document).items():
        cases[name] = tmp_path / f"{len(cases)}.json"
        cases[name].write_bytes(text if isinstance(text, bytes) else text.encode())
    cases["a FIFO"] = tmp_path / "fifo.json"
    os.mkfifo(cases["a FIFO"])
    cases["a device"] = "/dev/zero"
    cases["a folder"] = tmp_path / "folder.json"
    cases["a folder"].mkdir()
    for name, path in cases.items():
        out = refused(capsys, path, name="multi_gpu.trace")
        assert out.returncode == 2 and out.stderr.count("\n") == 1, (name, out.stderr[-300:])
        assert "not a --trace file of this project" in out.stderr, (name, out.stderr)
        assert not list(tmp_path.glob("*.png")), name
    odd = json.loads(json.dumps(document))
    odd["otherData"]["title"] = "$\\x$ and $"
    for e in odd["traceEvents"]:
        if e["name"] == "process_name":
            e["args"]["name"] += " $\\y$"
    (tmp_path / "odd.json").write_text(json.dumps(odd))
    out = refused(capsys, tmp_path / "odd.json", name="multi_gpu.trace")
    assert out.returncode in (0, None) and out.stderr == "", out.stderr  # main() returns None
    assert (tmp_path / "odd.png").stat().st_size > 10000
    x = next(e for e in document["traceEvents"] if e["ph"] == "X")
    crowded = dict(document, traceEvents=document["traceEvents"] + [x] * 30000)
    (tmp_path / "crowded.json").write_text(json.dumps(crowded))
    out = refused(capsys, tmp_path / "crowded.json", name="multi_gpu.trace")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "more than a picture shows" in out.stderr
    assert not (tmp_path / "crowded.png").exists()


@pytest.mark.parametrize("signum", [2, 15])
def test_the_trace_tool_stopped_mid_write_leaves_no_temporary(traced, tmp_path, signum):
    """Ctrl-C or SIGTERM while the picture is being written: one word, no
    traceback, and neither the picture nor its temporary left."""
    (tmp_path / "run.json").write_text(json.dumps(traced[1]))
    proc = subprocess.Popen(as_a_terminal_starts([sys.executable, "-m", "multi_gpu.trace",
                                                  tmp_path / "run.json"]),
                            cwd=ROOT, env=environment({"DUAL_MLP_FAULT": "trace:write:stop"}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, 60,
             "the picture's write")
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    os.kill(proc.pid, signum)
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signum and err == "interrupted\n", (proc.returncode, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]
