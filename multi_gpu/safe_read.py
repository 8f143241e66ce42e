"""Reading a data file that may be hostile: what a crafted file could do
to the process that reads it, refused in one line (``DatasetError``).

* only regular files are opened (a FIFO would block the open for ever);
* a file that expands without end (a gzip bomb) is refused once it passes
  a share of the memory this process may still take;
* a pickle builds NumPy arrays and tuples and nothing else (any other object
  it asks for is refused: a crafted file runs no code), and no array may
  declare more bytes than the file holds.
"""
import contextlib
import gzip
import os
import pickle
import stat
import zlib

import numpy as np

from multi_gpu import memory


class DatasetError(Exception):
    """A data set that cannot be used, with a message fit for one line."""


def regular_file(path):
    """Refuse what is not a regular file (a FIFO would block the open for ever)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise DatasetError(f"{path}: not a regular file")


@contextlib.contextmanager
def opened(path):
    """``path`` open for reading, decompressed where it ends in .gz; what goes
    wrong on the way is a DatasetError."""
    regular_file(path)
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            yield f
    except gzip.BadGzipFile:
        raise DatasetError(f"{path}: not a gzip file") from None
    except (EOFError, zlib.error):
        raise DatasetError(f"{path}: truncated or corrupt gzip data") from None
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror or e}") from None


def room_for(what):
    """The most bytes a data file may expand to here: a share of the memory
    this process may still take (``memory.available_memory``, which counts
    a container's limit), so that a file that expands without end (a gzip
    bomb: a few MB that expand to GB) is refused, not read until the kernel
    ends the process without a word."""
    available = memory.available_memory()
    return (8 << 30 if available is None else available) // what


def read_at_most(f, path, limit, piece=1 << 20):
    """All of ``f``, refused past ``limit`` bytes (read no further).  Read in
    pieces: one read of ``limit`` bytes would ask for a buffer that size
    before reading a byte, which ``ulimit -v`` refuses (MemoryError)."""
    pieces, size = [], 0
    while chunk := f.read(piece):
        size += len(chunk)
        if size > limit:
            raise DatasetError(f"{path}: expands to more than {limit / 2**30:.1f} GiB, more "
                               "than this machine's memory can hold beside the run (a gzip "
                               "bomb?)")
        pieces.append(chunk)
    return b"".join(pieces)


class ArraysOnly(pickle.Unpickler):
    """Unpickles what the tutorial's file holds, NumPy arrays in tuples, and
    refuses any other object a file asks for: a pickle can name any function
    to call, and a crafted data file would run it."""

    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"),
               ("numpy.core.multiarray", "_reconstruct"),    # NumPy 1 wrote these
               ("numpy._core.multiarray", "_reconstruct"),   # NumPy 2
               ("numpy.core.numeric", "_frombuffer"),        # protocol 5, NumPy 1
               ("numpy._core.numeric", "_frombuffer"),       # protocol 5, NumPy 2
               ("_codecs", "encode"),                        # protocol 2's bytes
               ("__builtin__", "bytes"), ("builtins", "bytes")}  # protocol 2's b"" (bytes())

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"it asks for {module}.{name}, which a data set "
                                         "never needs")
        if name == "bytes":
            return empty_bytes
        if name == "_reconstruct":  # NumPy's own, whichever version wrote the file
            return np.ndarray.__reduce__(np.zeros(0))[0]
        if name == "_frombuffer":
            return np.zeros(1).__reduce_ex__(5)[0]
        return super().find_class(module, name)


def empty_bytes(*args):
    """``bytes()``, as protocol 2 writes an empty array's data; never
    ``bytes(n)``, which would make n zero bytes a pickle asked for."""
    if args:
        raise pickle.UnpicklingError("it asks for bytes(...) with arguments, which a data set "
                                     "never needs")
    return b""


def arrays_in(splits):
    """Every array of the splits as the pickle left them (any nesting)."""
    if isinstance(splits, np.ndarray):
        yield splits
    elif isinstance(splits, (tuple, list)):
        for part in splits:
            yield from arrays_in(part)


def backed_by(raw, path, splits):
    """Refuse arrays larger than the file that holds them: ``numpy.ndarray``
    called with a buffer and zero strides, or with a shape alone, declares
    any number of rows for a few bytes, and the float copy would fill the
    memory."""
    for a in arrays_in(splits):
        if a.nbytes > len(raw) or any(s == 0 for s, n in zip(a.strides, a.shape) if n > 1):
            raise DatasetError(f"{path}: refused: an array of shape {a.shape} declares "
                               f"{a.nbytes:,} bytes, and the file holds {len(raw):,}")
