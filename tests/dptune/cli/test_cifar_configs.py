"""The shipped CIFAR-10 configs and the data path the CLI takes (``dptune.cli.build.load_data``,
the same ``load_dataset`` call ``dptune --config=NAME`` makes), offline: tensorflow-datasets'
``tfds.testing.mock_data`` (records generated from each dataset's metadata, no download) and a tiny
CIFAR-10 python-pickle folder made here.

No CIFAR-10 accuracy is measured anywhere in the test suite (docs/performance.md says why).
"""

import importlib
import pickle

import numpy as np
import pytest

from dptune.cli.build import load_data

SHAPES = {"mnist": (28, 28, 1), "fashion_mnist": (28, 28, 1), "cifar10": (32, 32, 3)}


def _config(name: str):
    return importlib.import_module(f"dptune.configs.{name}").get_config()


@pytest.mark.parametrize(
    "config_name, dataset",
    [("mnist", "mnist"), ("fashion_mnist", "fashion_mnist"), ("cifar10", "cifar10"),
     ("cifar10_wrn", "cifar10")],
)  # fmt: skip
def test_shipped_config_loads_through_tfds_mock_data(tfds, config_name, dataset, tmp_path):
    """Each shipped config's data section, with only the folder and the public sizes pointed at the
    mock records, loads through the CLI's loader with source "auto" (no local files -> tfds)."""
    cfg = _config(config_name)
    assert cfg.data.name == dataset
    n = 40
    cfg.data.dir = str(tmp_path)  # an empty folder: "auto" must fall through to tfds
    cfg.data.source = "auto"
    cfg.data.num_examples = n  # the public size of the (mock) training file
    cfg.data.validation_size = 10
    with tfds.testing.mock_data(num_examples=n):
        d = load_data(cfg)
    h, w, c = SHAPES[dataset]
    assert d.name == dataset and d.num_classes == 10
    assert d.train_x.shape[1:] == (h, w, c) and d.val_x.shape[1:] == (h, w, c)
    assert len(d.train_x) + len(d.val_x) == n  # every training record lands in exactly one split
    assert d.test_x.shape == (n, h, w, c)
    assert d.public_num_train == n - 10  # privacy uses the public sizes, not the drawn split
    for x in (d.train_x, d.val_x, d.test_x):
        assert x.dtype == np.float32 and 0.0 <= x.min() and x.max() <= 1.0
    # the mock images are not constant, so [0, 1] scaling happened (not all zeros)
    assert float(d.train_x.std()) > 0.05


def _write_cifar_pickles(root, per_batch, rng):
    root.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=per_batch).tolist()
        with open(root / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": name.encode()}, f)


def test_cifar10_config_reads_a_pickle_folder(tmp_path):
    """dptune --config=cifar10 --config.data.dir=<folder> on an unpacked cifar-10-python.tar.gz
    (made tiny here): source "auto" detects the pickle layout."""
    _write_cifar_pickles(tmp_path / "cifar-10-batches-py", 4, np.random.default_rng(5))
    cfg = _config("cifar10")
    cfg.data.dir = str(tmp_path)
    cfg.data.num_examples = 20
    cfg.data.validation_size = 5
    d = load_data(cfg)
    assert len(d.train_x) + len(d.val_x) == 20 and d.test_x.shape == (4, 32, 32, 3)


def test_cifar_configs_search_augmult_and_calibrate_to_the_total():
    """Budget first: both CIFAR configs calibrate sigma to the total budget and search learning
    rate, clipping norm and augmentation multiplicity; the WRN config keeps De et al.'s setting."""
    cnn, wrn = _config("cifar10"), _config("cifar10_wrn")
    for cfg, model in ((cnn, "cifar_cnn"), (wrn, "wrn16_4")):
        assert cfg.train.model == model
        assert cfg.space.noise_multiplier == "auto"
        assert {"learning_rate", "clip_norm", "augmult"} <= set(cfg.space.keys())
        assert (cfg.privacy.epsilon, cfg.privacy.delta) == (8.0, 1e-5)
    assert wrn.train.batch_size == 4096 and wrn.train.ema_decay == pytest.approx(0.999)
    assert cnn.train.batch_size == 512
