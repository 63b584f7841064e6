r"""Privacy of a DP-SGD tuning run: one (epsilon, delta) for everything released.

Examples:

  # One DP-SGD run (MNIST-like: 60000 examples, batch 256, 30 epochs = 7032 steps):
  dptune account --sampling_rate=0.0042667 --noise_multiplier=1.1 --steps=7032

  # Random stopping with Poisson(10) candidates, tightest route (PLD delta-hat):
  dptune account --sampling_rate=0.0042667 --noise_multiplier=1.1 --steps=7032 \
      --selection=poisson --mean_trials=10

  # The noise multiplier for a total budget epsilon=3 with logarithmic random stopping:
  dptune account --sampling_rate=0.0042667 --steps=7032 --selection=logarithmic \
      --mean_trials=10 --target_epsilon=3 --json

--selection: none (one run) or a method of ``selection.registry`` (as ``config.selection.method``;
listed below with the theorem that prices each), its options as flags. --accountant=rdp reproduces
dp_accounting's RDP route exactly; the default 'auto' takes the tightest valid route.
"""

from __future__ import annotations

import json
import math
import re

from absl import flags
from dp_accounting import dp_event

from dptune import accounting
from dptune.accounting.quiet import summarised_accounting_warnings
from dptune.cli import common
from dptune.cli.common import ArgumentError
from selection import privacy as sp
from selection import registry

SELECTIONS = ("none", *registry.names())

_SAMPLING_RATE = flags.DEFINE_float("sampling_rate", None, "Poisson sampling rate q in (0, 1] "
                                    "(expected batch size / examples).")  # fmt: skip
_NOISE = flags.DEFINE_float("noise_multiplier", None, "DP-SGD noise multiplier sigma > 0 (omit "
                            "with --target_epsilon).")  # fmt: skip
_STEPS = flags.DEFINE_integer("steps", None, "Number of DP-SGD steps per candidate (>= 1).")
_DELTA = flags.DEFINE_float("delta", 1e-5, "Total delta in (0, 1).")
_SELECTION = flags.DEFINE_enum("selection", "none", SELECTIONS, "Selection method.")
_OPTION_FLAGS = {
    name: (flags.DEFINE_float if kind is float else flags.DEFINE_integer)(name, None, help_)
    for name, (kind, help_) in registry.OPTIONS.items()
    # values that do not change the privacy (the test's noise scales with the sensitivity,
    # stability validation's exponential noise with its beta)
    if name not in ("threshold", "target_percentile", "score_sensitivity", "stability_beta")
}
_SCORE = flags.DEFINE_float("score_noise_std", None, "Gaussian noise std (counts) on each "
                            "validation count; omit: public.")  # fmt: skip
_ACCOUNTANT = flags.DEFINE_enum("accountant", "auto", accounting.ACCOUNTANTS,
                                "auto (tightest valid route), pld or rdp.")  # fmt: skip
_TARGET = flags.DEFINE_float("target_epsilon", None, "Total epsilon budget: calibrate "
                             "--noise_multiplier to meet it.")  # fmt: skip
_LAPLACE = flags.DEFINE_float("laplace_epsilon", None, "Instead of DP-SGD: pure epsilon-DP "
                              "(Laplace) candidates.")  # fmt: skip
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of text.")


def _check_inputs() -> None:
    """What the flags must say together; the values themselves are the accountant's to check
    (its ``name=`` becomes the flag's ``--name=`` in the refusal)."""
    if (eps := _LAPLACE.value) is not None:
        named = (_SAMPLING_RATE, _STEPS, _NOISE, _TARGET, _SCORE)
        if given := [f"--{f.name}" for f in named if f.value is not None]:
            raise ArgumentError(
                f"--laplace_epsilon describes the candidates completely; drop {', '.join(given)}."
            )
        if not (math.isfinite(eps) and eps > 0):
            raise ArgumentError(f"--laplace_epsilon={eps:g} must be a finite number > 0.")
        return
    for flag, what in ((_SAMPLING_RATE, "expected batch size / training examples"),
                       (_STEPS, "DP-SGD steps per candidate")):  # fmt: skip
        if flag.value is None:
            raise ArgumentError(f"--{flag.name} is required ({what}).")
    if (_NOISE.value is None) == (_TARGET.value is None):
        raise ArgumentError("give --noise_multiplier, or --target_epsilon to calibrate it (not "
                            "both: --target_epsilon computes the noise multiplier).")  # fmt: skip


#: A library message's ``name=`` of one of this command's flags, to be written as the flag.
_NAMES = [f.name for f in (_SAMPLING_RATE, _NOISE, _STEPS, _DELTA, _TARGET, _SCORE, _LAPLACE)]
_FLAG_NAMED = re.compile(r"(?<![\w.-])(" + "|".join(_NAMES) + r")=")


def _result() -> tuple[dict, str]:
    _check_inputs()
    given = {n: f.value for n, f in _OPTION_FLAGS.items() if f.value is not None}
    if _SELECTION.value != "none":
        transform = registry.build(_SELECTION.value, given, privacy_only=True).privacy
    elif given:
        raise ArgumentError(f"options {sorted(given)} do not apply to --selection=none.")
    else:
        transform = sp.SingleRunPrivacy()
    q, steps, delta, acc = _SAMPLING_RATE.value, _STEPS.value, _DELTA.value, _ACCOUNTANT.value
    out: dict = {"selection": _SELECTION.value}
    text_extra = ""
    if (target := _TARGET.value) is not None:
        cal = accounting.calibrate_noise(q, steps, transform, target, delta, acc, _SCORE.value)
        statement = cal.statement
        names = ("noise_multiplier", "target_epsilon", "untuned_noise_multiplier",
                 "naive_noise_multiplier", "naive_trials")  # fmt: skip
        out.update({k: getattr(cal, k) for k in names})
        naive = "" if cal.naive_noise_multiplier is None else (
            f"; naive best-of-{cal.naive_trials} (composition) would need "
            f"{cal.naive_noise_multiplier:.4f}")  # fmt: skip
        text_extra = (f"Noise multiplier for a total ({cal.target_epsilon:g}, {delta:g}) budget: "
                      f"{cal.noise_multiplier:.4f}\n  one untuned run would need "
                      f"{cal.untuned_noise_multiplier:.4f}{naive}.\n\n")  # fmt: skip
    else:
        if _LAPLACE.value is not None:
            # A pure epsilon-DP candidate: a Laplace mechanism of scale 1/epsilon on a
            # sensitivity-1 query (dptune.accounting.pure_epsilon reads it back as epsilon).
            event = dp_event.LaplaceDpEvent(1.0 / _LAPLACE.value)
            candidate = accounting.EventCandidate(event, label="Laplace mechanism")
            out["laplace_epsilon"] = _LAPLACE.value
        else:
            candidate = accounting.DpSgdCandidate(q, steps, _NOISE.value, _SCORE.value)
            out["noise_multiplier"] = _NOISE.value
        statement = accounting.total_privacy(candidate, transform, delta, acc)
    if statement.single_run_epsilon == 0:  # so large a delta that no epsilon is left to state
        raise ArgumentError(f"--delta={delta:g}: one candidate alone is (0, {delta:g})-DP; give "
                            "a delta below 1/n for n training examples, e.g. 1e-5.")  # fmt: skip
    d = statement.to_dict()
    names = ("single_run_epsilon", "total_epsilon", "delta", "overhead", "accountant")
    out.update({k: d[k] for k in names}, accountant_requested=acc)
    out.update(method=d["method"], theorem=d["theorem"], sampling_rate=q, steps=steps, statement=d)
    return out, text_extra + statement.to_text()


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        return common.refuse(f"unexpected arguments {argv[1:]} (dptune account takes flags only)")
    try:
        with summarised_accounting_warnings():
            out, text = _result()
    except ValueError as e:  # ArgumentError and the library's own input checks
        text = _FLAG_NAMED.sub(r"--\1=", str(e))  # and the selection's options, as flags:
        return common.refuse(registry.options_as("--", text, _OPTION_FLAGS))
    print(json.dumps(out) if _JSON.value else text)
    return common.OK


def cli(argv: list[str]) -> int:
    """``dptune account`` in this process: a flag error or an invalid input is one ``dptune:``
    line and exit code 2; ``--help`` exits 0."""
    if any(a in common.HELP for a in argv[1:]):
        print(__doc__, registry.describe(), flags.FLAGS.module_help(__name__), sep="\n")
        return common.OK
    try:
        rest = flags.FLAGS(list(argv))
    except flags.Error as e:
        return common.refuse(e)
    return main(rest)


if __name__ == "__main__":
    common.entry(cli)
