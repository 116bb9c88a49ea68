"""The lab: studies of ARCO beyond the paper, run as `python -m lab.<program>` from the repository's root. It reaches
the core through its one seam — step scorers and advantage estimators registered by name (arco.register_scorer,
arco.register_estimator), logging hooks, `--init-from` — and public names only; nothing outside imports it.

    study        the credit study: the μ ladder and the fork study (issues 33, 41)
    probe        the gradient probe and the ceiling of step credit (issues 53, 60)
    truth        the synthetic worlds' ground truth: step labels and the oracles' step scores
    diagnostics  run comparison, μ's diagnostics (AUC, judges, RQ3, RQ4), plots, the HTML page, data checks
    benchmark    speed: the training passes, μ's parse rate, one loop, a sample rubric
"""
