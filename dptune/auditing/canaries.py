"""Canaries as records, and the secret coins that say which ones are in the training data.

The canaries' design (the m records) is public and fixed before the run; which of them are
included is drawn once, each independently with probability 1/2 (the audit's premise: Steinke,
Nasr & Jagielski 2023, §3), from the operating system's entropy unless a seed is given (tests).
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

#: Canary kinds: white-box gradient canaries, black-box input canaries, validation-score canaries.
KINDS = ("gradient", "input", "score")

#: spawn_key of the audit's generators (``dptune.tune`` uses (0,) and (1, i)).
_COINS_KEY = (0xA0D17, 0)
_DESIGN_KEY = (0xA0D17, 1)


@dataclasses.dataclass(frozen=True, eq=False)
class Canaries:
    """m canary records of one ``kind`` (one of ``KINDS``): inputs ``x`` (m, ...) and int labels
    ``y`` (m,)."""

    kind: str
    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"canary kind {self.kind!r} must be one of {KINDS}")
        if len(self.x) != len(self.y) or len(self.x) < 1:
            raise ValueError(f"canaries: {len(self.x)} inputs and {len(self.y)} labels")

    def __len__(self) -> int:
        return len(self.y)

    def digest(self) -> str:
        """sha256 of the design (kind, inputs, labels): binds a resumed audit to the same
        canaries."""
        h = hashlib.sha256(self.kind.encode())
        h.update(np.ascontiguousarray(self.x).tobytes())
        h.update(np.ascontiguousarray(self.y, dtype=np.int64).tobytes())
        return h.hexdigest()

    def subset(self, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The records where ``mask`` is True: (x, y)."""
        mask = np.asarray(mask, bool)
        return self.x[mask], self.y[mask]


def design_rng(seed: int | None) -> np.random.Generator:
    """The generator of the canaries' (public) design: OS entropy, or ``seed`` in tests."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=_DESIGN_KEY))


def draw_inclusion(m: int, seed: int | None) -> np.ndarray:
    """(m,) bool: canary i is included with probability 1/2, independently (OS entropy unless a
    seed is given; the audit's bound holds only if the auditor cannot predict these coins)."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=_COINS_KEY))
    return rng.integers(0, 2, size=m).astype(bool)
