"""Degenerate Renyi orders (inf, 1, NaN curves) are refused instead of reported as epsilon 0."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dptune import accounting
from selection import privacy as sp

CAND = accounting.DpSgdCandidate(0.01, 1000, 1.0)


@pytest.mark.parametrize(
    "transform",
    [
        None,
        sp.ThresholdingPrivacy(0.1),
        sp.RandomStoppingPrivacy.from_mean(10, 1.0),
        sp.PoissonStoppingPrivacy(10),
        sp.BestOfKPrivacy(3),
    ],
)
def test_infinite_or_unit_orders_are_refused_not_epsilon_zero(transform):
    """Before the fix an order grid containing inf gave total_epsilon == 0.0 (dp_accounting's
    compute_epsilon: NaN at the infinite order, picked by argmin, then max(0, nan) = 0)."""
    for orders in ([2.0, 3.0, math.inf], [1.0, 2.0, 3.0], [2.0, float("nan")]):
        with pytest.raises(ValueError, match="Renyi order"):
            accounting.total_privacy(CAND, transform, 1e-5, "rdp", orders=orders)
    with pytest.raises(ValueError, match="Renyi order"):
        accounting.rdp_epsilon(CAND, 1e-5, orders=[2.0, math.inf])


def test_transforms_refuse_infinite_orders():
    """Thresholding's (a - 2)/(a - 1) is NaN at a = inf; every theorem is for finite orders."""
    for transform in (sp.ThresholdingPrivacy(0.1), sp.RandomStoppingPrivacy.from_mean(10, 0.0)):
        with pytest.raises(ValueError, match="finite"):
            transform.rdp([2.0, math.inf], [1.0, 2.0])


def test_nan_from_a_transform_is_refused_not_epsilon_zero():
    class NanTransform(sp.RandomStoppingPrivacy):
        def rdp(self, orders, rdp, *, delta_for_epsilon=None):
            out = super().rdp(orders, rdp)
            out[-1] = np.nan
            return out

    with pytest.raises(ValueError, match="NaN"):
        accounting.total_privacy(CAND, NanTransform(1.0, 0.1), 1e-5, "rdp")
