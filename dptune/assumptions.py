"""The assumptions a privacy statement rests on: one name each, explained in
``docs/privacy-model.md`` (a heading per name; a test keeps the two in step).

``make_privacy_plan`` names the ones that apply to a run in its statement (``privacy.txt`` lists
them), next to what dptune checked and what it takes on the trainer's word.
"""

from __future__ import annotations

#: name -> one line (the docs section of the same name says more).
ASSUMPTIONS: dict[str, str] = {
    "neighbours": "neighbouring datasets differ in one record (added or removed; replaced for "
    "replace-one), and every record is one person's data",
    "public-sizes": "the declared dataset size (it sets the sampling rate and step count) and "
    "the expected validation size are public; the loaded file's length never enters privacy",
    "per-record-split": "each record's part (training or validation) depends on that record "
    "alone, so training and the private score compose in parallel",
    "pure-declaration": "a trainer's declared privacy is a pure function of its "
    "hyperparameters, and depends only on the fields the accountant enumerated",
    "declaration-matches-code": "each candidate's training does what its declaration says "
    "(clipping, noise, sampling, the score's noise)",
    "score-kind": "the score is of the kind the trainer declares, a kind the method's theorem "
    "takes; the release holds only what the theorem covers",
    "method-constants": "the constants a method's theorem takes on the user's word hold (pure-DP "
    "candidates and exact percentiles for sparse vector, the score sensitivity for Accuracy "
    "First, the stability beta for stability-based validation)",
    "public-inputs": "the config, the search space, the selection method and its parameters, "
    "the split key and seed, and the code are public (chosen without the private data)",
    "hidden-private-folder": "DIR/private/ (every candidate, its score and seed, hence their "
    "number) and the ledger stay with the curator, as does the run's duration",
    "secret-randomness": "the randomness comes from the operating system's entropy (or a seed "
    "that stays secret); attacks on floating-point noise are outside the model",
    "failures": "a candidate fails (scores NaN) only as a function of its private output, never "
    "of the data directly",
    "public-test-split": "the test split that test accuracy is measured on is public (reported "
    "only, never used to select)",
    "public-validation": "a validation set declared public is public data, independent of the "
    "private records (its exact score costs nothing)",
    "public-init": "the initial parameters a fine-tuning run starts from (named by their "
    "fingerprint in the statement's notes) are public: chosen and trained independently of the "
    "private records",
}
