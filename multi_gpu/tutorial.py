"""What the tutorial's two scripts, ``mlp.py`` and ``logistic_sgd.py``, take
from the package, in their one line that imports it.

Imported before PyTensor, it maps ``THEANO_FLAGS`` onto PyTensor's flags
(``flags``).  Then:

* the data: ``read`` (any data set the demo reads, as the tutorial's three
  splits), ``resolve`` (which file, when none is named), ``N_PIXELS`` and
  ``N_CLASSES``;
* the command line: ``parser`` with the options both scripts share, the
  number checks, ``heartbeat`` while a graph compiles, ``backend_name``,
  ``quiet_start_up``, and ``run``, which says in one line what went wrong;
* the device ``THEANO_FLAGS=device=cudaN`` asks for: ``device_from_flags``;
* the records: ``save_checkpoint``, ``epoch_record``, ``run_header``,
  ``write_json``.
"""
from multi_gpu import flags  # first: THEANO_FLAGS onto PyTensor's flags
import os
import sys

from multi_gpu import cli, datasets, records
from multi_gpu.cli import (backend_name, heartbeat, non_negative, positive, positive_int,  # noqa: F401
                           quiet_start_up, writable)
from multi_gpu.datasets import N_CLASSES, N_PIXELS, DatasetError, read, resolve  # noqa: F401
from multi_gpu.records import epoch_record, run_header, save_checkpoint, write_json  # noqa: F401

parser = cli.tutorial_parser


def device_from_flags():
    """THEANO_FLAGS=device=cudaN: this process on GPU N, through PyTensor's JAX
    backend, as Theano's flag put it there (None: the CPU)."""
    if not flags.DEVICE:
        return None
    os.environ.update(CUDA_VISIBLE_DEVICES=flags.DEVICE[4:], JAX_PLATFORMS="cuda",
                      XLA_PYTHON_CLIENT_PREALLOCATE="false")
    from multi_gpu.devices import JaxDevice
    try:
        return JaxDevice()
    except Exception as e:  # no JAX with CUDA, no such GPU
        raise DatasetError(f"THEANO_FLAGS device={flags.DEVICE}: no such GPU for JAX "
                           f"({str(e).splitlines()[0]})") from None


def run(script, train, dataset, outputs=None):
    """``train()``, once no output in ``outputs`` ({option: path}) would
    overwrite the data set or each other, and holding ``--save``; what a
    user can get wrong is said in one line: exit 2 for bad input, 1 for a
    write that failed at the end (the file before it is kept)."""
    outputs = outputs or {}
    try:
        dataset, _ = resolve(dataset)
        clash = cli.clash({"--dataset": datasets.files_of(dataset)},
                          {option: [path] for option, path in outputs.items()})
        if clash:
            raise DatasetError(clash)
        with records.hold(outputs.get("--save")):
            train()
    except (DatasetError, records.CheckpointError) as e:
        print(f"{script}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{script}: error: could not write {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    return 0
