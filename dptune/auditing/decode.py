"""Reading an exact sum back into which canaries it contains (the exact-score audit).

A released score that is the exact sum of per-record values (no noise) over the validation split
holds ``sum_real + sum_j b_j s_j``, where the auditor can compute ``sum_real`` (the known records)
and every canary's own value ``s_j`` from the released model: the included set ``b`` is a
subset-sum problem, solved exactly here by meet-in-the-middle for up to ``MAX_CANARIES`` canaries.
A noisy score (Gaussian noise of a few counts) matches no subset to within the tolerance, and the
decoder then abstains on every canary.
"""

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
    sums_a = _subset_sums(values[:half])
    sums_b = _subset_sums(values[half:])
    order = np.argsort(sums_b, kind="stable")
    sorted_b = sums_b[order]
    need = target - sums_a
    pos = np.searchsorted(sorted_b, need)
    best_err, best = np.inf, (0, 0)
    for cand in (np.clip(pos - 1, 0, len(sorted_b) - 1), np.clip(pos, 0, len(sorted_b) - 1)):
        err = np.abs(sorted_b[cand] - need)
        i = int(np.argmin(err))
        if err[i] < best_err:
            best_err, best = float(err[i]), (i, int(order[cand[i]]))
    if best_err > tol * max(1.0, abs(target)):
        return np.zeros(m, np.int8)
    bits_a = (best[0] >> np.arange(half)) & 1
    bits_b = (best[1] >> np.arange(m - half)) & 1
    bits = np.concatenate([bits_a, bits_b]).astype(bool)
    return np.where(bits, 1, -1).astype(np.int8)
