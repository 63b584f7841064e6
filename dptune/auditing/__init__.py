"""Empirical privacy auditing of a run (``dptune audit``; Steinke, Nasr & Jagielski 2023):
``run`` (``audit()``, ``AuditResult``), ``canaries`` (records and their secret coins), ``guesses``
and ``bound`` (guesses to a lower bound on epsilon; numpy/scipy only), ``decode`` (the exact-score
control), ``dpsgd`` (DP-SGD under audit)."""

from dptune.auditing.bound import ceiling, epsilon_lower_bound, p_value
from dptune.auditing.canaries import KINDS, Canaries
from dptune.auditing.run import BREAKS, WHATS, AuditResult, audit

__all__ = ["BREAKS", "KINDS", "WHATS", "AuditResult", "Canaries", "audit", "ceiling",
           "epsilon_lower_bound", "p_value"]  # fmt: skip
