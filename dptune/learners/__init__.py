"""Private learners other than DP-SGD that dptune tunes like any candidate.

* ``dptune.learners.fisher``: DP feature selection + Fisher (linear discriminant) classifier
  (issue 14; the seed paper's Algorithm 1 made differentially private end to end).
* ``dptune.learners.public_data``: the oracle-efficient private learner with public unlabelled data
  (Algorithm 3 of "Oracle-Efficient Differentially Private Learning with Public Data").

Each module has a trainer class with the ``dptune.Trainer`` hooks (``privacy``, ``__call__``,
``privacy_fields``, ``calibrated_field``, ``release_view``) and states its privacy as a
``dp_accounting`` ``DpEvent`` in one function, with the theorem named next to the formula.
"""
