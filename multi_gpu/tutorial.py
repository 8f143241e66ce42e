"""What the tutorial's two scripts, ``mlp.py`` and ``logistic_sgd.py``, take
from the package, in their one line that imports it.

Imported before PyTensor, it maps ``THEANO_FLAGS`` onto PyTensor's flags
(``flags``).  Then:

* the data: ``read`` (any data set the demo reads, as the tutorial's three
  splits), ``resolve`` (which file, when none is named), ``N_PIXELS`` and
  ``N_CLASSES``;
* the command line: ``parser`` with the options both scripts share, the
  number checks, ``heartbeat`` while a graph compiles and what it says
  (``compiling``), ``backend_name``,
  ``quiet_start_up``, and ``run``, which says in one line what went wrong;
* the device the flags ask for (``device=cudaN``, or the CPU): ``device_from_flags``;
* the records: ``save_checkpoint``, ``epoch_record``, ``run_header``,
  ``write_json_or_show``; ``check_finite``, which stops a run that diverged before
  it writes anything.
"""
import multi_gpu.flags as flags  # first: THEANO_FLAGS onto PyTensor's flags

import importlib.metadata
import os
import shutil
import sys
import tempfile

from multi_gpu import cli, datasets, devices, locks, memory, records
from multi_gpu.cli import (  # noqa: F401
    backend_name,
    heartbeat,
    non_negative,
    positive,
    positive_int,
    quiet_start_up,
    seed,
    writable,
)
from multi_gpu.datasets import N_CLASSES, N_PIXELS, DatasetError, read, resolve  # noqa: F401
from multi_gpu.records import epoch_record, run_header, save_checkpoint, write_json_or_show  # noqa: F401
from multi_gpu.report import Diverged, check_finite, compiling  # noqa: F401

parser, add_model_options = cli.tutorial_parser, cli.add_model_options
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"  # one folder per GPU the NVIDIA driver sees


def device_from_flags():
    """The device the flags ask for.  THEANO_FLAGS=device=cudaN: this process
    on GPU N, through PyTensor's JAX backend, as Theano's flag put it there.
    Else the CPU, through JAX too (``devices.cpu_backend`` says why), or None
    where the flags name another mode (``mode=NUMBA``).  Where GPU N cannot
    be used, a ``DatasetError`` says why in one line: no CUDA in this JAX,
    no NVIDIA GPU, or no GPU of that number."""
    if not flags.DEVICE:  # the CPU, with JAX unless the flags name another mode
        if devices.cpu_backend() != "JAX":
            return None
        os.environ["JAX_PLATFORMS"] = "cpu"
        return devices.JaxDevice()
    index, asked = int(flags.DEVICE[4:]), f"THEANO_FLAGS device={flags.DEVICE_ASKED}"
    cpu = "or leave device= out to run on the CPU"
    if not any((d.metadata["Name"] or "").lower().startswith("jax-cuda")
               for d in importlib.metadata.distributions()):
        raise DatasetError(f"{asked}: this JAX has no CUDA support (pip install -r "
                           f"requirements-gpu.txt on a machine with an NVIDIA GPU), {cpu}")
    gpus = len(os.listdir(NVIDIA_GPUS)) if os.path.isdir(NVIDIA_GPUS) else None
    none_here = gpus == 0 or gpus is None and not os.path.exists("/dev/nvidiactl")
    if none_here:
        raise DatasetError(f"{asked}: no NVIDIA GPU here (no driver lists one), {cpu}")
    if gpus is not None and index >= gpus:
        raise DatasetError(f"{asked}: GPU {index} does not exist: this machine has {gpus} "
                           f"(cuda0..cuda{gpus - 1})")
    # this process sees its GPU only, as a dual_mlp.py worker does
    os.environ.update(CUDA_VISIBLE_DEVICES=str(index), JAX_PLATFORMS="cuda",
                      XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        return devices.JaxDevice()
    except Exception as e:  # the driver or JAX's CUDA plugin would not start
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DatasetError(f"{asked}: JAX cannot start GPU {index} ({why})") from None


def run(script, train, dataset, outputs=None, shapes=None):
    """``train()``, once no output in ``outputs`` ({option: path}) would
    overwrite the data set or each other, and holding them; for a model of
    parameter ``shapes``, once memory can hold it and each output's disk a
    checkpoint of it.  What a user can get wrong is said in one line: exit 2
    for bad input, 1 for a write that failed at the end (the file before
    it is kept)."""
    outputs = outputs or {}
    too_few = flags.threads_problem(flags.THREADS_PER_PROCESS + 16, script) or \
        flags.xla_flags_problem()
    if too_few:  # said before XLA starts its pools, or ends the process on a flag it refuses
        print(f"{script}: error: {too_few}", file=sys.stderr)
        return 2
    try:
        dataset, _ = resolve(dataset)
        clash = cli.clash({"--dataset": datasets.files_of(dataset)},
                          {option: [path] for option, path in outputs.items()})
        if clash:
            raise DatasetError(clash)
        too_big = shapes and memory.memory_problem(shapes)
        if too_big:
            raise DatasetError(too_big)
        room = records.checkpoint_bytes(shapes) if shapes else 0
        with locks.hold(*outputs.values(), room=room), \
                tempfile.TemporaryDirectory() as sources, \
                cli.on_quit(lambda: shutil.rmtree(sources, ignore_errors=True)):
            # PyTensor's compiled graphs' sources, which it leaves, go with the folder
            before, tempfile.tempdir = tempfile.tempdir, sources
            try:
                train()
            finally:
                tempfile.tempdir = before
    except (DatasetError, records.CheckpointError) as e:
        print(f"{script}: error: {e}", file=sys.stderr)
        return 2
    except Diverged as e:
        print(f"{script}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"{script}: error: could not write {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    return 0
