"""Node 0's lobby with many members: 256 simulated in processes of their
own (``bench.lobby``), each its own connection, CURVE handshake, hello and
heartbeat, as a run of 257 machines would bring them."""
from bench.lobby import measure
from multi_gpu.nodes import BEAT_S, LOST_AFTER


def test_node_0_lets_256_members_in_hears_them_all_and_takes_a_lost_one_back():
    """Every one of 256 members is let in; while all beat, none is taken for
    lost; the one that falls silent is the one node 0 names, once it has
    not been heard from for the time a node is lost in (counted from its
    last beat, up to a beat before it fell silent) and within seconds of
    it; and when it knocks again in its place, it is answered and let in."""
    seen = measure(256, cpu_seconds=2.0)
    print({k: v for k, v in seen.items() if k != "lost_named_as"})
    assert seen["refused"] == 0 and seen["false_losses"] is None
    assert seen["lost_named_as"].startswith("node 129 (") and " lost: not heard from" in \
        seen["lost_named_as"], seen["lost_named_as"]
    assert LOST_AFTER - 2 * BEAT_S <= seen["lost_named_after_s"] < LOST_AFTER + 10
    assert seen["back_answered_after_s"] is not None and seen["back_in"]
