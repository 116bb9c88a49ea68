"""Compare finished runs of arco.py and diagnose their rubric model μ (paper §4.1 tables, RQ3 §4.4,
RQ4 §4.5, and μ's step credit against ground truth). Nothing in the project imports this file.

Usage:

  python -m lab.diagnostics --run runs/synthetic/arco --run runs/synthetic/outcome [--diagnose]

(The loop benchmark, one iteration timed by phase, is `python -m lab.benchmark loop`.)

compares finished runs of arco.py (one dataset) side by side, and with --diagnose also
examines the rubric model μ of the FIRST run. One command makes every table and figure:

  comparison  Each run's checkpoint (selection.json's selected epoch, or --checkpoint) is
              scored greedily on --split (dev): the evaluation the run already made is reused
              (metrics.jsonl + traces/eval_epoch_K.jsonl), or one stored by an earlier call
              (<run>/evals/<split>_<checkpoint>.json/.jsonl), else the policy is loaded and
              evaluated now and stored there (--reevaluate forces this). The warmup's "base"
              and "SFT only" rows (its metrics.json, dev only) come first. One table: EM, F1,
              searches per question, invalid-step rate, then EM / F1 per question type
              (HotpotQA bridge / comparison, the 2Wiki types, MuSiQue hop counts 2hop / 3hop /
              4hop). Written to <first run>/comparison.md and comparison.json
              (comparison-<split>.* for another split).
  --diagnose  Into the first run's folder: diagnostics.json, diagnostics.md, dev_em.png,
              train_reward.png, bucket_scores.png, credit_auc.png, trajectories.html.
              * Credit assignment: a fixed held-out set -- the oracle teacher's gold and
                imperfect (redundant, wrong-entity, premature, wrong-answer) trajectories on
                --heldout-questions dev questions x --heldout-samples, seeded -- with every step
                labelled useful or useless (step_usefulness: the gold supporting paragraphs;
                every dataset has them). AUC of μ's s_t (greedy rubrics, Eq. 2) for useful vs
                useless steps, for the untrained μ (the base backbone, a fresh seeded score
                head), the warmup μ, and μ after each RL epoch; also the AUC of the s_t the run
                recorded on its own training rollouts, per epoch.
              * μ as a reward-free judge: pass iff Σ_t s_t > 0.5, and > a threshold fitted on
                the selected epoch's training traces (best_threshold of Σ_t s_t against R),
                against R(τ): agreement, κ, false-pass and false-fail rates; the AUC of Σ_t s_t
                for R; Spearman's ρ of Σ_t s_t and F1.
              * RQ3 Bind (and Spec) and RQ4 redundancy on the checkpoint epoch's training
                traces, for EVERY run whose traces hold criteria (so variants and K compare):
                the offline embedding judge always (the retriever's encoder), an OpenAI-
                compatible judge with --judge-model (key and endpoint from OPENAI_API_KEY /
                OPENAI_BASE_URL), split by Search and Finish, with 95% intervals.
              * Plots: dev EM per epoch and mean training R per update of every run; mean s_t
                per position bucket and epoch;
                the credit AUC over training (x = -1 untrained μ, 0 warmup μ, K epoch K). A page
                of a few training trajectories of the last epoch with their rubrics and scores.
"""
import sys
from dataclasses import dataclass, field
from typing import Sequence

from env import EnvSettings
from infra import models
from infra.data import DataError
from infra.files import write_json
from infra.settings import DataSettings, Split, fill_from_preset, main_guard, parse_args
from lab.compare import RunError, compare_runs, comparison_markdown, open_run
from lab.datacheck import check_data, check_files
from lab.mu_credit import diagnose

@dataclass
class Args(EnvSettings, DataSettings, Split):
    """The command line: the shared settings (infra.settings.DataSettings, the retriever's in env.EnvSettings,
    --split), then its own."""
    run: list[str] | None = field(default=None, metadata={"path": "dir",
        "help": "a run folder runs/<dataset>/<name>; repeat (--run A --run B) or list several to compare them; "
                "the outputs go into the first"})
    checkpoint: str | None = field(default=None, metadata={
        "help": "checkpoint of every run to compare, e.g. epoch_2 (epoch_0 = the warmup's π SFT); "
                "default: each run's selection.json"})
    reevaluate: bool = field(default=False, metadata={
        "help": "evaluate the checkpoints again even where an evaluation is already stored"})
    # diagnostics of μ
    diagnose: bool = field(default=False, metadata={
        "help": "also diagnose μ of the first --run (an ARCO run): credit assignment, μ as a judge, RQ3, RQ4, plots"})
    heldout_questions: int = field(default=10, metadata={"min": 1,
        "help": "--diagnose: dev questions of the held-out oracle trajectories with known step labels"})
    heldout_samples: int = field(default=2, metadata={"min": 1,
        "help": "--diagnose: oracle trajectories per held-out question (sample 0 gold, then imperfect variants)"})
    judge_model: str | None = field(default=None, metadata={
        "help": "--diagnose: model of an OpenAI-compatible RQ3 judge (Bind and Spec, e.g. gpt-4o-mini; "
                "OPENAI_API_KEY / OPENAI_BASE_URL); unset = the offline embedding judge only"})
    judge_items: int = field(default=200, metadata={
        "help": "--diagnose: steps per run sent to --judge-model, a seeded sample (two calls each)"})
    html_trajectories: int = field(default=6, metadata={
        "help": "--diagnose: training trajectories of the last epoch shown in trajectories.html"})
    # checks of the data and the oracle teacher (no run needed)
    check_retrieval: bool = field(default=False, metadata={
        "help": "measure how often a supporting paragraph's title, as a query, retrieves a supporting paragraph"})
    check_gold: bool = field(default=False, metadata={
        "help": "measure how often the oracle's gold trajectories retrieve every supporting paragraph"})
    check_size: int = field(default=0, metadata={
        "help": "questions measured by --check-retrieval / --check-gold (0 = the whole split; "
                "synthetic: 200)"})
    check_files: bool = field(default=False, metadata={
        "help": "load every data file asked for (--dataset all --split all: every one): questions loaded and skipped"})

    def __post_init__(self):
        fill_from_preset(self)
        self.split = self.split or "dev"


def run_command(args: "Args") -> None:
    """`--run`: the comparison table (printed and written), then with --diagnose the diagnostics."""
    runs = [open_run(f, args.checkpoint) for f in args.run]
    datasets = {r.args.get("dataset") for r in runs}
    if len(datasets) > 1:
        which = ", ".join(f"{r.dir}: {r.args.get('dataset')}" for r in runs)
        raise RunError(f"the runs are on different datasets ({which}); compare runs of one dataset")
    names = [r.name for r in runs]
    for r in runs:
        if names.count(r.name) > 1:
            r.name = str(r.dir)
    if args.diagnose and not runs[0].has_mu:
        why = "an outcome run" if runs[0].args.get("reward") == "outcome" else "no checkpoints/epoch_K/mu"
        raise RunError(f"--diagnose examines μ of the first --run, but {runs[0].dir} has no μ checkpoint ({why}); "
                       f"put an ARCO run first")
    comp = compare_runs(runs, args.split, args.data_dir or None, args.device, args.reevaluate, args.dtype)
    stem = "comparison" if args.split == "dev" else f"comparison-{args.split}"
    md = comparison_markdown(comp)
    (runs[0].dir / f"{stem}.md").write_text(md, encoding="utf-8")
    write_json(runs[0].dir / f"{stem}.json", comp)
    print(md)
    written = {"comparison table": runs[0].dir / f"{stem}.md", "comparison data": runs[0].dir / f"{stem}.json"}
    if args.diagnose:
        written.update(diagnose(runs, args))
    print("Written:")
    for what, path in written.items():
        print(f"  {what}: {path}")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(Args, argv, description=__doc__)
    if args.check_retrieval or args.check_gold or args.check_files:
        try:
            return check_data(args) if args.check_retrieval or args.check_gold else check_files(args)
        except DataError as e:
            sys.exit(f"error: {e}")
    if not args.run:
        print("error: give --run DIR (one or more; to score a predictions file: python evaluate.py FILE GOLD)",
              file=sys.stderr)
        sys.exit(2)
    try:
        run_command(args)
    except (RunError, DataError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main_guard(main, DataError, models.ModelLoadError)
