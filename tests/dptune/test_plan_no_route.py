"""A selection theorem with no accounting route for the trainer's candidates is refused with that
reason, not as a budget too small (no budget, noise or score noise would help)."""

import pytest

import dptune
from dptune.tuner import ImpossibleBudgetError, TuningConfigError
from selection.stability_validation import StabilityValidation
from tests.dptune.test_subsampled import SPACE, SubsetToy


def test_no_route_is_refused_with_its_reason_not_as_an_impossible_budget():
    # Chaudhuri & Vinterbo's stability validation needs pure-DP training; DP-SGD is not.
    sel = StabilityValidation.from_beta(3, 0.2, 0.01)
    with pytest.raises(TuningConfigError, match="not pure epsilon-DP") as err:
        dptune.tune(SubsetToy(), SPACE, sel, (3.0, 1e-5), ledger=None, progress=False)
    assert not isinstance(err.value, ImpossibleBudgetError)
    assert "raise the budget" not in str(err.value) and "\n" not in str(err.value)
