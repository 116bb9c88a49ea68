"""The lab: studies of ARCO beyond the paper, run as `python -m lab.<program>` from the repository's root. It changes
Algorithm 1 only through the seam — step scorers and advantage estimators registered by name (arco.register_scorer,
arco.register_estimator; --scorer, --estimator, --plugin), logging hooks, `--init-from` — and otherwise uses the
core's public functions as a library, never a private name (tests/test_layout.py); nothing outside imports it.

    study        the credit study: the μ ladder and the fork study (issues 33, 41)
    probe        the gradient probe, the ceiling of step credit, the groups that all fail (issues 53, 60, 67)
    truth        the synthetic worlds' ground truth: step labels and the oracles' step scores
    diagnostics  the command: run comparison and μ's diagnostics (python -m lab.diagnostics --run ... [--diagnose])
    compare      finished runs compared: EM / F1 overall and per type, paired differences, methods over seeds
    mu_credit    μ diagnosed: credit on held-out steps, μ as a judge, RQ3's Bind and Spec, RQ4's redundancy
    judges       RQ3's judges: an OpenAI-compatible model, or embeddings
    stats        the statistics the diagnostics use: κ, false passes, thresholds, ρ, intervals, redundancy
    page         a few trajectories as one self-contained HTML page
    plots        the diagnostics' PNG plots
    datacheck    checks of the data files, the retriever and the oracle teacher
    benchmark    speed: the training passes, μ's parse rate, one loop, a sample rubric
"""
