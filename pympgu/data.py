"""Datasets: the seed's mnist.pkl.gz, MNIST-format IDX files, Fashion-MNIST, CIFAR-10 and
CIFAR-100 as their authors ship them for Python, a .npz of one's own, and an embedded default
(the MNIST test set shipped inside pympgu) so training runs offline.

Every loader returns a :class:`Dataset` of float32 inputs (flattened; images in [0, 1]) and
int32 labels, split into train, valid and test. A missing, truncated or corrupt file raises
:class:`DataError` naming the file.
"""
import gzip
import io
import os
import pickle
import tarfile
import zlib

import numpy as np

EMBEDDED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "datasets")
FASHION_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist
# Fashion-MNIST's labels 0 to 9 (Zalando's README); its IDX files do not carry them.
FASHION_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                   "Sneaker", "Bag", "Ankle boot")
IMAGE_MAGIC, LABEL_MAGIC = 2051, 2049


class DataError(ValueError):
    """A dataset file is missing, truncated or not what it claims to be."""


class Dataset:
    """Three splits of (images float32 [n, d], labels int32 [n]), a name, and the classes'
    names where the data has them (None: a class is its number)."""

    def __init__(self, name, train, valid, test, n_classes=10, class_names=None):
        self.name, self.train, self.valid, self.test = name, train, valid, test
        self.n_classes = n_classes
        self.n_in = train[0].shape[1]
        if class_names is not None and len(class_names) != n_classes:
            raise DataError(f"{name}: {len(class_names)} class names for {n_classes} classes")
        self.class_names = class_names

    def __repr__(self):
        sizes = "/".join(str(len(s[1])) for s in (self.train, self.valid, self.test))
        return f"{self.name} ({sizes} train/valid/test, {self.n_in} inputs)"


def _open(path):
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def read_idx(path, magic):
    """An IDX file's array (uint8), checking its magic number and its length."""
    try:
        with _open(path) as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    if len(raw) < 8:
        raise DataError(f"{path}: truncated ({len(raw)} bytes, no IDX header)")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise DataError(f"{path}: IDX magic number {found}, expected {magic}")
    ndim = raw[3]
    header = 4 + 4 * ndim
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    expected = header + int(np.prod(dims))
    if len(raw) != expected:
        raise DataError(f"{path}: {len(raw)} bytes, the header {dims} needs {expected} "
                        "(truncated or corrupt)")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


def _find(directory, stem):
    for name in (stem + ".gz", stem, stem.replace("-idx", ".idx") + ".gz",
                 stem.replace("-idx", ".idx")):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return path
    return os.path.join(directory, stem + ".gz")  # the error then names the usual file


def load_idx_pair(directory, prefix):
    images = read_idx(_find(directory, f"{prefix}-images-idx3-ubyte"), IMAGE_MAGIC)
    labels = read_idx(_find(directory, f"{prefix}-labels-idx1-ubyte"), LABEL_MAGIC)
    if len(images) != len(labels):
        raise DataError(f"{directory}: {len(images)} {prefix} images but {len(labels)} labels")
    x = images.reshape(len(images), -1).astype(np.float32) / 255.0
    return x, labels.astype(np.int32)


def _split(x, y, n_valid, n_test):
    n = len(y)
    a, b = n - n_valid - n_test, n - n_test
    return (x[:a], y[:a]), (x[a:b], y[a:b]), (x[b:], y[b:])


# What --data-dir takes, for the errors that name a path holding none of it.
READS = ("pympgu reads a directory of MNIST-format IDX files (t10k-images-idx3-ubyte and "
         "t10k-labels-idx1-ubyte, gzipped or not, train-* beside them), CIFAR-10 or "
         "CIFAR-100's python version, the seed's mnist.pkl.gz, or a .npz of one's own")


def load_idx_dir(directory, name=None, n_valid=10000):
    """train-* and t10k-* IDX files; the last n_valid training images become validation.

    A directory with only the t10k files is split 8:1:1 after a fixed shuffle (that is the
    embedded default). The t10k file is not in random order (MNIST's page: its first 5,000
    images are cleaner and easier than its last 5,000), and split in file order the
    validation images (8,000 to 9,000) were far easier than the test images (9,000 on):
    3.2% against 9.5% error after the default 5 epochs, so the best epoch was chosen on
    unrepresentative data. Shuffled, the two agree (9.9% and 9.2%). The shuffle is
    RandomState's, whose stream numpy keeps fixed across versions, so every install splits
    alike.
    """
    name = name or os.path.basename(os.path.normpath(directory))
    if not os.path.isdir(directory):
        raise DataError(f"{directory}: " + (f"not a dataset: {READS}" if os.path.exists(directory)
                                            else "no such directory"))
    if not any(os.path.exists(_find(directory, stem))
               for stem in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")):
        raise DataError(f"{directory}: no dataset here: {READS}")
    # IDX files hold numbers only: a directory named for Fashion-MNIST gets its classes'
    # names (for pympgu.evaluate's report), any other a class's number.
    names = FASHION_CLASSES if "fashion" in name.lower() else None
    has_train = os.path.exists(_find(directory, "train-images-idx3-ubyte"))
    test = load_idx_pair(directory, "t10k")
    if not has_train:
        n = len(test[1])
        order = np.random.RandomState(0).permutation(n)
        train, valid, test = _split(test[0][order], test[1][order], n // 10, n // 10)
        return Dataset(name + " (t10k, shuffled 8:1:1)", train, valid, test, class_names=names)
    x, y = load_idx_pair(directory, "train")
    train, valid = (x[:-n_valid], y[:-n_valid]), (x[-n_valid:], y[-n_valid:])
    return Dataset(name, train, valid, test, class_names=names)


def load_pickle(path):
    """The seed's mnist.pkl.gz: ((train_x, train_y), (valid_x, valid_y), (test_x, test_y))."""
    try:
        with _open(path) as f:
            splits = pickle.load(f, encoding="latin1")
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{path}: not a readable mnist.pkl.gz ({type(e).__name__}: {e})") from None
    try:
        out = [(np.asarray(x, np.float32).reshape(len(y), -1), np.asarray(y, np.int32))
               for x, y in splits]
        train, valid, test = out
    except (TypeError, ValueError) as e:
        raise DataError(f"{path}: expected three (images, labels) pairs ({e})") from None
    return Dataset(os.path.basename(path), train, valid, test)


def load_npz(path, valid_share=0.1):
    """A dataset of one's own: a .npz with arrays ``x_train``, ``y_train``, ``x_test`` and
    ``y_test``, and ``x_valid`` and ``y_valid`` if it has its own validation split.

    Inputs of any shape (n, ...) are flattened to float32 as they are (scale them as the
    model expects); labels are integers from 0, and their largest value, over every split,
    gives the number of classes. Without a validation split, a ``valid_share`` of the
    training examples, drawn after a fixed shuffle (so that data sorted by class gives a
    representative one), becomes it.
    """
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except Exception as e:
        raise DataError(f"{path}: not a readable .npz ({type(e).__name__}: {e})") from None
    needed = ["x_train", "y_train", "x_test", "y_test"]
    splits = ["train", "test"]
    if "x_valid" in arrays or "y_valid" in arrays:
        needed += ["x_valid", "y_valid"]
        splits.insert(1, "valid")
    missing = [k for k in needed if k not in arrays]
    if missing:
        raise DataError(f"{path}: no array {', '.join(missing)} (it has "
                        f"{', '.join(sorted(arrays)) or 'none'}; it needs x_train, y_train, "
                        "x_test, y_test, and optionally x_valid, y_valid)")
    out = {}
    for split in splits:
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim < 1 or y.ndim != 1 or len(x) != len(y) or not len(y):
            raise DataError(f"{path}: x_{split} {x.shape} and y_{split} {y.shape} must hold "
                            "as many examples, one label each, and at least one")
        if not (np.issubdtype(x.dtype, np.number) and np.issubdtype(y.dtype, np.integer)):
            raise DataError(f"{path}: x_{split} must be numbers and y_{split} integers "
                            f"(got {x.dtype} and {y.dtype})")
        x = x.reshape(len(x), -1).astype(np.float32)
        if not np.isfinite(x).all():
            raise DataError(f"{path}: x_{split} holds NaN or infinite values")
        if y.min() < 0:
            raise DataError(f"{path}: y_{split} holds negative labels ({int(y.min())}); "
                            "labels count from 0")
        out[split] = (x, y.astype(np.int32))
    widths = {x.shape[1] for x, _ in out.values()}
    if len(widths) != 1:
        raise DataError(f"{path}: the splits' inputs differ in size "
                        f"({', '.join(f'{k} {x.shape[1]}' for k, (x, _) in out.items())})")
    if "valid" not in out:
        x, y = out["train"]
        n_valid = int(len(y) * valid_share)
        if not 0 < n_valid < len(y):
            raise DataError(f"{path}: {len(y)} training examples are too few to keep "
                            f"{valid_share:.0%} of them for validation (give x_valid, y_valid)")
        order = np.random.RandomState(0).permutation(len(y))
        x, y = x[order], y[order]
        out["train"], out["valid"] = (x[n_valid:], y[n_valid:]), (x[:n_valid], y[:n_valid])
    n_classes = int(max(y.max() for _, y in out.values())) + 1
    if n_classes < 2:
        raise DataError(f"{path}: every label is 0; a classifier needs two classes or more")
    return Dataset(os.path.basename(path), out["train"], out["valid"], out["test"], n_classes)


# CIFAR's "python version" (https://www.cs.toronto.edu/~kriz/cifar.html): pickled dicts of
# b"data", uint8 rows of 3072 (the red 32x32 plane, then green, then blue: channels first,
# as pympgu.nnet.square_images reads them) and b"labels" (CIFAR-100: b"fine_labels").
CIFAR = {"cifar-10": ("cifar-10-batches-py", [f"data_batch_{k}" for k in range(1, 6)],
                      "test_batch", b"labels", 10),
         "cifar-100": ("cifar-100-python", ["train"], "test", b"fine_labels", 100)}
# The file of each CIFAR that names its classes, and the key of the names.
CIFAR_META = {"cifar-10": ("batches.meta", b"label_names"),
              "cifar-100": ("meta", b"fine_label_names")}


def _cifar_kind(names):
    """Which CIFAR a set of file names (a directory's, an archive's) holds, or None."""
    for kind, (_, train, test, _, _) in CIFAR.items():
        if test in names and all(t in names for t in train):
            return kind
    return None


def _find_cifar(path):
    """The CIFAR archive or directory of batches at ``path`` or just inside it, or None."""
    if path.endswith((".tar.gz", ".tgz", ".tar")):
        return path
    if not os.path.isdir(path):
        return None
    if _cifar_kind(set(os.listdir(path))):
        return path
    for kind, (unpacked, *_) in CIFAR.items():
        for inner in (os.path.join(path, unpacked), os.path.join(path, f"{kind}-python.tar.gz")):
            if os.path.exists(inner):
                return inner
    return None


def _cifar_files(path):
    """(which CIFAR, read(name) -> bytes, KeyError for a file it lacks) of an archive or a
    directory of batches."""
    if os.path.isdir(path):
        kind = _cifar_kind(set(os.listdir(path)))
        if kind is None:
            raise DataError(f"{path}: no CIFAR-10 or CIFAR-100 files (data_batch_1 to 5 and "
                            "test_batch, or train and test) and no archive of them")

        def read(name):
            try:
                with open(os.path.join(path, name), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                raise KeyError(name) from None
        return kind, read
    try:
        archive = tarfile.open(path, "r:*")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (tarfile.TarError, OSError) as e:
        raise DataError(f"{path}: not a readable CIFAR archive ({e})") from None
    try:
        with archive:
            members = {os.path.basename(m.name): m for m in archive.getmembers() if m.isfile()}
            kind = _cifar_kind(set(members))
            if kind is None:
                raise DataError(f"{path}: holds no CIFAR-10 or CIFAR-100 files")
            _, train_files, test_file, _, _ = CIFAR[kind]
            blobs = {name: archive.extractfile(members[name]).read()
                     for name in train_files + [test_file, CIFAR_META[kind][0]]
                     if name in members}
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:  # corrupt past its header
        raise DataError(f"{path}: not a readable CIFAR archive ({type(e).__name__}: {e})") \
            from None
    return kind, blobs.__getitem__


def load_cifar(path):
    """CIFAR-10 or CIFAR-100 as downloaded: the archive (cifar-10-python.tar.gz), the
    directory it unpacks to (cifar-10-batches-py), or a directory holding either. The last
    tenth of the training images become the validation split (5,000 of 50,000). The files
    are Python pickles, which can run code when read: give only files you trust, as for
    the seed's mnist.pkl.gz."""
    path = _find_cifar(path) or path
    kind, read = _cifar_files(path)
    _, train_files, test_file, label_key, n_classes = CIFAR[kind]

    def split(name):
        where = f"{path}: {name}"
        try:
            batch = pickle.load(io.BytesIO(read(name)), encoding="bytes")
            x, y = np.asarray(batch[b"data"]), np.asarray(batch[label_key])
        except Exception as e:
            raise DataError(f"{where}: not a CIFAR batch ({type(e).__name__}: {e})") from None
        if x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3072 or y.shape != (len(x),):
            raise DataError(f"{where}: expected uint8 images of 3072 values and a label "
                            f"each, got {x.dtype} {x.shape} and {y.shape} labels")
        if len(y) and not 0 <= y.min() <= y.max() < n_classes:
            raise DataError(f"{where}: labels outside 0 to {n_classes - 1}")
        return x.astype(np.float32) / 255.0, y.astype(np.int32)
    parts = [split(name) for name in train_files]
    x, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    n_valid = len(y) // 10
    if not 0 < n_valid < len(y):
        raise DataError(f"{path}: {len(y)} training images are too few for a validation split")
    return Dataset(kind, (x[:-n_valid], y[:-n_valid]), (x[-n_valid:], y[-n_valid:]),
                   split(test_file), n_classes, _cifar_names(kind, read, n_classes))


def _cifar_names(kind, read, n_classes):
    """The classes' names from CIFAR's meta file, or None where it is missing or odd (the
    names only label pympgu.evaluate's report)."""
    meta, key = CIFAR_META[kind]
    try:
        names = [n.decode() if isinstance(n, bytes) else str(n)
                 for n in pickle.load(io.BytesIO(read(meta)), encoding="bytes")[key]]
    except Exception:  # no meta file, or not the one expected
        return None
    return names if len(names) == n_classes else None


def load(spec=None) -> "Dataset":
    """Load a dataset by name or path.

    None or 'embedded': the MNIST test set shipped with pympgu; 'fashion': Debian's
    Fashion-MNIST; 'digits': scikit-learn's 8x8 digits; a path ending in .pkl or .pkl.gz:
    the seed's pickle; in .npz: a dataset of one's own (load_npz); CIFAR-10 or CIFAR-100's
    archive or directories (load_cifar); any other path: a directory of IDX files.
    """
    if spec in (None, "embedded"):
        return load_idx_dir(EMBEDDED_DIR, "embedded MNIST")
    if spec == "fashion":
        if not os.path.isdir(FASHION_DIR):
            raise DataError(f"{FASHION_DIR}: no such directory (apt-get install "
                            "dataset-fashion-mnist, or give --data-dir)")
        return load_idx_dir(FASHION_DIR, "fashion-mnist")
    if spec == "digits":
        try:
            from sklearn.datasets import load_digits
        except ImportError:
            raise DataError("the 'digits' dataset is scikit-learn's: pip install "
                            '"pympgu[digits]" (or scikit-learn)') from None
        d = load_digits()
        x = (d.data / 16.0).astype(np.float32)
        y = d.target.astype(np.int32)
        perm = np.random.default_rng(0).permutation(len(y))
        return Dataset("sklearn digits", *_split(x[perm], y[perm], 300, 300))
    if spec.endswith((".pkl", ".pkl.gz")):
        return load_pickle(spec)
    if spec.endswith(".npz"):
        return load_npz(spec)
    cifar = _find_cifar(spec)
    if cifar:
        return load_cifar(cifar)
    return load_idx_dir(spec)


def batches_per_epoch(n_train, batch_size, nranks) -> int:
    """How many whole batches an epoch of n_train examples gives, a multiple of nranks so
    that every rank gets as many (0: the batch is too large for the workers)."""
    return n_train // batch_size // nranks * nranks


def shard_batches(n_train, batch_size, nranks, rank, seed, epoch, start=0, total=None) -> list:
    """This rank's minibatch index arrays for one epoch.

    Every rank draws the same permutation (from seed and epoch), cuts it into full batches,
    and takes every nranks-th batch starting at its rank: the seed's odd/even split for two
    workers, generalised. Ranks get disjoint batches and the same number of them.

    ``start`` and ``total``: the epoch's batches from ``start`` on, of ``total`` in all (by
    default, those of nranks workers), split among ``nranks`` workers: what is left of an
    epoch that fewer workers finish than began it (pympgu.training.recovery). The fewer
    than nranks batches that cannot go to every worker are left out."""
    perm = np.random.default_rng([seed, epoch]).permutation(n_train).astype(np.int32)
    nbatches = batches_per_epoch(n_train, batch_size, nranks) if total is None else total
    if nbatches == 0:
        raise ValueError(f"batch size {batch_size} x {nranks} workers exceeds the "
                         f"{n_train} training examples")
    end = start + (nbatches - start) // nranks * nranks
    return [perm[b * batch_size:(b + 1) * batch_size]
            for b in range(start + rank, end, nranks)]
