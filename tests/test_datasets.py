"""The data: shards, the embedded split, loaders of every format and the errors naming
the file at fault."""
import gzip
import os
import pickle
import shutil
import tarfile

import numpy as np
import pytest

from pympgu import data
from pympgu.training import cli

pytestmark = pytest.mark.timeout(600)
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def test_shards_are_disjoint_and_even():
    for nranks in (1, 2, 3, 8):
        shards = [data.shard_batches(1000, 16, nranks, r, seed=5, epoch=2) for r in range(nranks)]
        flat = np.concatenate([np.concatenate(s) for s in shards])
        assert len(set(flat.tolist())) == len(flat)
        assert len({len(s) for s in shards}) == 1
    a = data.shard_batches(1000, 16, 2, 0, seed=5, epoch=2)
    b = data.shard_batches(1000, 16, 2, 0, seed=5, epoch=3)
    assert not np.array_equal(a[0], b[0])


def test_embedded_split_is_a_fixed_shuffle_of_every_image():
    # The t10k file's last images come from other writers than its first: split in file
    # order, validation was far easier than test. The split must keep every image once,
    # mix the file's order, and be the same on every load.
    ds = data.load()
    x, y = data.load_idx_pair(data.EMBEDDED_DIR, "t10k")
    parts = [ds.train, ds.valid, ds.test]
    assert [len(p[1]) for p in parts] == [8000, 1000, 1000]

    def pairs(xs, ys):
        return sorted((r.tobytes(), int(label)) for r, label in zip(xs, ys))

    assert pairs(np.concatenate([p[0] for p in parts]),
                 np.concatenate([p[1] for p in parts])) == pairs(x, y)
    assert not np.array_equal(ds.test[1], y[-1000:])  # not the file's last thousand
    again = data.load()
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
               for a, b in zip(parts, [again.train, again.valid, again.test]))


def test_data_errors_name_the_file(tmp_path):
    src = data.EMBEDDED_DIR
    # A directory or file holding nothing pympgu reads: what it does read.
    (tmp_path / "notes.txt").write_text("not images")
    for path in (tmp_path, tmp_path / "notes.txt"):
        with pytest.raises(data.DataError, match=f"{path}: (no dataset here|not a dataset): "
                                                 "pympgu reads a directory of MNIST-format"):
            data.load(str(path))
    shutil.copy(os.path.join(src, "t10k-labels-idx1-ubyte.gz"), tmp_path)
    with pytest.raises(data.DataError, match="t10k-images-idx3-ubyte.gz: no such file"):
        data.load(str(tmp_path))
    raw = gzip.open(os.path.join(src, "t10k-images-idx3-ubyte.gz")).read()
    with gzip.open(tmp_path / "t10k-images-idx3-ubyte.gz", "wb") as f:
        f.write(raw[:100000])
    with pytest.raises(data.DataError, match=r"t10k-images-idx3-ubyte.gz: 100000 bytes.*truncated"):
        data.load(str(tmp_path))
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(data.DataError, match="t10k-images-idx3-ubyte.gz: cannot be read"):
        data.load(str(tmp_path))
    # A gzip header and corrupt deflate data past it (zlib.error), and a gzip cut short.
    packed = bytearray(gzip.compress(raw[:200000]))
    packed[12:20] = b"\xff" * 8
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(bytes(packed))
    with pytest.raises(data.DataError, match="t10k-images-idx3-ubyte.gz: cannot be read "
                                             r"\(error: .*invalid code lengths set"):
        data.load(str(tmp_path))
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(raw)[:5000])
    with pytest.raises(data.DataError, match="t10k-images-idx3-ubyte.gz: cannot be read "
                                             r"\(EOFError: "):
        data.load(str(tmp_path))
    (tmp_path / "t10k-images-idx3-ubyte.gz").unlink()
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(raw[:8] + raw[16:])  # header cut
    with pytest.raises(data.DataError, match="magic|bytes"):
        data.load(str(tmp_path))
    (tmp_path / "mnist.pkl.gz").write_bytes(gzip.compress(b"garbage"))
    with pytest.raises(data.DataError, match="mnist.pkl.gz: not a readable"):
        data.load(str(tmp_path / "mnist.pkl.gz"))


def blobs(n, rng, centers):
    """n examples of Gaussian blobs around ``centers`` (classes 0..k-1), as 4x5 'images'
    in float64, the way a user's own arrays may come."""
    y = rng.integers(0, len(centers), n)
    return (centers[y] + rng.normal(0, 1, (n, centers.shape[1]))).reshape(n, 4, 5), y


def test_a_dataset_of_ones_own_trains_from_npz(tmp_path, capsys):
    """--data-dir FILE.npz: the inputs flattened to float32 as they are, the number of
    classes from the labels, a tenth of the training set kept for validation after a fixed
    shuffle (labels sorted by class would otherwise leave it one class), and the model
    sized by the data: it learns far better than chance."""
    rng = np.random.default_rng(0)
    centers = rng.normal(0, 1.5, (3, 20))
    x, y = blobs(3000, rng, centers)
    order = np.argsort(y, kind="stable")  # sorted by class, as data often comes
    xt, yt = blobs(500, rng, centers)
    path = tmp_path / "blobs.npz"
    np.savez(path, x_train=x[order], y_train=y[order], x_test=xt, y_test=yt.astype(np.int16))
    ds = data.load(str(path))
    assert (ds.n_in, ds.n_classes) == (20, 3) and ds.train[0].dtype == np.float32
    assert [len(s[1]) for s in (ds.train, ds.valid, ds.test)] == [2700, 300, 500]
    assert set(np.unique(ds.valid[1])) == {0, 1, 2}
    # The validation split is a shuffled tenth of the training set, the same every time.
    assert np.array_equal(data.load(str(path)).valid[0], ds.valid[0])
    assert np.array_equal(np.sort(np.concatenate([ds.train[1], ds.valid[1]])), y[order])
    assert cli.main(["--cpu", "2", "--data-dir", str(path), "--hidden", "32", "--epochs",
                       "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "blobs.npz (2700/300/500 train/valid/test, 20 inputs) | MLP 20-32-3" in out, out
    test_error = float(out.split("its test error ")[1].split("%")[0])
    assert test_error < 20, out  # chance is 67%
    # Its own validation split is used as given.
    np.savez(path, x_train=x, y_train=y, x_valid=xt[:100], y_valid=yt[:100], x_test=xt,
             y_test=yt)
    assert len(data.load(str(path)).valid[1]) == 100


def fake_cifar(directory, kind="cifar-10", n=40, seed=0):
    """CIFAR's python files, as its authors pickle them (bytes keys, uint8 rows of 3072
    values, plane by plane), of n images a batch whose class sets one colour plane's
    brightness (learnable from the channels alone); returns every batch's (data, labels)."""
    unpacked, train_files, test_file, label_key, n_classes = data.CIFAR[kind]
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    out = {}
    for name in train_files + [test_file]:
        y = rng.integers(0, n_classes, n)
        x = rng.integers(0, 64, (n, 3, 1024))
        x[np.arange(n), y % 3] += (64 + 60 * (y // 3 % 3))[:, None]  # class: plane, level
        batch = {b"data": x.reshape(n, 3072).astype(np.uint8), label_key: list(map(int, y)),
                 b"batch_label": name.encode()}
        with open(os.path.join(directory, name), "wb") as f:
            pickle.dump(batch, f, protocol=2)
        out[name] = batch[b"data"], y
    meta, key = data.CIFAR_META[kind]
    with open(os.path.join(directory, meta), "wb") as f:
        pickle.dump({key: [f"class {c}".encode() for c in range(n_classes)]}, f, protocol=2)
    return out


def test_cifar_loads_from_its_directory_its_archive_or_a_directory_holding_them(tmp_path):
    """CIFAR-10's python version as downloaded: its five training batches in order, the
    last tenth of them kept for validation, the test batch, images scaled to [0, 1] with
    the colour planes first (as conv2d's NCHW reshape reads them); from the unpacked
    directory, the .tar.gz, or the directory either lies in. CIFAR-100 has 100 classes."""
    import tarfile
    batches = fake_cifar(tmp_path / "cifar-10-batches-py")
    ds = data.load(str(tmp_path / "cifar-10-batches-py"))
    assert (ds.name, ds.n_in, ds.n_classes) == ("cifar-10", 3072, 10)
    assert ds.class_names == [f"class {c}" for c in range(10)]  # from batches.meta
    assert [len(s[1]) for s in (ds.train, ds.valid, ds.test)] == [180, 20, 40]
    x = np.concatenate([batches[f"data_batch_{k}"][0] for k in range(1, 6)])
    assert np.array_equal(ds.train[0], x[:180].astype(np.float32) / 255)
    assert np.array_equal(ds.valid[1], batches["data_batch_5"][1][20:])
    assert np.array_equal(ds.test[1], batches["test_batch"][1])
    # Red plane first: the first 1024 values of a red image (class 0) are its brightest.
    red = ds.test[0][ds.test[1] == 0].reshape(-1, 3, 1024).mean(axis=(0, 2))
    assert red[0] > red[1] and red[0] > red[2], red
    with tarfile.open(tmp_path / "cifar-10-python.tar.gz", "w:gz") as t:
        t.add(tmp_path / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    (tmp_path / "elsewhere").mkdir()
    os.rename(tmp_path / "cifar-10-python.tar.gz", tmp_path / "elsewhere" / "cifar-10-python.tar.gz")
    for where in (tmp_path, tmp_path / "elsewhere", tmp_path / "elsewhere" / "cifar-10-python.tar.gz"):
        again = data.load(str(where))
        assert np.array_equal(again.train[0], ds.train[0]) and again.n_classes == 10, where
        assert again.class_names == ds.class_names, where
    fake_cifar(tmp_path / "c100" / "cifar-100-python", "cifar-100", n=50)
    hundred = data.load(str(tmp_path / "c100"))
    assert (hundred.name, hundred.n_classes, len(hundred.train[1])) == ("cifar-100", 100, 45)
    assert hundred.class_names[99] == "class 99"
    os.remove(tmp_path / "c100" / "cifar-100-python" / "meta")  # the names are optional
    assert data.load(str(tmp_path / "c100")).class_names is None


def test_cifar_errors_name_the_file(tmp_path, capsys):
    with pytest.raises(SystemExit):  # a name, not a path: where to get it
        cli.main(["--cpu", "2", "--data-dir", "cifar10"])
    assert "--data-dir cifar10: no such file or directory (pympgu reads CIFAR as its " \
        "authors ship it: download https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" \
        in capsys.readouterr().err
    fake_cifar(tmp_path / "c")
    (tmp_path / "c" / "data_batch_3").write_bytes(b"garbage")
    with pytest.raises(data.DataError, match=r"c: data_batch_3: not a CIFAR batch"):
        data.load(str(tmp_path / "c"))
    with open(tmp_path / "c" / "data_batch_3", "wb") as f:
        pickle.dump({b"data": np.zeros((4, 784), np.uint8), b"labels": [0] * 4}, f)
    with pytest.raises(data.DataError, match=r"data_batch_3: expected uint8 images of 3072 "
                                             r"values and a label each, got uint8 \(4, 784\)"):
        data.load(str(tmp_path / "c"))
    with open(tmp_path / "c" / "data_batch_3", "wb") as f:
        pickle.dump({b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2, 10]}, f)
    with pytest.raises(data.DataError, match="data_batch_3: labels outside 0 to 9"):
        data.load(str(tmp_path / "c"))
    with pytest.raises(data.DataError, match="missing.tar.gz: no such file"):
        data.load(str(tmp_path / "missing.tar.gz"))
    (tmp_path / "bad.tar.gz").write_bytes(b"not an archive")
    with pytest.raises(data.DataError, match="bad.tar.gz: not a readable CIFAR archive"):
        data.load(str(tmp_path / "bad.tar.gz"))
    # An archive whose gzip header reads, and whose deflate data past it does not.
    fake_cifar(tmp_path / "d")
    with tarfile.open(tmp_path / "d.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "d", arcname="cifar-10-batches-py")
    packed = bytearray((tmp_path / "d.tar.gz").read_bytes())
    cut = len(packed) * 3 // 10  # past the first member's header
    packed[cut:cut + 8] = b"\xff" * 8
    (tmp_path / "d.tar.gz").write_bytes(bytes(packed))
    with pytest.raises(data.DataError, match=r"d.tar.gz: not a readable CIFAR archive "
                                             r"\(error: Error -3 while decompressing"):
        data.load(str(tmp_path / "d.tar.gz"))


def test_a_convnet_trains_on_cifar_shaped_images(tmp_path, capsys):
    """3-channel 32x32 images from CIFAR's files through examples/strided.py on 2 CPU
    workers (CPU JAX, as GPU workers compile it): the model reads them as 3x32x32, and
    learns classes set by colour far better than chance."""
    pytest.importorskip("jax")
    fake_cifar(tmp_path / "cifar-10-batches-py", n=200)
    strided = os.path.join(EXAMPLES, "strided.py:StridedConvNet")
    assert cli.main(["--cpu", "2", "--data-dir", str(tmp_path), "--model", strided,
                       "--hidden", "8", "16", "--batch-size", "50", "--epochs", "4",
                       "--optimizer", "adam", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "cifar-10 (900/100/200 train/valid/test, 3072 inputs) | StridedConvNet 3x32x32" in out
    test_error = float(out.split("its test error ")[1].split("%")[0])
    assert test_error < 50, out  # chance is 90%; two runs here: 20.0%


@pytest.mark.parametrize("arrays,message", [
    (dict(x_train=np.zeros((4, 2)), y_train=np.zeros(4, int)),
     "no array x_test, y_test (it has x_train, y_train; it needs"),
    (dict(x_train=np.zeros((4, 2)), y_train=np.zeros(3, int), x_test=np.zeros((2, 2)),
          y_test=np.zeros(2, int)), "x_train (4, 2) and y_train (3,) must hold as many"),
    (dict(x_train=np.zeros((40, 2)), y_train=np.full(40, 0.5), x_test=np.zeros((2, 2)),
          y_test=np.zeros(2, int)), "y_train integers (got float64 and float64)"),
    (dict(x_train=np.full((40, 2), np.nan), y_train=np.zeros(40, int),
          x_test=np.zeros((2, 2)), y_test=np.zeros(2, int)), "x_train holds NaN"),
    (dict(x_train=np.zeros((40, 2)), y_train=-np.ones(40, int), x_test=np.zeros((2, 2)),
          y_test=np.zeros(2, int)), "y_train holds negative labels (-1)"),
    (dict(x_train=np.zeros((40, 2)), y_train=np.arange(40) % 2, x_test=np.zeros((2, 3)),
          y_test=np.zeros(2, int)), "the splits' inputs differ in size (train 2, test 3"),
    (dict(x_train=np.zeros((5, 2)), y_train=np.arange(5) % 2, x_test=np.zeros((2, 2)),
          y_test=np.zeros(2, int)), "5 training examples are too few"),
    (dict(x_train=np.zeros((40, 2)), y_train=np.zeros(40, int), x_test=np.zeros((2, 2)),
          y_test=np.zeros(2, int)), "every label is 0"),
    (dict(x_train=np.zeros((40, 2)), y_train=np.arange(40) % 2, x_valid=np.zeros((2, 2)),
          x_test=np.zeros((2, 2)), y_test=np.zeros(2, int)), "no array y_valid"),
])
def test_npz_errors_name_the_file_and_the_array(tmp_path, arrays, message):
    path = tmp_path / "mine.npz"
    np.savez(path, **arrays)
    with pytest.raises(data.DataError) as info:
        data.load(str(path))
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value), info.value
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(data.DataError, match="junk.npz: not a readable .npz"):
        data.load(str(tmp_path / "junk.npz"))


def test_digits_without_scikit_learn_says_what_to_install(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # its import then fails
    with pytest.raises(data.DataError, match="'digits' dataset is scikit-learn's: pip install "
                                             '"pympgu\\[digits\\]"'):
        data.load("digits")
    import tomllib  # the extra it names is there
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["digits"] == ["scikit-learn>=1.0"]


def test_seed_pickle_format(tmp_path):
    import pickle
    rng = np.random.default_rng(0)
    splits = [(rng.random((n, 784), dtype=np.float32), rng.integers(0, 10, n)) for n in (50, 20, 20)]
    path = tmp_path / "mnist.pkl.gz"
    with gzip.open(path, "wb") as f:
        pickle.dump(tuple(splits), f)
    ds = data.load(str(path))
    assert len(ds.train[1]) == 50 and ds.n_in == 784
