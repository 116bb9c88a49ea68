"""The credit study (issues 33 and 41): does μ's step credit help π beyond outcome RL, and what limits μ? On the
long-horizon worlds (`synthetic-long`: 3-4-hop chains, look-alike distractors, 5 searches), from one deliberately
partial π_sft. Not part of the paper (the lab: nothing outside it imports this file; it changes Algorithm 1 through
arco's seam only: the "mixed" estimator registered here, the oracles' scorers in lab/truth.py, a logging hook). Two
programs, each resumable (what is finished is kept; an unfinished run resumes), each taking arco.py's flags after
its own:

  python -m lab.study ladder [--rows ROW ...]          the μ-quality ladder, before any RL: one μ per row (a μ SFT
                                                   variant of the study's warmup), each μ's AUC by step type on
                                                   π_sft's seeded rollouts of 100 held-out dev questions, μ reading
                                                   its OWN greedy rubric, beside the position-only baseline on the
                                                   same steps. Written to <out-dir>/synthetic-long/study/ladder.md
  python -m lab.study fork [--seeds 0 1 2] [--arms ARM ...] [--figures figures]
                                                   Algorithm 1 as it runs: a sparse phase once per seed (π on outcome
                                                   advantages, μ co-evolving by Eq. 5 every update; `sparse-sN`),
                                                   then the arms forked from its last checkpoint at the dense
                                                   transition (same weights, μ, optimizer states, same first dense
                                                   batch): outcome RL continuing, ARCO, the mixed arm, the causal and
                                                   projection oracles, ARCO w/o Rubric (its own sparse phase with a
                                                   rubric-free μ: π's sparse updates do not read μ), outcome RL at
                                                   the dense phase's π rate and λ_π. The table (Δ EM
                                                   vs outcome RL of the same seed, paired 95% intervals), μ's AUC
                                                   through the sparse phase and at the fork, per-update credit
                                                   statistics, the learning curves: <out-dir>/synthetic-long/study/
                                                   over every finished arm of the given seeds, whichever process
                                                   ran it (seeds run as separate processes each write it for
                                                   their own seeds: the command with every seed rebuilds it,
                                                   running nothing again). A run another process is running is
                                                   refused, so once a seed has forked its arms may run as
                                                   parallel processes, each with its own --arms

The settings every run of the study shares are STUDY below; the dense phase takes the release's ratios to
the sparse one (CHOICES.md, "the credit study").
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

import torch

import arco
import env
import rubric_model
import warmup
from infra.runs import auc
from infra.data import DataError
from infra.engines import loading
from infra.files import read_jsonl, write_json, write_jsonl
from infra.models import ModelLoadError
from infra.parallel import Workers
from infra.runs import trace_rows
from infra.settings import main_guard, parse_args
from infra.teachers import cycle, plural
from infra.warmups import collection_suffix, mu_dir_name
from lab.truth import step_usefulness

# Shared by every run and every μ of the study (arco.py's flag names). 32 RL questions the warmup did not use,
# 8 trajectories an update (2 questions × 4 samples, in sparse and dense epochs alike): 16 updates an epoch.
# π_sft: one SFT epoch on 100 warmup questions (29 EM on 100 held-out questions: room for credit), μ SFT on
# the first 40's. The release's dense/sparse ratios: π's rate × 0.3 (1e-5 → 3e-6), λ_π 0 → 0.05, α 0.5; μ at the
# release's own rates (1e-5, head 5e-4), which kept μ's credit through RL where the cpu preset's eroded it. μ writes
# the release's JSON list; μ SFT and evaluation as the `cpu` preset had them when the study ran (issue 52 changed
# the preset's since).
STUDY = dict(dataset="synthetic-long", train_size=32, batch_size=8, group_size=4, dense_samples=4, eval_size=500,
             warmup_size=100, sft_epochs_pi=1, sft_questions_mu=40, sft_eval_size=100, warmup_questions="before",
             sparse_epochs=2, epochs=3, pi_lr_sparse=2e-4, pi_lr_dense=6e-5, kl_pi_sparse=0.0, kl_pi_dense=0.05,
             alpha=0.5, mu_lr=1e-5, head_lr=5e-4, rubric_format="json", eval_all=True, sft_epochs_mu=2,
             sft_batch_mu=8, sft_head_steps=500, max_new_tokens_mu=96, class_balance=True)
# What the study adds to every run through its logging hook (study_hook): a dev evaluation on the first CURVE_SIZE dev questions
# every EVAL_EVERY updates (the learning curves), and the per-update credit statistics in metrics.jsonl.
EVAL_EVERY, CURVE_SIZE = 4, 200

# The μ-quality ladder: each row a μ SFT variant of the study's warmup (warmup.py's flag names).
LADDER = {
    "teacher": dict(mu_data="teacher"),                                      # the oracle's own trajectories (App. B)
    "teacher-check": dict(mu_data="teacher", criteria="check"),
    "policy": dict(mu_data="policy"),                                        # π_sft's rollouts, oracle-annotated
    "policy-ownhead": dict(mu_data="policy", head_fit="own"),
    "policy-check": dict(mu_data="policy", criteria="check"),
    "policy-check-ownhead": dict(mu_data="policy", criteria="check", head_fit="own"),
    "policy-bal": dict(mu_data="policy", balance_finishes=True),            # right/wrong finishes weigh alike
    "policy-check-ownhead-bal": dict(mu_data="policy", criteria="check", head_fit="own", balance_finishes=True),
    "policy-q100": dict(mu_data="policy", sft_questions_mu=100),           # every warmup question's rollouts
    "policy-q100-n4": dict(mu_data="policy", sft_questions_mu=100, policy_samples=4),
    "policy-q100-check-ownhead": dict(mu_data="policy", sft_questions_mu=100, criteria="check", head_fit="own"),
    "policy-q100-n4-check-ownhead": dict(mu_data="policy", sft_questions_mu=100, policy_samples=4, criteria="check",
                                         head_fit="own"),
    "policy-norubric": dict(mu_data="policy", rubric="none"),
}

# The fork's arms: the sparse run each forks from, and its own settings (arco.py's flag names, and the study's own
# `credit` — mu: μ's s_t, or a ground-truth oracle's, a scorer of lab/truth.py — and `mixed`, the "mixed" estimator;
# kept in the run's lab.json; arm_credit reads them).
ARMS = {"outcome": ("sparse", dict(reward="outcome")),                       # R(τ) − the group's mean, continuing
        "arco": ("sparse", dict()),                                          # dense, μ's s_t (Algorithm 1)
        "mixed": ("sparse", dict(mixed=True)),                               # outcome + μ's dense advantage
        "causal-oracle": ("sparse", dict(credit="causal")),                  # G_t = R − Φ(h_t): a baseline arm
        "projection-oracle": ("sparse", dict(credit="projection")),          # the issue-33 oracle (reads the future)
        "arco-norubric": ("sparse-norubric", dict(rubric="none")),         # its own μ, its own sparse phase
        # A control beyond the issue: outcome RL at the dense phase's π rate and λ_π (ARCO's), so that ARCO's
        # difference to it is μ's credit alone, not the cooler update (the report pairs each arm with it too).
        # Its settings follow the command line's dense ones: a function of the study's arguments.
        "outcome-dense": ("sparse", lambda base: dict(reward="outcome", pi_lr_sparse=base.pi_lr_dense,
                                                      kl_pi_sparse=base.kl_pi_dense))}
SPARSE = {"sparse": dict(), "sparse-norubric": dict(rubric="none")}
ARGS_FIELDS = {f.name for f in dataclasses.fields(arco.Args)}


def study_args(argv: Sequence[str], **overrides) -> arco.Args:
    """arco.Args for one run of the study: arco.py's defaults, then STUDY, then the command line's flags, then
    `overrides` (the arm's or the row's), the preset filling the rest."""
    given = parse_args(arco.Args, list(argv))
    defaults = arco.Args()
    explicit = {f.name: getattr(given, f.name) for f in dataclasses.fields(arco.Args)
                if getattr(given, f.name) != getattr(defaults, f.name)}
    return arco.resolve_args(dataclasses.replace(defaults, **{**STUDY, **explicit, **overrides}))


# --- what the study adds to Algorithm 1: its options, through arco's seam (Credit, a hook) -------------------------

LAB_OPTIONS = {"credit": "mu", "mixed": False}    # an arm's own settings beyond arco.py's flags (ARMS), in lab.json


def split_settings(settings: dict) -> tuple[dict, dict]:
    """An arm's or a ladder row's settings: arco.py's flags, and the study's own options."""
    return ({k: v for k, v in settings.items() if k in ARGS_FIELDS},
            {k: v for k, v in settings.items() if k not in ARGS_FIELDS})


def run_settings(run_dir: Path) -> dict:
    """What a run of the study ran with: its args.json and the study's options (lab.json; a run made before the
    study kept them apart has them in args.json). `init_from` is called `fork_from` in those."""
    saved = json.loads((run_dir / "args.json").read_text())
    lab = run_dir / "lab.json"
    saved = {**LAB_OPTIONS, **saved, **(json.loads(lab.read_text()) if lab.is_file() else {})}
    saved["init_from"] = saved.get("init_from") or saved.get("fork_from") or ""
    return saved








@arco.register_estimator("mixed")
def mixed_advantages(batch: arco.CreditBatch) -> arco.Advantages:
    """The mixed arm (not ARCO; PRIME-style): in a dense epoch A_t = A_outcome(τ) + α (G_t − Ḡ_b), the outcome
    advantage (its group's or the batch's mean as the baseline, as --sparse-baseline says) plus μ's Eq. 3–4
    advantage; sparse epochs as Algorithm 1."""
    adv = arco.advantages(batch)
    if not batch.dense:
        return adv
    trajs = batch.trajs
    groups = [(t.example.dataset, t.example.id) for t in trajs] if batch.args.sparse_baseline == "group" else None
    outcome = arco.outcome_advantages([t.reward for t in trajs], groups)
    return dataclasses.replace(adv, A=[[a + o if st.valid else 0.0 for a, st in zip(a_t, t.steps)]
                                       for a_t, o, t in zip(adv.A, outcome, trajs)])


def credit_stats(trajs, s, adv: arco.Advantages) -> dict:
    """For the log of a dense or μ-scored update (issue 41): the mean s_t by step type and position
    (`search@1`, `finish@4`, …; valid steps), the correlation over the batch of Σ_t s_t − R(τ) with the number of
    searches (does the credit reward length?), and each bucket holding one valid step (Eq. 4's singleton, where
    --bucket-fallback puts the batch's mean G as its baseline) with the advantage that step got."""
    if s is None:
        return {}
    by: dict[str, list[float]] = {}
    excess, searches = [], []
    for t, r in zip(trajs, env.step_ranges(trajs)):
        scores = s[r.start:r.stop].tolist()
        for i, (st, x) in enumerate(zip(t.steps, scores), 1):
            if st.valid:
                by.setdefault(f"{st.action}@{i}", []).append(x)
        excess.append(sum(scores) - t.reward)
        searches.append(sum(st.valid and st.action == "search" for st in t.steps))
    sd = (float(torch.tensor(excess).std()), float(torch.tensor(searches, dtype=torch.float).std())) \
        if len(trajs) > 1 else (0.0, 0.0)
    # none where either does not vary; Σ_t s_t = R by construction (the oracles) leaves rounding error only
    corr = float(torch.corrcoef(torch.tensor([excess, searches], dtype=torch.float))[0, 1]) \
        if sd[0] > 1e-5 and sd[1] > 0 else None
    singletons = []
    if adv.buckets is not None:
        counts: dict = {}
        for t, b_t in zip(trajs, adv.buckets):
            for st, b in zip(t.steps, b_t):
                if b is not None and st.valid:            # Eq. 4's I_b: valid steps, as bucketed_advantages
                    counts[b] = counts.get(b, 0) + 1
        singletons = [{"bucket": b, "action": st.action, "A": a} for t, b_t, a_t in zip(trajs, adv.buckets, adv.A)
                      for st, b, a in zip(t.steps, b_t, a_t) if b is not None and st.valid and counts[b] == 1]
    return {"mean_s_by_step": {k: sum(v) / len(v) for k, v in sorted(by.items())},
            "corr_excess_searches": corr, "singleton_buckets": singletons}


def study_hook(args) -> arco.Hook:
    """What the study logs after every update of a run (arco.run's hook): the credit statistics in the update's
    row, and every EVAL_EVERY updates (but at an epoch's end, which evaluates anyway) a greedy evaluation on the
    first CURVE_SIZE dev questions, a `curve` row of metrics.jsonl (its traces in traces/curve_epoch_<epoch>.jsonl)."""
    run_dir = Path(args.out_dir) / args.dataset / args.name

    def hook(u: arco.Update) -> None:
        u.row.update(credit_stats(u.trajs, u.s, u.adv))
        if (u.batch + 1) % EVAL_EVERY or u.batch + 1 >= u.batches:
            return
        dev = env.load_split(args.dataset, "dev", args.data_dir or None, args.eval_size, args.seed)[:CURVE_SIZE]
        retriever = env.shared_retriever(args.retriever or None, args.retriever_pooling)
        ev, curve = arco.dev_evaluation(u.pi, dev, args, retriever, Workers())
        write_jsonl(run_dir / "metrics.jsonl", [{"kind": "curve", "epoch": u.epoch, "batch": u.batch, **ev}], append=True)
        write_jsonl(run_dir / "traces" / f"curve_epoch_{u.epoch}.jsonl", trace_rows(curve, u.epoch, u.batch), append=True)
        print(f"[study] epoch {u.epoch} after batch {u.batch}: dev EM {ev['em']:.1f} on {len(curve)} questions", flush=True)
    return hook


def arm_credit(options: dict) -> dict:
    """An arm's changes to Algorithm 1, by the seam's names (arco.py's --scorer, --estimator, --plugin): an oracle's
    step scores in place of μ's (lab/truth.py's scorers; then no μ), the mixed estimator (this module's)."""
    return {"scorer": options.get("credit", "mu"), "estimator": "mixed" if options.get("mixed") else "arco",
            "plugin": ["lab.study"]}


# --- the μ-quality ladder (no RL) ------------------------------------------------------------------------------

def auc_by_step_type(scores: Sequence[float], labels: Sequence[bool], kinds: Sequence[str | None]) -> dict:
    """auc of step scores against step labels for the search steps, the finish steps (`kinds`: each step's
    valid action, None for an invalid one) and all of them."""
    return {kind: auc([s for s, k in zip(scores, kinds) if kind in ("all", k)],
                      [y for y, k in zip(labels, kinds) if kind in ("all", k)]) for kind in ("search", "finish", "all")}


def position_auc(trajs) -> dict:
    """The position-only baseline: a step's score is minus its index (earlier = useful), by step type."""
    steps = [(t, st, u) for tr in trajs for t, (st, u) in enumerate(zip(tr.steps, step_usefulness(tr)))]
    return auc_by_step_type([-t for t, _, _ in steps], [u for _, _, u in steps],
                            [st.action if st.valid else None for _, st, _ in steps])


def ladder(argv: Sequence[str], rows: Sequence[str]) -> Path:
    """Train each row's μ (ladder_mu: the collection, π SFT and μ SFTs already made are reused), then score it on
    π_sft's seeded held-out rollouts (policy_dev_rollouts), kept in study/ladder.json."""
    base = study_args(argv)
    root = Path(base.out_dir) / base.dataset
    folder, out = root / "study-warmup", root / "study"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "ladder.json"
    done = json.loads(path.read_text()) if path.is_file() else {}
    trajs = None
    for row in rows:
        flags, variant = split_settings(LADDER[row])
        args = study_args(argv, **flags, warmup_dir=str(folder))
        name = ladder_mu(args, folder, variant)
        if done.get(row, {}).get("mu") == name:
            continue
        if trajs is None:
            retriever = env.shared_retriever(base.retriever or None, base.retriever_pooling)
            trajs = policy_dev_rollouts(base, folder, retriever)
        mu = rubric_model.RubricModel.load(folder / name, **loading(base))
        done[row] = {"mu": name, "settings": LADDER[row], "command": ladder_command(row),
                     **policy_dev_auc(mu, trajs, base.gen_batch, base.max_new_tokens_mu),
                     "position": position_auc(trajs), "sft": mu_sft_facts(folder, name)}
        done = keep_row(path, row, done[row])
    (out / "ladder.md").write_text(ladder_markdown(done), encoding="utf-8")
    print(ladder_markdown(done))
    return out


def ladder_mu_name(settings: dict, variant: dict) -> str:
    """A ladder row's μ folder: core's name for its data (infra.warmups.mu_dir_name) and the row's variant after it —
    π_sft's rollouts per question (`policy_samples`, -nN), the check criteria (`criteria: check`, -check:
    check_criteria), the score-head fit on μ's own greedy rubrics (`head_fit: own`, -ownhead; none without a fit),
    the rarer of right and wrong finishes repeated (`balance_finishes`, -bal)."""
    own = variant.get("head_fit") == "own" and settings.get("sft_head_steps")
    policy = variant.get("policy_samples") and settings.get("mu_data", "teacher") != "teacher"
    return (mu_dir_name(settings) + (f"-n{variant['policy_samples']}" if policy else "")
            + ("-check" if variant.get("criteria") == "check" else "") + ("-ownhead" if own else "")
            + ("-bal" if variant.get("balance_finishes") else ""))


def ladder_mu(args: arco.Args, folder: Path, variant: dict) -> str:
    """A ladder row's μ in the study's warmup folder (its name: ladder_mu_name), fine-tuned if missing (core's
    warmup.train_mu); the name returned."""
    own = variant.get("head_fit") == "own" and args.sft_head_steps
    name = ladder_mu_name(dataclasses.asdict(args), variant)
    if (folder / name / "config.json").is_file():
        return name
    print(f"[study] ladder μ {folder / name}", flush=True)
    warmup.run_from_arco(args, train_mu=False)             # the collection and π SFT, reused when there
    retriever = env.shared_retriever(args.retriever or None, args.retriever_pooling)
    questions = env.load_split(args.dataset, "train", args.data_dir or None, args.warmup_size, args.seed)
    questions = questions[:args.sft_questions_mu or len(questions)]
    records = []
    if args.mu_data != "teacher":                          # π_sft plays, the oracle annotates
        records += warmup.policy_records(args, folder, questions, retriever, variant.get("policy_samples"))
    if args.mu_data != "policy":                           # the oracle's own trajectories
        wanted = {q.id for q in questions}
        records += warmup.filter_records([r for r in read_jsonl(folder / f"records{collection_suffix(args.k)}"
                                                                                ".jsonl") if r["id"] in wanted
                                          and r["sample"] < args.warmup_samples], args.k, args.tol)[0]
    items = warmup.rubric_sft_examples(records)
    if variant.get("criteria") == "check":
        items = check_items(items, records, args.k)
    if variant.get("balance_finishes"):
        items = balanced_finishes(items)
    mu, facts = warmup.train_mu(args, items, head_steps=0 if own else None)
    if own:                           # μ writes r_t itself (greedy, as at RL time); the head learns to read that
        contexts = warmup.rubric_items(mu, items)[0]
        mu.eval()
        with torch.no_grad():
            rubrics = mu.generate_rubrics(contexts, 0.0, args.max_new_tokens_mu, args.gen_batch)
        facts["mu_head_fit_error"] = warmup.fit_score_head(mu, items, args.sft_head_steps, args.sft_head_lr,
                                                           rubrics=rubrics, pass_tokens=args.pass_tokens)
    finishes = [it for it in items if it["action"].startswith("Finish[")]
    facts.update(variant, sft_finishes=len(finishes), sft_right_finishes=sum(map(right_finish, finishes)))
    warmup.keep_mu(folder, name, mu, facts)
    return name


def check_items(items: Sequence[dict], records: Sequence[dict], K: int) -> list[dict]:
    """--criteria check: each μ SFT item with check_criteria in place of the teacher's criteria (the scores stay the
    teacher's, slot for slot)."""
    steps = {(r["id"], r["sample"]): warmup.steps_of(r) for r in records}
    out = []
    for it in items:
        s = steps[(it["id"], it["sample"])]
        out.append({**it, "criteria": check_criteria(s[:it["step"]], s[it["step"]], K)})
    return out


def _title(observation: str) -> str:
    return observation.split(": ", 1)[0]


def check_criteria(steps_before: Sequence[env.Step], step: env.Step, K: int) -> list[str]:
    """K criteria for one step written as checks from what the step's context shows (issue 41), in the slots of
    oracle_rubric's scores: the question's chain, the paragraphs found so far (their titles, from h_t), the
    action and the searches left. Nothing here knows the gold evidence or what the step brought back, so a
    useful and a useless action in the same context get criteria that differ only in the query or answer
    they quote; whether the check passes is said by the oracle's scores alone (μ's score head must read it
    from the context, as it must at RL time, when μ writes its criteria itself)."""
    found = list(dict.fromkeys(_title(s.observation) for s in steps_before if s.valid and s.action == "search"))
    queries = [s.argument for s in steps_before if s.valid and s.action == "search"]
    last = f"the last paragraph ({found[-1]})" if found else "the question"
    titles = ", ".join(found) or "none yet"
    arg = step.argument
    if step.valid and step.action == "search":
        c = [f"Search[{arg}] looks up the next link of the question's chain, named by {last}",
             f"\"{arg}\" brings back a paragraph the answer depends on, not one of: {titles}",
             f"\"{arg}\" repeats none of the {len(queries)} earlier quer{'y' if len(queries) == 1 else 'ies'}",
             "The query is short and names one entity or relation",
             f"A search is still needed, with {plural(step.searches_left, 'search')} left"]
    elif step.valid and step.action == "finish":
        c = [f"Finish[{arg}] gives what the question asks for",
             f"\"{arg}\" is stated in the paragraphs found: {titles}",
             f"Time to stop: the {len(found)} paragraph{'' if len(found) == 1 else 's'} found cover every link the "
             f"question names, "
             f"{plural(step.searches_left, 'search')} left",
             "A short, well-formed answer (a name, date, number or yes/no)",
             f"\"{arg}\" agrees with the facts found"]
    else:
        c = ["The output is one well-formed Search[query] or Finish[answer] action",
             f"The step makes progress on the question ({step.reason})"]
    return cycle(c, K)


def right_finish(item: dict) -> bool:
    """A μ SFT item of a Finish step the teacher scored right (its first score: the answer is right)."""
    return item["action"].startswith("Finish[") and item["scores"][0] > 0


def balanced_finishes(items: Sequence[dict]) -> list[dict]:
    """--balance-finishes: the rarer of right and wrong Finish items repeated (in order, cycling) until both
    classes count alike; search items as they are. A choice of ours (issue 41): π_sft's rollouts hold few right
    finishes (18 of 79 in the credit study), and Eq. 7's squared error is then met by scoring every finish low."""
    fin = [it for it in items if it["action"].startswith("Finish[")]
    right = [it for it in fin if right_finish(it)]
    wrong = [it for it in fin if not right_finish(it)]
    if not right or not wrong:
        return list(items)
    few, many = (right, wrong) if len(right) < len(wrong) else (wrong, right)
    return list(items) + [few[j % len(few)] for j in range(len(many) - len(few))]


POLICY_PROBE_QUESTIONS = 100     # held-out dev questions π_sft plays once each for μ's step AUC before RL


def policy_dev_rollouts(args, out_dir: Path, retriever, policy: Path | None = None) -> list[env.Trajectory]:
    """π_sft's seeded rollouts of POLICY_PROBE_QUESTIONS held-out dev questions (one each, at the rollout
    temperature): the steps on which every μ of a warmup is measured before RL (policy_dev_auc). With `policy`
    (a run's saved π), that π plays the same questions with the same seeds."""
    dev = env.load_split(args.dataset, "dev", args.data_dir or None, POLICY_PROBE_QUESTIONS, args.seed + 1)
    return warmup.on_policy_teacher(args, out_dir, policy).rollout([(ex, 0) for ex in dev], retriever)[0]


def policy_dev_auc(mu, trajs: Sequence[env.Trajectory], gen_batch: int, max_new_tokens: int = 128) -> dict:
    """μ's step credit on a policy's own rollouts (policy_dev_rollouts: π_sft's before any RL, or a saved π's):
    the AUC of s_t for useful vs useless steps (step_usefulness) by step type (the ladder shows each μ's)."""
    contexts = [c for t in trajs for c in rubric_model.contexts_from_trajectory(t)]
    mu.eval()
    with torch.no_grad():
        _, scores = mu.annotate(contexts, 0.0, max_new_tokens, gen_batch)      # μ's own greedy rubric
    steps = [st for t in trajs for st in t.steps]
    labels = [u for t in trajs for u in step_usefulness(t)]
    out = {"questions": len(trajs), "steps": len(steps), "useful_share": sum(labels) / max(1, len(labels)),
           **auc_by_step_type(scores.s.tolist(), labels, [st.action if st.valid else None for st in steps])}
    print(f"[study] μ's AUC on the policy's own dev steps: search {out['search']}, finish {out['finish']}", flush=True)
    return out


def keep_row(path: Path, key: str, row: dict) -> dict:
    """Add `row` under `key` to the JSON file at `path`, read again first: another of the study's processes
    may have added its own rows since this one read it. Returns the file's rows."""
    done = {**(json.loads(path.read_text()) if path.is_file() else {}), key: row}
    write_json(path, done)
    return done


def ladder_command(row: str) -> str:
    flags = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in LADDER[row].items())
    return f"python warmup.py {flags} (with the study's settings; or: python -m lab.study ladder --rows {row})"


def mu_sft_facts(folder: Path, name: str) -> dict:
    """What the row's μ SFT saw and did (the warmup's metrics.json)."""
    m = json.loads((folder / "metrics.json").read_text()).get("mu", {}).get(name, {})
    return {k: m.get(k) for k in ("mu_sft_loss_per_epoch", "mu_head_fit_error", "sft_items", "sft_finishes",
                                  "sft_right_finishes")}


def fmt(v) -> str:
    return "–" if v is None else f"{v:.2f}"


def auc_table(heads: Sequence[str], rows: Iterable[tuple[Sequence[str], dict]]) -> str:
    """μ's step AUC beside the position-only baseline (policy_dev_auc and position_auc rows), one line each,
    after the row's own cells (`heads` names them)."""
    lines = [f"| {' | '.join(cells)} | **{fmt(d['search'])}** / {fmt(d['position']['search'])} | "
             f"**{fmt(d['finish'])}** / {fmt(d['position']['finish'])} | {fmt(d['all'])} | {d['steps']} |"
             for cells, d in rows]
    return (f"| {' | '.join(heads)} | search: μ / position | finish: μ / position | all | steps |\n"
            f"|{'---|' * (len(heads) + 4)}\n" + "\n".join(lines) + "\n")


def ladder_markdown(done: dict) -> str:
    return auc_table(["row", "μ folder"], (([row, f"`{d['mu']}`"], d) for row, d in done.items()))


# --- sparse, then fork ---------------------------------------------------------------------------------------------

def run_once(args: arco.Args, options: dict | None = None) -> Path:
    """One run of the study, with its own `options` (LAB_OPTIONS, kept in lab.json): skipped when finished, resumed
    when started; refused while another process runs it (so the arms of one seed can run in parallel processes,
    each with its own --arms, once its fork exists)."""
    options = {**LAB_OPTIONS, **(options or {})}
    run_dir = Path(args.out_dir) / args.dataset / args.name
    if (run_dir / "selection.json").is_file():
        return run_dir
    with held(run_dir):
        args.resume = (run_dir / "args.json").is_file()
        print(f"[study] {args.name}: {'resuming' if args.resume else 'starting'}", flush=True)
        write_json(run_dir / "lab.json", {**options, "eval_every": EVAL_EVERY, "curve_size": CURVE_SIZE})
        return arco.run(dataclasses.replace(args, **arm_credit(options)), hooks=[study_hook(args)])


@contextlib.contextmanager
def held(run_dir: Path):
    """Plumbing: an exclusive lock on <run_dir>/running.lock (holding the owner's process id) while the run runs;
    the system drops it when its process ends, however it ends. The file stays (removing a lock file races)."""
    import fcntl
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "running.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            sys.exit(f"error: {run_dir} is being run by process {f.read().strip() or '?'}: give each lab.study process "
                     "its own --seeds or --arms (a seed's arms in parallel only once its sparse phase is done)")
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        yield


def fork_study(argv: Sequence[str], seeds: Sequence[int], arms: Sequence[str], figures: str = "") -> Path:
    base = study_args(argv)
    root = Path(base.out_dir) / base.dataset
    warm = str(root / "study-warmup")
    for seed in seeds:                       # a seed's sparse phase, then its arms: results come in whole
        for arm in arms:
            parent, own = ARMS[arm]
            flags, options = split_settings(own(base) if callable(own) else own)
            sparse = run_once(study_args(argv, **SPARSE[parent], epochs=base.sparse_epochs, warmup_dir=warm,
                                         seed=seed, name=f"{parent}-s{seed}"))
            fork_at = sparse / "checkpoints" / f"epoch_{base.sparse_epochs}"
            run_once(study_args(argv, **flags, warmup_dir=warm, seed=seed, name=f"{arm}-s{seed}",
                                init_from=str(fork_at)), options)
    # The report: every finished arm of these seeds, whichever process ran it (the one-seed arms included).
    dirs = {arm: [d for d in (root / f"{arm}-s{seed}" for seed in seeds) if (d / "selection.json").is_file()]
            for arm in ARMS}
    return fork_report(base, root, {arm: ds for arm, ds in dirs.items() if ds}, figures)


def update_aucs(run_dir: Path) -> list[dict]:
    """Per update of a run with μ, the AUC of s_t for useful vs useless steps of its own training batch, each
    batch scored by the μ that scored it (no pooling across μ states), by step type, with the update's
    decomposition error (Eq. 5's first term)."""
    mse = {(r["epoch"], r["batch"]): r.get("decomposition_mse") for r in read_jsonl(run_dir / "metrics.jsonl")
           if r["kind"] == "update"}
    out = []
    for path in sorted((run_dir / "traces").glob("epoch_*.jsonl"), key=lambda f: int(f.stem.split("_")[1])):
        batches: dict = defaultdict(list)
        for row in read_jsonl(path):                  # each step's label from the row (step_usefulness)
            batches[row["batch"]] += [(st, u) for st, u in zip(row["steps"], step_usefulness(row)) if "s" in st]
        epoch = int(path.stem.split("_")[1])
        for b, steps in sorted(batches.items()):
            out.append({"epoch": epoch, "batch": b, "decomposition_mse": mse.get((epoch, b)), **auc_by_step_type(
                [st["s"] for st, _ in steps], [u for _, u in steps],
                [st.get("action") if st.get("valid") else None for st, _ in steps])})
    return out


def fork_mu_auc(base: arco.Args, warm: Path, forks: Iterable[Path], path: Path) -> dict:
    """μ's step AUC at the fork, held out: per seed, the μ of the sparse run's checkpoint at the fork (co-evolved
    by Eq. 5 on π's rollouts) and the warmup μ it started from, each reading its own greedy rubric, on the
    ladder's 100 dev questions played by π_sft (the ladder's probe: μ before RL) and by π at the fork (the same
    questions and sampling seeds), with the position-only baseline on the same steps. Kept in `path` by
    "<μ> on <player>"; a pair already there is not measured again (the seeds' processes share the file)."""
    done = json.loads(path.read_text()) if path.is_file() else {}
    trajs: dict = {}
    for fork in forks:
        run = fork.parent.parent
        start = warm / mu_dir_name(json.loads((run / "args.json").read_text()))
        label = f"{run.name}/{fork.name}"
        for mu_dir, mu_name in ((start, start.name), (fork / "mu", label)):
            for policy, player in ((None, "pi_sft"), (fork / "pi", label)):
                key = f"{mu_name} on {player}"
                if key in done:
                    continue
                if player not in trajs:
                    retriever = env.shared_retriever(base.retriever or None, base.retriever_pooling)
                    trajs[player] = policy_dev_rollouts(base, warm, retriever, policy)
                print(f"[study] μ's AUC at the fork: {key}", flush=True)
                mu = rubric_model.RubricModel.load(mu_dir, **loading(base))
                row = {"mu": mu_name, "player": player, "position": position_auc(trajs[player]),
                       **policy_dev_auc(mu, trajs[player], base.gen_batch, base.max_new_tokens_mu)}
                del mu
                done = keep_row(path, key, row)
    return done


def fork_mu_markdown(done: dict) -> str:
    return auc_table(["μ", "rollouts of"], (([d["mu"], d["player"]], d) for d in done.values()))


def credit_summary(updates: Sequence[dict]) -> dict:
    """Over a run's dense updates (metrics rows with μ's statistics): μ's mean s_t by step type and position, the
    mean correlation of Σ_t s_t − R with the trajectory's number of searches (does μ pay for length?), and the
    singleton fallback (Eq. 3–4: a bucket of one step is advantaged against its batch, not its bucket): such
    buckets per update, how many were terminal (a Finish's), and the mean advantage those Finishes got."""
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None
    by_step = defaultdict(list)
    for u in updates:
        for k, v in (u.get("mean_s_by_step") or {}).items():
            by_step[k].append(v)
    singles = [b for u in updates for b in u.get("singleton_buckets") or []]
    finishes = [b["A"] for b in singles if b.get("action") == "finish"]
    return {"updates": len(updates), "mean_s_by_step": {k: mean(v) for k, v in sorted(by_step.items())},
            "corr_excess_searches": mean([u.get("corr_excess_searches") for u in updates]),
            "singletons_per_update": len(singles) / len(updates) if updates else None,
            "finish_singletons_per_update": len(finishes) / len(updates) if updates else None,
            "finish_singleton_A": mean(finishes)}


def credit_room(rows: Iterable[dict]) -> dict:
    """How much room step credit has in a policy's trajectories (trace rows): the share of failed ones (R = 0)
    holding a useful step followed later by a useless one — where outcome credit blames the useful step
    with the rest and step credit need not."""
    failed = [r for r in rows if not r["reward"]]
    room = 0
    for r in failed:
        useful = step_usefulness(r)
        room += any(u and not v for i, u in enumerate(useful) for v in useful[i + 1:])
    return {"failed": len(failed), "useful_then_useless": room, "share": room / len(failed) if failed else None}


def dev_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(updates made before it, dev EM) of every evaluation of a run, all on the curve's slice (the first
    --curve-size dev questions): the --eval-every points, and each epoch-end evaluation's EM on those same
    questions (its traces; the evaluation's own EM covers --eval-size questions, shown in the table)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    size = run_settings(run_dir).get("curve_size")
    done = lambda e, b: sum(r["kind"] == "update" and (r["epoch"], r["batch"]) <= (e, b) for r in rows)  # noqa: E731

    def on_slice(r: dict) -> float:
        traces = run_dir / "traces" / f"eval_epoch_{r['epoch']}.jsonl"
        if r["kind"] == "curve" or not size or not traces.is_file():
            return r["em"]
        first = read_jsonl(traces)[:size]               # an evaluation's traces keep the dev order
        return 100.0 * sum(t["reward"] for t in first) / len(first)
    return [(done(r["epoch"], r["batch"] if r["kind"] == "curve" else 10 ** 9), on_slice(r))
            for r in rows if r["kind"] in ("eval", "curve")]


def train_reward(run_dir: Path, window: int = 4) -> list[tuple[int, float]]:
    """(update, mean R(τ) of the training rollouts over the last `window` updates): one update's 8 rollouts are
    too few to read (the per-update values are in metrics.jsonl)."""
    rs = [r["mean_R"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "update"]
    last = [rs[max(0, i - window):i] for i in range(1, len(rs) + 1)]
    return [(i, sum(xs) / len(xs)) for i, xs in enumerate(last, 1)]


def study_curves(dirs: dict[str, list[Path]], sparse_of: dict[Path, Path], curve) -> dict[str, list]:
    """`curve` of each sparse phase once ("sparse phase", its seeds), then of each arm from its fork on
    (`sparse_of`: the sparse run each arm's run forked from)."""
    shared = {p: curve(p) for p in dict.fromkeys(sparse_of[d] for ds in dirs.values() for d in ds)}   # arms' order
    out: dict[str, list] = defaultdict(list)
    for p, points in shared.items():
        out["sparse phase" + (", rubric-free μ" if p.name.startswith("sparse-norubric") else "")].append(points)
    for arm, ds in dirs.items():
        out[arm] = [[(x, y) for x, y in curve(d) if x >= shared[sparse_of[d]][-1][0]] for d in ds]
    return dict(out)


# The arms as the README's and RESULTS' tables name them (the figures' legends say the same).
ARM_LABELS = {"outcome": "outcome RL continuing", "outcome-dense": "the control: outcome RL at ARCO's dense rate and λ_π",
              "arco": "ARCO", "mixed": "mixed: outcome + α·μ's dense advantage", "causal-oracle": "causal oracle",
              "projection-oracle": "projection oracle", "arco-norubric": "ARCO w/o Rubric"}


def plot_curves(curves: dict[str, list[list[tuple[int, float]]]], path: Path, title: str, ylabel: str):
    """Per arm: each seed a thin line, the mean over seeds a thick one (points where every seed has one); the
    sparse phases in grey; the fork (the dense transition, where the arms start) a dashed line. Legends name the
    arms as the tables do (ARM_LABELS), in type legible at half a page's width."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(9, 5.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    arms = [arm for arm in curves if not arm.startswith("sparse")]
    for arm, series in curves.items():
        color = f"C{arms.index(arm)}" if arm in arms else ("0.35" if arm == "sparse phase" else "0.65")
        for s in series:
            ax.plot([x for x, _ in s], [y for _, y in s], color=color, linewidth=0.8, alpha=0.45)
        xs = sorted(set.intersection(*[{x for x, _ in s} for s in series])) if series else []
        mean = [sum(dict(s)[x] for s in series) / len(series) for x in xs]
        ax.plot(xs, mean, color=color, linewidth=2.6, marker="o", markersize=4,
                label=f"{ARM_LABELS.get(arm, arm)} ({len(series)} seed{'s' if len(series) > 1 else ''})")
    starts = [s[0][0] for arm in arms for s in curves[arm] if s]
    if starts:
        ax.axvline(min(starts), color="0.2", linestyle="--", linewidth=1.2)
        ax.annotate("fork: the dense transition", (min(starts), 1.0), xycoords=("data", "axes fraction"),
                    xytext=(4, -14), textcoords="offset points", fontsize=12)
    ax.set_title(title, fontsize=14)
    ax.set_xlabel("update", fontsize=13)
    ax.set_ylabel(ylabel, fontsize=13)
    ax.tick_params(labelsize=12)
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return fig


def fork_report(base: arco.Args, root: Path, dirs: dict[str, list[Path]], figures: str) -> Path:
    """The fork study's table, μ's AUC through the sparse phase and after the fork, the per-update credit
    statistics and the curves, into <root>/study/fork.md, fork.json and the two images."""
    out = root / "study"
    runs = [d for ds in dirs.values() for d in ds]
    # The comparison table (paired intervals against outcome RL of the same seed) is lab.diagnostics', run as
    # the command a reader would type; it writes comparison.md/.json into the first run's folder.
    subprocess.run([sys.executable, "-m", "lab.diagnostics", "--run", *(str(r.resolve()) for r in runs),
                    "--device", base.device, "--dtype", base.dtype] + (["--data-dir", base.data_dir] if base.data_dir
                                                                        else []), check=True,
                   cwd=Path(__file__).resolve().parent.parent)
    comp = json.loads((runs[0] / "comparison.json").read_text())
    md = "# The fork study (issue 41)\n\n" + (runs[0] / "comparison.md").read_text()
    saved = {d: run_settings(d) for d in runs}                                   # each run's own settings
    forks = sorted({Path(a["init_from"]) for a in saved.values()})
    sparse_of = {d: Path(a["init_from"]).parent.parent for d, a in saved.items()}
    aucs = {p.name: update_aucs(p) for p in sorted(set(sparse_of.values())) if (p / "checkpoints").is_dir()}
    aucs.update({d.name: update_aucs(d) for d in runs if (d / "traces").is_dir() and saved[d]["reward"] == "arco"
                 and saved[d]["credit"] == "mu"})
    fork_mu = fork_mu_auc(base, root / "study-warmup", forks, out / "fork_mu.json")
    md += ("\nμ's step AUC at the fork, held out: the warmup μ and each seed's μ at the fork, each writing its own "
           f"rubric, on {POLICY_PROBE_QUESTIONS} dev questions played once by π_sft and by π at the fork "
           "(the same questions and sampling seeds):\n\n" + fork_mu_markdown(fork_mu))
    md += "\nμ through the sparse phase and after the fork, per update (decomposition error; step AUC search / finish):\n\n"
    for name, rows in aucs.items():
        md += f"- {name}: " + "; ".join(f"{fmt(r['decomposition_mse'])} {fmt(r['search'])}/{fmt(r['finish'])}"
                                        for r in rows) + "\n"
    # The oracles' Σ_t s_t = R by construction: logs written before credit_stats knew it correlate rounding
    # error with length, so their correlation is dropped here.
    exact = {d.name for d in runs if saved[d]["credit"] != "mu"}
    stats = {d.name: [{k: None if k == "corr_excess_searches" and d.name in exact else r.get(k)
                       for k in ("epoch", "batch", "dense", "mean_s_by_step", "corr_excess_searches", "singleton_buckets")}
                      for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == "update" and "mean_s_by_step" in r]
             for d in runs}
    summary = {name: credit_summary([r for r in rows if r["dense"]]) for name, rows in stats.items()
               if any(r["dense"] for r in rows)}
    md += ("\nμ's credit over each arm's dense updates: corr(Σ s − R, searches), mean over updates (> 0: μ pays for "
           "length); singleton buckets per update (terminal ones, and the mean advantage of their Finish); μ's mean "
           "s_t by step and position:\n\n")
    for name, c in summary.items():
        md += (f"- {name} ({c['updates']} updates): corr {fmt(c['corr_excess_searches'])}; singletons "
               f"{fmt(c['singletons_per_update'])} (terminal {fmt(c['finish_singletons_per_update'])}, A "
               f"{fmt(c['finish_singleton_A'])}); s̄ " + ", ".join(f"{k} {v:+.2f}" for k, v in
                                                                 c["mean_s_by_step"].items()) + "\n")
    curves, rewards = (study_curves(dirs, sparse_of, curve) for curve in (dev_curve, train_reward))
    for folder in [out] + ([Path(figures)] if figures else []):
        plot_curves(curves, folder / "study_dev_em.png", f"dev EM on {CURVE_SIZE} questions "
                    "(thin: seeds; thick: mean)", "EM (%)")
        plot_curves(rewards, folder / "study_train_reward.png", "mean R(τ) of the training rollouts, last 4 "
                    "updates (thin: seeds; thick: mean)", "mean R")
    out.mkdir(parents=True, exist_ok=True)
    (out / "fork.md").write_text(md, encoding="utf-8")
    write_json(out / "fork.json", {"comparison": comp, "fork_mu": fork_mu, "update_aucs": aucs,
                                       "credit_stats": stats, "credit_summary": summary, "curves": curves})
    print(md)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    pre = argparse.ArgumentParser(prog="python -m lab.study", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = pre.add_subparsers(dest="program", required=True)
    lad = sub.add_parser("ladder", help="the μ-quality ladder (no RL)")
    lad.add_argument("--rows", nargs="+", default=list(LADDER), choices=list(LADDER))
    fk = sub.add_parser("fork", help="sparse, then fork: the arms against outcome RL")
    fk.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    fk.add_argument("--arms", nargs="+", default=["outcome", "arco", "mixed", "causal-oracle"], choices=list(ARMS))
    fk.add_argument("--figures", default="", help="also write the learning curves here (the README's figures/)")
    own, rest = pre.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if own.program == "ladder":
        ladder(rest, own.rows)
    else:
        fork_study(rest, own.seeds, own.arms, own.figures)


if __name__ == "__main__":
    main_guard(main, DataError, ModelLoadError)
