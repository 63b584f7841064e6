"""Poisson sampling of DP-SGD batches into a fixed-capacity index buffer with a mask, split into
chunks.

Poisson sampling (each training example joins a batch independently with probability q) is what the
accountant's subsampled-Gaussian analysis assumes (Abadi et al. 2016; Mironov, Talwar & Zhang 2019;
dp_accounting's PLD accountant). It is drawn as n ~ Binomial(N, q) followed by a uniformly random
subset of size n, which has exactly the same distribution.

The buffer: a batch goes to the compiled step as index/mask arrays of fixed shapes, so nothing
recompiles. Its capacity is ``body + m * tail`` slots, the smallest such size whose overflow
probability P[Binomial(N, q) > capacity] is below ``overflow_prob`` (1e-9 by default, exact binomial
tail). The buffer is laid out as "body" chunks adding up to about the expected batch size B,
followed by ``m`` small "tail" chunks; the step computes only the chunks that hold at least one
example (padding contributes exactly zero, so skipping an all-padding chunk changes nothing). A
batch larger than the capacity (probability < 1e-9) simply gets more tail chunks: it is never
truncated.

Why chunks: a buffer padded to the 1e-9 quantile (B + ~6 sqrt(B)) costs ~1.4x the work of a fixed
batch at B = 256; with body chunks of B and tails of ~2 sqrt(B) the expected padding is a few
percent (``docs/performance.md``).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats


def _round_up(x: float, multiple: int) -> int:
    return int(math.ceil(x / multiple) * multiple)


def poisson_capacity(
    num_examples: int, expected_batch_size: float, overflow_prob: float = 1e-9, multiple: int = 8
) -> int:
    """Smallest multiple of ``multiple`` c with P[Binomial(num_examples, q) > c] < overflow_prob, q
    = expected_batch_size / num_examples (exact binomial tail from scipy)."""
    if num_examples <= 0:
        raise ValueError(f"num_examples={num_examples} must be positive")
    if not 0 < expected_batch_size <= num_examples:
        raise ValueError(
            f"expected_batch_size={expected_batch_size} must be in (0, num_examples={num_examples}]"
        )
    if not 0 < overflow_prob < 1:
        raise ValueError(f"overflow_prob={overflow_prob} must be in (0, 1)")
    q = expected_batch_size / num_examples
    c = int(stats.binom.isf(overflow_prob, num_examples, q))
    # isf is approximate on a discrete distribution: step until the exact tail is below the target.
    while c < num_examples and stats.binom.sf(c, num_examples, q) >= overflow_prob:
        c += 1
    while c > 0 and stats.binom.sf(c - 1, num_examples, q) < overflow_prob:
        c -= 1
    return _round_up(max(c, 1), multiple)


class PoissonSampler:
    """Draws Poisson-sampled batches of indices into [0, num_examples) and lays them out in chunks.

    Layout of the buffer: ``num_body_chunks`` chunks of ``chunk_size`` slots (together about the
    expected batch size B; chunks of at most ``max_chunk`` slots because larger ones ran slower per
    example on XLA CPU), then ``num_tail_chunks`` chunks of ``tail_size`` (~2 std of the batch size)
    slots, so that the capacity's overflow probability is below ``overflow_prob``.

    Args:
      num_examples: N, the size of the private training set.
      expected_batch_size: B; each example is included with probability q = B / N.
      rng: numpy Generator; its seed must come from the candidate's secret key (or OS entropy).
      max_chunk: largest body chunk.
      tail_size: slots of each tail chunk; default ~2 std of the batch size, a multiple of 8.
      overflow_prob: the capacity C satisfies P[Binomial(N, q) > C] < overflow_prob.
      sampling_rate: q; default B / N. DP-SGD passes B / N_public (the accountant's rate).
    """

    def __init__(
        self,
        num_examples: int,
        expected_batch_size: float,
        rng: np.random.Generator,
        max_chunk: int = 256,
        tail_size: int | None = None,
        overflow_prob: float = 1e-9,
        sampling_rate: float | None = None,
    ):
        self.num_examples = int(num_examples)
        self.expected_batch_size = float(expected_batch_size)
        # The accountant's q comes from the public nominal size (``sampling_rate``); B / N is the
        # default for callers whose N is public.
        self.sampling_rate = (
            self.expected_batch_size / self.num_examples
            if sampling_rate is None
            else float(sampling_rate)
        )
        if not 0 < self.sampling_rate <= 1:
            raise ValueError(f"sampling_rate={self.sampling_rate!r} must be in (0, 1]")
        if max_chunk < 8:
            raise ValueError(f"max_chunk={max_chunk} must be >= 8")
        q = self.sampling_rate
        std = math.sqrt(self.num_examples * q * (1 - q))
        self.num_body_chunks = max(1, math.ceil(self.expected_batch_size / max_chunk))
        self.chunk_size = _round_up(self.expected_batch_size / self.num_body_chunks, 8)
        self.tail_size = int(tail_size) if tail_size else max(8, _round_up(2 * std, 8))
        if self.tail_size <= 0:
            raise ValueError(f"tail_size={tail_size} must be positive")
        body = self.num_body_chunks * self.chunk_size
        # No records (an empty private split, e.g. a small Poisson subset): every batch is empty
        # and a step adds noise alone, as for its neighbour's batches that miss its one record.
        n = self.num_examples
        quantile = poisson_capacity(n, n * q, overflow_prob, 1) if n > 0 else 0
        self.num_tail_chunks = max(0, math.ceil((quantile - body) / self.tail_size))
        self.capacity = body + self.num_tail_chunks * self.tail_size
        self._rng = rng

    def sample(self) -> np.ndarray:
        """One batch: sorted, distinct int32 indices; its size is Binomial(N, q)."""
        n = self._rng.binomial(self.num_examples, self.sampling_rate)
        idx = self._rng.choice(self.num_examples, size=n, replace=False)
        idx.sort()  # sorted gathers are kinder to the cache; the order does not matter to a sum
        return idx.astype(np.int32)

    def chunk_sizes(self, n: int) -> list[int]:
        """Sizes of the non-empty chunks for a batch of n examples (the first chunk always)."""
        sizes, filled = [], 0
        while not sizes or filled < n:
            size = self.chunk_size if len(sizes) < self.num_body_chunks else self.tail_size
            sizes.append(size)
            filled += size
        return sizes

    def chunks(self, indices: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """The non-empty chunks of the buffer holding ``indices`` as [(idx, mask)]: every index
        appears exactly once, whatever the batch size (beyond the capacity, tail chunks continue:
        nothing is ever truncated). Padding slots point at example 0 with mask 0, so they contribute
        nothing to the clipped sum.
        """
        out, start = [], 0
        for size in self.chunk_sizes(len(indices)):
            part = indices[start : start + size]
            idx = np.zeros(size, np.int32)
            mask = np.zeros(size, np.float32)
            idx[: len(part)] = part
            mask[: len(part)] = 1.0
            out.append((idx, mask))
            start += size
        return out
