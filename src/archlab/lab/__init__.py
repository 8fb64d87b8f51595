"""The lab: matched-budget comparisons of architecture variants (``archlab compare``).

Layers, each usable on its own:

* ``suite``  - suite YAML files (built-in ones in ``archlab/suites/``) -> ``Suite``
* ``plan``   - a ``Suite`` -> every run's validated config, budget, costs and run id
* ``runner`` - train what is missing, resume what was interrupted, record results
* ``display`` - the progress display while a suite runs, and the ``--dry-run`` plan table
* ``store/`` - the SQLite results database (one row per run, and the claims of runs in progress;
  ``store.owner``: which process trains a run and whether it still exists)
* ``latency`` - measured prefill/decode latency of each variant on the inference engine, after training
* ``stats``  - noise floor, Welch's t, confidence intervals, Bonferroni verdicts
* ``report/`` - report.md / report.html / console table and their plots, from the database alone;
  ``report.trend``: an effect across model sizes or training lengths
* ``cli``    - the ``compare`` and ``report`` commands

Submodules are imported on use: the report pulls in matplotlib and scipy, which the rest of
the command line does not need.
"""
