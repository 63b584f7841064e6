"""The tuning subset is drawn per record (trainers.data.record_subset_mask, subset_dataset): adding
or removing one person changes only their own membership; memberships are Bernoulli(fraction)
under a secret key."""

import numpy as np
import pytest

from trainers.data import (
    Dataset,
    record_digests,
    record_subset_mask,
    subset_dataset,
)

KEY = b"k" * 32


def _records(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n, 4, 4, 1), dtype=np.float32), rng.integers(0, 10, n).astype(np.int32)


def test_adding_or_removing_a_record_changes_only_its_membership():
    x, y = _records(300)
    d = record_digests(x, y)
    base = record_subset_mask(d, 0.3, KEY)
    for i in (0, 17, 299):  # remove record i
        removed = record_subset_mask(np.delete(d, i), 0.3, KEY)
        np.testing.assert_array_equal(removed, np.delete(base, i))
    x2, y2 = _records(1, seed=9)  # add a new person anywhere (order does not matter either)
    added = record_subset_mask(np.insert(d, 5, record_digests(x2, y2)[0]), 0.3, KEY)
    np.testing.assert_array_equal(np.delete(added, 5), base)
    perm = np.random.default_rng(1).permutation(300)
    np.testing.assert_array_equal(record_subset_mask(d[perm], 0.3, KEY), base[perm])


def test_identical_records_get_their_own_draws():
    x, y = _records(1)
    d = record_digests(np.repeat(x, 4000, axis=0), np.repeat(y, 4000))
    m = record_subset_mask(d, 0.5, KEY)
    # Copies are distinct people: independent draws, not one shared draw.
    assert 1800 < m.sum() < 2200
    # Removing one copy (the copies are interchangeable: the last one) leaves the others' draws.
    np.testing.assert_array_equal(record_subset_mask(d[:-1], 0.5, KEY), m[:-1])


def test_rate_and_key():
    x, y = _records(20000)
    d = record_digests(x, y)
    m = record_subset_mask(d, 0.2, KEY)
    sd = np.sqrt(20000 * 0.2 * 0.8)
    assert abs(m.sum() - 4000) < 4 * sd  # Bernoulli(0.2) per record (fixed key: deterministic)
    other = record_subset_mask(d, 0.2, b"j" * 32)
    assert abs((m & other).sum() - 800) < 4 * np.sqrt(20000 * 0.04 * 0.96)  # keys independent
    # A smaller rate selects a subset of a larger one's records (same key, same uniforms).
    assert not np.any(record_subset_mask(d, 0.1, KEY) & ~m)
    with pytest.raises(ValueError, match="secret bytes"):
        record_subset_mask(d, 0.2, b"short")
    with pytest.raises(ValueError, match="fraction"):
        record_subset_mask(d, 0.0, KEY)


def test_subset_dataset_keeps_splits_and_scales_public_sizes():
    x, y = _records(1000)
    data = Dataset(x[:800], y[:800], x[800:], y[800:], x[:10], y[:10], 10, "synthetic")
    sub = subset_dataset(data, 0.25, KEY)
    assert sub.public_num_train == 200 and sub.public_num_val == pytest.approx(50.0)
    mask = record_subset_mask(record_digests(x, y), 0.25, KEY)
    np.testing.assert_array_equal(sub.train_x, x[:800][mask[:800]])
    np.testing.assert_array_equal(sub.val_y, y[800:][mask[800:]])
    assert len(sub.test_x) == 10 and sub.split["subset_fraction"] == 0.25
