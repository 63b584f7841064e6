"""DP-SGD under audit (``dptune audit``): the DP-SGD trainer on its data plus canaries, with the
negative controls that need the engine. The DP-SGD trainer itself knows nothing of audits."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dptune.auditing.canaries import Canaries
from dptune.auditing.decode import decode_subset_sum
from dptune.errors import CandidateFailure, TuningConfigError
from dptune.learners.dpsgd import DpSgdTrainer
from dptune.trainer_protocol import ReleaseView
from trainers import audit, models
from trainers.spec import AUDIT_MODEL_SUFFIX


def _first_step(step: int) -> int:
    """``noise_step`` of the ``noise_reused`` control (a module function: the trainer pickles)."""
    return 0


class AuditDpSgdTrainer(DpSgdTrainer):
    """A DP-SGD trainer on its parent's data plus the included canaries, with the parent's privacy
    declaration (same public sizes, same hyperparameters): the audit checks training against it.

    ``gradient`` canaries train the parent's model wrapped by ``trainers.audit.GradientCanaries``
    (its canary block after each epoch is released as ``canary_trace``); ``input`` canaries join the
    training split, ``score`` canaries the validation split. ``fault``: ``"noise_reused"`` (every
    step's noise key folded with 0: the loop's ``noise_step``) or ``"exact_score"`` (the released
    score is the exact sum of the validation records' probabilities of their labels over the public
    validation size, instead of the noisy accuracy)."""

    #: Faults this trainer can inject (others are hyperparameter rewrites, ``dptune.auditing``).
    FAULTS = ("noise_reused", "exact_score")

    def __init__(
        self, parent: DpSgdTrainer, canaries: Canaries, included: np.ndarray, fault: str | None
    ) -> None:
        x, y = canaries.subset(included)
        part = "val" if canaries.kind == "score" else "train"  # the split the canaries join
        old_x, old_y = getattr(parent.data, f"{part}_x"), getattr(parent.data, f"{part}_y")
        data = dataclasses.replace(parent.data, **{
            f"{part}_x": np.concatenate([old_x, x.astype(old_x.dtype)]),
            f"{part}_y": np.concatenate([old_y, y.astype(old_y.dtype)]),
        })  # fmt: skip
        super().__init__(
            data, parent.base, parent.epoch_progress, parent.test_curve,
            parent.compilation_cache, grad_impl=parent.grad_impl,
        )  # fmt: skip
        self.parent, self.canaries, self.fault = parent, canaries, fault
        self.init_fingerprint, self._finetune = parent.init_fingerprint, parent._finetune
        if fault == "noise_reused":
            self.noise_step = _first_step
        self._trace: dict[int, list[np.ndarray]] = {}

    @staticmethod
    def design(trainer: DpSgdTrainer, kind: str, m: int, rng: np.random.Generator) -> Canaries:
        """m canaries of ``kind`` placed by the dataset's own per-record split: gradient and input
        canaries in the training split, score canaries in the validation split."""
        data = trainer.data
        shape = tuple(data.train_x.shape[1:])
        if kind == "gradient":
            if len(shape) != 3:
                raise TuningConfigError(
                    f"gradient canaries are images (a marker pixel); this data's records have "
                    f"shape {shape}: audit it with --kind=input"
                )
            x, y = audit.gradient_canary_records(m, shape, data)
        else:  # input or score (dptune.auditing.run checked the kind)
            if kind == "score" and data.split.get("kind") != "record_hash":
                raise TuningConfigError(
                    "score canaries are placed in the validation split by its per-record hash; "
                    "this dataset's validation set is separate: audit it with --kind=gradient"
                )
            x, y = audit.input_canary_records(
                m, shape, data.num_classes, data, rng, validation=kind == "score"
            )
        return Canaries(kind, x, y)

    def hyperparams(self, hparams: Mapping[str, Any]) -> Any:
        """The parent's hyperparameters; with gradient canaries, its model wrapped by
        ``trainers.audit.GradientCanaries`` (refused for a model that reads features)."""
        hp = super().hyperparams(hparams)
        wrapped = getattr(hp.model, "name", "").endswith(AUDIT_MODEL_SUFFIX)
        if self.canaries.kind == "gradient" and not wrapped:
            if not isinstance(hp.model, str):
                raise TuningConfigError(
                    "gradient canaries wrap a shipped image model; audit your own model with "
                    "--kind=input"
                )
            base = models.get_model(hp.model, self.data.num_classes)
            if base.features is not None:
                raise TuningConfigError(
                    f"gradient canaries need a model that reads images; {hp.model!r} reads "
                    "features: audit it with --kind=input"
                )
            hp = dataclasses.replace(hp, model=audit.gradient_canary_spec(base))
        return hp

    def epoch_hook(self, index: int, epoch: int, params: Any) -> None:
        if self.canaries.kind == "gradient":
            self._trace.setdefault(index, []).append(audit.canary_block(params))

    def train_many(
        self, hparams: Sequence[Mapping[str, Any]], rngs: Sequence[np.random.Generator]
    ) -> list[tuple[float, Any]]:
        self._trace = {}
        out = super().train_many(hparams, rngs)
        for i, (score, payload) in enumerate(out):
            if isinstance(payload, CandidateFailure):
                continue  # journaled as the failure it is; never released, so no trace to read
            if self.canaries.kind == "gradient":
                trace = self._trace.get(i) or [np.zeros((0, audit.GRADIENT_CANARY_SLOTS))]
                payload["canary_trace"] = np.vstack(trace)
            if self.fault == "exact_score" and math.isfinite(score):
                spec = models.resolve(self.hyperparams(hparams[i]).model, self.data.num_classes)
                val_x, val_y = self.data.val_x, self.data.val_y
                _, conf = audit.per_record(payload["params"], spec, val_x, val_y)
                out[i] = (math.fsum(conf) / float(self.data.public_num_val), payload)
        return out

    def release_view(self, hparams: Mapping[str, Any], payload: Any) -> ReleaseView:
        """The parent's view, plus ``canary_trace`` in the parameters for gradient canaries (a
        function of the iterates, which DP-SGD's guarantee covers)."""
        view = super().release_view(hparams, payload)
        if self.canaries.kind == "gradient" and view.payload is not None:
            params = {**view.payload["params"], "canary_trace": payload["canary_trace"]}
            view = dataclasses.replace(view, payload={"params": params})
        return view

    def canary_scores(self, release: Any) -> dict[str, np.ndarray]:
        """Per-canary statistics of the released candidate, higher = more likely included.

        * gradient: ``displacement`` = -w[j] at the end (w starts at 0 and moves by -lr C / B per
          sampling of an included canary, plus noise); ``dispersion`` = standard deviation over
          epochs of w[j]'s per-epoch increments (0 for an excluded canary when the noise repeats).
        * input: ``loss`` = minus the canary's cross-entropy under the released parameters.
        * score: ``decoded`` = +1 / -1 / 0 from the released score read as an exact sum
          (``dptune.auditing.decode``)."""
        m = len(self.canaries)
        params = release.payload["params"]
        if self.canaries.kind == "gradient":
            trace = np.asarray(params["canary_trace"], np.float64)[:, :m]
            final = audit.canary_block(params)[:m]
            steps = np.diff(np.vstack([np.zeros((1, m)), trace]), axis=0)
            return {"displacement": -final, "dispersion": steps.std(axis=0)}
        spec = models.resolve(self.hyperparams(release.hparams).model, self.data.num_classes)
        losses, conf = audit.per_record(params, spec, self.canaries.x, self.canaries.y)
        if self.canaries.kind == "input":
            return {"loss": -losses}
        _, real = audit.per_record(params, spec, self.parent.data.val_x, self.parent.data.val_y)
        target = float(release.validation_score) * float(self.data.public_num_val) - math.fsum(real)
        return {"decoded": decode_subset_sum(target, conf)}

    def check_adjacency(self, adjacency: str) -> None:
        self.parent.check_adjacency(adjacency)
