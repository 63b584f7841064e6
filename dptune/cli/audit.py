"""``dptune audit``: an empirical privacy audit of a config's run, next to the epsilon it states.

    dptune audit --config=smoke --workdir=/tmp/dptune-audit
    dptune audit --config=smoke --workdir=/tmp/audit-one --what=training --canaries=500
    dptune audit --config=smoke --workdir=/tmp/control --what=training --break=no_noise

The config's run (its data, trainer, search space, selection and budget, as ``dptune`` would run
it) is repeated with m canaries added to the private data, each included with probability 1/2
(OS entropy); every canary is scored on the released candidate and the guesses become a lower
bound on epsilon at the stated delta with the given confidence (Steinke, Nasr & Jagielski 2023).
``DIR/audit.json`` and ``DIR/audit.md`` hold the result; ``DIR/release/`` is the audit's release,
marked as an audit, never the dataset's. The ledger charges an audit entry of its own.

--kind: gradient (white-box: the DP-SGD step, through canaries whose gradient is a Dirac on a
parameter block of their own), input (black-box: out-of-distribution images scored by their
loss), score (validation canaries read from the released score). --break: a negative control that
makes training NOT private, to show the audit catches it: no_noise, no_clipping, noise_reused,
exact_score. docs/audit.md says what the number means and what it does not.
"""

from __future__ import annotations

from pathlib import Path

from absl import flags
from ml_collections import config_flags

from dptune.auditing import BREAKS, KINDS, WHATS
from dptune.auditing.run import AUDIT_JSON, AUDIT_MD, audit
from dptune.cli import build, common
from dptune.errors import Refused

#: This command's own flags (kept apart from the other commands' in one process).
FLAGS = flags.FlagValues()
_OWN = {"flag_values": FLAGS}
_CONFIG = config_flags.DEFINE_config_file("config", None, "A shipped config or a file.", **_OWN)
_WORKDIR = flags.DEFINE_string("workdir", None, "The audit's own folder (not a run's).", **_OWN)
_WHAT = flags.DEFINE_enum("what", "tuning", WHATS, "tuning: the run, or training.", **_OWN)
_CANARIES = flags.DEFINE_integer("canaries", None, "m (default 1000; 20 for score).", **_OWN)
_KIND = flags.DEFINE_enum("kind", None, KINDS, "Canaries (default gradient for DP-SGD).", **_OWN)
_BREAK = flags.DEFINE_enum("break", None, BREAKS, "A negative control: NOT private.", **_OWN)
_CONFIDENCE = flags.DEFINE_float("confidence", 0.95, "Of the lower bound, in (0, 1).", **_OWN)
_SEED = flags.DEFINE_integer("seed", None, "Fixed seed (tests); default OS entropy.", **_OWN)
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress display on stderr.", **_OWN)


def cli(argv: list[str]) -> int:
    """``dptune audit`` in this process; returns the exit code."""
    if any(a in common.HELP for a in argv[1:]):
        print(common.help_text(__doc__, FLAGS))
        return common.OK
    try:
        config, work = common.parse_run_command(FLAGS, argv, "the audit's own folder")
        common.setup_logging()
        # the config goes through the same validation as a tuning run's
        c = build.validate(config, work, seed=_SEED.value)
        o = c.options  # the ledger, accountant and adjacency, checked
        trainer = build.build_trainer(c.cfg, build.load_data(c.cfg), progress=_PROGRESS.value)
        result = audit(
            trainer, c.space, c.method, c.budget, workdir=work, ledger=o.ledger, config=c.cfg,
            accountant=o.accountant, adjacency=o.adjacency, what=_WHAT.value,
            canaries=_CANARIES.value, kind=_KIND.value, break_=_BREAK.value,
            confidence=_CONFIDENCE.value, seed=_SEED.value, progress=_PROGRESS.value,
        )  # fmt: skip
    except Refused as e:
        return common.refuse(e)
    except Exception as e:  # noqa: BLE001 - a full disk is the user's; anything else a bug
        return common.unexpected(e, Path(_WORKDIR.value) / "private", argv)
    print(f"{result}\n\n{work / AUDIT_MD}\n{work / AUDIT_JSON}")
    return common.OK


if __name__ == "__main__":
    common.entry(cli)
