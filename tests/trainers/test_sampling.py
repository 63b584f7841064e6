"""Poisson sampling: batch sizes ~ Binomial(N, q), inclusion probability, capacity, chunking."""

import numpy as np
import pytest
from scipy import stats

from trainers.sampling import PoissonSampler, poisson_capacity


def test_batch_sizes_follow_binomial():
    n, b = 5000, 64
    s = PoissonSampler(n, b, np.random.default_rng(1234))
    sizes = np.array([len(s.sample()) for _ in range(3000)])
    q = b / n
    # chi-square goodness of fit on bins of the exact Binomial(N, q) pmf (fixed seed: deterministic)
    edges = np.array([0, 50, 55, 58, 61, 63, 65, 67, 70, 73, 78, n + 1])
    observed = np.histogram(sizes, bins=edges)[0]
    cdf = stats.binom.cdf(edges - 1, n, q)
    expected = np.diff(cdf) * len(sizes)
    assert expected.min() > 5  # the chi-square approximation needs populated bins
    chi2 = ((observed - expected) ** 2 / expected).sum()
    p_value = stats.chi2.sf(chi2, len(expected) - 1)
    assert p_value > 1e-3, (observed, expected.round(1))
    assert abs(sizes.mean() - b) < 4 * np.sqrt(b * (1 - q) / len(sizes))


def test_batch_sizes_are_not_fixed_and_indices_distinct_sorted():
    s = PoissonSampler(1000, 100, np.random.default_rng(0))
    batches = [s.sample() for _ in range(50)]
    assert len({len(b) for b in batches}) > 5
    for b in batches:
        assert b.dtype == np.int32
        assert np.all(np.diff(b) > 0)  # sorted and distinct
        assert b.min() >= 0 and b.max() < 1000


def test_each_example_included_with_probability_q():
    n, b, rounds = 200, 20, 4000
    s = PoissonSampler(n, b, np.random.default_rng(7))
    counts = np.zeros(n)
    for _ in range(rounds):
        counts[s.sample()] += 1
    q = b / n
    # per-example inclusion counts ~ Binomial(rounds, q); all within 5 standard deviations
    sd = np.sqrt(rounds * q * (1 - q))
    assert np.all(np.abs(counts - rounds * q) < 5 * sd)
    # and they are not all equal (that would be shuffling without replacement, not Poisson)
    assert counts.std() > 0.5 * sd


@pytest.mark.parametrize("n,b", [(60000, 256), (55000, 2048), (1000, 10), (100, 100)])
def test_capacity_overflow_probability_below_1e9(n, b):
    cap = poisson_capacity(n, b, overflow_prob=1e-9, multiple=1)
    q = b / n
    assert stats.binom.sf(cap, n, q) < 1e-9
    if cap < n:  # minimal: one less would overflow too often
        assert stats.binom.sf(cap - 1, n, q) >= 1e-9
    s = PoissonSampler(n, b, np.random.default_rng(0))
    assert s.capacity >= cap
    assert s.capacity - s.tail_size < max(cap, s.num_body_chunks * s.chunk_size)


def test_capacity_known_value():
    # 1e-9 upper quantile of Binomial(60000, 256/60000) is about mean + 6.1 sd (right-skewed)
    cap = poisson_capacity(60000, 256, multiple=1)
    assert 350 <= cap <= 362


def test_chunks_cover_every_index_exactly_once_even_beyond_capacity():
    s = PoissonSampler(10000, 256, np.random.default_rng(3))
    for n in [0, 1, 255, 256, 257, 300, s.capacity, s.capacity + 1, 3 * s.capacity]:
        idx = np.sort(np.random.default_rng(n).choice(10000, size=n, replace=False)).astype(
            np.int32
        )
        chunks = s.chunks(idx)
        got = np.concatenate([c[0][c[1] > 0] for c in chunks])
        np.testing.assert_array_equal(got, idx)
        assert chunks[0][0].shape == (s.chunk_size,)
        assert all(c[0].shape == (s.tail_size,) for c in chunks[s.num_body_chunks :])
        for ids, mask in chunks:
            assert set(np.unique(mask)) <= {0.0, 1.0}
            assert np.all(ids[mask == 0] == 0)
        # only chunks that hold an example are computed (except the always-present first one)
        assert all(c[1].sum() > 0 for c in chunks[1:])


def test_large_batches_use_several_body_chunks():
    s = PoissonSampler(55000, 2048, np.random.default_rng(0))
    assert s.num_body_chunks == 8 and s.chunk_size == 256


def test_invalid_arguments():
    with pytest.raises(ValueError, match="expected_batch_size"):
        poisson_capacity(100, 200)
    with pytest.raises(ValueError, match="num_examples"):
        poisson_capacity(0, 1)
    with pytest.raises(ValueError, match="overflow_prob"):
        poisson_capacity(100, 10, overflow_prob=0)
