"""One vocabulary of selection methods, used by the configs, the ``dptune`` command and
``dptune account``.

Each entry names a method, the options it takes (from one shared set, :data:`OPTIONS`), and how to
build it. Adding a method: write its class (and its theorem in ``selection/privacy.py``), then add
one :class:`MethodInfo` here; the configs and both command lines pick it up.

    >>> build("poisson", {"mean_trials": 8}).privacy.theorem
    'Papernot & Steinke 2022, Thm 6 (Poisson number of candidates)'
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from selection.accuracy_first import AccuracyFirst
from selection.baselines import BestOfK, NonPrivateBest
from selection.method import SelectionMethod
from selection.random_stopping import RandomStopping
from selection.sparse_vector import PercentileSparseVector
from selection.stability_validation import StabilityValidation
from selection.thresholding import Thresholding

#: Every option a method may take, its type and what it means (one line each): the config's
#: ``selection`` fields and the command lines' flags.
OPTIONS: dict[str, tuple[type, str]] = {
    "mean_trials": (float, "expected number of candidates E[K] >= 1 (random stopping)"),
    "shape": (float, "shape eta > -1 of the truncated negative binomial count"),
    "max_trials": (int, "hard cap T on the number of candidates"),
    "threshold": (float, "thresholding: release the first candidate scoring >= this"),
    "stop_probability": (float, "thresholding: probability gamma in (0, 1] of stopping per miss"),
    "k": (int, "number of candidates of the fixed-k baselines"),
    "target_percentile": (
        float,
        "sparse_vector: stop at the first candidate whose P[score >= tau] exceeds this, in (0, 1)",
    ),
    "noise_scale": (
        float,
        "sparse_vector: Laplace scale beta > 0 of the threshold noise in logit units",
    ),
    "score_sensitivity": (
        float,
        "accuracy_first: l1 sensitivity Delta > 0 of each candidate's exact score "
        "(validation accuracy: 1/n_val)",
    ),
    "iat_epsilon": (
        float,
        "accuracy_first: epsilon eps_A > 0 of the InteractiveAboveThreshold test",
    ),
    "validation_epsilon": (
        float,
        "stability_validation: alpha2 > 0 of the noisy argmax over the k exact scores",
    ),
    "stability_beta": (
        float,
        "stability_validation: beta > 0, the most one training or validation record moves a "
        "candidate's exact score: max(beta1/n, beta2/m) (Chaudhuri & Vinterbo 2013, Thm 4/6)",
    ),
    "stability_delta": (
        float,
        "stability_validation: per-candidate probability in [0, 1) that the stability bound "
        "fails (default 0); the total delta is k times it",
    ),
}


#: What a candidate's score is, as its trainer declares it (``score_kind``). Each method
#: says which kinds its theorem takes (``SelectionMethod.takes``) and a mismatch is refused before
#: anything trains.
SCORE_KINDS: dict[str, str] = {
    "covered": "covered by the candidate's own declared privacy: a noisy statistic of the private "
    "data whose noise is accounted in the candidate's privacy, or any statistic of public data",
    "exact": "an exact statistic of the private data (e.g. accuracy on a private validation "
    "split), not covered by the candidate's privacy",
    "percentile": "the exact percentile P[Q_i(D) >= tau] of a pure eps-DP candidate Q_i (Liu & "
    "Talwar 2019, Sec. 4.1's percentile oracle), not covered by the candidate's privacy",
}

#: What of the selected candidate a release may hold (``SelectionMethod.publishes``): only what
#: the method's theorem covers.
PUBLISHABLE: dict[str, str] = {
    "payload": "the selected candidate's hyperparameters and payload (the model), and what is "
    "computed from them and public data only (test accuracy, the public per-epoch curve)",
    "score": "the selected candidate's score, as the selection saw it",
    "index": "the selected candidate's position in the run (it bounds the number of candidates "
    "from below), and what depends on it (the ex-post privacy loss)",
}


class SelectionConfigError(ValueError):
    """A method name or its options are invalid; the message names the option."""


@dataclass(frozen=True)
class MethodInfo:
    """A selection method as the configs and command lines know it.

    Attributes:
      name: the method's name (``config.selection.method``, ``--selection``).
      summary: one line: what it does and its theorem.
      required: options it needs.
      optional: options it may take.
      build: ``build(**options) -> SelectionMethod``.
      privacy_only: options that do not change its privacy, with the value used when only the
        privacy transform is wanted (``dptune account``).
      method_class: the class ``build`` returns; its ``takes`` (score kinds its theorem is proved
        for, ``SCORE_KINDS``) and ``publishes`` (what of the selected candidate a release may
        hold, ``PUBLISHABLE``) are this entry's :attr:`takes` and :attr:`publishes`.
    """

    name: str
    summary: str
    required: tuple[str, ...]
    optional: tuple[str, ...]
    build: Callable[..., SelectionMethod]
    privacy_only: Mapping[str, Any] = None  # type: ignore[assignment]
    method_class: type[SelectionMethod] = SelectionMethod

    def __post_init__(self) -> None:
        object.__setattr__(self, "privacy_only", dict(self.privacy_only or {}))
        for o in (*self.required, *self.optional):
            assert o in OPTIONS, f"{self.name}: unknown option {o!r}; add it to OPTIONS"
        for kind in self.takes:
            assert kind in SCORE_KINDS, f"{self.name}: unknown score kind {kind!r}"
        for what in self.publishes:
            assert what in PUBLISHABLE, f"{self.name}: unknown publishable {what!r}"

    @property
    def takes(self) -> tuple[str, ...]:
        """Score kinds the method's theorem takes (``SelectionMethod.takes``)."""
        return tuple(self.method_class.takes)

    @property
    def publishes(self) -> tuple[str, ...]:
        """What of the selected candidate a release may hold (``SelectionMethod.publishes``)."""
        return tuple(self.method_class.publishes)


METHODS: dict[str, MethodInfo] = {}


def register(info: MethodInfo) -> MethodInfo:
    """Adds a method to the vocabulary (its name must be new)."""
    if info.name in METHODS or info.name == "none":
        raise ValueError(f"selection method {info.name!r} is already registered")
    METHODS[info.name] = info
    return info


def _mean(mean_trials: float) -> float:
    if not (math.isfinite(mean_trials) and mean_trials >= 1):
        raise SelectionConfigError(
            f"mean_trials={mean_trials:g} must be a finite number >= 1: the expected number of "
            "candidates trained"
        )
    return float(mean_trials)


def _stopping(name: str, summary: str, build: Callable, required=("mean_trials",), optional=()):
    """Registers a random-stopping method (its ``method_class`` is `RandomStopping`)."""
    register(MethodInfo(name, summary, required, optional, build, method_class=RandomStopping))


def _shape(shape: float) -> float:
    if not (math.isfinite(shape) and shape > -1):
        raise SelectionConfigError(
            f"shape={shape:g} must be a finite number > -1: the truncated negative binomial "
            "(Papernot & Steinke 2022, Def. 1) is defined for eta in (-1, inf)"
        )
    return float(shape)


_stopping(
    "logarithmic",
    "random stopping, logarithmic count (Papernot & Steinke 2022, Thm 2, eta = 0)",
    lambda mean_trials: RandomStopping.logarithmic(_mean(mean_trials)),
)
_stopping(
    "geometric",
    "random stopping, geometric count (Liu & Talwar 2019, Thm 3.2; with max_trials our bounds)",
    lambda mean_trials, max_trials=None: RandomStopping.geometric(_mean(mean_trials), max_trials),
    optional=("max_trials",),
)
_stopping(
    "tnb",
    "random stopping, truncated negative binomial count (Papernot & Steinke 2022, Thm 2)",
    lambda mean_trials, shape: RandomStopping.truncated_negative_binomial(
        _mean(mean_trials), _shape(shape)
    ),
    required=("mean_trials", "shape"),
)
_stopping(
    "poisson",
    "random stopping, Poisson count (Papernot & Steinke 2022, Thm 6)",
    lambda mean_trials: RandomStopping.poisson(_mean(mean_trials)),
)
register(
    MethodInfo(
        "thresholding",
        "first candidate above a threshold, coin-flip stopping (Liu & Talwar 2019, Thm 3.1)",
        ("threshold", "stop_probability"),
        ("max_trials",),
        Thresholding,
        privacy_only={"threshold": 0.0},
        method_class=Thresholding,
    )
)
register(
    MethodInfo(
        "sparse_vector",
        "generalized sparse vector on exact percentiles of pure-DP candidates "
        "(Liu & Talwar 2019, §4.1 with Dwork & Roth 2014, Thm 3.23)",
        ("target_percentile", "noise_scale", "max_trials"),
        (),
        PercentileSparseVector,
        privacy_only={"target_percentile": 0.5},
        method_class=PercentileSparseVector,
    )
)
register(
    MethodInfo(
        "accuracy_first",
        "Accuracy First: first of T candidates whose exact score passes InteractiveAboveThreshold "
        "against the target; charged the worst case eps_A + T eps (Ligett et al. 2017, Lemma 2.8)",
        ("threshold", "score_sensitivity", "iat_epsilon", "max_trials"),
        (),
        AccuracyFirst,
        privacy_only={"threshold": 0.0, "score_sensitivity": 1.0},
        method_class=AccuracyFirst,
    )
)
register(
    MethodInfo(
        "stability_validation",
        "all k candidates, noisy argmax of exact stable scores; alpha1 + alpha2 whatever k "
        "(Chaudhuri & Vinterbo 2013, Thm 1-2; pure-DP candidates only)",
        ("k", "validation_epsilon", "stability_beta"),
        ("stability_delta",),
        lambda k, validation_epsilon, stability_beta, stability_delta=0.0: (
            StabilityValidation.from_beta(k, validation_epsilon, stability_beta, stability_delta)
        ),
        privacy_only={"stability_beta": 1.0},
        method_class=StabilityValidation,
    )
)
register(
    MethodInfo(
        "best_of_k",
        "best of exactly k candidates, priced by composition (baseline)",
        ("k",),
        (),
        BestOfK,
        method_class=BestOfK,
    )
)
register(
    MethodInfo(
        "non_private_best",
        "best of k candidates with NO guarantee (debugging only)",
        ("k",),
        (),
        NonPrivateBest,
        method_class=NonPrivateBest,
    )
)


def names() -> tuple[str, ...]:
    """Registered method names, in registration order."""
    return tuple(METHODS)


def options_as(prefix: str, text: str, names: Iterable[str] = OPTIONS) -> str:
    """``text`` (a refusal of :func:`build`) with each option it names (``k=``, ``'k'``, ``k
    must``, ``k (...)``) written ``prefix + k``: a command's words (``--config.selection.k``)."""
    named = rf"(?<![\w.-])('?)({'|'.join(names)})(?=[=']| must | \()"
    return re.sub(named, lambda m: m[1] + prefix + m[2], text)


def applicable(name: str, options: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``(the options method name takes, the names of the set ones it does not take)``: a config
    holds every option, and switching the method should not require unsetting the others."""
    info = METHODS.get(name)
    if info is None:
        return dict(options), []
    takes = set(info.required) | set(info.optional)
    given = {k: v for k, v in options.items() if v is not None}
    return {k: v for k, v in given.items() if k in takes}, sorted(set(given) - takes)


def build(name: str, options: Mapping[str, Any], *, privacy_only: bool = False) -> SelectionMethod:
    """The method ``name`` with ``options`` (None values are ignored: unset config fields).

    With ``privacy_only``, options that do not change the method's privacy may be left out (for
    accounting without a run).

    Raises:
      SelectionConfigError: unknown name, a missing or inapplicable option, an invalid value.
    """
    if name not in METHODS:
        raise SelectionConfigError(
            f"selection method {name!r} is unknown; choose one of {', '.join(METHODS)}"
        )
    info = METHODS[name]
    given = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise SelectionConfigError(f"unknown selection option(s) {unknown}; known: {list(OPTIONS)}")
    extra = sorted(set(given) - set(info.required) - set(info.optional))
    if extra:
        raise SelectionConfigError(
            f"option(s) {extra} do not apply to selection method {name!r} (it takes "
            f"{list(info.required + info.optional)})"
        )
    if privacy_only:
        given = {**info.privacy_only, **given}
    missing = [o for o in info.required if o not in given]
    if missing:
        why = "; ".join(OPTIONS[o][1] for o in missing)
        raise SelectionConfigError(f"selection method {name!r} needs {missing} ({why})")
    args = {}
    for k, v in given.items():
        kind = OPTIONS[k][0]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise SelectionConfigError(f"selection option {k}={v!r} must be a number")
        if kind is int and int(v) != v:
            raise SelectionConfigError(f"selection option {k}={v!r} must be an integer")
        args[k] = kind(v)
    try:
        return info.build(**args)
    except SelectionConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise SelectionConfigError(f"selection method {name!r}: {e}") from None


def describe() -> str:
    """A table of the methods and options, for ``--help`` texts and docs."""
    lines = ["Selection methods:"]
    for info in METHODS.values():
        opts = ", ".join([*info.required, *(f"[{o}]" for o in info.optional)])
        lines.append(
            f"  {info.name} ({opts}): {info.summary}; takes {'/'.join(info.takes)} scores, "
            f"releases {' + '.join(info.publishes)}"
        )
    lines.append("Options: " + "; ".join(f"{k}: {v[1]}" for k, v in OPTIONS.items()))
    return "\n".join(lines)
