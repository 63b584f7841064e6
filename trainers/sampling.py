"""Poisson sampling of DP-SGD batches into fixed-capacity index buffers with a mask.

Poisson sampling (each training example joins a batch independently with probability q) is what the
accountant's
subsampled-Gaussian analysis assumes (Abadi et al. 2016; Mironov, Talwar & Zhang 2019; the PLD
accountant of
dp_accounting). It is drawn here as n ~ Binomial(N, q) followed by a uniformly random subset of size
n, which has
exactly the same distribution.

Batches go to the compiled step as an index buffer of a fixed capacity plus a {0, 1} mask, so the
step never
recompiles. The capacity is the smallest size whose overflow probability P[Binomial(N, q) >
capacity] is below
``overflow_prob`` (1e-9 by default, from the exact binomial tail). An overflowing batch is not
truncated: it is
split into several capacity-sized chunks whose clipped sums are added before the noise (see
``trainers.train``).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats


def poisson_capacity(
    num_examples: int, expected_batch_size: float, overflow_prob: float = 1e-9, multiple: int = 8
) -> int:
    """Smallest multiple of ``multiple`` c with P[Binomial(num_examples, q) > c] < overflow_prob, q
    = B / N."""
    if num_examples <= 0:
        raise ValueError(f"num_examples={num_examples} must be positive")
    if not 0 < expected_batch_size <= num_examples:
        raise ValueError(
            f"expected_batch_size={expected_batch_size} must be in (0, num_examples={num_examples}]"
        )
    if not 0 < overflow_prob < 1:
        raise ValueError(f"overflow_prob={overflow_prob} must be in (0, 1)")
    q = expected_batch_size / num_examples
    # isf gives the smallest c with sf(c) <= p; step up while the tail is still >= p (discreteness).
    c = int(stats.binom.isf(overflow_prob, num_examples, q))
    while c < num_examples and stats.binom.sf(c, num_examples, q) >= overflow_prob:
        c += 1
    c = min(max(c, 1), num_examples)
    return min(int(math.ceil(c / multiple) * multiple), max(num_examples, multiple))


class PoissonSampler:
    """Draws Poisson-sampled batches of indices into [0, num_examples).

    Args:
      num_examples: N, the size of the private training set.
      expected_batch_size: B; each example is included with probability q = B / N.
      rng: numpy Generator; its seed must come from the candidate's secret key (or OS entropy).
      capacity: buffer size; defaults to :func:`poisson_capacity`.
    """

    def __init__(
        self,
        num_examples: int,
        expected_batch_size: float,
        rng: np.random.Generator,
        capacity: int | None = None,
    ):
        self.num_examples = int(num_examples)
        self.sampling_rate = float(expected_batch_size) / self.num_examples
        if capacity is None:
            capacity = poisson_capacity(self.num_examples, expected_batch_size)
        if capacity <= 0:
            raise ValueError(f"capacity={capacity} must be positive")
        self.capacity = int(capacity)
        self._rng = rng

    def sample(self) -> np.ndarray:
        """One batch: int32 indices, sorted, distinct; its size is Binomial(N, q)."""
        n = self._rng.binomial(self.num_examples, self.sampling_rate)
        idx = self._rng.choice(self.num_examples, size=n, replace=False)
        idx.sort()  # sorted gathers are friendlier to the cache; the order does not matter to a sum
        return idx.astype(np.int32)

    def chunks(self, indices: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Splits a batch into capacity-sized (indices, mask) buffers; >1 chunk only on overflow
        (never truncates).

        Padding slots point at example 0 and have mask 0, so they contribute nothing to the clipped
        sum.
        """
        n = len(indices)
        out = []
        for start in range(0, max(n, 1), self.capacity):
            part = indices[start : start + self.capacity]
            idx = np.zeros(self.capacity, np.int32)
            mask = np.zeros(self.capacity, np.float32)
            idx[: len(part)] = part
            mask[: len(part)] = 1.0
            out.append((idx, mask))
        return out
