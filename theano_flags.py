"""Honour ``THEANO_FLAGS`` by mapping it onto PyTensor's ``PYTENSOR_FLAGS``.

PyTensor reads its flags once, when it is first imported, so every script
imports this module before ``pytensor``.  The seed was run as::

    THEANO_FLAGS=mode=FAST_RUN,floatX=float32 python dual_mlp.py 0 1

* Flags PyTensor shares with Theano (``mode``, ``floatX``, ``optimizer``,
  ``compiledir``, ...) pass through; ``PYTENSOR_FLAGS`` wins where both set one.
* Theano's old mode names become PyTensor's (``DEBUG_MODE`` -> ``DebugMode``).
* Theano's GPU flags (``device=cuda0``, ``gpuarray__*``, ...) are warned about
  and dropped: here the GPUs are the positional arguments of ``dual_mlp.py``.
* ``floatX`` defaults to float32, the seed's setting and what GPUs need.

The mapped flags are written back to the environment and ``THEANO_FLAGS`` is
removed, so child processes inherit the result without warning again.
"""
import os
import sys

THEANO_ONLY = ("device", "init_gpu_device", "contexts", "force_device", "print_active_device",
               "gpuarray__", "dnn__", "lib__cnmem", "nvcc__", "cuda__", "pycuda__",
               "enable_initial_driver_test")
MODES = {"DEBUG_MODE": "DebugMode", "PROFILE_MODE": "FAST_RUN"}


def parse(flags):
    """'a=1,b=2' -> {'a': '1', 'b': '2'} (Theano's syntax; '.' in names is '__')."""
    pairs = (item.split("=", 1) for item in flags.split(",") if item.strip())
    return {k.strip().replace(".", "__"): v.strip() for k, v in pairs}


def to_pytensor(theano_flags, pytensor_flags=""):
    """The PYTENSOR_FLAGS string for these flag strings, and the warnings."""
    flags, warnings = {}, []
    for key, value in parse(theano_flags).items():
        if key.startswith(THEANO_ONLY):
            warnings.append(f"THEANO_FLAGS: '{key}={value}' is a Theano-only flag, ignored "
                            "(dual_mlp.py takes its devices as arguments: dual_mlp.py 0 1)")
        elif key == "mode":
            flags[key] = MODES.get(value, value)
            if value == "PROFILE_MODE":
                flags["profile"] = "True"
        else:
            flags[key] = value
    flags.update(parse(pytensor_flags))
    flags.setdefault("floatX", "float32")
    return ",".join(f"{k}={v}" for k, v in flags.items()), warnings


def apply(environ=os.environ):
    pytensor_flags, warnings = to_pytensor(environ.pop("THEANO_FLAGS", ""),
                                           environ.get("PYTENSOR_FLAGS", ""))
    environ["PYTENSOR_FLAGS"] = pytensor_flags
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)


# Too late once PyTensor is imported (e.g. by a notebook): its flags are read.
if "pytensor" not in sys.modules:
    apply()
