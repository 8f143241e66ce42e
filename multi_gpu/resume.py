"""Where a run resumes: a --resume checkpoint checked against the request
(``check_resume``), and where a restart starts again, as a request that
resumes (``restart_point``: this run's last checkpoint; ``follow``: node
0's order, on another node; ``taken``: a copy the other nodes kept, on node
0 started again), said in words (``resumed_at``).  A checkpoint records
the options that shape the training (``TRAINED_WITH``); a resumed run must
be given the same, but for the learning rate.
"""
from multi_gpu import flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)
import base64

from multi_gpu import datasets, records
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


def check_resume(args, shapes, epochs=None, raw=None):
    """The checkpoint fits the model's parameter ``shapes``, is not finished,
    and was trained as this run asks (the learning rate may change, with a
    notice).  Without --epochs, the run goes on to the epochs the
    checkpoint's run asked for (``epochs``, the default, where it does not
    say), and says so.  Returns the notices."""
    # read once (a FIFO refused before it is opened), checked, and handed to the
    # workers as that one version (``launch``), whatever writes the file meanwhile
    # (``raw``: its bytes, where they came from another node)
    args.checked_resume = raw or records.read_checkpoint(args.resume, shapes)
    _, _, state = records.load_checkpoint(args.resume, shapes, records.TRAINING_STATE,
                                          raw=args.checked_resume)
    saved, notices = state.get("config"), []
    asked = (saved or {}).get("epochs")
    if args.epochs is None:
        known = type(asked) is int and asked > state["epoch"]
        args.epochs = asked if known else epochs
        notices.append(f"notice: --resume {args.resume}: trains on to epoch {args.epochs}, "
                       + ("as its run asked" if known else "the default") + " (see --epochs)")
    if state["epoch"] >= args.epochs:
        raise UsageError(f"{args.resume} is already at epoch {state['epoch']}: "
                         f"ask for more --epochs")
    args.resume_epoch = state["epoch"]
    if saved is not None:
        saved.setdefault("average_every", 1)  # checkpoints from before --average-every
        odd = [k for k in TRAINED_WITH if not isinstance(saved.get(k), CONFIG_KINDS[k])
               or isinstance(saved.get(k), bool)] + sorted(set(saved) - set(TRAINED_WITH) -
                                                          {"epochs"})
        if asked is not None and type(asked) is not int:
            odd.append("epochs")
        if odd:
            raise records.CheckpointError(
                f"{args.resume}: its config has {odd[0]} = {saved.get(odd[0])!r}, not one this "
                "demo writes: not a checkpoint of dual_mlp.py")
    if saved is None:
        return notices + [f"notice: {args.resume} does not record how it was trained (an "
                          "older checkpoint): resuming with the options given"]
    if not saved["dataset"].startswith(datasets.FINGERPRINT):
        raise UsageError(f"{args.resume} was written by an older version of the demo, whose "
                         "data set fingerprint sampled 256 rows: this one cannot tell whether "
                         "it was trained on this data set; start anew")
    fixed = [k for k in TRAINED_WITH if k != "learning_rate"]
    if differences(saved, args.trained_with, fixed):
        raise UsageError(f"{args.resume} was trained otherwise: "
                         f"{differences(saved, args.trained_with, fixed)} (the checkpoint "
                         "there, this run here): resume with its options, or start anew")
    if saved["learning_rate"] != args.learning_rate:
        notices.append(f"notice: the learning rate changes from {saved['learning_rate']} to "
                       f"{args.learning_rate} at epoch {state['epoch'] + 1}")
    return notices


def restart_point(args, shapes):
    """Make the request resume where a restart starts: from this run's last
    checkpoint (--save) once it wrote one, else where the run began (its
    --resume, or the first epoch).  Returns where, in words."""
    if args.save and records.written_by(args.save, shapes)[0] == args.run_id:
        args.resume = args.save
    if args.resume:
        check_resume(args, shapes)
    return resumed_at(args)


def follow(args, order, shapes):
    """Node R > 0: make the request resume where node 0's ``order`` says,
    from the bytes of node 0's checkpoint, checked here as a file given to
    --resume is (a checkpoint of this model, at the epoch the order names).
    Returns where, in words."""
    args.jax_coordinator, args.resume_epoch = order["jax_coordinator"], order["resume_epoch"]
    args.checked_resume = order["checkpoint"] and base64.b64decode(order["checkpoint"])
    args.resume = "node 0's checkpoint" if order["checkpoint"] else None
    if args.resume:
        _, _, state = records.load_checkpoint(args.resume, shapes, records.TRAINING_STATE,
                                              raw=args.checked_resume)
        if state["epoch"] != args.resume_epoch:
            raise records.CheckpointError(f"node 0's checkpoint is at epoch {state['epoch']}, "
                                          f"its order says {args.resume_epoch}")
    return resumed_at(args)


def resumed_at(args):
    """From where the restart trains, in words; a --trace window behind it
    moves to the restart's first epoch, and the words say so."""
    moved = ""
    if args.trace and args.trace_from <= args.resume_epoch:
        args.trace_from = args.resume_epoch + 1
        moved = f", --trace now from epoch {args.trace_from} (its window was behind the restart)"
    where = f"from {args.resume} at epoch {args.resume_epoch}" if args.resume else \
        "from the first epoch"
    return where + moved


def taken(args, shapes, kept):
    """Make the request resume from ``kept``, one node's copy of the run's
    checkpoint, checked as --resume is (CheckpointError where it does not
    check out).  Returns from where, in words."""
    args.run_id = kept["run"]
    raw = kept.get("checkpoint") and base64.b64decode(kept["checkpoint"])
    if not raw:
        args.resume, args.resume_epoch = None, 0
        return resumed_at(args)
    args.resume = f"node {kept['rank']}'s copy of the run's checkpoint"
    try:
        run, epoch = records.written_by(args.resume, shapes, raw)
        if (run, epoch) != (kept["run"], kept.get("epoch")):
            raise records.CheckpointError(f"{args.resume} is not the run's checkpoint it says")
        check_resume(args, shapes, raw=raw)
    except (UsageError, records.CheckpointError) as e:
        raise records.CheckpointError(f"{kept['who']} kept the run, but {e}") from None
    return resumed_at(args)
