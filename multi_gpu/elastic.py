"""Elastic runs (``--nodes MIN:MAX``): a run goes on with the nodes it has.

A run of N nodes of L workers each trains on N L workers: worker k trains
the minibatches k, k + N L, ... of each epoch, and every step averages the
replicas, which is SGD on N L minibatches at once.  Where a node is lost
and its command is not started again within --rejoin-timeout, while MIN
nodes are left, node 0 starts the others again from the run's last
checkpoint on fewer workers; a node whose command is started again later
is taken back in the same way.  Each change is a restart (--max-restarts).

The world changes only at a checkpoint, so that the run equals one trained
in stages, each saved and then resumed with the next world (``--resume``
on another number of workers: ``resume.changes`` says what changes).  A
node keeps its rank, its name in every line; its place in the world
(``Plan.world``: the ranks of the nodes training now, in order) gives its
workers' ranks, which JAX's runtime needs without gaps.  Node 0 is in
every world: the other nodes reach the run at its address.
"""
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import dataclasses

from multi_gpu.cli import UsageError


def check_range(draft):
    """What an elastic run needs: each change is a restart, from node 0's
    checkpoint, and the fewest nodes still hold two workers."""
    elastic = f"--nodes {draft.min_nodes}:{draft.nodes}: the nodes change at a checkpoint, "
    if not draft.max_restarts:
        raise UsageError(f"{elastic}each change a restart: give --max-restarts too")
    if not (draft.save or draft.node_rank):
        raise UsageError(f"{elastic}node 0's: give it --save too")
    if draft.min_nodes * (len(draft.devices) or 2) < 2:  # no devices named: two a node
        raise UsageError(f"{elastic}and {draft.min_nodes} node of one worker would train "
                         "alone: give MIN 2, or each node two devices (e.g. 'cpu cpu')")


def first_worker(args):
    """The rank of this node's first worker: its place in the world, times
    the workers a node runs."""
    return args.world.index(args.node_rank) * len(args.devices)


def workers(args):
    """The workers of the world: those of every node training now."""
    return len(args.world) * len(args.devices)


def regroup(plan, ranks):
    """The ``plan`` for a world of the nodes ``ranks`` (node 0 among them).
    Returns (that plan, what changes in words: None where nothing does)."""
    world = tuple(sorted(ranks))
    if world == tuple(plan.world):
        return plan, None
    n = len(world) * plan.local_workers
    plan = dataclasses.replace(plan, world=world, trained_with=dict(plan.trained_with, workers=n))
    return plan, (f"the run goes on with {len(world)} of its {plan.nodes} nodes "
                  f"({', '.join(map(str, world))}): {n} workers, each step SGD on {n} "
                  f"minibatches of {plan.batch_size}")
