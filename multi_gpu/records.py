"""What a training run leaves behind: checkpoints, its learning curve, its JSON summary.

Shared by ``mlp.py`` (one process) and ``dual_mlp.py`` (its worker 0).

* A checkpoint is an ``.npz`` file, written atomically: the weights
  (``params_0``..), the best-validation weights (``best_0``..) and the
  training state beside them.  ``mlp.py --save`` writes a final model;
  ``dual_mlp.py --save`` writes ``TRAINING_STATE`` too, after every epoch,
  and the configuration it trains with (``config``: the options that shape
  the training, and the data set's fingerprint), so that ``--resume`` goes
  on where it stopped, and only with the same configuration; and which run
  wrote it (``run``), so that a restart takes only its own run's.  A run holds
  the checkpoint it writes (``hold``): a second run asking for it is refused.
* The learning curve: one ``epoch_record`` per epoch.
* The summary: one JSON document per run (``--json``), written atomically.
"""
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import datetime
import functools
import io
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import zipfile

import numpy as np

from multi_gpu import cli, datasets, files
from multi_gpu.hooks import fault_point
from multi_gpu.transports import Layout


class CheckpointError(Exception):
    """A checkpoint that does not fit the model, with a one-line message."""


# the training state a dual_mlp.py checkpoint holds beside the weights
TRAINING_STATE = ("epoch", "best_validation_error", "test_error", "validation_errors")
# what each entry must be: its number of dimensions and kind of number
STATE_TYPES = {"epoch": (0, "iu"), "best_validation_error": (0, "f"), "test_error": (0, "f"),
               "validation_errors": (1, "f"), "epoch_workers": (1, "iu"), "config": (0, "U"),
               "run": (0, "U")}


def save_checkpoint(path, params, best_params, **state):
    """Write parameters and training state to an .npz file atomically: a run
    killed while saving leaves the previous checkpoint intact."""
    arrays = {f"params_{i}": p for i, p in enumerate(params)}
    arrays.update({f"best_{i}": p for i, p in enumerate(best_params)})
    arrays.update({k: np.asarray(json.dumps(v, sort_keys=True) if k == "config" else v,
                                 np.float64 if k == "validation_errors" else None)
                   for k, v in state.items()})
    with files.atomic_write(path) as f:
        np.savez(f, **arrays)
        fault_point(0, "save")  # the fault tests' hook: a write not yet in place


def checkpoint_bytes(shapes, itemsize=4):
    """About what a checkpoint of a model of ``shapes`` takes on disk: its
    weights twice (current, best), and room for the rest."""
    return 2 * itemsize * sum(math.prod(s) for s in shapes) + (1 << 14)


def checkpoint_limit(shapes):
    """The most a checkpoint file may hold for a model of ``shapes``: room for
    one of another --n-hidden to be told apart by its shapes, never the
    gigabytes a crafted file could declare."""
    return 4 * checkpoint_bytes(shapes, itemsize=8) + (64 << 20)


def read_checkpoint(path, shapes):
    """A checkpoint file's bytes, read once, for ``load_checkpoint`` (and the
    workers) to take that one version whatever writes the file next.  A
    file too large for a checkpoint of ``shapes`` is refused unread."""
    try:
        datasets.regular_file(path)
    except datasets.DatasetError:
        if not os.path.lexists(path):
            raise CheckpointError(f"checkpoint not found: {path}") from None
        raise CheckpointError(f"{path}: not a regular file") from None
    limit = checkpoint_limit(shapes)
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise CheckpointError(f"{path}: over {limit / 1e6:.1f} MB, larger than any checkpoint "
                              "of this model")
    return raw


def members(zipped, name, limit):
    """Every member of an .npz, checked before NumPy reads one: arrays only
    (``.npy``), whose declared sizes a checkpoint of this model can hold."""
    try:
        infos = zipfile.ZipFile(io.BytesIO(zipped)).infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise CheckpointError(f"{name}: not a readable checkpoint ({type(e).__name__})") from None
    odd = [i.filename for i in infos if not i.filename.endswith(".npy")]
    if odd:
        raise CheckpointError(f"{name}: holds {odd[0]}, which is not an array: not a "
                              "checkpoint this demo wrote")
    if sum(i.file_size for i in infos) > limit:
        raise CheckpointError(f"{name}: its arrays declare {sum(i.file_size for i in infos):,} "
                              "bytes, more than any checkpoint of this model")


def check_weights(path, names, arrays, shapes):
    """Each array the ``shape`` of its parameter, and finite."""
    for name, v, shape in zip(names, arrays, shapes):
        if v.shape != tuple(shape):
            raise CheckpointError(f"{path}: {name} has shape {v.shape}, the model "
                                  f"{tuple(shape)} (another --n-hidden?)")
        if v.dtype.kind != "f" or not np.isfinite(v).all():
            raise CheckpointError(f"{path}: {name} holds no finite weights (a run that "
                                  "diverged?)")


def state_values(path, saved):
    """The training state's arrays, each of its type, as Python values (the
    config a JSON object)."""
    for k, v in saved.items():
        ndim, kinds = STATE_TYPES.get(k, (v.ndim, v.dtype.kind))
        if v.ndim != ndim or v.dtype.kind not in kinds:
            raise CheckpointError(f"{path}: {k} is a {v.ndim}-d array of {v.dtype}: not a "
                                  "checkpoint this script wrote")
    values = {k: v.item() if v.ndim == 0 else v.tolist() for k, v in saved.items()}
    if "config" in values:
        try:
            values["config"] = json.loads(values["config"])
        except ValueError:
            raise CheckpointError(f"{path}: its config is not JSON") from None
        if not isinstance(values["config"], dict):
            raise CheckpointError(f"{path}: its config is not a JSON object")
    return values


def load_checkpoint(path, shapes, state=("epoch",), raw=None):
    """Read a checkpoint written by ``save_checkpoint`` for a model whose
    parameters have ``shapes`` (from its bytes ``raw`` when given, else from
    ``path``), and check all of it: every parameter, its best-validation
    twin, the training ``state`` entries named, and nothing else.
    Returns (params, best_params, state)."""
    raw = read_checkpoint(path, shapes) if raw is None else raw
    members(raw, path, checkpoint_limit(shapes))
    try:
        with np.load(io.BytesIO(raw)) as f:
            saved = {k: f[k] for k in f.files}
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(e).__name__})") from None
    names = [f"{kind}_{i}" for kind in ("params", "best") for i in range(len(shapes))]
    unknown = [k for k in saved if k not in names and k not in STATE_TYPES]
    if unknown:
        raise CheckpointError(f"{path}: holds {unknown[0]}, which no checkpoint of this demo "
                              "has")
    missing = [k for k in names + list(state) if k not in saved]
    if missing:
        training = "validation_errors" in state
        raise CheckpointError(f"{path}: not a {'dual_mlp.py' if training else 'this script'} "
                              f"checkpoint of this model: no {', '.join(missing)}"
                              + (" (mlp.py --save writes a final model, not a training state)"
                                 if training and names[0] in saved else ""))
    arrays = [saved.pop(k) for k in names]
    check_weights(path, names, arrays, shapes + shapes)
    values = state_values(path, saved)
    for k in ("validation_errors", "epoch_workers"):
        if k in values and len(values[k]) != values["epoch"]:
            raise CheckpointError(f"{path}: {len(values[k])} {k.replace('_', ' ')} for "
                                  f"{values['epoch']} epochs: not a consistent checkpoint")
    if not all(n > 0 for n in values.get("epoch_workers", ())):
        raise CheckpointError(f"{path}: an epoch trained by no worker: not a consistent checkpoint")
    return arrays[:len(shapes)], arrays[len(shapes):], values


def written_by(path, shapes, raw=None):
    """(the run that wrote the checkpoint at ``path``, its epoch); (None,
    None) where there is none there, or none of this model: a run that
    names no run (an older checkpoint) is nobody's."""
    try:
        _, _, state = load_checkpoint(path, shapes, ("epoch",), raw)
    except CheckpointError:
        return None, None
    return state.get("run"), state["epoch"]


def replaced_checkpoint(save, resume, shapes, node0_again=False):
    """A notice where ``save`` holds a file a new run will replace: another
    run's checkpoint (that it resumes from aside), or something else.  On a
    node 0 that may be this run's started again (``node0_again``), the
    checkpoint may be this run's own: the others keep the run, and say."""
    if not (save and os.path.lexists(save)) or (resume and cli.same_file(save, resume)):
        return None
    _, epoch = written_by(save, shapes)
    held = "a file that is not a checkpoint of this model" if epoch is None else \
        f"another run's checkpoint (epoch {epoch})"
    if node0_again and epoch is not None:
        held = (f"a checkpoint (epoch {epoch}) of an earlier run, or of this one before this "
                "node 0 was lost (then the other nodes bring the run back)")
    return (f"notice: --save {save} holds {held}: this run replaces it at the end of its first "
            "epoch, and a restart takes only this run's own")


def resume_hint(args, shapes):
    """What the last line of a failed run adds: the run's last checkpoint
    and the command that resumes from it; node R > 0: node 0's."""
    if args.node_rank:
        return "; resume from node 0's last checkpoint (--resume)" if args.nodes > 1 else ""
    if not (args.save and os.path.exists(args.save)):
        return ""
    try:
        epoch = load_checkpoint(args.save, shapes)[2]["epoch"]
    except CheckpointError:
        return ""
    words, near = shlex.split(args.command), os.path.relpath(args.save)
    shown = args.save if near.startswith("..") else near  # as the user would type it here
    if epoch >= args.epochs:  # a resume would be refused: nothing is left to train
        return f"; {shown} holds the run's last epoch ({epoch}): its training is complete"
    if "--resume" in words:
        del words[words.index("--resume"):words.index("--resume") + 2]
    return f"; resume (epoch {epoch}): {shlex.join(words + ['--resume', shown])}"


def epoch_record(epoch, train_s, validation_error, test_error, workers=1):
    """One point of a run's learning curve (``--json``'s ``curve``): the
    training seconds so far (no compile, no validation), the epoch's
    validation error, the test error of the best-validation model so far,
    and the workers that trained the epoch."""
    return dict(epoch=epoch, train_s=train_s, validation_error=validation_error,
                test_error=test_error, workers=workers)


class Progress:
    """A training run, epoch by epoch: the state a checkpoint keeps beside
    the weights (``TRAINING_STATE``, and the workers that trained each
    epoch), the best-validation weights, the learning curve and the steps
    and seconds of training so far, on ``workers`` workers in all."""

    def __init__(self, params, workers, epoch=0, best_validation_error=np.inf,
                 test_error=np.inf, validation_errors=(), epoch_workers=()):
        self.epoch, self.best_validation_error, self.test_error = epoch, best_validation_error, \
            test_error
        self.validation_errors, self.best_params = list(validation_errors), params
        self.workers, self.epoch_workers = workers, list(epoch_workers)
        self.curve, self.steps, self.train_s, self.saved = [], 0, 0.0, None  # saved: its epoch

    @classmethod
    def begin(cls, model, workers, checkpoint=None):
        """A new run's progress; or the ``checkpoint``'s (a checked copy of
        --resume), its current weights set in ``model``."""
        if not checkpoint:
            return cls(model.get_params(), workers)
        current, best, state = load_checkpoint(checkpoint, Layout.of(model.params).shapes,
                                               TRAINING_STATE)
        # a checkpoint older than the count of each epoch's workers was trained by the
        # workers its config names, all along (a resume with others was refused then)
        config = state.pop("config", None) or {}
        state.setdefault("epoch_workers", [config.get("workers", 0)] * state["epoch"])
        state.pop("run", None)
        model.set_params(current)
        return cls(best, workers, **state)

    def trained(self, steps, seconds):
        self.steps, self.train_s = self.steps + steps, self.train_s + seconds

    def validated(self, epoch, validation_error, test, params):
        """After an epoch: its validation error; where it is the best so far,
        ``test()`` gives the test error and ``params()`` the weights kept."""
        self.validation_errors.append(validation_error)
        if validation_error < self.best_validation_error:
            self.best_validation_error, self.test_error = validation_error, float(test())
            self.best_params = params()
        self.epoch = epoch
        self.epoch_workers.append(self.workers)
        self.curve.append(epoch_record(epoch, self.train_s, validation_error, self.test_error,
                                       self.workers))

    def state(self):
        return {k: getattr(self, k) for k in (*TRAINING_STATE, "epoch_workers")}

    def save(self, path, params, config, run):
        """The epoch's checkpoint, which names its ``run``; a write that fails
        (a full disk) leaves the previous checkpoint as it was, and training
        goes on."""
        try:
            save_checkpoint(path, params, self.best_params, **self.state(), config=config,
                            run=run)
            self.saved = self.epoch
        except OSError as e:
            print(f"worker 0: warning: could not write {path} ({e.strerror}): the previous one "
                  "is kept", file=sys.stderr)

    def check_saved(self, path):
        """A run asked to ``--save`` that trained and could not write the
        checkpoint of its last epoch has failed, whatever else it did: it
        says which epoch the file holds, if any."""
        if path and self.steps and self.saved is None:
            raise CheckpointError(f"no checkpoint could be written to {path} (see the "
                                  "warnings above): the training is lost")
        if path and self.steps and self.saved != self.epoch:
            raise CheckpointError(f"{path} holds epoch {self.saved}, not epoch {self.epoch}, "
                                  "the last one trained (see the warnings above)")

    def summary(self, steps_per_epoch):
        """The summary's entries that describe the training itself."""
        return dict(validation_errors=self.validation_errors,
                    best_validation_error=self.best_validation_error, test_error=self.test_error,
                    epochs_run=self.steps // steps_per_epoch, steps_per_epoch=steps_per_epoch,
                    training_time_s=self.train_s, workers_per_epoch=self.epoch_workers)


@functools.cache  # a process's code does not change under it: git is asked once
def code_commit():
    """The commit the code that runs is at (``DUAL_MLP_COMMIT`` where the
    working tree travelled without git, as to a device), with ``+changes``
    where the tracked files differ from it (results and the READMEs, which a
    refresh rewrites, aside); None where nobody knows."""
    if os.environ.get("DUAL_MLP_COMMIT"):
        return os.environ["DUAL_MLP_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=datasets.ROOT,
                              capture_output=True, text=True, timeout=30)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                  ".", ":!bench/results", ":!*.md"], cwd=datasets.ROOT,
                                 capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+changes" if changed.stdout.strip() else "")


def run_header(command):
    """The summary's first entries: what ran, when, where."""
    return dict(command=command, commit=code_commit(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                host=platform.node())


def write_json(path, document):
    """Write ``document`` as JSON, atomically (raises OSError: a full disk)."""
    with files.atomic_write(path) as f:
        f.write(json.dumps(document, indent=2).encode())


def write_json_or_show(path, document, speaker):
    """``write_json``, and where it fails (a full disk, a folder gone
    read-only), the summary on stdout after one line that says so, and exit
    1: a run's result is never lost."""
    try:
        write_json(path, document)
    except OSError as e:
        print(f"{speaker}: error: could not write {path} ({e.strerror}); the summary follows on "
              "stdout", file=sys.stderr)
        print(json.dumps(document, indent=2))
        raise SystemExit(1) from None
