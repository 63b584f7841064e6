"""Data: IDX (gz, raw), CIFAR-10 pickle, synthetic, validation split, fingerprint, errors."""

import gzip
import logging
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.paths import mnist_10k
from trainers.data import DatasetNotFoundError, load_dataset, make_synthetic

MNIST10K = mnist_10k()  # ../shared/data/mnist-10k, else the copy shipped in dptune/data


def _write_idx(path: Path, arr: np.ndarray, gz: bool):
    header = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    raw = header + arr.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as f:
            f.write(raw)
    else:
        path.write_bytes(raw)


@pytest.fixture(scope="module")
def idx_folders(tmp_path_factory):
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, size=(50, 28, 28)),
        "train-labels-idx1-ubyte": rng.integers(0, 10, size=50),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, size=(20, 28, 28)),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, size=20),
    }
    folders = {}
    for gz in (True, False):
        folder = tmp_path_factory.mktemp("gz" if gz else "raw")
        for name, arr in arrays.items():
            _write_idx(folder / name, arr, gz)
        folders[gz] = folder
    return folders, arrays


@pytest.mark.parametrize("gz", [True, False])
def test_idx_loader_gz_and_raw(idx_folders, gz):
    folders, arrays = idx_folders
    d = load_dataset("mnist", folders[gz], validation_size=10, num_examples=50)
    assert len(d.train_x) + len(d.val_x) == 50 and 0 < len(d.val_x) < 25  # ~10 expected
    assert d.public_num_train == 40 and d.public_num_val == 10  # public: from the declared size
    assert d.test_x.shape == (20, 28, 28, 1)
    assert d.train_x.dtype == np.float32 and d.train_y.dtype == np.int32
    np.testing.assert_allclose(
        d.test_x[..., 0], arrays["t10k-images-idx3-ubyte"] / 255.0, rtol=1e-6
    )
    np.testing.assert_array_equal(d.test_y, arrays["t10k-labels-idx1-ubyte"])
    # train + val is a permutation of the original training set
    all_y = np.sort(np.concatenate([d.train_y, d.val_y]))
    np.testing.assert_array_equal(all_y, np.sort(arrays["train-labels-idx1-ubyte"]))


def test_real_mnist_subset():
    d = load_dataset("mnist", MNIST10K, validation_size=1000, num_examples=8000)
    assert len(d.train_x) + len(d.val_x) == 8000 and d.test_x.shape == (2000, 28, 28, 1)
    assert abs(len(d.val_x) - 1000) < 4 * (8000 * 0.125 * 0.875) ** 0.5  # binomial, 4 sd
    assert 0.0 <= d.train_x.min() and d.train_x.max() <= 1.0 and d.train_x.max() > 0.9
    assert set(np.unique(d.train_y)) == set(range(10))
    assert d.num_classes == 10 and d.name == "mnist"


def test_validation_split_is_fixed_public_and_disjoint(idx_folders, caplog):
    folders, _ = idx_folders
    a = load_dataset("mnist", folders[True], validation_size=10, seed_split=0, num_examples=50)
    b = load_dataset("mnist", folders[True], validation_size=10, seed_split=0, num_examples=50)
    c = load_dataset("mnist", folders[True], validation_size=10, seed_split=1, num_examples=50)
    np.testing.assert_array_equal(a.val_x, b.val_x)
    assert not np.array_equal(a.val_x, c.val_x)
    rows = {r.tobytes() for r in a.train_x}
    assert not any(r.tobytes() in rows for r in a.val_x)
    with pytest.raises(ValueError, match="validation_size"):
        load_dataset("mnist", folders[True], validation_size=50, num_examples=50)
    with caplog.at_level(logging.WARNING):  # 50 records are not MNIST: warned, not refused
        load_dataset("mnist", folders[True], validation_size=10)
    assert "declared public size 60000" in caplog.text


def test_fingerprint_is_of_the_records_not_the_split(idx_folders):
    folders, _ = idx_folders
    a = load_dataset("mnist", folders[True], validation_size=10, num_examples=50)
    b = load_dataset("mnist", folders[False], validation_size=10, num_examples=50)
    assert a.fingerprint() == b.fingerprint()  # same data, gz or raw
    assert len(a.fingerprint()) == 64
    c = load_dataset("mnist", folders[True], validation_size=20, seed_split=1, num_examples=50)
    assert c.fingerprint() == a.fingerprint()  # another split of the same people: same budget
    s1, s2 = (
        make_synthetic(num_train=200, validation_size=50),
        make_synthetic(num_train=200, validation_size=50, seed=1),
    )
    assert s1.fingerprint() != s2.fingerprint()


def test_cifar_pickle_folder(tmp_path):
    rng = np.random.default_rng(1)
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(4, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=4).tolist()
        batches[name] = (data, labels)
        with open(root / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels}, f)
    d = load_dataset("cifar10", tmp_path, validation_size=5, num_examples=20)
    assert len(d.train_x) + len(d.val_x) == 20 and d.test_x.shape == (4, 32, 32, 3)
    # CHW rows -> HWC images
    img = batches["test_batch"][0][0].reshape(3, 32, 32).transpose(1, 2, 0) / 255.0
    np.testing.assert_allclose(d.test_x[0], img, rtol=1e-6)


def test_missing_data_says_how_to_point_at_local_files(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="data_dir"):
        load_dataset("mnist", tmp_path, source="idx")
    with pytest.raises(DatasetNotFoundError, match="data_dir"):
        load_dataset("cifar10", tmp_path / "nope", source="cifar_pickle")
    try:
        import tensorflow_datasets  # noqa: F401
    except ImportError:
        with pytest.raises(DatasetNotFoundError, match="pip install"):
            load_dataset("fashion_mnist")
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match="unknown source"):
        load_dataset("mnist", source="ftp")


def test_synthetic_is_deterministic_and_learnable_shape():
    a, b = (
        make_synthetic(num_train=300, validation_size=100),
        make_synthetic(num_train=300, validation_size=100),
    )
    np.testing.assert_array_equal(a.train_x, b.train_x)
    assert len(a.train_x) + len(a.val_x) == 300 and a.val_x.shape[1:] == (28, 28, 1)
    assert a.public_num_train == 200 and a.public_num_val == 100
    assert load_dataset("synthetic", validation_size=100).name == "synthetic"
