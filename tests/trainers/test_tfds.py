"""tensorflow-datasets loading through the same ``trainers.data.load_dataset`` call users make, with
``tfds.testing.mock_data`` (random records generated from each dataset's metadata; no download, no
internet), and a tiny CIFAR-10 python-pickle folder written by the test.

tensorflow-datasets is in the `test` extra, so CI runs these; they skip, saying why, only where the
package is genuinely not installed.
"""

import pickle

import numpy as np
import pytest

from trainers.data import load_dataset

SHAPES = {"mnist": (28, 28, 1), "fashion_mnist": (28, 28, 1), "cifar10": (32, 32, 3)}


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist", "cifar10"])
def test_tfds_mock_data_through_load_dataset(tfds, name, tmp_path):
    n = 12
    with tfds.testing.mock_data(num_examples=n):
        d = load_dataset(name, data_dir=tmp_path, validation_size=4, source="tfds", num_examples=n)
        # the same records read directly (mock data is deterministic per split)
        src = tfds.data_source(name, split="train", data_dir=str(tmp_path))
        direct = np.stack([np.asarray(src[i]["image"]) for i in range(len(src))])
        direct_y = np.asarray([src[i]["label"] for i in range(len(src))])
    h, w, c = SHAPES[name]
    assert d.name == name and d.num_classes == 10
    # the per-record split: each record's side is its own keyed hash, so only the total is fixed
    assert len(d.train_x) + len(d.val_x) == n and d.public_num_train + d.public_num_val == n
    assert d.train_x.shape[1:] == d.val_x.shape[1:] == (h, w, c)
    assert d.test_x.shape == (n, h, w, c)
    for x in (d.train_x, d.val_x, d.test_x):
        assert x.dtype == np.float32 and x.min() >= 0.0 and x.max() <= 1.0
    for y in (d.train_y, d.val_y, d.test_y):
        assert y.dtype == np.int32 and y.min() >= 0 and y.max() < 10
    # train + validation hold exactly the split's records, scaled to [0, 1] (split order aside)
    pooled = np.concatenate([d.train_x, d.val_x])
    pooled_y = np.concatenate([d.train_y, d.val_y])
    key = np.argsort(pooled.reshape(len(pooled), -1).sum(1))
    ref_key = np.argsort(direct.reshape(len(direct), -1).astype(np.float64).sum(1))
    np.testing.assert_allclose(pooled[key], direct[ref_key] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(pooled_y[key], direct_y[ref_key])


def test_tfds_auto_source_without_local_files_uses_tfds(tfds, tmp_path):
    with tfds.testing.mock_data(num_examples=8):
        # source="auto"
        d = load_dataset("cifar10", data_dir=tmp_path, validation_size=2, num_examples=8)
    assert len(d.train_x) + len(d.val_x) == 8 and d.train_x.shape[1:] == (32, 32, 3)


def test_tiny_cifar10_pickle_folder_auto_detected(tmp_path):
    """A CIFAR-10 python folder (as unpacked from cifar-10-python.tar.gz) made here: rows are CHW
    uint8, five training batches in order, then the test batch."""
    rng = np.random.default_rng(3)
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    train_rows, train_labels = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(3, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=3).tolist()
        with open(root / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": name.encode()}, f)
        if name != "test_batch":
            train_rows.append(data)
            train_labels += labels
        else:
            test_rows, test_labels = data, labels
    for folder in (tmp_path, root):  # the parent folder or the python folder itself
        d = load_dataset("cifar10", folder, validation_size=3, num_examples=15)
        assert len(d.train_x) + len(d.val_x) == 15 and d.val_x.shape[1:] == (32, 32, 3)
        np.testing.assert_array_equal(d.test_y, test_labels)
        img = test_rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1) / 255.0
        np.testing.assert_allclose(d.test_x, img, rtol=1e-6)
        pooled_y = np.sort(np.concatenate([d.train_y, d.val_y]))
        np.testing.assert_array_equal(pooled_y, np.sort(train_labels))
