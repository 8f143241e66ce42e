"""A blip never loses a run: two test hosts (``bench/testhosts.py``), node
1's cable cut and mended, or node 0's door stopped and let go on, for a
few seconds, with and without --max-restarts; and a cut as node 0 reports
its last epoch.  The runs are made once, all at the same time
(``blip_runs``), beside an uninterrupted one, and each test looks at what
one of them did.  A silence shorter than ``nodes.LOST_AFTER`` changes
nothing; a longer one is a loss and a return: with --max-restarts the run
starts again from its last checkpoint and ends as the uninterrupted run, bit
for bit; without, every node ends in one line naming the other."""
import concurrent.futures
import json
import os
import signal
import subprocess
import threading
import time

import pytest

from bench.testhosts import BLIPS, hosts_on_a_bridge, two_nodes, why_no_test_hosts
from conftest import PACED, assert_identical_checkpoints, made_once, start_dual

pytestmark = pytest.mark.skipif(bool(why_no_test_hosts()), reason=str(why_no_test_hosts()))

EPOCHS = 16
# a door stopped leaves the workers training (their sockets are their own): its runs
# are paced to outlast it
SLOWER = {"DUAL_MLP_FAULT": "0:train:slow=0.5"}
# name: (--max-restarts, the pace, its blips in turn: (what, seconds)); blip k strikes
# once node 0 has reported epoch 2 + 3k, or, for the cut at the end, the last epoch
CASES = {
    "cuts": (5, PACED, [("cut", 3), ("cut", 5), ("cut", 6), ("cut", 8), ("cut", 12)]),
    "door": (2, SLOWER, [("door", 8)]),
    "cuts, no restarts": (0, PACED, [("cut", 3), ("cut", 8)]),
    "door, no restarts": (0, SLOWER, [("door", 8)]),
    "cut at the end": (0, PACED, [("cut", 8)]),
}


def slug(name):
    return name.replace(" ", "-").replace(",", "")


def strike(name, node0, hosts, said):
    """Each of the case's blips in turn, at node 0's epochs (``said``: what
    it prints, as it comes): node 1's cable, or node 0's door.  Returns
    when each struck (monotonic seconds)."""
    _, _, blips = CASES[name]
    struck, read = [], 0
    while len(struck) < len(blips) and (node0.poll() is None or read < len(said)):
        if read == len(said):
            time.sleep(0.05)
            continue
        line, read = said[read][1], read + 1
        if not line.startswith("epoch "):
            continue
        epoch = int(line.split()[1].split("/")[0])
        if epoch >= (EPOCHS if name == "cut at the end" else 2 + 3 * len(struck)):
            what, seconds = blips[len(struck)]
            struck.append(time.monotonic())
            BLIPS[what](hosts[1] if what == "cut" else hosts[0], seconds)
    return struck


def listen(stream, heard):
    """Every line of ``stream``, with when it came (monotonic seconds), to
    its end (then closed)."""
    with stream:
        for line in stream:
            heard.append((time.monotonic(), line))


def ended(proc, timeout):
    """The launcher's exit code, once its listeners have read all it said;
    killed, and the test failed, where it runs past ``timeout``."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"launcher still running after {timeout} s") from None
    while not (proc.stdout.closed and proc.stderr.closed):
        time.sleep(0.05)
    return proc.returncode


def run_blips(folder):
    secret = folder / "secret"
    secret.write_text("a secret of the blip tests' own runs")
    secret.chmod(0o600)
    names = ["whole", *CASES]
    seen = {}
    with hosts_on_a_bridge(2 * len(names)) as hosts:
        pairs = {name: hosts[2 * i:2 * i + 2] for i, name in enumerate(names)}
        runs, heard = {}, {}
        for name in names:
            restarts, pace, _ = CASES.get(name, (0, PACED, []))
            h, same = pairs[name], ("--epochs", EPOCHS, "--secret-file", "secret",
                                    "--max-restarts", restarts)
            runs[name] = [start_dual(*two_nodes(h[0], rank), *same, *(
                ("--save", f"{slug(name)}.npz", "--json", f"{slug(name)}.json") if rank == 0
                else ()), env=pace, host=h[rank], cwd=folder) for rank in (0, 1)]
            heard[name] = [([], []), ([], [])]  # each node's (output, error output)
            for proc, (out, err) in zip(runs[name], heard[name]):
                for stream, lines in ((proc.stdout, out), (proc.stderr, err)):
                    threading.Thread(target=listen, args=(stream, lines), daemon=True).start()
        with concurrent.futures.ThreadPoolExecutor(len(CASES)) as pool:
            struck = {name: pool.submit(strike, name, runs[name][0], pairs[name],
                                        heard[name][0][0]) for name in CASES}
            struck = {name: future.result() for name, future in struck.items()}
        for name, nodes in runs.items():
            seen[name] = []
            times = struck.get(name, [])
            for proc, (out, err) in zip(nodes, heard[name]):
                code = ended(proc, timeout=240)
                restarts = [[line for t, line in err if begin <= t < end
                             and "restarting every worker" in line]
                            for begin, end in zip(times, times[1:] + [float("inf")])]
                seen[name].append(dict(code=code, out="".join(line for _, line in out),
                                       err="".join(line for _, line in err),
                                       restarts=restarts))
        seen["hosts"] = {name: [h.address for h in pair] for name, pair in pairs.items()}
    return seen


@pytest.fixture(scope="module")
def blip_runs():
    folder, seen = made_once("blip_runs", run_blips)
    return dict(seen, folder=folder)


def test_blips_with_restarts_end_as_the_uninterrupted_run(blip_runs):
    """--max-restarts 5, node 1's cable cut and mended after 3, 5, 6, 8 and
    12 s in turn: both nodes exit 0, and the checkpoint equals the
    uninterrupted run's, bit for bit.  A silence under the lost-bound
    changes nothing (3 s); a longer one is one restart, said on both nodes
    (5 and 6 s: a silence that TCP's back-off may stretch past the bound)."""
    folder = blip_runs["folder"]
    for node in blip_runs["whole"]:
        assert node["code"] == 0, node["err"]
    counted = [[len(r) for r in node["restarts"]] for node in blip_runs["cuts"]]
    print(f"restarts counted after each cut, on node 0 and node 1: {counted}")
    for node in blip_runs["cuts"]:
        assert node["code"] == 0, node["err"]
        assert "error" not in node["err"] and "Traceback" not in node["err"] + node["out"]
    for n, seconds in enumerate(s for _, s in CASES["cuts"][2]):
        counts = {node[n] for node in counted}
        assert counts == ({0} if seconds < 5 else {1} if seconds > 6 else counts & {0, 1}) \
            and len(counts) == 1, (seconds, counted, blip_runs["cuts"])
    assert_identical_checkpoints(folder / "cuts.npz", folder / "whole.npz")


def test_a_door_stopped_8_s_with_restarts_ends_as_the_uninterrupted_run(blip_runs):
    folder = blip_runs["folder"]
    for node in blip_runs["door"]:
        assert node["code"] == 0, node["err"]
        assert len(node["restarts"][0]) == 1, node["err"]
    assert_identical_checkpoints(folder / "door.npz", folder / "whole.npz")


@pytest.mark.parametrize("name", ["cuts, no restarts", "door, no restarts"])
def test_without_restarts_a_short_blip_changes_nothing_and_a_long_one_ends_both_nodes(
        blip_runs, name):
    """No --max-restarts: a cut of 3 s changes nothing (no word); one of 8 s,
    or node 0's door stopped 8 s, ends both nodes, exit 1, in one line each
    that names the other."""
    node0, node1 = blip_runs["hosts"][name]
    for node, other in zip(blip_runs[name], (f"node 1 ({node1})", f"node 0 ({node0})")):
        assert node["code"] == 1, node["err"]
        assert node["err"].strip().splitlines() == [node["err"].strip()], node["err"]
        assert node["err"].startswith(f"error: {other} lost: not heard from for "), node["err"]
    said = blip_runs[name][0]["out"]
    assert f"epoch {2 + 3 * (len(CASES[name][2]) - 1)}/{EPOCHS}" in said, said


def test_a_cut_as_the_last_epoch_is_reported_is_no_failure(blip_runs):
    """The cable cut as node 0 prints its last epoch line: the run is
    trained and written, so both nodes end exit 0, node 0's summary and
    checkpoint written, each saying what happened after."""
    folder = blip_runs["folder"]
    for node in blip_runs["cut at the end"]:
        assert node["code"] == 0, node["err"]
        assert "error" not in node["err"], node["err"]
    summary = json.loads((folder / "cut-at-the-end.json").read_text())
    assert summary["epochs_run"] == EPOCHS
    assert_identical_checkpoints(folder / "cut-at-the-end.npz", folder / "whole.npz")
