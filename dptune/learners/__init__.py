"""Every candidate family dptune tunes, as a trainer (``dptune.Trainer`` hooks), and ``LEARNERS``:
the one vocabulary of their names, read by the library, ``config.trainer`` and the docs.

* ``dpsgd``: DP-SGD in JAX (``dptune.learners.dpsgd.DpSgdTrainer``), the one module of dptune that
  imports ``trainers``.
* ``fisher``: DP feature selection + Fisher (linear discriminant) classifier
  (``dptune.learners.fisher``).
* ``public_data``: the oracle-efficient private learner with public unlabelled data (Algorithm 3
  of "Oracle-Efficient Differentially Private Learning with Public Data";
  ``dptune.learners.public_data``).
* ``dptune.learners.classical``: ridge, logistic output perturbation and histogram density on
  NumPy arrays (``FunctionTrainer`` factories of their own; not built from a ``config.data``).

Each trainer states its privacy as a ``dp_accounting`` ``DpEvent`` (or an accounting candidate) in
one function, with the theorem named next to the formula.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class LearnerInfo:
    """A candidate family that a config can name (``config.trainer``).

    Attributes:
      name: its name in configs and docs.
      module, attribute: where its trainer class lives; it is built as
        ``cls(data, base=..., **options)`` from a loaded ``Dataset``.
      summary: one line for ``dptune --help`` and the docs.
      options: the constructor's own arguments besides ``data`` and ``base`` (``config.learner``).
    """

    name: str
    module: str
    attribute: str
    summary: str
    options: tuple[str, ...] = ()

    def trainer_class(self) -> type:
        """The trainer class (imported on first use: DP-SGD imports JAX)."""
        return getattr(importlib.import_module(self.module), self.attribute)


#: ``DpSgdTrainer``'s own options (``config.learner`` and ``config.init``).
_DPSGD_OPTIONS = ("epoch_progress", "test_curve", "model", "loss", "metric", "grad_impl", "init",
                  "trainable")  # fmt: skip

#: The candidate families a config can name, by ``config.trainer``.
LEARNERS: dict[str, LearnerInfo] = {
    info.name: info
    for info in (
        LearnerInfo(
            "dpsgd",
            "dptune.learners.dpsgd",
            "DpSgdTrainer",
            "DP-SGD (JAX/Flax/Optax), shipped models or your own Flax module",
            options=_DPSGD_OPTIONS,
        ),
        LearnerInfo(
            "fisher",
            "dptune.learners.fisher",
            "FisherTrainer",
            "DP feature selection + Fisher linear discriminant",
        ),
        LearnerInfo(
            "public_data",
            "dptune.learners.public_data",
            "PublicDataTrainer",
            "oracle-efficient private learning with public unlabelled data",
            options=("num_public",),
        ),
    )
}


def names() -> tuple[str, ...]:
    """The names ``config.trainer`` accepts."""
    return tuple(LEARNERS)


def get(name: str) -> LearnerInfo:
    """The learner ``name``; ValueError naming the choices otherwise."""
    if name not in LEARNERS:
        raise ValueError(f"trainer {name!r} is unknown; choose one of {', '.join(LEARNERS)}")
    return LEARNERS[name]


def build(name: str, data: Any, base: Mapping[str, Any] | None = None, **options: Any) -> Any:
    """The trainer ``name`` on ``data`` with fixed hyperparameters ``base`` and its own
    ``options`` (``LearnerInfo.options``; others are refused with a ValueError naming them)."""
    info = get(name)
    unknown = set(options) - set(info.options)
    if unknown:
        raise ValueError(
            f"trainer {name!r} takes no options {sorted(unknown)} (it takes {list(info.options)})"
        )
    return info.trainer_class()(data, base=dict(base or {}), **options)
