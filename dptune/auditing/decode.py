"""Reading an exact sum back into which canaries it contains (the exact-score audit).

A released score that is the exact sum of per-record values (no noise) over the validation split
holds ``sum_real + sum_j b_j s_j``, where the auditor can compute ``sum_real`` (the known records)
and every canary's own value ``s_j`` from the released model: the included set ``b`` is a
subset-sum problem, solved exactly here by meet-in-the-middle for up to ``MAX_CANARIES`` canaries.
A noisy score (Gaussian noise of a few counts) matches no subset to within the tolerance, and the
decoder then abstains on every canary."""

from __future__ import annotations

import numpy as np

#: Most canaries the decoder takes: 2 x 2^(m/2) subset sums are enumerated.
MAX_CANARIES = 24


def _subset_sums(values: np.ndarray) -> np.ndarray:
    """All 2^k subset sums of k values; bit i of the index says whether value i is in."""
    sums = np.zeros(1)
    for v in values:
        sums = np.concatenate([sums, sums + v])
    return sums


def decode_subset_sum(target: float, values: np.ndarray, tol: float = 1e-9) -> np.ndarray:
    """The subset of ``values`` whose sum is closest to ``target``, as +1 (in) / -1 (out) per
    value, if that sum is within ``tol * max(1, |target|)`` of it; all 0 (abstain) otherwise.

    Args:
      target: the exact sum of the included values (plus rounding).
      values: (m,) the canaries' values, m <= MAX_CANARIES.
    """
    values = np.asarray(values, dtype=np.float64)
    m = len(values)
    if m > MAX_CANARIES:
        raise ValueError(f"{m} values: the subset-sum decoder takes at most {MAX_CANARIES}")
    if m == 0 or not np.isfinite(target) or not np.all(np.isfinite(values)):
        return np.zeros(m, np.int8)
    half = m // 2
    sums_a, sums_b = _subset_sums(values[:half]), _subset_sums(values[half:])
    order = np.argsort(sums_b, kind="stable")
    need = target - sums_a
    pos = np.searchsorted(sums_b[order], need)
    # For each of a's sums, b's closest: the sorted sum just below or just above what it needs.
    near = order[np.clip(np.stack([pos - 1, pos]), 0, len(order) - 1)]
    err = np.abs(sums_b[near] - need)
    k, a = np.unravel_index(np.argmin(err), err.shape)
    if err[k, a] > tol * max(1.0, abs(target)):
        return np.zeros(m, np.int8)
    bits_a = (a >> np.arange(half)) & 1
    bits_b = (near[k, a] >> np.arange(m - half)) & 1
    return np.where(np.concatenate([bits_a, bits_b]).astype(bool), 1, -1).astype(np.int8)
