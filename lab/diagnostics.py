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
import functools
import html
import json
import random
import re
import string
import sys
import threading
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

import arco
import env
import rubric_model
from evaluate import auc, average_ranks, exact_match, f1_score, format_table, report_predictions
from infra import models
from infra.data import GENERATED, DataError, find_data_file
from infra.engines import ENGINES
from infra.files import read_jsonl, write_json, write_jsonl
from infra.oracle import OracleTeacher, evidence_found
from infra.openai_teacher import chat_completion
from infra.passes import policy_act
from infra.runs import trace_rows
from infra.settings import DATASETS, DataSettings, Split, fill_from_preset, main_guard, parse_args
from infra.teachers import TeacherError
from infra.warmups import mu_dir_name
from lab.truth import step_usefulness


@dataclass
class Args(DataSettings, Split):
    """The command line: the shared settings (infra.settings.DataSettings, --split), then its own."""
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
        "help": "questions measured by --check-retrieval / --check-gold / --predictions (0 = the whole split; "
                "synthetic: 200)"})
    check_files: bool = field(default=False, metadata={
        "help": "load every data file asked for (--dataset all --split all: every one): questions loaded and skipped"})
    predictions: str = field(default="", metadata={"path": "file", "help": 'score this JSONL of {"id": ..., "answer": ...} '
                                                  "against --dataset/--split (EM, F1, per question type)"})

    def __post_init__(self):
        fill_from_preset(self)
        self.split = self.split or "dev"


# --------------------------------------------------------------------------- checks of the data and the oracle teacher
def retrieval_hit_rate(examples: list, retriever) -> dict:
    """Query = the title of a supporting paragraph; hit = the top-1 paragraph is a supporting one."""
    pairs = [(ex, ex.paragraphs[i][0], i) for ex in examples for i in ex.supporting]
    got = retriever.retrieve([ex for ex, _, _ in pairs], [q for _, q, _ in pairs])
    hits = sum(g in ex.supporting for (ex, _, _), g in zip(pairs, got))
    same = sum(g == i for (_, _, i), g in zip(pairs, got))
    n = max(len(pairs), 1)
    return {"queries": len(pairs), "supporting_hit": hits / n, "same_paragraph": same / n}


def gold_evidence_rate(examples: Sequence, retriever, obs_chars: int = 400) -> dict:
    """Play the oracle's gold trajectory on every example and measure the evidence it retrieved.

    `all_evidence`: share of questions whose searches retrieved every supporting paragraph;
    `fits_budget`: questions with no more supporting paragraphs than searches (2Wiki
    bridge_comparison needs 4 with a budget of 3) and the share of those with all evidence.
    """
    teacher = OracleTeacher(env, obs_chars=obs_chars)
    trajs, metas = teacher.rollout([(ex, 0) for ex in examples], retriever)
    found = [evidence_found(t) for t in trajs]
    fits = [m["evidence_fits_budget"] for m in metas]
    n, nf = len(trajs), sum(fits)
    by_type = {}
    for ty in sorted({t.example.type for t in trajs}):
        idx = [i for i, t in enumerate(trajs) if t.example.type == ty]
        by_type[ty] = {"n": len(idx), "all_evidence": sum(found[i] for i in idx) / len(idx)}
    return {"questions": n, "all_evidence": sum(found) / max(n, 1), "reward": sum(t.reward for t in trajs) / max(n, 1),
            "fits_budget": nf, "all_evidence_when_fits": sum(f for f, ok in zip(found, fits) if ok) / max(nf, 1),
            "by_type": by_type}


def check_data(args) -> None:
    """--check-retrieval: how often a supporting paragraph's title, as a query, retrieves a supporting paragraph;
    --check-gold: how often the oracle teacher's gold trajectories retrieve every supporting paragraph."""
    retriever = env.Retriever(args.retriever or None, pooling=args.retriever_pooling)
    for ds in (DATASETS if args.dataset == "all" else [args.dataset]):
        for sp in (("train", "dev") if args.split == "all" else [args.split]):
            examples = env.load_split(ds, sp, args.data_dir or None, args.check_size or None, args.seed)
            if args.check_retrieval:
                r = retrieval_hit_rate(examples, retriever)
                print(f"{ds}/{sp}: {r['queries']} supporting-title queries, supporting paragraph retrieved "
                      f"{100 * r['supporting_hit']:.1f}%, the titled paragraph itself {100 * r['same_paragraph']:.1f}%")
            if args.check_gold:
                r = gold_evidence_rate(examples, retriever)
                print(f"{ds}/{sp}: {r['questions']} questions; the gold trajectory retrieved every supporting "
                      f"paragraph for {100 * r['all_evidence']:.1f}% (R = 1 for {100 * r['reward']:.1f}%); "
                      f"{r['fits_budget']} need no more searches than the budget ({env.DEFAULT_MAX_SEARCHES[ds]}), "
                      f"{100 * r['all_evidence_when_fits']:.1f}% of those; by type: "
                      + ", ".join(f"{t} {100 * v['all_evidence']:.0f}% of {v['n']}" for t, v in r["by_type"].items()))


# --------------------------------------------------------------------------- diagnostics: statistics (issue 6)
# Small pure functions behind the diagnostics of μ (RQ3, RQ4, and the judge / credit-assignment
# checks): ranks, AUC, κ, false passes, confidence intervals, step-binding items, rubric
# redundancy, and which synthetic steps were useful. Plain Python; numpy only in `redundancy`.

def cohen_kappa(pred: Sequence[bool | int], truth: Sequence[bool | int]) -> float | None:
    """Cohen's κ of two binary labelings: (p_o − p_e) / (1 − p_e), p_o the observed agreement,
    p_e the agreement expected from the two marginals. None when undefined: no items, or
    p_e = 1 (both sides constant and equal)."""
    if len(pred) != len(truth):
        raise ValueError(f"cohen_kappa: {len(pred)} predictions but {len(truth)} labels")
    n = len(pred)
    if n == 0:
        return None
    a, b = [bool(x) for x in pred], [bool(y) for y in truth]
    p_o = sum(x == y for x, y in zip(a, b)) / n
    pa, pb = sum(a) / n, sum(b) / n
    p_e = pa * pb + (1 - pa) * (1 - pb)
    return None if p_e == 1 else (p_o - p_e) / (1 - p_e)


def judge_stats(pred_pass: Sequence[bool | int], truth_pass: Sequence[bool | int]) -> dict:
    """How a pass/fail judge agrees with the true outcome (RubricForge's false-pass lens).

    false_pass_rate = share of truly failed trajectories the judge passes (the dangerous error:
    it certifies a broken agent); false_fail_rate = share of truly passing ones it fails. Each
    is None when its denominator is empty; agreement and kappa are None with no items.
    """
    if len(pred_pass) != len(truth_pass):
        raise ValueError(f"judge_stats: {len(pred_pass)} verdicts but {len(truth_pass)} labels")
    pairs = [(bool(p), bool(t)) for p, t in zip(pred_pass, truth_pass)]
    tp = sum(p and t for p, t in pairs)
    fp = sum(p and not t for p, t in pairs)          # false passes
    fn = sum(t and not p for p, t in pairs)          # false fails
    tn = len(pairs) - tp - fp - fn
    return {"n": len(pairs), "agreement": (tp + tn) / len(pairs) if pairs else None,
            "kappa": cohen_kappa(pred_pass, truth_pass),
            "false_pass_rate": fp / (fp + tn) if fp + tn else None,
            "false_fail_rate": fn / (fn + tp) if fn + tp else None,
            "true_pass": tp, "false_pass": fp, "true_fail": tn, "false_fail": fn}


def best_threshold(scores: Sequence[float], labels: Sequence[bool | int]) -> float:
    """The threshold on `scores` that maximizes agreement with `labels` (fit it on train data).

    A score passes when score > threshold. Candidates: −inf (everything passes), the midpoint
    between each pair of consecutive distinct scores, and +inf (nothing passes). Ties in
    agreement go to the HIGHEST candidate, the strictest judge: fewer false passes.
    """
    if len(scores) != len(labels):
        raise ValueError(f"best_threshold: {len(scores)} scores but {len(labels)} labels")
    if not scores:
        raise ValueError("best_threshold: no scores")
    counts: dict[float, list[int]] = defaultdict(lambda: [0, 0])  # score -> [negatives, positives]
    for s, y in zip(scores, labels):
        counts[s][bool(y)] += 1
    values = sorted(counts)
    correct = sum(bool(y) for y in labels)                     # threshold −inf: all pass
    best, best_thr = correct, float("-inf")
    for j, v in enumerate(values):                            # the threshold moves just above v
        correct += counts[v][0] - counts[v][1]
        thr = (v + values[j + 1]) / 2 if j + 1 < len(values) else float("inf")
        if correct >= best:                                   # >=: a later (higher) one wins ties
            best, best_thr = correct, thr
    return best_thr


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's ρ: Pearson correlation of the average ranks (ties share a rank). None when
    either side is constant or there are fewer than 2 items."""
    if len(x) != len(y):
        raise ValueError(f"spearman: {len(x)} vs {len(y)} values")
    if len(x) < 2:
        return None
    rx, ry = average_ranks(x), average_ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / (sxx * syy) ** 0.5


Z95 = 1.96  # two-sided 95% normal quantile, used by every interval below


def proportion_ci(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n (stays inside [0, 1] and is sensible at
    k = 0 or k = n, unlike p ± z·√(p(1−p)/n)). Tables report ± its half-width, (high − low) / 2,
    as Table 3 (RQ3) gives Bind ± 95% CI half-widths."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"proportion_ci: need 0 <= k <= n and n > 0, got k={k}, n={n}")
    p, z2 = k / n, z * z
    center = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * (p * (1 - p) / n + z2 / (4 * n * n)) ** 0.5
    return max(0.0, center - half), min(1.0, center + half)


def mean_ci(values: Sequence[float], z: float = Z95) -> tuple[float, float]:
    """(mean, half-width) of the normal-approximation 95% interval mean ± z·sd/√n, with the
    sample sd (n − 1 denominator). With one value the half-width is 0 (no spread to measure)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_ci: no values")
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
    return mean, z * sd / n ** 0.5


def _norm_text(s: str) -> str:
    """Strip and collapse whitespace: two texts equal after this are the same action / criterion."""
    return " ".join(str(s).split())


def binding_item(actions: Sequence[str], t: int, rng: Any) -> tuple[list[str], int] | None:
    """One step-binding item (RQ3, §4.4): the gold is actions[t], the action the rubric of step t
    was written for; the distractors are up to three other distinct actions of the SAME
    trajectory (`actions` = every step's action text, e.g. Step.action_text()).

    Texts are compared and returned whitespace-normalized (`_norm_text`). Distractors never equal
    the gold and are distinct; with more than three, `rng` (a random.Random) samples three, then
    shuffles the candidates. Fewer than three distractors give fewer candidates (chance is then
    1 / len(candidates), not 25%); none gives None (the item is skipped).
    Returns (candidates, index of the gold among them).
    """
    gold = _norm_text(actions[t])
    pool = []
    for j, a in enumerate(actions):
        a = _norm_text(a)
        if j != t and a != gold and a not in pool:
            pool.append(a)
    if not pool:
        return None
    candidates = rng.sample(pool, min(3, len(pool))) + [gold]
    rng.shuffle(candidates)
    return candidates, candidates.index(gold)


def redundancy(criteria: Sequence[str], vectors: Any, scores: Sequence[float],
               threshold: float = 0.8) -> dict:
    """Redundancy of one step's K criteria (RQ4, §4.5, Fig. 3B–C and 4).

    Themes are clusters of the criteria's embeddings (`vectors`: K rows, any dimension), formed
    greedily in order: a criterion joins the first earlier cluster whose FIRST member has cosine
    ≥ `threshold` with it, else starts a new one (the paper runs K-Means; this needs no K and is
    deterministic). Returns k, themes, theme_ratio (themes / K), exact_duplicate_rate (share of
    criteria whose `_norm_text` equals an earlier one's), paraphrase_duplicate_rate (share that
    joined an existing cluster: every semantic duplicate, exact ones included), and score_range
    (largest max − min of `scores` (μ's d_t) within a cluster of ≥ 2 criteria; None if none).
    Rates are None when K = 0. A zero vector has cosine 0 with everything.
    """
    k = len(criteria)
    if len(scores) != k or len(vectors) != k:
        raise ValueError(f"redundancy: {k} criteria, {len(vectors)} vectors, {len(scores)} scores")
    if k == 0:
        return {"k": 0, "themes": 0, "theme_ratio": None, "exact_duplicate_rate": None,
                "paraphrase_duplicate_rate": None, "score_range": None}
    v = np.asarray(vectors, dtype=float).reshape(k, -1)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    unit = np.divide(v, norms, out=np.zeros_like(v), where=norms > 0)
    clusters: list[list[int]] = []
    joined = exact = 0
    seen: set[str] = set()
    for i in range(k):
        text = _norm_text(criteria[i])
        exact += text in seen
        seen.add(text)
        home = next((c for c in clusters if float(unit[c[0]] @ unit[i]) >= threshold), None)
        if home is None:
            clusters.append([i])
        else:
            home.append(i)
            joined += 1
    ranges = [max(scores[i] for i in c) - min(scores[i] for i in c) for c in clusters if len(c) >= 2]
    return {"k": k, "themes": len(clusters), "theme_ratio": len(clusters) / k,
            "exact_duplicate_rate": exact / k, "paraphrase_duplicate_rate": joined / k,
            "score_range": float(max(ranges)) if ranges else None}


def redundancy_summary(per_step: Sequence[dict]) -> dict:
    """Means over steps of each `redundancy` number (Fig. 3B–C average over dev steps); a step
    whose value is None (K = 0, or no cluster of ≥ 2 for score_range) is left out of that mean,
    whose count is kept as `n_<key>`. `steps` is the number of steps given."""
    out: dict[str, Any] = {"steps": len(per_step)}
    for key in ("k", "themes", "theme_ratio", "exact_duplicate_rate", "paraphrase_duplicate_rate", "score_range"):
        vals = [r[key] for r in per_step if r.get(key) is not None]
        out[key] = sum(vals) / len(vals) if vals else None
        out[f"n_{key}"] = len(vals)
    return out


# --------------------------------------------------------------------------- diagnostics: judges, page, plots (issue 6)

# §4.4 (RQ3). Our own prompt wording: the paper shows its prompts only as figures (Fig. 11–12).
_BIND_SYSTEM = ("You check evaluation checklists. Each checklist was written to grade exactly one action of a "
                "question-answering agent, and you find which action that was.")
_BIND_USER = """An agent answers questions by searching a collection of passages (Search[query]) and by giving a final answer (Finish[answer]). Someone wrote the checklist below to grade ONE of the agent's actions. Exactly one of the {n} candidate actions is that action; the others come from the same episode.

Checklist:
{criteria}

Candidate actions:
{candidates}

Which candidate was the checklist written for? Choose the one whose target (entity, relation, missing fact, or answer) and type (search or final answer) the checklist describes most closely. Reply with the letter only ({letters})."""

_SPEC_SYSTEM = ("You rate evaluation checklists for how closely they are tied to the particular action they grade. "
                "Reply with one digit.")
_SPEC_USER = """An agent answers questions by searching a collection of passages (Search[query]) and by giving a final answer (Finish[answer]). Below are the question, what the agent did before, the action being graded, and the checklist written to grade it.

Question: {question}

Earlier steps:
{prefix}

Action being graded: {action}

Checklist:
{criteria}

How specific is the checklist to THIS action at THIS point of the episode?
5 = every item names what this action should achieve here (its entity, relation, missing fact or answer)
4 = mostly specific; one item is generic
3 = a mix of specific and generic items
2 = mostly generic; it would fit many other actions just as well
1 = generic or unrelated to the action
Reply with the digit only (1-5)."""


def _numbered(items: Sequence[str]) -> str:
    return "\n".join(f"{i}. {c}" for i, c in enumerate(items, 1)) or "(empty)"


def bind_messages(criteria: Sequence[str], candidates: Sequence[str]) -> list[dict]:
    """RQ3 Bind prompt (§4.4): the rubric and the lettered candidates only; no question, no prefix."""
    letters = string.ascii_uppercase[:len(candidates)]
    user = _BIND_USER.format(n=len(candidates), criteria=_numbered(criteria),
                             candidates="\n".join(f"{x}. {a}" for x, a in zip(letters, candidates)),
                             letters=", ".join(letters))
    return [{"role": "system", "content": _BIND_SYSTEM}, {"role": "user", "content": user}]


def spec_messages(question: str, prefix: str, action: str, criteria: Sequence[str]) -> list[dict]:
    """RQ3 Spec prompt (§4.4): question, trajectory prefix h_t, gold action a_t and rubric r_t."""
    user = _SPEC_USER.format(question=question, prefix=prefix.strip() or "(none: this is the first step)",
                             action=action, criteria=_numbered(criteria))
    return [{"role": "system", "content": _SPEC_SYSTEM}, {"role": "user", "content": user}]


_WRAPPING = "*_`'\"()[]{}<> \t\r\n.:"  # markdown, brackets, quotes, a trailing period or colon


def parse_choice(reply: str, n: int) -> int | None:
    """The 0-based candidate a Bind reply names, or None if it names none clearly.

    Read in order: (1) a reply that is one letter or one whole number once markdown, brackets,
    quotes and a trailing period are stripped ('B', '(b)', '**B.**', '2'; numbers count from 1);
    (2) 'answer|option|choice|candidate [is] [:] X', when every such phrase gives the same X;
    (3) the one capital among the first n letters that stands alone in the reply ('B. Search[…]'),
    when no other of them does. The index may lie outside 0..n−1 ('E', '7'): the caller checks.
    """
    core = reply.strip(_WRAPPING)
    if re.fullmatch(r"[A-Za-z]", core):
        return string.ascii_uppercase.index(core.upper())
    if re.fullmatch(r"\d+", core):
        return int(core) - 1
    said = set(re.findall(r"(?i:answer|option|choice|candidate)\s*(?:is\s*)?[:=]?\s*[*(\[]*([A-Z]|\d+)\b", reply))
    if len(said) == 1:
        x = said.pop()
        return int(x) - 1 if x.isdigit() else string.ascii_uppercase.index(x)
    alone = set(re.findall(rf"\b([{string.ascii_uppercase[:n]}])\b", reply)) if n > 0 else set()
    return string.ascii_uppercase.index(alone.pop()) if len(alone) == 1 else None


def parse_rating(reply: str) -> int | None:
    """The whole number a Spec reply gives, or None if it gives none clearly (range unchecked).

    Read in order: (1) a reply that is one whole number once markdown and a trailing period
    are stripped ('4', '**4**', '4.'); (2) 'N/5' or 'N out of 5'; (3) 'rating|score|specificity
    [is] [:] N'; (4) the one whole number standing alone in the reply. A decimal ('4.5'), a word
    ('four') or two different numbers give None.
    """
    core = reply.strip(_WRAPPING)
    if re.fullmatch(r"\d+", core):
        return int(core)
    for pattern in (r"(?<![\d.])(\d+)\s*(?:/|out of)\s*5\b",
                    r"(?i:rating|score|specificity)\s*(?:is\s*)?[:=]?\s*\**\s*(\d+)(?!\.?\d)"):
        found = set(re.findall(pattern, reply))
        if len(found) == 1:
            return int(found.pop())
    alone = set(re.findall(r"(?<!\d)(?<!\d\.)(\d+)(?!\.?\d)", reply))
    return int(alone.pop()) if len(alone) == 1 else None


class OpenAIJudge:
    """The RQ3 judge (§4.4; the paper used gpt-4o-mini) on any OpenAI-compatible endpoint.

    `bind` and `spec` return None when the item cannot be scored: the reply is malformed or out
    of range, or the API still fails after `max_retries` retries (HTTP 408/409/429/5xx, timeouts
    and connection errors are retried after backoff·2^attempt s; other errors are not). An
    unscored item is counted in `counters`, never as right or wrong. The key is `api_key` or
    $OPENAI_API_KEY, the endpoint `base_url` or $OPENAI_BASE_URL; the key is kept out of errors.
    """

    def __init__(self, model: str = "gpt-4o-mini", base_url: str | None = None, api_key: str | None = None,
                 timeout: float = 60.0, max_retries: int = 3, backoff: float = 1.0, max_tokens: int = 16):
        import openai
        try:
            self.client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=0)
        except openai.OpenAIError as e:
            raise ValueError(f"cannot start the judge's API client ({e}); set OPENAI_API_KEY, and OPENAI_BASE_URL "
                             f"for a server other than OpenAI's") from None
        self.model, self.max_retries, self.backoff, self.max_tokens = model, max_retries, backoff, max_tokens
        self.counters: Counter = Counter()
        self.last_error = ""
        self.lock = threading.Lock()

    def _count(self, key: str, k: int = 1) -> None:
        with self.lock:
            self.counters[key] += k

    def chat(self, messages: list[dict]) -> str | None:
        """One greedy completion (teachers.chat_completion, with its retries); None when the API fails for good."""
        try:
            return chat_completion(self.client, self.model, messages, 0.0, self.max_tokens, self.max_retries,
                                          self.backoff, self.counters, self.lock)
        except TeacherError as e:
            self.last_error = str(e)
            return None

    def _judged(self, reply: str | None, value: int | None, lo: int, hi: int) -> int | None:
        if reply is None:
            why = "api_error"
        elif value is None:
            why = "malformed"
        elif not lo <= value <= hi:
            why = "out_of_range"
        else:
            self._count("scored")
            return value
        self._count("unscored")
        self._count(why)
        return None

    def bind(self, criteria: Sequence[str], candidates: Sequence[str]) -> int | None:
        """Bind (§4.4): the index of the candidate action the rubric was written for, or None (unscored)."""
        if not 2 <= len(candidates) <= 26:
            raise ValueError(f"Bind needs 2 to 26 candidate actions, got {len(candidates)}")
        reply = self.chat(bind_messages(criteria, candidates))
        return self._judged(reply, None if reply is None else parse_choice(reply, len(candidates)),
                            0, len(candidates) - 1)

    def spec(self, question: str, prefix: str, action: str, criteria: Sequence[str]) -> int | None:
        """Spec (§4.4): how specifically the rubric evaluates `action`, 1–5, or None (unscored)."""
        reply = self.chat(spec_messages(question, prefix, action, criteria))
        return self._judged(reply, None if reply is None else parse_rating(reply), 1, 5)


def embedding_bind(encode, criteria: Sequence[str], candidates: Sequence[str]) -> int:
    """Offline Bind judge: the candidate whose embedding is closest (cosine) to the rubric's.

    `encode(list[str])` returns an (n, dim) array or tensor, e.g. env.Retriever().encode. The
    rubric is its criteria joined into one text. Ties go to the first candidate.
    """
    v = np.asarray(encode([" ".join(criteria)] + list(candidates)), dtype=np.float64)
    v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    return int(np.argmax(v[1:] @ v[0]))


# Sample trajectories as one self-contained HTML page: inline CSS, no script, no external asset.
_PAGE_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
section.traj { border: 1px solid #ccc; border-radius: 6px; padding: .6em 1em; margin: 1em 0; }
.meta { color: #666; font-size: 12px; }
ol.steps > li { margin: .5em 0; padding: .3em .6em; background: #f7f7f7; border-radius: 4px; }
li.invalid { background: #fff4e5; }
code { background: #eee; padding: 0 .25em; border-radius: 3px; }
.obs { color: #555; font-size: 12px; white-space: pre-wrap; margin: .2em 0; }
ul.criteria { margin: .2em 0; padding-left: 1.2em; }
.score { font-family: monospace; font-weight: bold; padding: 0 .3em; border-radius: 3px; }
.pos { color: #0a6b1f; background: #e3f6e7; }
.neg { color: #a4161a; background: #fde4e4; }
.zero { color: #555; background: #eee; }
"""


def _score(x: Any, label: str = "") -> str:
    """A number as a span coloured by its sign (green > 0, red < 0, grey 0); '' when absent."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return ""
    sign = "pos" if x > 0 else "neg" if x < 0 else "zero"
    return f'<span class="score {sign}">{html.escape(label)}{x:+.3f}</span>'


def _step_html(st: dict) -> str:
    e = html.escape
    action = f"{st.get('action', '').capitalize()}[{st.get('argument', '')}]" if st.get("valid", True) \
        else f"invalid ({st.get('reason', '')}): {str(st.get('output', ''))[:200]}"
    head = [f"<code>{e(action)}</code>"]
    if st.get("bucket"):
        head.append(f'<span class="meta">{e(str(st["bucket"]))}</span>')
    head += [_score(st.get(k), f"{k}_t ") for k in ("s", "G", "A")]
    criteria, d = list(st.get("criteria") or []), list(st.get("d") or [])
    items = [f"<li>{_score(d[j] if j < len(d) else None, 'd ')} {e(str(criteria[j])) if j < len(criteria) else ''}"
             f"</li>" for j in range(max(len(criteria), len(d)))]
    parts = [" ".join(h for h in head if h), f'<div class="obs">{e(str(st.get("observation", ""))[:300])}</div>']
    if items:
        parts.append('<ul class="criteria">' + "".join(items) + "</ul>")
    if st.get("rubric_text"):
        parts.append(f'<div class="obs">unparsed rubric: {e(str(st["rubric_text"]))}</div>')
    return f'<li class="step{"" if st.get("valid", True) else " invalid"}">' + "".join(parts) + "</li>"


def trajectories_html(rows: Sequence[dict], title: str = "ARCO sample trajectories") -> str:
    """One HTML page of trace rows (infra.runs.trace_rows): question, gold, answer and R, then each step's
    action, observation head, criteria with d_{t,j}, and s_t, G_t, A_t (Eq. 2–4) coloured by sign.
    Every value is HTML-escaped; the page needs no server, no network and no JavaScript."""
    e = html.escape
    body = []
    for i, row in enumerate(rows, 1):
        gold = row.get("gold", "")
        gold = " | ".join(map(str, gold)) if isinstance(gold, (list, tuple)) else str(gold)
        R = row.get("reward")
        r_cls = "pos" if isinstance(R, (int, float)) and R > 0 else "neg"  # R ∈ {0, 1}: a miss shows red
        where = " · ".join(f"{k} {row[k]}" for k in ("id", "epoch", "batch") if k in row)
        body.append(
            f'<section class="traj"><h2>Trajectory {i} <span class="meta">{e(where)}</span></h2>'
            f"<p><b>Question:</b> {e(str(row.get('question', '')))}</p>"
            f"<p><b>Gold:</b> {e(gold)} &nbsp; <b>Answer:</b> {e(str(row.get('answer', '')))} &nbsp; "
            f'<b>R:</b> <span class="score {r_cls}">{e(str(R))}</span></p>'
            f'<ol class="steps">{"".join(_step_html(st) for st in row.get("steps", []))}</ol></section>')
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
            f"<style>{_PAGE_CSS}</style></head><body><h1>{e(title)}</h1>"
            f'<p class="meta">{len(rows)} trajectories. d: criterion scores; s_t: their mean (Eq. 2); G_t: '
            f"reward-to-go; A_t: advantage (Eq. 3–4). Green &gt; 0, red &lt; 0.</p>"
            + "\n".join(body) + "</body></html>\n")


# PNG plots (matplotlib, Agg canvas, no pyplot state). Each returns its Figure so callers can check the data.
_Series = Sequence[tuple[float, float | None]]


def plot_lines(series: dict[str, _Series], path: str | Path, title: str, ylabel: str, chance: float | None = None,
               ylim: tuple[float, float] | None = None, size: tuple[float, float] = (6.4, 4.0), dpi: int = 100,
               xlabel: str = "epoch"):
    """One line per named series of (epoch, value) points (sorted; None values skipped), a dashed
    `chance` line if given, saved as PNG. The report's three: dev EM per epoch of each run (§4.2
    selects the checkpoint by peak dev EM), mean s_t per position bucket (Eq. 3–4), credit AUC."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
    fig = Figure(figsize=size, dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, points in series.items():
        pts = sorted((x, y) for x, y in points if y is not None)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=str(name))
    if chance is not None:
        ax.axhline(chance, linestyle="--", color="grey", label="chance")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return fig


def dev_em_series(metrics: Iterable[dict]) -> list[tuple[int, float]]:
    """(epoch, dev EM) pairs of a run's metrics.jsonl rows (the `kind: eval` ones)."""
    return [(r["epoch"], r["em"]) for r in metrics if r.get("kind") == "eval"]


def train_reward_series(metrics: Iterable[dict]) -> list[tuple[int, float]]:
    """(update number from 1, mean R(τ) of the update's rollouts) of a run's metrics.jsonl rows."""
    return [(i, r["mean_R"]) for i, r in enumerate((r for r in metrics if r.get("kind") == "update"), 1)]


def bucket_mean_scores(rows: Iterable[dict]) -> dict[str, list[tuple[int, float]]]:
    """{bucket: [(epoch, mean s_t)]} over the scored valid steps of trace rows (Eq. 2–4)."""
    sums: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        steps = row.get("steps", [])
        for st, b in zip(steps, arco.step_buckets([x.get("action") for x in steps], [x.get("valid") for x in steps])):
            b = st.get("bucket") or b
            if b is not None and st.get("valid") and isinstance(st.get("s"), (int, float)):
                sums[b][row.get("epoch", 0)].append(st["s"])
    rank = lambda b: (b == "terminal", int(b.rsplit("_", 1)[-1]) if b.rsplit("_", 1)[-1].isdigit() else 0, b)
    order = sorted(sums, key=rank)  # search_1, search_2, …, search_10, terminal
    return {b: [(ep, sum(v) / len(v)) for ep, v in sorted(sums[b].items())] for b in order}


# --------------------------------------------------------------------------- runs: comparison and diagnostics (issue 6)
# `python -m lab.diagnostics --run DIR [--run DIR ...] [--diagnose]`. Reads what arco.py leaves in a run folder
# (args.json, metrics.jsonl, traces/, checkpoints/, selection.json) and its warmup folder; loads models
# only where an evaluation or a μ diagnostic needs them.

_METRICS = ("n", "em", "f1", "mean_searches", "invalid_rate", "finished_rate")


class RunError(ValueError):
    """A run folder, checkpoint or option that cannot be used; the message names it."""


def question_type(t: str | None) -> str:
    """The key of the per-type breakdown: the trace row's `type`, except that MuSiQue's id prefixes
    '3hop1' / '3hop2' become the hop count '3hop'; an empty type is 'unknown'."""
    m = re.fullmatch(r"(\d+hop)\d*", t or "")
    return m.group(1) if m else (t or "unknown")


def trajectory_scores(rows: Sequence[dict]) -> dict:
    """EM and F1 (%), valid searches per question, invalid-step rate and finished rate of trace
    rows (Trajectory.to_dict()), overall and by `question_type`, computed as
    env.evaluate computes them: an unfinished trajectory scores 0."""
    def summary(rs: Sequence[dict]) -> dict:
        n = len(rs)
        steps = [st for r in rs for st in r["steps"]]
        hit = [(exact_match(r["answer"], r["gold"]), f1_score(r["answer"], r["gold"])) if r.get("finished")
               else (0.0, 0.0) for r in rs]
        return {"n": n, "em": 100 * sum(h[0] for h in hit) / max(n, 1), "f1": 100 * sum(h[1] for h in hit) / max(n, 1),
                "mean_searches": sum(st["action"] == "search" and st["valid"] for st in steps) / max(n, 1),
                "invalid_rate": sum(not st["valid"] for st in steps) / max(len(steps), 1),
                "finished_rate": sum(bool(r.get("finished")) for r in rs) / max(n, 1)}
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[question_type(r.get("type"))].append(r)
    return {**summary(rows), "by_type": {t: summary(groups[t]) for t in sorted(groups)}}


@dataclass
class Run:
    """One run folder of arco.py and the checkpoint of it being compared."""
    dir: Path
    name: str
    args: dict              # args.json: the resolved settings the run used
    checkpoint: str         # epoch_K, interrupted (a Ctrl-C checkpoint), or epoch_0 = the warmup's π SFT
    epoch: int              # the epoch that checkpoint ends (its training traces: traces/epoch_K.jsonl)
    selected: bool          # the checkpoint is selection.json's
    warmup_dir: Path

    def policy_dir(self) -> Path:
        if self.checkpoint == "epoch_0":
            return self.warmup_dir / "pi_sft"
        return self.dir / "checkpoints" / self.checkpoint / "pi"

    def warmup_mu_dir(self) -> Path:
        return self.warmup_dir / mu_dir_name(self.args)

    def mu_dirs(self) -> list[tuple[int, Path]]:
        """(epoch, folder) of μ after each finished RL epoch, in order."""
        found = []
        for p in (self.dir / "checkpoints").glob("epoch_*"):
            tail = p.name.split("_", 1)[1]
            if tail.isdigit() and (p / "mu" / "config.json").is_file():
                found.append((int(tail), p / "mu"))
        return sorted(found)

    def metrics(self) -> list[dict]:
        return read_jsonl(self.dir / "metrics.jsonl")

    def training_traces(self, epoch: int) -> list[dict]:
        return read_jsonl(self.dir / "traces" / f"epoch_{epoch}.jsonl")

    def trace_epochs(self) -> list[int]:
        return sorted(int(p.stem.split("_")[1]) for p in (self.dir / "traces").glob("epoch_*.jsonl")
                      if p.stem.split("_")[1].isdigit())

    @property
    def has_mu(self) -> bool:
        return self.args.get("reward") != "outcome" and bool(self.mu_dirs())


def open_run(folder: str | Path, checkpoint: str | None = None) -> Run:
    """A run folder and its checkpoint: `checkpoint`, else selection.json's selected epoch, else
    (an unfinished run) the last epoch checkpoint, with a warning."""
    folder = Path(folder)
    if not (folder / "args.json").is_file():
        raise RunError(f"{folder}: not a run folder (no args.json); give a folder arco.py wrote, "
                       f"runs/<dataset>/<name>")
    args = json.loads((folder / "args.json").read_text())
    if (folder / "lab.json").is_file():          # a study's run: its own options (credit, mixed, ...) beside them
        args.update(json.loads((folder / "lab.json").read_text()))
    warm = Path(args["warmup_dir"]) if args.get("warmup_dir") else folder.parent / "warmup"
    ckpts = folder / "checkpoints"
    have = sorted((p.name for p in ckpts.glob("*") if (p / "pi" / "config.json").is_file()),
                  key=lambda n: (len(n), n)) if ckpts.is_dir() else []   # epoch_2 before epoch_10
    selected = False
    if checkpoint is None:
        if (folder / "selection.json").is_file():
            checkpoint = f"epoch_{json.loads((folder / 'selection.json').read_text())['selected_epoch']}"
            selected = True
        else:
            epochs = sorted(int(c.split("_")[1]) for c in have if c.split("_")[-1].isdigit())
            if not epochs:
                raise RunError(f"{folder}: no selection.json and no finished epoch in {ckpts}")
            checkpoint = f"epoch_{epochs[-1]}"
            print(f"warning: {folder} has no selection.json (an unfinished run?): using its last checkpoint, "
                  f"{checkpoint}", file=sys.stderr)
    if checkpoint == "epoch_0":
        epoch = 0
        if not (warm / "pi_sft" / "config.json").is_file():
            raise RunError(f"{folder}: checkpoint epoch_0 is the warmup's π SFT, but {warm / 'pi_sft'} is missing")
    elif checkpoint == "interrupted" and checkpoint in have:
        epoch = json.loads((ckpts / checkpoint / "state.json").read_text())["epoch"]
    elif re.fullmatch(r"epoch_\d+", checkpoint):
        epoch = int(checkpoint.split("_")[1])
        if checkpoint not in have and not selected:   # a selected one may be gone: its evaluation is kept
            raise RunError(f"{folder}: no checkpoint {checkpoint} (it has: {', '.join(have) or 'none'})")
    else:
        raise RunError(f"{folder}: no checkpoint {checkpoint!r}; give epoch_K (it has: {', '.join(have) or 'none'})")
    return Run(folder, folder.name, args, checkpoint, epoch, selected, warm)


@functools.cache
def _retriever():
    """The retriever (MiniLM and its index cache), built once per command and only if needed."""
    return env.Retriever()


def evaluation(run: Run, split: str, data_dir: str | None, device: str, reevaluate: bool, dtype: str = "auto") -> dict:
    """Greedy scores of the run's checkpoint on `split` (the _METRICS, by_type, source), reusing an
    evaluation already made unless `reevaluate`: on dev, the run's own (metrics.jsonl's eval row
    of that epoch; the breakdown from traces/eval_epoch_K.jsonl); else one stored by an earlier
    call in <run>/evals/. Otherwise π is loaded and evaluated (env.evaluate, the run's
    settings and question sample) and the result stored in <run>/evals/<split>_<checkpoint>.json
    with the trajectories beside it (.jsonl)."""
    stored = run.dir / "evals" / f"{split}_{run.checkpoint}.json"
    if not reevaluate:
        if split == "dev" and run.checkpoint.startswith("epoch_"):
            row = next((r for r in reversed(run.metrics()) if r.get("kind") == "eval" and r["epoch"] == run.epoch),
                       None)
            if row is not None:
                traces = run.dir / "traces" / f"eval_epoch_{run.epoch}.jsonl"
                by_type = trajectory_scores(read_jsonl(traces))["by_type"] if traces.is_file() else {}
                return {**{k: row[k] for k in _METRICS if k in row}, "by_type": by_type,
                        "source": f"the run's own evaluation (metrics.jsonl, epoch {run.epoch})"}
        if stored.is_file():
            return {**json.loads(stored.read_text()), "source": f"stored: {stored}"}
    a = run.args
    examples = env.load_split(a["dataset"], split, data_dir or a.get("data_dir") or None, a.get("eval_size"),
                              a.get("seed", 0))
    print(f"[evaluate] {run.name}: evaluating {run.checkpoint} greedily on {len(examples)} {split} questions",
          flush=True)
    pi, _ = models.load_backbone_checkpoint(run.policy_dir(), device=device, dtype=dtype, engine=ENGINES["fast"])
    act = policy_act(pi, 0.0, a["max_new_tokens_pi"], a.get("gen_batch") or 16)        # greedy
    scores, trajs = env.evaluate(examples, act, _retriever(), a.get("max_searches"), a["obs_chars"])
    del pi
    rows = [{**row, "checkpoint": run.checkpoint} for row in trace_rows(trajs, run.epoch, -1)]
    result = {**{k: scores[k] for k in _METRICS if k in scores}, "by_type": trajectory_scores(rows)["by_type"],
              "checkpoint": run.checkpoint, "split": split}
    write_jsonl(stored.with_suffix(".jsonl"), rows)
    write_json(stored, result)
    return {**result, "source": f"evaluated now, stored: {stored}"}


def warmup_rows(runs: Sequence[Run]) -> list[dict]:
    """The paper's Base and SFT-only rows from each distinct warmup folder's metrics.json (dev)."""
    rows, seen = [], set()
    for run in runs:
        path = run.warmup_dir / "metrics.json"
        if path.resolve() in seen or not path.is_file():
            continue
        seen.add(path.resolve())
        m = json.loads(path.read_text())
        suffix = "" if len({r.warmup_dir.resolve() for r in runs}) == 1 else f" ({run.warmup_dir})"
        for key, label, ckpt in (("base", "base", run.args.get("model", "")), ("sft_only", "SFT only", "pi_sft")):
            if key in m:
                rows.append({"system": label + suffix, "checkpoint": ckpt,
                             **{k: m[key][k] for k in _METRICS if k in m[key]}, "by_type": {},
                             "source": f"warmup: {path}"})
    return rows


def question_em(run: Run, epoch: int) -> dict[str, float]:
    """{question id: EM in %} of the run's own greedy dev evaluation at `epoch` (traces/eval_epoch_K.jsonl;
    R(τ) is EM, Alg. 1 line 23); {} when the run kept no such traces."""
    return {r["id"]: 100.0 * r["reward"] for r in read_jsonl(run.dir / "traces" / f"eval_epoch_{epoch}.jsonl")}


def paired_difference(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """EM after − EM before over the questions both evaluated, with the 95% interval of the mean of
    the per-question differences (paired: the same questions, so question difficulty cancels)."""
    ids = sorted(before.keys() & after.keys())
    if not ids:
        return None
    mean, half = mean_ci([after[i] - before[i] for i in ids])
    return {"n": len(ids), "delta_em": mean, "half_width": half}


def method_of(row: dict) -> str:
    """The method a run row belongs to, whatever its seed: outcome RL, ARCO, ARCO w/o Rubric, …"""
    if row.get("reward") == "outcome":
        return "outcome RL"
    if row.get("credit") in ("oracle", "projection"):          # "oracle": its name before issue 41
        return "projection oracle"
    if row.get("credit") == "causal":
        return "causal oracle"
    if row.get("mixed"):
        return "mixed (outcome + μ's dense advantage)"
    variant = {"adaptive": "", "none": " w/o Rubric", "static": " w/o Adaptive", "prefix-free": " w/o Prefix"}
    data = {"policy": " (μ SFT on π's rollouts)", "both": " (μ SFT on π's rollouts and the teacher's)"}
    rubric = variant.get(row.get("rubric"), f" {row.get('rubric')}")
    k = "" if row.get("k") in (3, None) else f" K={row['k']}"
    return "ARCO" + rubric + k + data.get(row.get("mu_data"), "")     # --mu-data teacher (the paper's) adds nothing


# Run arguments that tell seeds of one method apart (or only say where and how it ran), not its settings.
NOT_SETTINGS = {"seed", "name", "out_dir", "resume", "dry_run", "benchmark", "device", "dtype", "autocast", "data_dir",
                "warmup_dir", "fork_from", "init_from",   # a study's arms start from their seed's own sparse run
                "eval_every", "curve_size"}                # the study's learning-curve points
# What outcome RL never reads (no μ, no dense epoch): differences in these do not split its runs.
UNUSED_BY_OUTCOME = {"sparse_epochs", "pi_lr_dense", "kl_pi_dense", "rubric", "k", "mu_model", "mu_lr", "head_lr",
                     "kl_mu", "alpha", "bucket_fallback", "class_balance", "rubric_temperature", "max_new_tokens_mu",
                     "mu_examples", "sft_epochs_mu", "sft_lr_mu", "sft_head_lr", "sft_batch_mu", "sft_questions_mu",
                     "warmup_probe"}


def split_by_settings(groups: dict[str, list[dict]], by_run: dict[str, Run]) -> dict[str, list[dict]]:
    """Runs of one method whose settings differ (say --group-size) are not seeds of each other: each
    setting gets its own group, labelled with the flags that tell the groups apart."""
    out: dict[str, list[dict]] = {}
    for method, members in groups.items():
        ignore = NOT_SETTINGS | (UNUSED_BY_OUTCOME if all(m.get("reward") == "outcome" for m in members) else set())
        settings = [{k: v for k, v in by_run[m["run"]].args.items() if k not in ignore} for m in members]
        differ = sorted({k for s in settings for k in s if any(t.get(k) != s[k] for t in settings)})
        for member, s in zip(members, settings):
            flags = ", ".join(f"--{k.replace('_', '-')} {s.get(k)}" for k in differ)
            out.setdefault(f"{method} ({flags})" if differ else method, []).append(member)
    return out


def outcome_baseline(groups: dict[str, list[dict]], by_run: dict[str, Run]) -> str | None:
    """The group every other one is paired against ("Δ EM vs outcome RL"): outcome RL. When outcome RL ran at
    several settings (the fork study's control at ARCO's dense π rate and λ_π beside it), the one whose
    settings the other methods' runs share most (outcome RL as a user would run it instead of them): counted
    over the settings that tell the outcome groups apart; ties (no other method given, say) go to the label
    that sorts first, whatever the order of the runs."""
    labels = sorted(m for m in groups if m.startswith("outcome RL"))
    if len(labels) < 2:
        return labels[0] if labels else None
    first = {m: by_run[groups[m][0]["run"]].args for m in labels}
    split = {k for a in first.values() for k in a if any(b.get(k) != a[k] for b in first.values())} \
        - NOT_SETTINGS - UNUSED_BY_OUTCOME
    others = [by_run[r["run"]].args for m, rs in groups.items() if m not in labels for r in rs]
    return max(labels, key=lambda m: sum(o.get(k) == first[m].get(k) for o in others for k in split))


def method_rows(rows: Sequence[dict], runs: Sequence[Run]) -> list[dict]:
    """One row per method over its runs (seeds): EM and F1 as mean ± half the range over the runs, the
    SFT-only EM of the same runs' dev questions (each run's epoch 0), and the paired difference to it
    pooled over every run's questions with its 95% interval: beyond noise when the interval excludes 0; and the
    paired difference to outcome RL of the same seed (`outcome_baseline`), pooled the same way."""
    by_run = {str(r.dir): r for r in runs}
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row.get("run"):
            groups[method_of(row)].append(row)
    groups = split_by_settings(groups, by_run)
    final = {row["run"]: question_em(by_run[row["run"]], by_run[row["run"]].epoch) for rs in groups.values()
             for row in rs}
    same_seed = lambda members: {(by_run[row["run"]].args.get("seed"), q): v for row in members   # noqa: E731
                                 for q, v in final[row["run"]].items()}
    base = outcome_baseline(groups, by_run)
    outcome = {m: same_seed(rs) for m, rs in groups.items() if m.startswith("outcome RL")}   # keyed (seed, question)
    out = []
    for method, members in groups.items():
        before, after, sft = {}, {}, []
        for row in members:
            run = by_run[row["run"]]
            b, a = question_em(run, 0), question_em(run, run.epoch)
            before.update({(run.name, q): v for q, v in b.items()})
            after.update({(run.name, q): v for q, v in a.items()})
            if b:
                sft.append(sum(b.values()) / len(b))
        spread = lambda v: (sum(v) / len(v), (max(v) - min(v)) / 2) if v else (None, None)   # noqa: E731
        em, f1 = spread([m["em"] for m in members]), spread([m["f1"] for m in members])
        by_seed = same_seed(members)
        out.append({"method": method, "runs": len(members), "em": em[0], "em_spread": em[1], "f1": f1[0],
                    "f1_spread": f1[1], "sft_only_em": sum(sft) / len(sft) if sft else None,
                    "vs_sft_only": paired_difference(before, after),
                    "vs_outcome": None if method == base or base is None else
                    paired_difference(outcome[base], by_seed),
                    "vs_other_outcome": {m: paired_difference(em_, by_seed) for m, em_ in outcome.items()
                                         if m not in (base, method)}})
    return out


def compare_runs(runs: Sequence[Run], split: str, data_dir: str | None, device: str, reevaluate: bool,
                 dtype: str = "auto") -> dict:
    """The side-by-side comparison: warmup rows (dev only), then one row per run (on dev with its paired
    difference to its own epoch 0), then one row per method over its runs (seeds)."""
    rows = warmup_rows(runs) if split == "dev" else []
    for run in runs:
        scores = evaluation(run, split, data_dir, device, reevaluate, dtype)
        scores = {k: v for k, v in scores.items() if k not in ("checkpoint", "split")}   # the row says them
        mu = run.args.get("reward") != "outcome" and run.args.get("credit", "mu") == "mu"
        rows.append({"system": run.name, "checkpoint": run.checkpoint + (" (selected)" if run.selected else ""),
                     "run": str(run.dir), "reward": run.args.get("reward"), "credit": run.args.get("credit"), "mixed": run.args.get("mixed"),
                     "rubric": run.args.get("rubric") if mu else None, "k": run.args.get("k") if mu else None,
                     "mu_data": run.args.get("mu_data") if mu else None,
                     **scores,
                     "vs_sft_only": paired_difference(question_em(run, 0), question_em(run, run.epoch))
                     if split == "dev" else None})
    types_ = sorted({t for r in rows for t in r["by_type"]})
    return {"dataset": runs[0].args["dataset"], "split": split, "types": types_, "rows": rows,
            "methods": method_rows(rows, runs) if split == "dev" else []}


def comparison_markdown(comp: dict) -> str:
    """The comparison as one markdown table, then where each row comes from."""
    pct = lambda x: "" if x is None else f"{x:.1f}"                                  # noqa: E731
    delta = lambda d: "" if not d else f"{d['delta_em']:+.1f} ± {d['half_width']:.1f} (n {d['n']})"  # noqa: E731
    cols = ["system", "checkpoint", "n", "EM", "F1", "Δ EM vs SFT only ± 95%", "searches / q", "invalid steps %"] + \
        [f"{t} EM / F1" for t in comp["types"]]
    table = []
    for r in comp["rows"]:
        cells = {"system": r["system"], "checkpoint": r["checkpoint"], "n": r.get("n"), "EM": pct(r.get("em")),
                 "F1": pct(r.get("f1")), "Δ EM vs SFT only ± 95%": delta(r.get("vs_sft_only")),
                 "searches / q": "" if r.get("mean_searches") is None else f"{r['mean_searches']:.2f}",
                 "invalid steps %": "" if r.get("invalid_rate") is None else f"{100 * r['invalid_rate']:.1f}"}
        for t in comp["types"]:
            b = r["by_type"].get(t)
            cells[f"{t} EM / F1"] = f"{b['em']:.1f} / {b['f1']:.1f} (n {b['n']})" if b else ""
        table.append(cells)
    lines = [f"# Comparison on {comp['dataset']} / {comp['split']}", "", format_table(table, cols), "",
             "Greedy decoding; EM and F1 in %, an unfinished trajectory scores 0. The warmup rows have no "
             "per-type breakdown (its metrics.json keeps none). Δ EM: the checkpoint's EM minus the same run's "
             "epoch 0 (SFT only) on the same questions, mean of the per-question differences ± its 95% interval "
             "(beyond noise when the interval excludes 0).", ""]
    if comp.get("methods"):
        mrows = [{"method": m["method"], "runs": m["runs"],
                  "EM (mean ± half range)": f"{m['em']:.1f} ± {m['em_spread']:.1f}",
                  "F1": f"{m['f1']:.1f} ± {m['f1_spread']:.1f}",
                  "SFT-only EM, same questions": pct(m["sft_only_em"]),
                  "Δ EM vs SFT only ± 95% (pooled)": delta(m["vs_sft_only"]),
                  "Δ EM vs outcome RL, same seed ± 95%": delta(m.get("vs_outcome"))} for m in comp["methods"]]
        lines += ["By method, over its runs (seeds):", "", format_table(mrows, list(mrows[0])), ""]
        others = dict.fromkeys(o for m in comp["methods"] for o in m.get("vs_other_outcome") or {})
        if others:                       # outcome RL at several settings: the column's baseline, then the rest
            base = next(m["method"] for m in comp["methods"] if m["method"].startswith("outcome RL")
                        and m["vs_outcome"] is None)
            lines += [f"Outcome RL ran at several settings: the column pairs with {base}."]
            lines += [f"Paired with {other} instead (same seed ± 95%): " + "; ".join(
                f"{m['method']} {delta(m['vs_other_outcome'][other])}" for m in comp["methods"]
                if other in m["vs_other_outcome"]) for other in others] + [""]
    lines += ["Sources:", ""]
    lines += [f"- {r['system']}: {r['source']}" for r in comp["rows"]]
    return "\n".join(lines) + "\n"


# --- μ diagnostics ---------------------------------------------------------------------------------

class _CachedEncoder:
    """`encode(texts)` -> numpy (n, dim), each distinct text encoded once (batched by `warm`)."""

    def __init__(self, encode):
        self.encode, self.vectors = encode, {}

    def warm(self, texts: Iterable[str]) -> None:
        todo = list(dict.fromkeys(t for t in texts if t not in self.vectors))
        if todo:
            for t, v in zip(todo, np.asarray(self.encode(todo), dtype=np.float64)):
                self.vectors[t] = v

    def __call__(self, texts: Sequence[str]):
        self.warm(texts)
        return np.stack([self.vectors[t] for t in texts])


def step_action_text(st: dict) -> str:
    """a_t of a trace row's step as env.Step.action_text writes it (the canonical action, or the
    raw output of an invalid step): the candidates of a Bind item."""
    return env.action_text(bool(st.get("valid")), st.get("action"), st.get("argument"), str(st.get("output", "")))


def _prefix_text(steps: Sequence[dict]) -> str:
    return "\n".join(f"Step {i}: {step_action_text(s)}\nObservation: {s.get('observation', '')}"
                     for i, s in enumerate(steps, 1))


def _criteria(st: dict) -> list[str]:
    return [str(c) for c in (st.get("criteria") or []) if str(c).strip()]


def _proportion(correct: int, n: int, chance: Sequence[float] = ()) -> dict:
    out: dict[str, Any] = {"n": n, "correct": correct, "bind": 100 * correct / n if n else None}
    if n:
        low, high = proportion_ci(correct, n)
        out.update(ci95=[100 * low, 100 * high], half_width=100 * (high - low) / 2)
    if chance:
        out["chance"] = 100 * sum(chance) / len(chance)
    return out


def trace_binding(rows: Sequence[dict], encode, seed: int = 0, judge: Any = None, judge_items: int = 200) -> dict:
    """RQ3 (§4.4) on trace rows: one Bind item per step whose rubric has criteria (binding_item:
    the gold action among up to three other actions of its trajectory), judged by the embedding
    judge (`encode`) and, when `judge` (an OpenAIJudge) is given, by it on `judge_items` items
    drawn with `seed` (Bind, and Spec of the rubric for its own action). Split by the gold action's kind.
    Bind is in %, with the Wilson 95% interval and the chance level (mean 1 / candidates); Spec
    is a mean with its normal 95% half-width; unscored judge items count in `unscored` only."""
    rng = random.Random(seed)
    counts = Counter()
    items = []
    for row in rows:
        actions = [step_action_text(st) for st in row["steps"]]
        for t, st in enumerate(row["steps"]):
            counts["steps"] += 1
            criteria = _criteria(st)
            if not criteria:
                counts["without_criteria"] += 1
                continue
            item = binding_item(actions, t, rng)
            if item is None:
                counts["without_distractor"] += 1
                continue
            items.append({"kind": st.get("action", "invalid"), "criteria": criteria, "candidates": item[0],
                          "gold": item[1], "question": row["question"], "prefix": _prefix_text(row["steps"][:t]),
                          "action": actions[t]})
    if isinstance(encode, _CachedEncoder):
        encode.warm([" ".join(i["criteria"]) for i in items] + [c for i in items for c in i["candidates"]])
    picks = [embedding_bind(encode, i["criteria"], i["candidates"]) for i in items]
    kinds = ["all"] + sorted({i["kind"] for i in items})
    group = lambda k: [j for j, i in enumerate(items) if k == "all" or i["kind"] == k]   # noqa: E731
    out: dict[str, Any] = {**counts, "items": len(items), "embedding": {
        k: _proportion(sum(picks[j] == items[j]["gold"] for j in group(k)), len(group(k)),
                       [1 / len(items[j]["candidates"]) for j in group(k)]) for k in kinds}}
    if judge is not None:
        asked = sorted(random.Random(seed).sample(range(len(items)), min(judge_items, len(items))))
        with ThreadPoolExecutor(8) as pool:
            bind = dict(zip(asked, pool.map(lambda j: judge.bind(items[j]["criteria"], items[j]["candidates"]), asked)))
            spec = dict(zip(asked, pool.map(lambda j: judge.spec(items[j]["question"], items[j]["prefix"],
                                                                 items[j]["action"], items[j]["criteria"]), asked)))
        res: dict[str, Any] = {"model": judge.model, "items": len(asked), "bind": {}, "spec": {}}
        for k in kinds:
            idx = [j for j in group(k) if j in bind]
            scored = [j for j in idx if bind[j] is not None]
            res["bind"][k] = {**_proportion(sum(bind[j] == items[j]["gold"] for j in scored), len(scored),
                                            [1 / len(items[j]["candidates"]) for j in scored]),
                              "unscored": len(idx) - len(scored)}
            ratings = [spec[j] for j in idx if spec[j] is not None]
            mean, half = mean_ci(ratings) if ratings else (None, None)
            res["spec"][k] = {"n": len(ratings), "spec": mean, "half_width": half, "unscored": len(idx) - len(ratings)}
        res["counters"] = dict(judge.counters)
        if judge.last_error:
            res["last_error"] = judge.last_error
        out["openai"] = res
    return out


def trace_redundancy(rows: Sequence[dict], encode, threshold: float = 0.8) -> dict:
    """RQ4 (§4.5) on trace rows: `redundancy` of every step's criteria (their embeddings from
    `encode`, their scores d_t), then `redundancy_summary`. Only the criteria μ wrote count: empty
    slots (a rubric with fewer than K criteria, or none parsed) are left out with their d."""
    per_step, without = [], 0
    steps = [st for row in rows for st in row["steps"]]
    pairs = [[(str(c), float(x)) for c, x in zip(st.get("criteria") or [], st.get("d") or []) if str(c).strip()]
             for st in steps]
    if isinstance(encode, _CachedEncoder):
        encode.warm([c for p in pairs for c, _ in p])
    for p in pairs:
        if not p:
            without += 1
            continue
        texts = [c for c, _ in p]
        per_step.append(redundancy(texts, encode(texts), [x for _, x in p], threshold))
    return {**redundancy_summary(per_step), "steps_without_criteria": without}


def heldout_set(run: Run, n_questions: int, samples: int, seed: int, data_dir: str | None):
    """The fixed held-out trajectories with known step labels: the oracle teacher's gold (sample 0)
    and imperfect trajectories (samples 1.. rotate through redundant / wrong-entity / premature /
    wrong-answer) on the first `n_questions` of a seeded dev sample, played in the real
    environment. Returns (trajectories, oracle metas, step labels)."""
    a = run.args
    examples = env.load_split(a["dataset"], "dev", data_dir or a.get("data_dir") or None, n_questions, seed)
    teacher = OracleTeacher(env, seed=seed, obs_chars=a.get("obs_chars") or 400)
    trajs, metas = teacher.rollout([(ex, s) for ex in examples for s in range(samples)], _retriever())
    return trajs, metas, [step_usefulness(t) for t in trajs]


def untrained_mu(warm_mu: Path, device: str, seed: int, dtype: str = "auto"):
    """μ before any training: the warmup μ's base backbone and settings, a fresh score head seeded
    by `seed` (ScoreHead's own initialization)."""
    config = json.loads((warm_mu / "config.json").read_text())
    m = config["rubric_model"]
    backbone = models.load_backbone(config["base_model"], device=device, dtype=dtype, engine=ENGINES["fast"])
    torch.manual_seed(seed)
    return rubric_model.RubricModel(backbone, m["k"], m["rubric_mode"], m["head_hidden"], m["static_criteria"],
                                    m.get("examples", 2))


def heldout_scores(mu, trajs, max_new_tokens: int, batch_size: int) -> tuple[list[list[float]], float]:
    """μ's s_t for every step of `trajs` (greedy rubrics, then the score head: Eq. 2), one list per
    trajectory, and the share of rubrics that parsed."""
    contexts = [c for t in trajs for c in rubric_model.contexts_from_trajectory(t)]
    mu.eval()
    with torch.no_grad():
        rubrics = mu.generate_rubrics(contexts, temperature=0.0, max_new_tokens=max_new_tokens, batch_size=batch_size)
        s = mu.score(contexts, rubrics, batch_size=batch_size).s.float().cpu().tolist()
    return [s[r.start:r.stop] for r in env.step_ranges(trajs)], sum(r.parsed for r in rubrics) / max(len(rubrics), 1)


def _finite(x: float) -> float | str:
    """A threshold for JSON: ±inf as the strings '+inf' / '-inf'."""
    return x if x not in (float("inf"), float("-inf")) else ("+inf" if x > 0 else "-inf")


def credit_stage(s: Sequence[Sequence[float]], labels: Sequence[Sequence[bool]], kinds: Sequence[Sequence[str]],
                 rewards: Sequence[float], f1s: Sequence[float], threshold: float = 0.5) -> dict:
    """Credit assignment and the judge lens of one μ on the held-out set: AUC of s_t for useful vs
    useless steps (all, Search steps, Finish steps), mean s_t of each class; Σ_t s_t as a judge of
    R(τ) (pass iff Σ_t s_t > threshold): judge_stats, its AUC for R, Spearman's ρ with F1."""
    flat = [(x, y, k) for st, lt, kt in zip(s, labels, kinds) for x, y, k in zip(st, lt, kt)]
    pick = lambda kind: [(x, y) for x, y, k in flat if kind is None or k == kind]   # noqa: E731
    mean = lambda v: sum(v) / len(v) if v else None                                # noqa: E731
    sums = [sum(st) for st in s]
    truth = [r >= 0.5 for r in rewards]
    out = {f"auc_{name}": auc([x for x, _ in pick(kind)], [y for _, y in pick(kind)])
           for name, kind in (("steps", None), ("search", "search"), ("finish", "finish"))}
    out.update(steps=len(flat), useful=sum(y for _, y, _ in flat),
               mean_s_useful=mean([x for x, y, _ in flat if y]), mean_s_useless=mean([x for x, y, _ in flat if not y]),
               judge={"threshold": threshold, **judge_stats([x > threshold for x in sums], truth)},
               auc_sum_vs_R=auc(sums, truth), spearman_sum_vs_f1=spearman(sums, list(f1s)))
    return out


def training_traces_auc(run: Run) -> list[dict]:
    """Per epoch: the AUC of the s_t recorded in the run's training traces (μ scoring the policy's
    own rollouts) for useful vs useless steps (step_usefulness from the rows' supporting indices)."""
    out = []
    for epoch in run.trace_epochs():
        s, y = [], []
        for row in run.training_traces(epoch):
            if row.get("supporting") is None or not all("s" in st for st in row["steps"]):
                continue
            s += [st["s"] for st in row["steps"]]
            y += step_usefulness(row)
        if s:
            out.append({"epoch": epoch, "steps": len(s), "useful": sum(y), "auc": auc(s, y)})
    return out


def step_count_reference(trajs: Sequence[Any], labels: Sequence[Sequence[bool]]) -> dict:
    """What a scorer that knows only where a step stands reaches (the reference for μ's AUC): the AUC
    of −(steps in the step's trajectory) and of −(the step's position t), each in its better direction
    (max of AUC and 1 − AUC, fitted on the same steps, so a generous reference)."""
    y = [v for lt in labels for v in lt]
    better = lambda a: None if a is None else max(a, 1 - a)                        # noqa: E731
    return {"auc_step_count": better(auc([-len(t.steps) for t in trajs for _ in t.steps], y)),
            "auc_step_position": better(auc([-i for t in trajs for i in range(len(t.steps))], y))}


def crossfit_judge(sums: Sequence[float], truth: Sequence[bool], folds: Sequence[int]) -> dict:
    """μ as a judge with a fitted threshold, out of sample: the trajectories of the held-out set in two
    folds (by question); each fold is judged with best_threshold fitted on the other, and the verdicts
    of both are pooled into one judge_stats. Works for every stage alike (the warmup μ too, which has no
    training traces of its own)."""
    verdicts, thresholds = [False] * len(sums), []
    for f in (0, 1):
        train = [i for i, g in enumerate(folds) if g != f]
        thr = best_threshold([sums[i] for i in train], [truth[i] for i in train]) if train else float("inf")
        thresholds.append(_finite(thr))
        for i, g in enumerate(folds):
            if g == f:
                verdicts[i] = sums[i] > thr
    return {"threshold": thresholds, **judge_stats(verdicts, truth)}


def fitted_threshold(rows: Sequence[dict]) -> dict | None:
    """best_threshold of Σ_t s_t against R(τ) over trace rows that recorded s_t (training data)."""
    scored = [r for r in rows if r["steps"] and all("s" in st for st in r["steps"])]
    if not scored:
        return None
    thr = best_threshold([sum(st["s"] for st in r["steps"]) for r in scored], [r["reward"] >= 0.5 for r in scored])
    return {"threshold": thr, "trajectories": len(scored)}


def diagnose_mu(run: Run, args: "Args") -> dict:
    """Credit assignment and the judge lens (see the module docstring) for the untrained μ, the
    warmup μ and μ after each RL epoch of `run`, on the held-out set."""
    trajs, metas, labels = heldout_set(run, args.heldout_questions, args.heldout_samples, args.seed,
                                       args.data_dir or None)
    kinds = [[st.action for st in t.steps] for t in trajs]
    order = {qid: i for i, qid in enumerate(dict.fromkeys(t.example.id for t in trajs))}
    folds = [order[t.example.id] % 2 for t in trajs]              # crossfit_judge's two folds, by question
    rewards = [t.reward for t in trajs]
    f1s = [f1_score(t.answer, t.example.answers) if t.finished else 0.0 for t in trajs]
    heldout = {"dataset": run.args["dataset"], "split": "dev", "questions": args.heldout_questions,
               "samples": args.heldout_samples, "seed": args.seed, "trajectories": len(trajs),
               "steps": sum(len(t.steps) for t in trajs), "useful_steps": sum(map(sum, labels)),
               "reward_1": sum(r >= 0.5 for r in rewards), "variants": dict(Counter(m["variant"] for m in metas)),
               # A reference for "AUC Σs vs R": Σ_t s_t of a μ that gives every step the same small score is
               # the trajectory's length times that score, so its AUC is this one (or 1 minus it).
               "auc_length_vs_R": auc([len(t.steps) for t in trajs], [r >= 0.5 for r in rewards]),
               **step_count_reference(trajs, labels)}
    a = run.args
    stages = [("untrained", -1, None), ("warmup", 0, run.warmup_mu_dir())] + \
        [(f"epoch_{e}", e, p) for e, p in run.mu_dirs()]
    selected_stage = "warmup" if run.checkpoint == "epoch_0" else run.checkpoint
    fit = fitted_threshold(run.training_traces(run.epoch)) if run.epoch > 0 else None
    results = []
    for name, x, folder in stages:
        print(f"[evaluate] credit assignment: scoring {heldout['steps']} held-out steps with the {name} μ",
              flush=True)
        mu = untrained_mu(run.warmup_mu_dir(), args.device, args.seed, args.dtype) if folder is None \
            else rubric_model.RubricModel.load(folder, device=args.device, dtype=args.dtype, engine=ENGINES["fast"])
        s, parse_rate = heldout_scores(mu, trajs, a.get("max_new_tokens_mu") or 128, a.get("gen_batch") or 16)
        del mu
        row = {"stage": name, "x": x,
               "model": str(folder) if folder else f"base backbone, fresh head (seed {args.seed})",
               "rubric_parse_rate": parse_rate, **credit_stage(s, labels, kinds, rewards, f1s),
               "judge_crossfit": crossfit_judge([sum(st) for st in s], [r >= 0.5 for r in rewards], folds)}
        if name == selected_stage and fit is not None:
            row["judge_fitted"] = {"threshold": _finite(fit["threshold"]),
                                   "fitted_on_trajectories": fit["trajectories"],
                                   "fitted_on": f"traces/epoch_{run.epoch}.jsonl",
                                   **judge_stats([sum(st) > fit["threshold"] for st in s], [r >= 0.5 for r in rewards])}
        results.append(row)
    return {"heldout": heldout, "stages": results, "selected_stage": selected_stage,
            "training_traces_auc": training_traces_auc(run)}


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        text = f"{x:.{digits}f}"
        return text[1:] if text.startswith("-") and float(text) == 0 else text   # no "-0.000"
    return str(x)


def diagnostics_markdown(d: dict) -> str:
    """diagnostics.md: every diagnostics table, in the order of the module docstring."""
    lines = [f"# Diagnostics of μ: run `{d['run']}` ({d['dataset']}, checkpoint {d['checkpoint']})", ""]
    if "credit" in d:
        h = d["credit"]["heldout"]
        lines += ["## Credit assignment (held-out oracle trajectories, known step labels)", "",
                  f"{h['trajectories']} trajectories ({h['questions']} dev questions × {h['samples']} samples, seed "
                  f"{h['seed']}; variants {h['variants']}), {h['steps']} steps of which {h['useful_steps']} useful; "
                  f"R = 1 for {h['reward_1']}. AUC of s_t for useful vs useless steps (0.5 = chance); the judge "
                  f"passes a trajectory iff Σ_t s_t > threshold and is compared with R(τ). Reference: the number "
                  f"of steps alone has AUC {_fmt(h.get('auc_length_vs_R'))} for R, so a μ that scores every step "
                  f"alike reaches that AUC (or 1 minus it) with Σ_t s_t. For the step AUC, a scorer that knows only "
                  f"how many steps the trajectory has reaches {_fmt(h.get('auc_step_count'))}, one that knows only the "
                  f"step's position {_fmt(h.get('auc_step_position'))} (each in its better direction).", ""]
        rows = []
        for r in d["credit"]["stages"]:
            rows.append({"μ": r["stage"], "AUC steps": _fmt(r["auc_steps"]), "AUC search": _fmt(r["auc_search"]),
                         "AUC finish": _fmt(r["auc_finish"]), "mean s useful / useless":
                         f"{_fmt(r['mean_s_useful'])} / {_fmt(r['mean_s_useless'])}",
                         "rubrics parsed": _fmt(r["rubric_parse_rate"], 2)})
        lines += [format_table(rows, list(rows[0])), "", "### μ as a reward-free judge of R(τ)", ""]
        rows = []
        for r in d["credit"]["stages"]:
            for key, label in (("judge", ""), ("judge_crossfit", "cross-fitted: "), ("judge_fitted", "fitted: ")):
                if key not in r:
                    continue
                j = r[key]
                thr = j["threshold"]
                thr = " / ".join(map(_fmt, thr)) if isinstance(thr, list) else _fmt(thr)
                rows.append({"μ": r["stage"], "threshold": label + thr,
                             "agreement": _fmt(j["agreement"]), "κ": _fmt(j["kappa"]),
                             "false pass": _fmt(j["false_pass_rate"]), "false fail": _fmt(j["false_fail_rate"]),
                             "AUC Σs vs R": _fmt(r["auc_sum_vs_R"]),
                             "Spearman Σs, F1": _fmt(r["spearman_sum_vs_f1"])})
        lines += [format_table(rows, list(rows[0])), "",
                  "The fitted threshold is best_threshold of Σ_t s_t against R on the checkpoint epoch's training "
                  "traces, applied to that epoch's μ. The cross-fitted one is fitted on the held-out trajectories of "
                  "half the questions and applied to the other half, both ways (the two thresholds shown), for every "
                  "μ alike.", ""]
        tr = d["credit"]["training_traces_auc"]
        if tr:
            lines += ["### AUC of the s_t recorded on the policy's own training rollouts", "",
                      format_table([{"epoch": r["epoch"], "steps": r["steps"], "useful": r["useful"],
                                     "AUC": _fmt(r["auc"])} for r in tr], ["epoch", "steps", "useful", "AUC"]), ""]
    lines += ["## RQ3: step binding (Bind, Spec) on the checkpoint epoch's training traces", "",
              "Bind in % with the Wilson 95% interval; chance = mean of 1 / candidates (a trajectory with few distinct "
              "actions gives fewer than four).", ""]
    rows = []
    for name, r in d["runs"].items():
        b = r.get("binding")
        if not b:
            continue
        for judge in ("embedding", "openai"):
            res = b.get(judge)
            if not res:
                continue
            bind = res if judge == "embedding" else res["bind"]
            for kind, x in bind.items():
                sp = res["spec"].get(kind, {}) if judge == "openai" else {}
                rows.append({"run": name, "epoch": r["epoch"],
                             "judge": "embedding" if judge == "embedding" else res["model"],
                             "steps": kind, "n": x["n"], "Bind %": _fmt(x["bind"], 1),
                             "± 95%": _fmt(x.get("half_width"), 1), "chance %": _fmt(x.get("chance"), 1),
                             "Spec (1–5)": f"{_fmt(sp.get('spec'), 2)} ± {_fmt(sp.get('half_width'), 2)}"
                             if sp else "",
                             "unscored": x.get("unscored", "")})
    lines += [format_table(rows, list(rows[0])) if rows else "No run's traces hold criteria.", ""]
    lines += ["## RQ4: rubric redundancy on the same traces", "",
              "Themes: greedy clusters of a step's criteria by embedding cosine ≥ 0.8; means over steps.", ""]
    rows = [{"run": name, "epoch": r["epoch"], "K": r["k"], "rubric": r["rubric"], "steps": x["steps"],
             "themes": _fmt(x["themes"], 2), "theme ratio": _fmt(x["theme_ratio"], 2),
             "exact dup.": _fmt(x["exact_duplicate_rate"], 3),
             "paraphrase dup.": _fmt(x["paraphrase_duplicate_rate"], 3),
             "score range in a theme": _fmt(x["score_range"], 3)}
            for name, r in d["runs"].items() if (x := r.get("redundancy")) and x["steps"]]
    lines += [format_table(rows, list(rows[0])) if rows else "No run's traces hold criteria.", ""]
    lines += ["## Files", ""] + [f"- `{f}`: {what}" for f, what in d["files"].items()]
    return "\n".join(lines) + "\n"


def diagnose(runs: Sequence[Run], args: "Args") -> dict[str, Path]:
    """--diagnose: the μ diagnostics of runs[0], RQ3 / RQ4 of every run with criteria, the plots and
    the page, all written into runs[0]'s folder. Returns {what: path}."""
    run = runs[0]
    out = run.dir
    d: dict[str, Any] = {"run": run.name, "dataset": run.args["dataset"], "checkpoint": run.checkpoint, "runs": {}}
    if args.judge_model:
        OpenAIJudge(args.judge_model)                 # fails here, before any model work, without a key
    d["credit"] = diagnose_mu(run, args)
    encode = _CachedEncoder(_retriever().encode)
    for r in runs:
        rows = r.training_traces(r.epoch)
        entry = {"epoch": r.epoch, "k": r.args.get("k"), "rubric": r.args.get("rubric"),
                 "reward": r.args.get("reward"), "trajectories": len(rows)}
        if any(_criteria(st) for row in rows for st in row["steps"]):
            print(f"[evaluate] RQ3 / RQ4 on {r.name}'s traces/epoch_{r.epoch}.jsonl", flush=True)
            judge = OpenAIJudge(args.judge_model) if args.judge_model else None   # counters of this run only
            entry["binding"] = trace_binding(rows, encode, args.seed, judge, args.judge_items)
            entry["redundancy"] = trace_redundancy(rows, encode)
        d["runs"][r.name] = entry
    files = {}
    series = {r.name: dev_em_series(r.metrics()) for r in runs}
    plot_lines(series, out / "dev_em.png", "Dev EM per epoch", "dev EM (%)")
    files["dev_em.png"] = "dev EM per epoch, every --run"
    rewards = {r.name: train_reward_series(r.metrics()) for r in runs}
    plot_lines(rewards, out / "train_reward.png", "Mean R of the training rollouts", "mean R(τ)", ylim=(-0.05, 1.05),
               xlabel="update")
    files["train_reward.png"] = "mean R(τ) of each update's rollouts, every --run"
    traces = {e: run.training_traces(e) for e in run.trace_epochs()}     # read once: the buckets and the page
    buckets = bucket_mean_scores([row for rows in traces.values() for row in rows])
    plot_lines(buckets, out / "bucket_scores.png", "Mean step score per bucket", "mean s_t", ylim=(-1.05, 1.05))
    files["bucket_scores.png"] = f"mean s_t per position bucket and epoch, {run.name}'s training traces"
    stages = d["credit"]["stages"]
    auc_series = {"held-out steps": [(r["x"], r["auc_steps"]) for r in stages],
                  "held-out searches": [(r["x"], r["auc_search"]) for r in stages],
                  "held-out Σs vs R": [(r["x"], r["auc_sum_vs_R"]) for r in stages],
                  "own rollouts (traces)": [(r["epoch"], r["auc"]) for r in d["credit"]["training_traces_auc"]]}
    auc_series = {k: v for k, v in auc_series.items() if any(y is not None for _, y in v)}  # no empty legend
    plot_lines(auc_series, out / "credit_auc.png", "Credit-assignment AUC", "AUC", chance=0.5, ylim=(0.0, 1.0))
    files["credit_auc.png"] = "credit-assignment AUC over training (x = -1 untrained μ, 0 warmup μ, K epoch K)"
    last = max(traces, default=None)
    shown = traces[last][:args.html_trajectories] if traces else []
    title = f"ARCO run {run.name}: training trajectories of epoch {'—' if last is None else last}"
    (out / "trajectories.html").write_text(trajectories_html(shown, title), encoding="utf-8")
    files["trajectories.html"] = f"{len(shown)} training trajectories of the last epoch with rubrics and scores"
    d["figures"] = {"dev_em.png": series, "train_reward.png": rewards, "bucket_scores.png": buckets,
                    "credit_auc.png": auc_series}
    files["diagnostics.json"] = "every number above, and the data of each figure"
    files["diagnostics.md"] = "these tables"
    d["files"] = files
    write_json(out / "diagnostics.json", d)
    (out / "diagnostics.md").write_text(diagnostics_markdown(d), encoding="utf-8")
    return {f: out / f for f in ("diagnostics.md", "diagnostics.json", "dev_em.png", "train_reward.png",
                                 "bucket_scores.png", "credit_auc.png", "trajectories.html")}


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


def load_report(datasets: Sequence[str], splits: Sequence[str], data_dir: str | None) -> list[dict]:
    """--check-files: load every file asked for; count examples loaded and skipped (with reasons)."""
    rows = []
    for ds in datasets:
        for sp in splits:
            if ds in GENERATED:
                n = len(env.synthetic_examples(200, split=sp, long=ds == "synthetic-long"))
                rows.append({"dataset": ds, "split": sp, "file": "(generated)", "loaded": n, "skipped": "0"})
                continue
            path = find_data_file(ds, sp, data_dir)
            examples, skipped = env.read_examples(path, ds)
            rows.append({"dataset": ds, "split": sp, "file": str(path), "loaded": len(examples),
                         "skipped": ", ".join(f"{n} {why}" for why, n in skipped.items()) or "0"})
    return rows


def files_and_predictions(args) -> None:
    """--check-files (counts and skips of every file asked for) or --predictions (EM / F1 of a file of answers)."""
    if args.predictions:
        if args.dataset == "all" or args.split == "all":
            sys.exit("error: --predictions scores one --dataset and one --split")
        examples = env.load_split(args.dataset, args.split, args.data_dir or None, args.check_size or None, args.seed)
        sys.exit(report_predictions(args.predictions, examples, f"{args.dataset}/{args.split}"))
    splits = ("train", "dev") if args.split == "all" else [args.split]
    for row in load_report(DATASETS if args.dataset == "all" else [args.dataset], splits, args.data_dir):
        print(f"{row['dataset']:>14}/{row['split']:<5} loaded {row['loaded']:>5}  skipped {row['skipped']:<24} {row['file']}")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(Args, argv, description=__doc__)
    if args.check_retrieval or args.check_gold or args.check_files or args.predictions:
        try:
            return check_data(args) if args.check_retrieval or args.check_gold else files_and_predictions(args)
        except DataError as e:
            sys.exit(f"error: {e}")
    if not args.run:
        print("error: give --run DIR (one or more; to score a predictions file: --predictions FILE)",
              file=sys.stderr)
        sys.exit(2)
    try:
        run_command(args)
    except (RunError, DataError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main_guard(main, DataError, models.ModelLoadError)
