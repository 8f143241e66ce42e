"""What a training run leaves behind: checkpoints, its learning curve, its JSON summary.

Shared by ``mlp.py`` (one process) and ``dual_mlp.py`` (its worker 0).

* A checkpoint is an ``.npz`` file, written atomically: the weights
  (``params_0``..), the best-validation weights (``best_0``..) and the
  training state beside them.  ``mlp.py --save`` writes a final model;
  ``dual_mlp.py --save`` writes ``TRAINING_STATE`` too, after every epoch,
  and the configuration it trains with (``config``: the options that shape
  the training, and the data set's fingerprint), so that ``--resume`` goes
  on where it stopped, and only with the same configuration.  A run holds
  the checkpoint it writes (``hold``): a second run asking for it is refused.
* The learning curve: one ``epoch_record`` per epoch.
* The summary: one JSON document per run (``--json``), written atomically.
"""
from multi_gpu import flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)
import contextlib
import datetime
import fcntl
import glob
import json
import os
import platform
import sys

import numpy as np

from multi_gpu import datasets


class CheckpointError(Exception):
    """A checkpoint that does not fit the model, with a one-line message."""


# the training state a dual_mlp.py checkpoint holds beside the weights
TRAINING_STATE = ("epoch", "best_validation_error", "test_error", "validation_errors")
# what each entry must be: its number of dimensions and kind of number
STATE_TYPES = {"epoch": (0, "iu"), "best_validation_error": (0, "f"), "test_error": (0, "f"),
               "validation_errors": (1, "f"), "config": (0, "U")}


def save_checkpoint(path, params, best_params, **state):
    """Write parameters and training state to an .npz file atomically: a run
    killed while saving leaves the previous checkpoint intact."""
    arrays = {f"params_{i}": p for i, p in enumerate(params)}
    arrays.update({f"best_{i}": p for i, p in enumerate(best_params)})
    arrays.update({k: np.asarray(json.dumps(v, sort_keys=True) if k == "config" else v,
                                 np.float64 if k == "validation_errors" else None)
                   for k, v in state.items()})
    with datasets.atomic_write(path) as f:
        np.savez(f, **arrays)


def load_checkpoint(path, shapes, state=("epoch",)):
    """Read a checkpoint written by ``save_checkpoint`` for a model whose
    parameters have ``shapes``, and check all of it: every parameter, its
    best-validation twin, and the training ``state`` entries named.
    Returns (params, best_params, state)."""
    try:
        with np.load(path) as f:
            saved = {k: f[k] for k in f.files}
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint not found: {path}") from None
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(e).__name__})") from None
    names = [f"{kind}_{i}" for kind in ("params", "best") for i in range(len(shapes))]
    missing = [k for k in names + list(state) if k not in saved]
    if missing:
        training = "validation_errors" in state
        raise CheckpointError(f"{path}: not a {'dual_mlp.py' if training else 'this script'} "
                              f"checkpoint of this model: no {', '.join(missing)}"
                              + (" (mlp.py --save writes a final model, not a training state)"
                                 if training and names[0] in saved else ""))
    arrays = [saved.pop(k) for k in names]
    for name, v, shape in zip(names, arrays, shapes + shapes):
        if v.shape != tuple(shape):
            raise CheckpointError(f"{path}: {name} has shape {v.shape}, the model "
                                  f"{tuple(shape)} (another --n-hidden?)")
        if v.dtype.kind != "f" or not np.isfinite(v).all():
            raise CheckpointError(f"{path}: {name} holds no finite weights (a run that "
                                  "diverged?)")
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
    if "validation_errors" in state and len(values["validation_errors"]) != values["epoch"]:
        raise CheckpointError(f"{path}: {len(values['validation_errors'])} validation errors "
                              f"for {values['epoch']} epochs: not a consistent checkpoint")
    return arrays[:len(shapes)], arrays[len(shapes):], values


def epoch_record(epoch, train_s, validation_error, test_error):
    """One point of a run's learning curve (``--json``'s ``curve``): the
    training seconds so far (no compile, no validation), the epoch's
    validation error, and the test error of the best-validation model so far."""
    return dict(epoch=epoch, train_s=train_s, validation_error=validation_error,
                test_error=test_error)


class Progress:
    """A training run, epoch by epoch: the state a checkpoint keeps beside
    the weights (``TRAINING_STATE``), the best-validation weights, the
    learning curve and the steps and seconds of training so far."""

    def __init__(self, params, epoch=0, best_validation_error=np.inf, test_error=np.inf,
                 validation_errors=()):
        self.epoch, self.best_validation_error, self.test_error = epoch, best_validation_error, \
            test_error
        self.validation_errors, self.best_params = list(validation_errors), params
        self.curve, self.steps, self.train_s = [], 0, 0.0

    @classmethod
    def resume(cls, path, shapes):
        """(the checkpoint's current weights, its Progress)."""
        current, best, state = load_checkpoint(path, shapes, TRAINING_STATE)
        state.pop("config", None)  # the launcher compared it with this run's
        return current, cls(best, **state)

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
        self.curve.append(epoch_record(epoch, self.train_s, validation_error, self.test_error))

    def state(self):
        return {k: getattr(self, k) for k in TRAINING_STATE}

    def save(self, path, params, config):
        """The epoch's checkpoint; a write that fails (a full disk) leaves the
        previous checkpoint as it was, and training goes on."""
        try:
            save_checkpoint(path, params, self.best_params, **self.state(), config=config)
        except OSError as e:
            print(f"worker 0: warning: could not write {path} ({e.strerror}): the previous one "
                  "is kept", file=sys.stderr)

    def summary(self, steps_per_epoch):
        """The summary's entries that describe the training itself."""
        return dict(validation_errors=self.validation_errors,
                    best_validation_error=self.best_validation_error, test_error=self.test_error,
                    epochs_run=self.steps // steps_per_epoch, steps_per_epoch=steps_per_epoch,
                    training_time_s=self.train_s)


def run_header(command):
    """The summary's first entries: what ran, when, where."""
    return dict(command=command,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                host=platform.node())


def write_json(path, document):
    """Write ``document`` as JSON, atomically (raises OSError: a full disk)."""
    with datasets.atomic_write(path) as f:
        f.write(json.dumps(document, indent=2).encode())


@contextlib.contextmanager
def hold(path):
    """Hold ``path`` for this run: a lock file beside it (``.NAME.lock``),
    which a second run finds taken and is refused by.  Once held, what an
    interrupted write of an earlier run left beside it (``.NAME.*.tmp``) is
    nobody's and goes; the temporaries of a live run are never touched."""
    if path is None:
        yield
        return
    folder, name = os.path.split(os.path.abspath(path))
    lock = os.path.join(folder, f".{name}.lock")
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise CheckpointError(f"{path} is being written by another run (pid {owner}): "
                                  "choose another --save, or wait for it") from None
        try:  # the lock file still there, not one a finishing run has just removed
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        for stale in glob.glob(os.path.join(glob.escape(folder), f".{glob.escape(name)}.*.tmp")):
            os.unlink(stale)
        yield
    finally:
        os.unlink(lock)
        os.close(fd)
