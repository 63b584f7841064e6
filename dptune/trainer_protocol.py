"""What the tuner trains: the trainer protocol, a user's function as a trainer, and the release
view of a selected candidate.

A trainer declares its privacy before it runs (``privacy(hparams)``) and trains one candidate
(``__call__(hparams, rng) -> (score, payload)``). Everything else is an optional hook, so the core
(``dptune.plan``, ``dptune.tuner``) never asks which kind of trainer it holds:

* ``train_many(hparams_list, rngs)``: several candidates at once (vectorised).
* ``num_examples``: the public size of the private training set (checks delta < 1/n).
* ``fingerprint``: the dataset's id in the budget ledger.
* ``privacy_fields``: fields known to change ``privacy(hparams)`` (others are found by probing).
* ``calibrated_field``: the field that ``"auto"`` calibrates (default ``"noise_multiplier"``).
* ``score_noise_field``: the setting of its validation score's noise, which a refusal names.
* ``privacy_notes()``, ``privacy_checks()``, ``taken_on_word()``: the statement's notes, what
  dptune's own code guarantees, what is taken on the trainer's word (a trainer with neither of
  the last two is described as a user's trainer).
* ``check_adjacency(adjacency)``: refuse an adjacency the data does not support.
* ``release_view(hparams, payload) -> ReleaseView``: what of the selected candidate may be
  released (default: the payload as it is).
* ``score_kind``: what the score is (``selection.registry.SCORE_KINDS``; default ``"exact"``).
* ``bind_accounted(pairs)``: the accounted declaration of every candidate it will train.
* ``code_digest()``: a digest of the code that trains the candidates; the workdir is bound to it.
* ``check_inputs(hparams)``: refuse (TuningConfigError), before any private computation, a
  candidate the trainer would refuse when it starts (checks of the data's public schema).
* ``curator_view()``: JSON-safe facts for ``dptune inspect`` (never released).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dptune.accounting.events import as_candidates
from dptune.errors import CandidateFailure, Refused, TuningConfigError

#: How a release names a :class:`FunctionTrainer` (``your function 'train'``); the report reads
#: its score in the function's own units, not as an accuracy.
FUNCTION_TRAINER = "your function"


def as_candidate(x: Any) -> Any:
    """A trainer's declared privacy as one ``dptune.accounting`` candidate."""
    if isinstance(x, (tuple, list)):  # e.g. an (epsilon, delta) pair: read item by item, the
        # refusal named only its first number
        raise TuningConfigError(
            f"the trainer's privacy(hparams) returned {x!r:.80}: it must return one DpEvent "
            "(e.g. dp_accounting.dp_event.GaussianDpEvent(noise_multiplier)) or a dptune "
            "accounting candidate (dptune.dpsgd_privacy(schedule, noise_multiplier)), which "
            "dptune composes over the search; not an (epsilon, delta) pair or a list"
        )
    try:
        cands = as_candidates(x)
    except ValueError as e:
        raise TuningConfigError(f"the trainer's privacy declaration is invalid: {e}") from None
    if len(cands) != 1:
        raise TuningConfigError(f"privacy(hparams) must describe one candidate, got {x!r}")
    return cands[0]


def checked_result(score: Any, payload: Any) -> tuple[float, Any]:
    """A trainer's ``(score, payload)`` as the tuner journals it: a finite float and the payload,
    or NaN and a :class:`~dptune.errors.CandidateFailure` saying what was wrong (a non-numeric or
    non-finite score is a failure, never a released "success")."""
    if isinstance(payload, CandidateFailure):
        return float("nan"), payload
    try:
        value = float(score)
    except (TypeError, ValueError):
        return float("nan"), CandidateFailure("InvalidScore", f"the trainer returned the score "
                                              f"{score!r:.80}, which is not a number")  # fmt: skip
    if not math.isfinite(value):
        return float("nan"), CandidateFailure("NonFiniteScore", f"the trainer returned the score "
                                              f"{value!r} (not finite)")  # fmt: skip
    return value, payload


def check_trainer(trainer: Any) -> None:
    """TuningConfigError unless ``trainer`` has the protocol's two methods (:class:`Trainer`): a
    plain function, the decorator forgotten, is refused with the decorator named."""
    what = f"trainer={getattr(trainer, '__name__', None) or type(trainer).__name__}"
    if not callable(getattr(trainer, "privacy", None)):
        raise TuningConfigError(
            f"{what} has no privacy(hparams) declaring what one candidate costs: wrap a training "
            "function with @dptune.trainer(privacy=lambda hp: ..., num_examples=N) or "
            "dptune.FunctionTrainer(fn, privacy_fn), or give your class a privacy method"
        )
    if not callable(trainer):
        raise TuningConfigError(
            f"{what} has privacy() but no __call__(hparams, rng) -> (score, payload) that trains "
            "one candidate: define it, or wrap a training function with @dptune.trainer"
        )


def public_size(num_examples: Any, name: str = "num_examples") -> int | None:
    """``num_examples`` as a positive int (None stays None): a PUBLIC size, never ``len()`` of
    the private data nor the data itself; anything else is one TuningConfigError naming ``name``."""
    if num_examples is None:
        return None
    if shape := getattr(num_examples, "shape", ()):
        raise TuningConfigError(
            f"{name}=<array of shape {tuple(shape)}>: pass the PUBLIC number of training "
            "records (an int you would publish), not the data"
        )
    ok = not isinstance(num_examples, (bool, np.bool_, str, bytes))
    try:
        n = int(num_examples)
        ok = ok and n == num_examples and n >= 1
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise TuningConfigError(
            f"{name}={num_examples!r} must be a positive integer: the PUBLIC number of training "
            "records"
        )
    return n


def code_digest(trainer: Any) -> str:
    """A digest (16 hex characters) of the code that trains ``trainer``'s candidates (the journal
    binds a workdir to it): its ``code_digest()`` hook, else the source of a ``FunctionTrainer``'s
    function, else of the trainer's class."""
    if callable(hook := getattr(trainer, "code_digest", None)):
        return str(hook())
    target = trainer.fn if isinstance(trainer, FunctionTrainer) else type(trainer)
    return source_digest([target])


def source_digest(objects: Sequence[Any] = (), files: Sequence[Path] = ()) -> str:
    """sha256 (first 16 hex characters) of the source of ``objects`` (functions, classes) and the
    bytes of ``files``; a function without source (a lambda typed at a prompt) contributes its
    bytecode and constants."""
    h = hashlib.sha256(b"dptune/code/v1")
    for obj in objects:
        while isinstance(obj, functools.partial):
            obj = obj.func
        if not (inspect.isroutine(obj) or inspect.isclass(obj) or inspect.ismodule(obj)):
            obj = type(obj)  # a callable object: its class's code
        try:
            h.update(inspect.getsource(obj).encode())
        except (OSError, TypeError):
            code = getattr(obj, "__code__", None)
            ok = isinstance(code, types.CodeType)
            h.update(code.co_code + repr(code.co_consts).encode() if ok else repr(obj).encode())
    for path in sorted(files):
        h.update(str(Path(path).name).encode())
        h.update(Path(path).read_bytes())
    return h.hexdigest()[:16]


@runtime_checkable
class Trainer(Protocol):
    """A private candidate generator (module docstring): ``privacy(hparams)`` returns a
    ``dptune.accounting`` candidate or a ``DpEvent``; ``__call__`` draws its randomness from
    ``rng`` (seeded from the candidate's seed); a higher score is better, NaN is a failure."""

    def privacy(self, hparams: Mapping[str, Any]) -> Any: ...

    def __call__(
        self, hparams: Mapping[str, Any], rng: np.random.Generator
    ) -> tuple[float, Any]: ...


@dataclass(frozen=True)
class ReleaseView:
    """What may be released of the selected candidate.

    Attributes:
      payload: the released payload (e.g. the model's parameters; never exact training losses).
      test_accuracy: accuracy on a public test split, if measured and the score is accuracy.
      history: per-epoch public rows (metrics on public or privatised data), oldest first.
      privacy_by_epoch: the privacy (accounting candidates) of the training up to each row of
        ``history``, the last the whole run: the released curve's epsilon (empty: no curve).
      test_metric: ``{"name": ..., "value": ...}``: the model's own ``Metric`` on the public test
        split, for a model scored by it instead of accuracy.
    """

    payload: Any
    test_accuracy: float | None = None
    history: Sequence[Mapping[str, Any]] = field(default_factory=tuple)
    privacy_by_epoch: Sequence[Any] = field(default_factory=tuple)
    test_metric: Mapping[str, Any] | None = None  # last: trainers build views positionally


def config_section(name: str, drawn: Iterable[str]) -> str:
    """Where the command sets hyperparameter ``name``: ``"--config.space."`` when the search
    space draws it (``drawn``: the space's fields), else ``"--config.train."``."""
    return f"--config.{'space' if name in drawn else 'train'}."


class DatasetTrainer:
    """Shared by the trainers over a ``trainers.data.Dataset``. Subclasses set ``data``, ``base``
    (fixed hyperparameters under the drawn ones), ``hyperparams_class`` (a dataclass validating
    its fields) and ``kind`` (its name in error messages)."""

    hyperparams_class: type
    kind: str = "trainer"
    score_noise_field: str = "score_noise_std"
    data: Any
    base: dict[str, Any]

    @functools.cached_property
    def fingerprint(self) -> str:
        """The dataset's id in the ledger: its private records as a multiset (so neither a new
        split nor a new order of the same records opens a fresh budget)."""
        return self.data.fingerprint()

    def code_digest(self) -> str:
        """The source file of this trainer's class (``dptune.trainer_protocol.code_digest``)."""
        return source_digest(files=[Path(inspect.getfile(type(self)))])

    def curator_view(self) -> dict[str, Any]:
        """What the loader dropped or changed, by kind (private counts; never released)."""
        return dict(getattr(self.data, "sanitized", None) or {})

    def hyperparams(self, hparams: Mapping[str, Any]) -> Any:
        """``base`` overridden by ``hparams``, as a ``hyperparams_class``; a bad field or value is
        one :class:`TuningConfigError` line."""
        merged = {**self.base, **dict(hparams)}
        try:
            return self.hyperparams_class(**merged)
        except (TypeError, ValueError) as e:
            text = str(e)  # names the refused field "field=": config.space's if drawn
            at = min(((text.find(f"{k}="), k) for k in merged if f"{k}=" in text), default=None)
            command = at and config_section(at[1], hparams) + text[at[0] :]
            takes = ", ".join(getattr(self.hyperparams_class, "__dataclass_fields__", ()))
            fix = f" ({self.kind} takes {takes})" if isinstance(e, TypeError) and takes else ""
            raise TuningConfigError(
                f"invalid {self.kind} hyperparameters {merged}: {e}{fix}", command=command
            ) from None


def _hparams_key(hparams: Mapping[str, Any]) -> str:
    """A candidate's hyperparameters as a lookup key (JSON, sorted keys)."""
    return json.dumps(dict(hparams), sort_keys=True, default=repr)


@dataclass
class FunctionTrainer:
    """Wraps a user's training function as a trainer.

    Args:
      fn: ``fn(hparams: dict, rng: numpy.random.Generator) -> (score, payload)``, or ``(score,
        payload, event)`` where the event must equal the one accounted for these hyperparameters.
      privacy_fn: the candidate's privacy: a ``DpEvent`` / accounting candidate, or a pure
        function of the hyperparameters returning one (no state, counter, clock or data): dptune
        accounts it before the run and checks it again before each candidate trains.
      num_examples, fingerprint: the private dataset's public size (checks delta < 1/n) and its
        id in the budget ledger, if known.
      privacy_fields: fields known to change the declared privacy (a speed-up: others that do are
        found by probing ``privacy``); calibrated_field: the field ``"auto"`` calibrates.
      score_kind: what ``fn``'s score is (``selection.registry.SCORE_KINDS``): ``"covered"`` (its
        noise is part of ``privacy``, or it reads public data only), ``"exact"`` (the default: a
        wrong ``"exact"`` only refuses, a wrong ``"covered"`` makes the statement false) or
        ``"percentile"``.
    """

    fn: Callable[..., tuple]
    privacy_fn: Any
    num_examples: int | None = None
    fingerprint: str | None = None
    name: str = "user function"
    privacy_fields: tuple[str, ...] = ("noise_multiplier",)
    calibrated_field: str = "noise_multiplier"
    score_kind: str = "exact"
    #: the accounted declaration of each candidate the tuner will train (``bind_accounted``)
    _accounted: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.num_examples = public_size(self.num_examples)

    def privacy(self, hparams: Mapping[str, Any]) -> Any:
        """``privacy_fn(hparams)`` (or ``privacy_fn`` itself); an exception from it is one
        TuningConfigError naming ``privacy=`` (it is asked before anything trains)."""
        if not callable(self.privacy_fn):
            return self.privacy_fn
        try:
            return self.privacy_fn(hparams)
        except Refused:  # dptune's own refusal (e.g. from dptune.dpsgd_privacy) says it already
            raise
        except Exception as e:  # noqa: BLE001 - any error in the user's declaration is theirs
            first = (str(e).splitlines() or [""])[0][:200]
            raise TuningConfigError(
                f"privacy= of {self.name} raised {type(e).__name__}: {first} at hparams "
                f"{dict(hparams)}: it must return a DpEvent for every point of the search space"
            ) from None

    def bind_accounted(self, pairs: Iterable[tuple[Mapping[str, Any], Any]]) -> None:
        """``(hparams, declared privacy)`` of every candidate the accountant covered: the event
        ``fn`` returns is compared with these, never with a fresh call of ``privacy``."""
        self._accounted = {_hparams_key(hp): as_candidate(c) for hp, c in pairs}

    def __call__(self, hparams: Mapping[str, Any], rng: np.random.Generator) -> tuple[Any, Any]:
        """``fn``'s ``(score, payload)``, its event checked; the score as returned (the tuner's
        ``checked_result`` records one that is not a finite number as a failure)."""
        out = self.fn(dict(hparams), rng)
        if not isinstance(out, tuple) or len(out) not in (2, 3):
            raise TypeError(
                f"{self.name} must return (score, payload) or (score, payload, event), got "
                f"{out!r:.80}"
            )
        if len(out) == 3:
            declared = self._accounted.get(_hparams_key(hparams))
            if declared is None:  # called outside dptune.tune: nothing was accounted
                declared = as_candidate(self.privacy(hparams))
            if as_candidate(out[2]) != declared:
                raise RuntimeError(
                    f"{self.name} returned the DpEvent {out[2]!r} but {declared!r} was accounted "
                    f"for hparams {dict(hparams)}: the accountant charged the accounted one"
                )
        return out[0], out[1]

    def describe(self) -> dict[str, Any]:
        return {"kind": "function", "name": self.name, "num_examples": self.num_examples}


def trainer(
    privacy: Any, *, num_examples: int | None = None, fingerprint: str | None = None,
    score_kind: str = "exact",
) -> Callable[[Callable], FunctionTrainer]:  # fmt: skip
    """Decorator form of :class:`FunctionTrainer`::

    @dptune.trainer(privacy=lambda hp: make_event(hp["noise_multiplier"]), num_examples=n,
                    score_kind="covered")
    def train(hparams, rng):
        ...
        return noisy_accuracy, params
    """

    def wrap(fn: Callable) -> FunctionTrainer:
        name = getattr(fn, "__name__", "user function")
        return FunctionTrainer(fn, privacy, num_examples, fingerprint, name, score_kind=score_kind)

    return wrap
