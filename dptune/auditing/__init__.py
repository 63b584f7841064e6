"""Empirical privacy auditing of a run (``dptune audit``; Steinke, Nasr & Jagielski 2023).

* ``bound``: m canaries, r guesses, v correct -> a lower bound on epsilon at confidence 1 - beta.
* ``canaries``: canary records and the secret coins that include them.
* ``guesses``: guessing rules and their bound (a union bound over the rules).
* ``decode``: reading an exact released score back into included canaries (exact-score control).
* ``run``: ``audit()``, the run itself (``dptune.audit``), and ``AuditResult``.

``dptune.auditing.bound`` and ``guesses`` need only numpy/scipy; the run needs a trainer.
"""

from __future__ import annotations

from dptune.auditing.bound import ceiling, epsilon_lower_bound, p_value
from dptune.auditing.canaries import KINDS, Canaries
from dptune.auditing.run import BREAKS, WHATS, AuditResult, audit

__all__ = [
    "BREAKS",
    "KINDS",
    "WHATS",
    "AuditResult",
    "Canaries",
    "audit",
    "ceiling",
    "epsilon_lower_bound",
    "p_value",
]
