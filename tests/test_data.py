"""The three data sources, read through the same function as the demo."""
import gzip
import io
import pickle
import struct

import numpy as np
import pytest

from conftest import FASHION, corrupt_cases, idx_folder, splits
from multi_gpu import datasets


class Python2Pickler(pickle._Pickler):
    """Writes bytes as Python 2 ``str`` opcodes, as the 2014 mnist.pkl.gz has
    them: Python 3 reads those back only with encoding='latin1'."""
    dispatch = pickle._Pickler.dispatch.copy()

    def save_py2_str(self, obj):
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)
    dispatch[bytes] = save_py2_str


def test_shipped_digits_are_real_mnist_in_the_classic_split():
    (tx, ty), (vx, vy), (sx, sy) = datasets.read(datasets.SHIPPED)
    assert [len(tx), len(vx), len(sx)] == [3000, 1000, 1000]
    assert tx.dtype == np.float32 and ty.dtype == np.int32 and tx.shape[1] == 784
    assert 0.0 == tx.min() and tx.max() == 1.0
    for y in (ty, vy, sy):  # shuffled: every split holds every class
        assert np.bincount(y, minlength=10).min() > 50
    # digits, not noise: about a fifth of MNIST's pixels are ink
    assert 0.1 < (tx > 0.5).mean() < 0.2


def test_python2_pickle_loads(tmp_path):
    data = splits()
    buffer = io.BytesIO()
    Python2Pickler(buffer, protocol=2).dump(data)
    with pytest.raises(UnicodeDecodeError):  # really a Python 2 pickle
        pickle.loads(buffer.getvalue())
    path = tmp_path / "mnist.pkl.gz"
    path.write_bytes(gzip.compress(buffer.getvalue()))
    for (x, y), (x0, y0) in zip(datasets.read(str(path)), data):
        np.testing.assert_array_equal(x, x0)
        np.testing.assert_array_equal(y, y0)


def test_idx_folder_loads_with_the_last_10000_training_images_for_validation(tmp_path):
    images, labels = idx_folder(tmp_path)
    (tx, ty), (vx, vy), (sx, sy) = datasets.read(str(tmp_path))
    assert [len(tx), len(vx), len(sx)] == [50, 10000, 40]
    np.testing.assert_allclose(vx[-1] * 255, images["train"][-1].ravel(), atol=1e-3)
    np.testing.assert_array_equal(ty, labels["train"][:50])
    np.testing.assert_array_equal(sy, labels["t10k"])


def test_an_unpacked_idx_folder_reads_the_same(tmp_path):
    (tmp_path / "gz").mkdir()
    (tmp_path / "raw").mkdir()
    idx_folder(tmp_path / "gz")
    for f in datasets.IDX_FILES:
        (tmp_path / "raw" / f[:-3]).write_bytes(gzip.decompress((tmp_path / "gz" / f).read_bytes()))
    for a, b in zip(datasets.read(str(tmp_path / "gz")), datasets.read(str(tmp_path / "raw"))):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])


@pytest.mark.skipif(not FASHION.exists(), reason="needs Debian's dataset-fashion-mnist "
                    "(.ci/run installs it)")
def test_fashion_mnist_from_debian_loads():
    (tx, ty), (vx, vy), (sx, sy) = datasets.read(str(FASHION))
    assert [len(tx), len(vx), len(sx)] == [50000, 10000, 10000]
    assert np.bincount(sy).tolist() == [1000] * 10


def test_download_would_verify_the_published_checksums():
    """The download itself needs the internet, never used in tests; its
    checksum table must name the four files it converts."""
    assert sorted(datasets.MNIST_MD5) == sorted(datasets.IDX_FILES)
    assert all(len(h) == 32 for h in datasets.MNIST_MD5.values())


def test_every_corrupt_data_set_raises_a_one_line_error(tmp_path):
    for name, (path, words) in corrupt_cases(tmp_path).items():
        if name == "missing":
            with pytest.raises(datasets.DatasetError, match=words):
                datasets.resolve(path)
            continue
        with pytest.raises(datasets.DatasetError) as e:
            datasets.read(path)
        assert words in str(e.value) and "\n" not in str(e.value), name


def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    """A crafted mnist.pkl.gz whose payload creates a file: the demo refuses it
    in one line (exit 2) and the file is never created."""
    import os

    from conftest import dual

    marker = tmp_path / "owned"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)
    path = tmp_path / "mnist.pkl.gz"
    path.write_bytes(gzip.compress(pickle.dumps((Payload(), None, None), protocol=2)))
    for read in (lambda: datasets.read(str(path)), lambda: datasets.read_checked(str(path))):
        with pytest.raises(datasets.DatasetError, match="refused: it asks for posix.system"):
            read()
    out = dual("cpu", "cpu", "--dataset", path, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "refused: it asks for posix.system, which a data set never needs" in out.stderr
    out = dual("cpu", "cpu", cwd=tmp_path, timeout=60)  # the default ./mnist.pkl.gz, too
    assert out.returncode == 2 and "refused" in out.stderr
    assert not marker.exists()


def test_what_is_not_an_array_of_numbers_is_refused(tmp_path):
    objects = np.array([{"a": 1}] * 784 * 30, dtype=object).reshape(30, 784)
    (tx, ty), valid, test = splits()
    for name, data, words in [
            ("objects", ((objects, ty), valid, test), "train images are object, not numbers"),
            ("lists", (([[0.0] * 784] * 30, [int(v) for v in ty]), valid, test),
             "is not two arrays"),
            ("nan", ((np.full_like(tx, np.nan), ty), valid, test), "NaN or infinite"),
            ("inf", ((tx, ty), (np.full_like(valid[0], np.inf), valid[1]), test),
             "NaN or infinite")]:
        path = tmp_path / f"{name}.pkl.gz"
        path.write_bytes(gzip.compress(pickle.dumps(data, protocol=2)))
        with pytest.raises(datasets.DatasetError, match=words):
            datasets.read(str(path))


def test_a_fifo_or_an_empty_split_is_refused_without_blocking(tmp_path):
    import os
    fifo = tmp_path / "data.pkl.gz"
    os.mkfifo(fifo)
    with pytest.raises(datasets.DatasetError, match="not a regular file"):
        datasets.resolve(str(fifo))
    folder = tmp_path / "idx"
    folder.mkdir()
    idx_folder(folder)
    (folder / "t10k-images-idx3-ubyte.gz").unlink()
    os.mkfifo(folder / "t10k-images-idx3-ubyte.gz")
    with pytest.raises(datasets.DatasetError, match="not a regular file"):
        datasets.read(str(folder))
    (folder / "t10k-images-idx3-ubyte.gz").unlink()
    datasets.write_idx(str(folder / "t10k-images-idx3-ubyte.gz"), np.zeros((0, 28, 28)))
    datasets.write_idx(str(folder / "t10k-labels-idx1-ubyte.gz"), np.zeros(0))
    with pytest.raises(datasets.DatasetError, match="test set is empty"):
        datasets.read(str(folder))


class Declared:
    """Pickles as ``numpy.ndarray(*args)``: an array whose size the pickle
    only declares (a shape, a tiny buffer, zero strides)."""

    def __init__(self, *args):
        self.args = args

    def __reduce__(self):
        return np.ndarray, self.args


def test_an_array_larger_than_its_file_is_refused_before_it_is_copied(tmp_path):
    (tx, ty), valid, test = splits()
    rows = 10 ** 5  # 313 MB as float32, from a file of kilobytes
    for _name, images in [("zero strides", Declared((rows, 784), np.dtype(np.float32),
                                                   b"\0" * 4, 0, (0, 0))),
                         ("a shape alone", Declared((rows, 784), np.dtype(np.float32)))]:
        path = tmp_path / "big.pkl.gz"
        data = ((images, np.zeros(rows, np.int64)), valid, test)
        path.write_bytes(gzip.compress(pickle.dumps(data, protocol=2)))
        assert path.stat().st_size * 1000 < rows * 784 * 4
        with pytest.raises(datasets.DatasetError, match=r"refused: an array of shape "
                                                        r"\(100000, 784\) declares"):
            datasets.read(str(path))


def test_labels_that_are_not_integers_are_one_line(tmp_path):
    (tx, ty), valid, test = splits()
    for labels, kind in [(np.array(["3"] * len(ty)), "<U1"), (ty.astype(object), "object"),
                         (ty.astype(np.float32), "float32")]:
        path = tmp_path / "labels.pkl.gz"
        path.write_bytes(gzip.compress(pickle.dumps(((tx, labels), valid, test), protocol=2)))
        with pytest.raises(datasets.DatasetError,
                           match=f"train labels are {kind}, not integers in 0..9"):
            datasets.read(str(path))


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_every_pickle_protocol_numpy_writes_reads_the_same(tmp_path, protocol):
    data = splits()
    path = tmp_path / "data.pkl.gz"
    path.write_bytes(gzip.compress(pickle.dumps(data, protocol=protocol)))
    for (x, y), (rx, ry) in zip(data, datasets.read(str(path))):
        assert np.array_equal(x, rx) and np.array_equal(y, ry)


def test_an_empty_split_is_named_as_empty_whatever_its_shape(tmp_path):
    (tx, ty), (vx, vy), test = splits()
    for data, which in [(((tx[:0], ty[:0]), (vx, vy), test), "train"),
                        (((tx, ty), (np.zeros(0, np.float32), vy[:0]), test), "valid")]:
        path = tmp_path / "empty.pkl.gz"
        path.write_bytes(gzip.compress(pickle.dumps(data, protocol=2)))
        with pytest.raises(datasets.DatasetError, match=f"{which} set is empty"):
            datasets.read(str(path))


def test_an_idx_header_whose_size_wraps_around_is_refused(tmp_path):
    path = tmp_path / "wrap-idx3-ubyte"
    path.write_bytes(b"\0\0\x08\x04" + struct.pack(">4I", 65536, 65536, 65536, 65536))
    with pytest.raises(datasets.DatasetError,
                       match=r"IDX header says \(65536, 65536, 65536, 65536\) = "
                             r"18,446,744,073,709,551,616 values, more than this machine's "
                             r"memory can hold"):
        datasets.read_idx(str(path))


@pytest.mark.parametrize("name", ["dual_mlp.py", "mlp.py"])
def test_a_file_that_is_no_data_set_is_told_what_a_data_set_is(name, capsys):
    """README.md, or one IDX file of the four: what --dataset takes, not
    pickle's words (by the script's main())."""
    from conftest import ROOT, refused
    for path, words in ((ROOT / "README.md", "not a data set: --dataset takes the tutorial's "
                         "mnist.pkl.gz (a pickle) or a folder of the four IDX files"),
                        (FASHION / "train-labels-idx1-ubyte.gz",
                         "one IDX file: --dataset takes the folder of all four")):
        if not path.exists():
            continue  # Fashion-MNIST: where Debian's package is installed
        out = refused(capsys, "--dataset", path, name=name)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, out.stderr
        assert lines[0].startswith(f"{name}: error: {path}: {words}"), out.stderr
