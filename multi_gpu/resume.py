"""Where a run resumes: a --resume checkpoint checked against the request
(``check_resume``), and where a restart starts again, as a request that
resumes (``restart_point``: this run's last checkpoint; ``follow``: node
0's order, on another node; ``adopt``: of the copies the other nodes kept,
the one a node 0 started again takes), said in words (``resumed_at``).  A
checkpoint records the options that shape the training (``TRAINED_WITH``);
a resumed run must be given the same, but for the learning rate and the
number of workers.
"""
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import base64
import dataclasses
import sys

from multi_gpu import cli, datasets, elastic, records
from multi_gpu.cli import UsageError

# the options that shape the training: a checkpoint records them, and every
# node of a run must be given the same (with the data set's fingerprint)
# (what a checkpoint's config holds of each, in this order)
CONFIG_KINDS = dict(batch_size=int, learning_rate=(int, float), n_hidden=int, l1=(int, float),
                    l2=(int, float), average_every=int, workers=int, dataset=str)
TRAINED_WITH = tuple(CONFIG_KINDS)


def option_name(key):
    return {"workers": "workers in all", "dataset": "data set (fingerprint)",
            "local_workers": "workers per node", "resume_epoch": "resumed epoch",
            "platform": "devices (cpu or GPUs)"}.get(key, "--" + key.replace("_", "-"))


def differences(theirs, mine, keys):
    """'--batch-size 100 there, 50 here; ...' for the keys whose values differ."""
    differ = [k for k in keys if theirs.get(k) != mine.get(k)]
    if "local_workers" in differ:  # the rest follow from it (workers in all, steps a call)
        return (f"workers per node {theirs['local_workers']} there, {mine['local_workers']} "
                "here (every node gives the same number of devices)")
    return "; ".join(f"{option_name(k)} {theirs.get(k)} there, {mine.get(k)} here"
                     for k in differ)


def check_resume(request, shapes, epochs=None, raw=None):
    """The checkpoint ``request.resume`` fits the model's parameter
    ``shapes``, is not finished, and was trained as ``request`` asks (the
    learning rate may change, with a notice).  Without --epochs, the run
    goes on to the epochs the checkpoint's run asked for (``epochs``, the
    default, where it does not say), and says so.  Returns (what the request
    resumes with: the checkpoint's bytes, its epoch, and the epochs where
    --epochs was not given; the notices)."""
    # read once (a FIFO refused before it is opened), checked, and handed to the
    # workers as that one version (``leave_the_request``), whatever writes the file
    # meanwhile (``raw``: its bytes, where they came from another node)
    path = request.resume
    checked = raw or records.read_checkpoint(path, shapes)
    _, _, state = records.load_checkpoint(path, shapes, records.TRAINING_STATE, raw=checked)
    saved, notices = state.get("config"), []
    asked = (saved or {}).get("epochs")
    resumed = dict(checked_resume=checked, resume_epoch=state["epoch"])
    if request.epochs is None:
        known = type(asked) is int and asked > state["epoch"]
        resumed["epochs"] = asked if known else epochs
        notices.append(f"notice: --resume {path}: trains on to epoch {resumed['epochs']}, "
                       + ("as its run asked" if known else "the default") + " (see --epochs)")
    if state["epoch"] >= resumed.get("epochs", request.epochs):
        raise UsageError(f"{path} is already at epoch {state['epoch']}: ask for more --epochs")
    if saved is not None:
        saved.setdefault("average_every", 1)  # checkpoints from before --average-every
        odd = [k for k in TRAINED_WITH if not isinstance(saved.get(k), CONFIG_KINDS[k])
               or isinstance(saved.get(k), bool)] + sorted(set(saved) - set(TRAINED_WITH) -
                                                          {"epochs"})
        if asked is not None and type(asked) is not int:
            odd.append("epochs")
        if odd:
            raise records.CheckpointError(
                f"{path}: its config has {odd[0]} = {saved.get(odd[0])!r}, not one this "
                "demo writes: not a checkpoint of dual_mlp.py")
    if saved is None:
        return resumed, notices + [f"notice: {path} does not record how it was trained (an "
                                   "older checkpoint): resuming with the options given"]
    if not saved["dataset"].startswith(datasets.FINGERPRINT):
        raise UsageError(f"{path} was written by an older version of the demo, whose "
                         "data set fingerprint sampled 256 rows: this one cannot tell whether "
                         "it was trained on this data set; start anew")
    fixed = [k for k in TRAINED_WITH if k not in ("learning_rate", "workers")]
    if differences(saved, request.trained_with, fixed):
        raise UsageError(f"{path} was trained otherwise: "
                         f"{differences(saved, request.trained_with, fixed)} (the checkpoint "
                         "there, this run here): resume with its options, or start anew")
    return resumed, notices + changes(saved, request, state["epoch"] + 1)


def changes(saved, request, epoch):
    """Notices of what a resumed run may change from ``epoch`` on: the
    learning rate, and the number of workers.  Worker k of N trains the
    minibatches k, k + N, ...: with another N each worker takes another
    share of an epoch's minibatches, and every averaged step is SGD on N
    minibatches at once."""
    notices = []
    if saved["learning_rate"] != request.learning_rate:
        notices.append(f"notice: the learning rate changes from {saved['learning_rate']} to "
                       f"{request.learning_rate} at epoch {epoch}")
    before, now, batch = saved["workers"], request.trained_with["workers"], request.batch_size
    if before != now:
        notices.append(f"notice: the workers change from {before} to {now} at epoch {epoch}: "
                       f"worker k trains minibatches k, k + {now}, ... of each epoch, and each "
                       f"step averages {now} of them (SGD on {now * batch:,} images a step, not "
                       f"{before * batch:,})")
    return notices


# -- where a restart starts: the plan again, resuming from elsewhere ---------------------

def restart_point(plan, shapes):
    """Where a restart starts: from this run's last checkpoint (--save) once
    it wrote one, else where the run began (its --resume, or the first
    epoch).  Returns (the plan that resumes there, where in words)."""
    if plan.save and records.written_by(plan.save, shapes)[0] == plan.run_id:
        plan = dataclasses.replace(plan, resume=plan.save)
    if plan.resume:
        plan = dataclasses.replace(plan, **check_resume(plan, shapes)[0])
    return resumed_at(plan)


def follow(plan, order, shapes):
    """Node R > 0: where node 0's ``order`` says, from the bytes of node 0's
    checkpoint, checked here as a file given to --resume is (a checkpoint of
    this model, at the epoch the order names).  Returns (the plan that
    resumes there, where in words)."""
    raw = order["checkpoint"] and base64.b64decode(order["checkpoint"])
    world = order.get("world", plan.world)
    if plan.node_rank not in world:
        raise UsageError(f"node 0 goes on without this node (nodes {', '.join(map(str, world))})")
    plan = elastic.regroup(plan, world)[0]
    plan = dataclasses.replace(plan, jax_coordinator=order["jax_coordinator"],
                               resume_epoch=order["resume_epoch"], checked_resume=raw or None,
                               resume="node 0's checkpoint" if raw else None)
    if plan.resume:
        _, _, state = records.load_checkpoint(plan.resume, shapes, records.TRAINING_STATE,
                                              raw=raw)
        if state["epoch"] != plan.resume_epoch:
            raise records.CheckpointError(f"node 0's checkpoint is at epoch {state['epoch']}, "
                                          f"its order says {plan.resume_epoch}")
    return resumed_at(plan)


def taken(plan, shapes, kept):
    """Node 0 started again: from ``kept``, one node's copy of the run's
    checkpoint, checked as --resume is (CheckpointError where it does not
    check out), as the run its file names (the node's word for the run may
    be the name a node 0 gave it before it adopted the run; a file of an
    older version names none: the node's word, then).  Returns (the plan
    that resumes there, where in words)."""
    plan = dataclasses.replace(plan, run_id=kept["run"])
    raw = kept.get("checkpoint") and base64.b64decode(kept["checkpoint"])
    if not raw:
        return resumed_at(dataclasses.replace(plan, resume=None, resume_epoch=0,
                                              checked_resume=None))
    plan = dataclasses.replace(plan, resume=f"node {kept['rank']}'s copy of the run's checkpoint")
    try:
        run, epoch = records.written_by(plan.resume, shapes, raw)
        if epoch != kept.get("epoch"):
            raise records.CheckpointError(f"{plan.resume} is not the run's checkpoint it says "
                                          f"(epoch {epoch}, not {kept.get('epoch')})")
        plan = dataclasses.replace(plan, run_id=run or kept["run"],
                                   **check_resume(plan, shapes, raw=raw)[0])
    except (UsageError, records.CheckpointError) as e:
        raise records.CheckpointError(f"{kept['who']} kept the run, but {e}") from None
    return resumed_at(plan)


def resumed_at(plan):
    """From where the restart trains, in words; a --trace window behind it
    moves to the restart's first epoch, and the words say so.  Returns (the
    plan, its window moved where it must, the words)."""
    moved = ""
    if plan.trace and plan.trace_from <= plan.resume_epoch:
        plan = dataclasses.replace(plan, trace_from=plan.resume_epoch + 1)
        moved = f", --trace now from epoch {plan.trace_from} (its window was behind the restart)"
    where = f"from {plan.resume} at epoch {plan.resume_epoch}" if plan.resume else \
        "from the first epoch"
    return plan, where + moved


def adopt(plan, shapes, link):
    """Node 0 started again goes on with the run the others kept: its name,
    and the newest copy of its last checkpoint that checks out (as --resume
    does), or where it began.  The copies are checked against each other
    too (``agreed``); a copy not taken is said, with why.  Returns (the plan
    that resumes there, where in words); CheckpointError where none
    checks out."""
    for kept in agreed(link.kept_by_others(every=True)):
        try:
            resumed = taken(plan, shapes, kept)
        except records.CheckpointError as e:
            cli.say(f"node 0: {e}: its copy is not taken", file=sys.stderr)
            continue
        link.adopt(resumed[0].run_id)
        return resumed
    raise records.CheckpointError("no copy of the run's checkpoint that the other nodes kept "
                                  "checks out (see above)")


def agreed(copies):
    """The copies of the run's checkpoint the other nodes kept (newest
    first), one of each content: at each epoch the one most nodes hold;
    one that others of its epoch contradict is said and left out, and where
    as many hold each, none of that epoch is taken."""
    groups = {}
    for kept in copies:
        at = (kept["generation"], kept.get("epoch") or 0)
        groups.setdefault(at, {}).setdefault(kept["checkpoint"], []).append(kept["who"])
    for at, held in groups.items():  # newest first, as the copies came
        ranked = sorted(held.values(), key=len, reverse=True)
        if len(ranked) > 1:
            tie = len(ranked[0]) == len(ranked[1])
            cli.say(f"node 0: the copies of the run's checkpoint at epoch {at[1]} differ: "
                    + "; ".join(" and ".join(who) + "'s" for who in ranked)
                    + (": as many nodes hold each, so none is taken" if tie else
                       f": {' and '.join(ranked[0])}'s, held by more, is taken"),
                    file=sys.stderr)
            if tie:
                continue
        yield next(k for k in copies if k["who"] == ranked[0][0])
