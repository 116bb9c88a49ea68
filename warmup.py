"""Supervised warmup of ARCO: teacher trajectories and rubrics, Eq. 6's projection, π SFT and μ SFT (Eq. 7).

Paper: §3.2 ("a closed-source LLM teacher collects trajectories and step rubrics ... π is SFT-initialized on the
trajectories, μ by a text-LM loss on the criteria plus an MSE on projected criterion scores") and Appendix B
(warmup details, Eq. 6 and Eq. 7).

Top to bottom: 1. Eq. 6, `project_scores`; 2. the teacher protocol and collection: a teacher plays the warmup
questions and annotates every step (`rollout`, `annotate`; the offline oracle, π_sft played with the oracle
annotating, and an OpenAI-compatible model are infra/oracle.py's and infra/openai_teacher.py's), one record per
(question, sample) appended to `records.jsonl` as it finishes (a rerun resumes); 3. filtering and the two SFT
datasets (`policy_sft_examples`: π's exact RL prompt → the action; `rubric_sft_examples`: q, h_t, a_t, K criteria,
K projected scores); 4. π SFT and μ SFT (Eq. 7) in batches of whole trajectories; 5. the warmup run, and what RL
starts from (`ensure`). The warmup folder's names and checks are infra/warmups.py's.

    python warmup.py --dataset synthetic --warmup-size 200       # oracle teacher, offline
    python warmup.py --dataset hotpotqa --teacher openai         # needs OPENAI_API_KEY (and OPENAI_BASE_URL)
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

import env
from env import EnvSettings
from infra.data import DataError
from infra.engines import loading
from infra.files import check_intact, read_jsonl, scrub, write_atomically, write_json, write_jsonl
from infra.memory import MEMORY
from infra.models import (ModelLoadError, add_lora, check_model_available, load_backbone, load_backbone_checkpoint,
                          merge_lora, save_backbone, trainable_parameters)
from infra.openai_teacher import OpenAITeacher
from infra.oracle import OnPolicyTeacher, OracleTeacher, evidence_found
from infra.passes import chat_prompt_ids, encode_response, policy_act, training_passes
from infra.settings import (DATASETS, EMBEDDED_RETRIEVER, RunSettings, Split, fill_from_preset, from_preset, main_guard,
                            parse_args)
from infra.teachers import TeacherError, in_parallel, serialized
from infra.warmups import (MU_SFT_SETTINGS, check_mu_settings, check_pi_settings, check_retriever, collection_suffix,
                           eval_settings, mu_dir_name, pi_sft_settings, warmup_folder)
from rubric_model import MuSettings, RubricModel, StepContext, mean_pool

@dataclass
class Settings(MuSettings, EnvSettings, RunSettings):
    """The warmup's knobs (§3.2, App. B) and what RL shares with it: the data, device and engines (infra.settings),
    π's rollout (env.EnvSettings), μ's form (rubric_model.MuSettings), then these; warmup.Args and arco.Args extend
    them (run_from_arco copies them by name)."""
    eval_size: int | None = from_preset(paper=500, cpu=100, min=1, help="dev questions evaluated (paper 500)")
    eval_all: bool | None = from_preset(paper=True, cpu=False, help="dev evaluations of every stage: the base model, "
                                        "every π SFT epoch (the best is kept) and every RL epoch (release); off: only "
                                        "where a choice or the result reads one — the last π SFT epoch (kept) and the "
                                        "RL epochs after --sparse-epochs (§4.1's selection)")
    sft_eval_size: int = field(default=0, metadata={
        "help": "dev questions of the warmup's evaluations (base, π SFT epochs); 0 = --eval-size. A smaller one saves "
                "the warmup's time; arco.py then evaluates epoch 0 itself"})
    token_reduction: str | None = from_preset(paper="mean", cpu="mean", choices=["mean", "sum"],
                                              help="mean (release) or sum (the paper's Σ_i) over the tokens of a step "
                                                   "in the KL terms of Eq. 3 and Eq. 5 and in Eq. 7 (CHOICES.md)")
    weight_decay: float | None = from_preset(paper=0.01, cpu=0.01,
                                             help="AdamW weight decay of every optimizer, RL and SFT (release 0.01)")
    warmup_size: int | None = from_preset(paper=1000, cpu=150, min=1, help="warmup questions (release 1,000)")
    warmup_samples: int | None = from_preset(paper=3, cpu=2, min=1,
                                             help="warmup: teacher trajectories per question (release 3)")
    warmup_probe: int | None = from_preset(paper=32, cpu=8,
                                           help="μ SFT items on which the warmup shows Eq. 7's terms before/after")
    mu_data: str = field(default="teacher", metadata={
        "help": "μ SFT data: teacher (the teacher's own trajectories, App. B) or policy (π_sft plays the μ SFT "
                "questions, the oracle annotates every step: the release's local-policy mode) or both",
        "choices": ["teacher", "policy", "both"]})
    sft_epochs_pi: int | None = from_preset(paper=6, cpu=2, min=1,
                                            help="warmup π SFT epochs (release 6; the best dev-EM epoch is kept)")
    sft_epochs_mu: int | None = from_preset(paper=10, cpu=2, min=1,
                                            help="warmup μ SFT epochs (release 10; the last is kept)")
    sft_lr_pi: float | None = from_preset(paper=1e-5, cpu=5e-4, help="warmup π SFT learning rate (release 1e-5)")
    sft_lr_mu: float | None = from_preset(paper=5e-5, cpu=3e-4, help="warmup μ SFT learning rate (release 5e-5)")
    sft_head_lr: float | None = from_preset(paper=1e-3, cpu=1e-3,
                                            help="warmup μ score-head learning rate (release 1e-3)")
    sft_head_steps: int | None = from_preset(paper=0, cpu=500, help="warmup: Adam steps fitting μ's score head alone "
                                             "after μ SFT (Eq. 7's score term; release 0)")
    sft_batch_pi: int | None = from_preset(paper=64, cpu=8, min=1,
                                           help="warmup π SFT examples per optimizer step (release 64)")
    sft_batch_mu: int | None = from_preset(paper=32, cpu=4, min=1,
                                           help="warmup μ SFT steps per optimizer step (release 32)")
    sft_questions_mu: int | None = from_preset(paper=0, cpu=20, help="warmup μ SFT on the trajectories of the first "
                                               "this many warmup questions (0 = all; release)")


@dataclass
class Args(Settings, Split):
    """warmup.py's knobs: the shared ones (Settings), then its own."""
    teacher: str = field(default="oracle", metadata={
        "help": "oracle (offline, from the gold evidence) or openai (any OpenAI-compatible endpoint)",
        "choices": ["oracle", "openai"]})
    teacher_policy_model: str = field(default="gpt-4o-mini", metadata={
        "help": "API model that acts as the policy (the paper names only 'a closed-source LLM teacher')"})
    teacher_rubric_model: str = field(default="gpt-4o-mini", metadata={
        "help": "API model that annotates whole trajectories with criteria and scores"})
    teacher_temperature: float = field(default=1.0, metadata={
        "help": "sampling temperature of the API policy (release: 1.0, configs/hotpotqa/hotpotqa.yaml)"})
    max_retries: int = field(default=5, metadata={
        "help": "retries of an API call on HTTP 408/409/429/5xx, timeouts and connection errors"})
    backoff: float = field(default=1.0, metadata={
        "help": "seconds before the first retry, doubled at each further one (at most 60)"})
    timeout: float = field(default=60.0, metadata={"above": 0, "help": "seconds before an API call is abandoned (and retried)"})
    concurrency: int = field(default=8, metadata={"min": 1, "help": "questions in flight at once with the API teacher"})
    policy_max_tokens: int = field(default=128, metadata={"min": 1, "help": "max new tokens of one API policy reply"})
    rubric_max_tokens: int = field(default=2048, metadata={"min": 1, "help": "max new tokens of one trajectory annotation"})
    price_input: float = field(default=0.15, metadata={
        "help": "USD per 1M prompt tokens, for the cost counter (default: gpt-4o-mini's list price)"})
    price_output: float = field(default=0.60, metadata={
        "help": "USD per 1M completion tokens, for the cost counter (default: gpt-4o-mini's list price)"})
    min_reward: float = field(default=1.0, metadata={"max": 1, "help": "π SFT uses trajectories with R >= this (paper: 1.0)"})
    require_evidence: bool = field(default=True, metadata={
        "help": "π SFT also requires every supporting paragraph to have been retrieved (no lucky guesses); "
                "--no-require-evidence gives the paper's reward-only filter"})
    tol: float = field(default=1e-6, metadata={"above": 0, "help": "tolerance of the decomposition constraint (Eq. 6) when filtering"})
    progress: bool = field(default=True, metadata={"help": "show progress bars"})
    collect_only: bool = field(default=False, metadata={"help": "stop after collection and the SFT datasets"})
    score_weight: float = field(default=10.0, metadata={"help": "λ of Eq. 7, the criterion-score loss weight (release: 10)"})
    train_mu: bool = field(default=True, metadata={"help": "also train μ (arco.py's outcome baseline needs only π)"})

    def __post_init__(self):
        fill_from_preset(self)
        self.split = self.split or "train"


# ----------------------------------------------------------------------------------------
# 1. App. B: the teacher's K scores read, and Eq. 6: projected onto the outcome
# ----------------------------------------------------------------------------------------

def _score(value) -> tuple[float, str]:
    """One teacher score -> (number clipped to [-1, 1], what was wrong with it or "")."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return 0.0, "non-numeric"
    if isinstance(value, str):
        try:
            value = float(value.strip().rstrip(","))
        except ValueError:
            return 0.0, "non-numeric"
    value = float(value)
    if math.isnan(value):
        return 0.0, "non-numeric"
    if value < -1.0 or value > 1.0:
        return min(1.0, max(-1.0, value)), "out of range"
    return value, ""


def fit_scores(raw, K: int) -> tuple[list[float], list[str]]:
    """A step's teacher scores (numbers or numeric strings, as the teacher wrote them) -> exactly K floats in
    [-1, 1] (App. B), and the problems found (for the annotation log): clipped to [-1, 1]; cut to the first K;
    padded with 0.0 (the neutral score: "no opinion") when fewer than K were given. A value that is not a number
    (a word, a bool, null, NaN) also becomes 0.0. A single number stands for a list of one."""
    values = list(raw) if isinstance(raw, (list, tuple)) else ([] if raw is None else [raw])
    issues = []
    if len(values) != K:
        issues.append(f"{len(values)} scores for K={K}")
    out = []
    for v in values[:K]:
        s, why = _score(v)
        out.append(s)
        if why:
            issues.append(f"{why} score {v!r}")
    return out + [0.0] * (K - len(out)), issues


def step_means_sum(scores: Sequence[Sequence[float]]) -> float:
    """Σ_t (1/K) Σ_j s_{t,j}: the left-hand side of Eq. 6."""
    return sum(sum(row) / len(row) for row in scores)


def _shifted(scores: Sequence[Sequence[float]], c: float) -> list[list[float]]:
    return [[min(1.0, max(-1.0, v + c)) for v in row] for row in scores]


def project_scores(scores: Sequence[Sequence[float]], reward: float, tol: float = 1e-6) -> list[list[float]] | None:
    """Eq. 6: scores ŝ in [-1, 1] with Σ_t mean_j ŝ_{t,j} = R(τ) (within `tol`), keeping the teacher's order.

    `scores` is T rows of K teacher scores already in [-1, 1] (fit_scores). The map is
    ŝ = clip(s + c, -1, 1) with one shift c shared by every score of the trajectory, found by
    bisection on c ∈ [-2, 2]: the left side of Eq. 6 is continuous and non-decreasing in c, -T at
    c = -2 and T at c = 2. Being one monotone map, it never reverses two scores anywhere in the
    trajectory (s_a <= s_b implies ŝ_a <= ŝ_b; clipping may tie them). When the constraint already
    holds the input comes back unchanged.

    Infeasible cases return None, and the caller counts them: no step (T = 0), no criterion
    (K = 0), or |R| > T (no scores in [-1, 1] can reach R). Input that is ragged, not finite or
    outside [-1, 1] is a programming error: ValueError.
    """
    rows = [[float(v) for v in row] for row in scores]
    if not rows or not rows[0]:
        return None
    K = len(rows[0])
    for t, row in enumerate(rows):
        if len(row) != K:
            raise ValueError(f"project_scores: step {t + 1} has {len(row)} scores, step 1 has {K}")
        if any(not (-1.0 <= v <= 1.0) for v in row):  # also catches NaN
            raise ValueError(f"project_scores: step {t + 1} has a score outside [-1, 1]: {row} (use fit_scores)")
    if abs(step_means_sum(rows) - reward) <= tol:
        return rows
    if not abs(reward) <= len(rows):
        return None
    lo, hi = -2.0, 2.0  # f(lo) = -T <= R <= T = f(hi)
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if step_means_sum(_shifted(rows, mid)) < reward:
            lo = mid
        else:
            hi = mid
    out = min((_shifted(rows, c) for c in (lo, hi)), key=lambda s: abs(step_means_sum(s) - reward))
    return out if abs(step_means_sum(out) - reward) <= tol else None


# ----------------------------------------------------------------------------------------
# 2. The teacher protocol and collection: records appended as they finish, resumable
# ----------------------------------------------------------------------------------------

def make_teacher(args: Args):
    """The teacher of --teacher, given this environment to play in (env). Its protocol, as collect() calls it:
    `rollout(pairs of (question, sample), retriever)` → the trajectories and a meta per trajectory, and
    `annotate(trajectory, meta, K)` → K criteria and K scores per step and the issues met (App. B: the teacher
    annotates whole trajectories; Eq. 6 then projects the scores, make_record)."""
    if args.teacher == "oracle":
        return OracleTeacher(env, seed=args.seed, obs_chars=args.obs_chars)
    return OpenAITeacher(env, args.teacher_policy_model, args.teacher_rubric_model, args.teacher_temperature,
                         args.max_retries, args.backoff, args.timeout, args.concurrency, args.policy_max_tokens,
                         args.rubric_max_tokens, args.price_input, args.price_output, args.obs_chars)


def make_record(ex: env.Example, sample: int, traj: env.Trajectory, meta: dict, criteria: list[list[str]],
                raw_scores: list, issues: list[str], K: int, tol: float, teacher: str) -> dict:
    """One warmup record: the whole trajectory as logged by the environment, its rubric, Eq. 6."""
    T = len(traj.steps)  # rows beyond T are cut, missing ones padded (no criteria, neutral scores)
    fitted = [fit_scores(row, K) for row in (list(raw_scores) + [[]] * T)[:T]]
    teacher_scores = [row for row, _ in fitted]
    issues = list(issues) + [f"step {t + 1}: {w}" for t, (_, why) in enumerate(fitted)    # a missing step
                             if t < len(raw_scores) and raw_scores[t] != [] for w in why]      # is logged as such
    criteria = [[str(x) for x in (list(c) + [""] * K)[:K]] for c in (list(criteria) + [[]] * T)[:T]]
    projected = project_scores(teacher_scores, traj.reward, tol)
    d = traj.to_dict()
    steps = []
    for t, s in enumerate(d["steps"]):
        s["criteria"] = criteria[t]
        s["teacher_scores"] = teacher_scores[t]
        s["scores"] = projected[t] if projected is not None else None
        steps.append(s)
    return {"id": ex.id, "sample": sample, "dataset": ex.dataset, "teacher": teacher, "K": K,
            "variant": meta.get("variant", ""), "imperfect": bool(meta.get("imperfect", False)),
            "question": ex.question, "gold": ex.answers, "answer": traj.answer, "reward": traj.reward,
            "finished": traj.finished, "max_searches": traj.max_searches,
            "supporting": list(ex.supporting), "evidence_found": evidence_found(traj),
            "projected": projected is not None, "annotation_issues": issues, "steps": steps}


def _run_group(teacher, group: list[tuple[env.Example, list[int]]], retriever, K: int, tol: float,
               write: Callable[[dict], None], fail: Callable[[dict], None]) -> None:
    pairs = [(ex, s) for ex, samples in group for s in samples]
    try:
        trajs, metas = teacher.rollout(pairs, retriever)
    except TeacherError as e:
        for ex, s in pairs:
            fail({"id": ex.id, "sample": s, "stage": "policy", "error": str(e)})
        return
    for (ex, s), traj, meta in zip(pairs, trajs, metas):
        try:
            criteria, scores, issues = teacher.annotate(traj, meta, K)
        except TeacherError as e:
            fail({"id": ex.id, "sample": s, "stage": "rubric", "error": str(e)})
            continue
        write(make_record(ex, s, traj, meta, criteria, scores, issues, K, tol, teacher.name))


def collect(examples: Sequence[env.Example], teacher, retriever, out_dir: str | Path, k: int = 4, K: int = 3,
            tol: float = 1e-6, progress: bool = True) -> dict:
    """Collect k annotated trajectories per question into out_dir/records.jsonl (App. B), or
    records-k{K}.jsonl for K ≠ 3 (`collection_suffix`; failures.jsonl likewise).

    Resumable: (id, sample) pairs already in records.jsonl are skipped and cost no teacher call.
    Failures (after retries) go to failures.jsonl and are tried again by the next run. Returns the
    counts of this run.
    """
    out_dir = Path(out_dir)
    ks = collection_suffix(K)
    path = out_dir / f"records{ks}.jsonl"
    old = read_jsonl(path, repair=True)
    for r in old:
        if r.get("K") != K or r.get("teacher") != teacher.name:
            raise ValueError(f"{path}: records were made with teacher={r.get('teacher')} K={r.get('K')}, this run uses "
                             f"teacher={teacher.name} K={K}; choose another --out-dir")
    done = {(r["id"], r["sample"]) for r in old}
    unique: dict[str, env.Example] = {}
    for ex in examples:  # each id once
        unique.setdefault(ex.id, ex)
    examples = list(unique.values())
    jobs = [(ex, [s for s in range(k) if (ex.id, s) not in done]) for ex in examples]
    jobs = [j for j in jobs if j[1]]
    counts = Counter(skipped_finished=sum(k - len(j[1]) for j in jobs) + k * (len(examples) - len(jobs)))

    @serialized                                      # API workers write from their own threads
    def write(rec: dict) -> None:
        write_jsonl(path, [rec], append=True)
        counts["records"] += 1
        counts[f"reward_{rec['reward']:g}"] += 1

    @serialized
    def fail(rec: dict) -> None:
        write_jsonl(out_dir / f"failures{ks}.jsonl", [rec], append=True)
        counts[f"failed_{rec['stage']}"] += 1

    groups = [jobs[i:i + teacher.questions_per_call] for i in range(0, len(jobs), teacher.questions_per_call)]
    in_parallel(teacher, groups, retriever, lambda g, r: _run_group(teacher, g, r, K, tol, write, fail), progress)
    return dict(counts)


# ----------------------------------------------------------------------------------------
# 3. Filtering (App. B) and the SFT datasets
# ----------------------------------------------------------------------------------------

def criteria_ok(step: dict, K: int) -> bool:
    """A step keeps its μ SFT example only with K non-empty criteria."""
    c = step.get("criteria") or []
    return len(c) == K and all(isinstance(x, str) and x.strip() for x in c)


def filter_records(records: Sequence[dict], K: int, tol: float = 1e-6) -> tuple[list[dict], Counter]:
    """Records usable for μ SFT, and why the others (and steps) were dropped (App. B).

    A record is dropped when its scores could not be projected (infeasible Eq. 6), when its
    projected scores are not K wide, or when they miss the constraint by more than `tol`; steps
    with empty criteria are counted here and skipped by `rubric_sft_examples`.
    """
    kept, dropped = [], Counter()
    for r in records:
        rows = [s.get("scores") for s in r["steps"]]
        if not r.get("projected") or any(row is None for row in rows) or not rows:
            dropped["infeasible_projection"] += 1
        elif any(len(row) != K for row in rows):
            dropped["wrong_width"] += 1
        elif abs(step_means_sum(rows) - r["reward"]) > tol:
            dropped["constraint_violated"] += 1
        else:
            kept.append(r)
            dropped["empty_criteria_steps"] += sum(not criteria_ok(s, K) for s in r["steps"])
    return kept, dropped


def steps_of(record: dict) -> list[env.Step]:
    return [env.Step(prompt=[], output=s["output"], action=s["action"], argument=s["argument"],
                     observation=s["observation"], valid=s["valid"], reason=s["reason"],
                     searches_left=s["searches_left"], forced_finish=s["forced_finish"], retrieved=s.get("retrieved"))
            for s in record["steps"]]


def policy_sft_examples(records: Sequence[dict], min_reward: float = 1.0, require_evidence: bool = True,
                        dropped: Counter | None = None) -> list[dict]:
    """π SFT data (App. B, "Policy warmup"): one example per valid step of a successful trajectory.

    Successful: R >= min_reward and (with `require_evidence`) every supporting paragraph was
    retrieved, so no example teaches a lucky guess. The oracle's deliberately imperfect
    trajectories (a wrong-entity or redundant search that still ended with R = 1) are there for
    μ and are not imitated. Input: the exact prompt the RL policy sees at
    that step (`env.policy_messages` with the same history text, budget and finish-only switch);
    target: the action string, Search[query] or Finish[answer]. Invalid steps stay in later
    prompts' history, as in the environment, but are not targets.
    """
    dropped = dropped if dropped is not None else Counter()
    out = []
    for r in records:
        if r["reward"] < min_reward:
            dropped["low_reward"] += 1
            continue
        if require_evidence and not r.get("evidence_found"):
            dropped["evidence_not_found"] += 1
            continue
        if r.get("imperfect"):
            dropped["imperfect_variant"] += 1
            continue
        steps = steps_of(r)
        for t, s in enumerate(steps):
            if not s.valid:
                dropped["invalid_step"] += 1
                continue
            out.append({"id": r["id"], "sample": r["sample"], "step": t,
                        "messages": env.policy_messages(r["question"], env.format_history(steps[:t]), s.searches_left,
                                                        s.forced_finish),
                        "target": s.action_text()})
    return out


def rubric_sft_examples(records: Sequence[dict]) -> list[dict]:
    """μ SFT data (App. B, "Rubric warmup"; Eq. 7): one item per step with K non-empty criteria.

    Each item: question, prefix h_t (the history text before the step, as π saw it), action a_t,
    searches left, the K criteria r̃_t and the K projected scores ŝ_t. Pass records through
    `filter_records` first.
    """
    out = []
    for r in records:
        steps = steps_of(r)
        for t, (s, raw) in enumerate(zip(steps, r["steps"])):
            if not criteria_ok(raw, r["K"]) or raw.get("scores") is None:
                continue
            out.append({"id": r["id"], "sample": r["sample"], "step": t, "question": r["question"],
                        "prefix": env.format_history(steps[:t]), "action": s.action_text(),
                        "searches_left": s.searches_left, "forced_finish": s.forced_finish,
                        "criteria": list(raw["criteria"]), "scores": list(raw["scores"])})
    return out


# ----------------------------------------------------------------------------------------
# 4. π SFT and μ SFT (App. B, Eq. 7)
# ----------------------------------------------------------------------------------------

def trajectory_units(items: Sequence[dict]) -> list[list[int]]:
    """The indices of each trajectory's items (same id and sample; items without them stand alone), in order of
    first appearance: a training pass holds whole trajectories."""
    units: dict = {}
    for i, it in enumerate(items):
        units.setdefault((it["id"], it.get("sample", 0)) if "id" in it else i, []).append(i)
    return list(units.values())


def trajectory_batches(items: Sequence[dict], batch_size: int, rng: random.Random) -> list[list[list[int]]]:
    """SFT's optimizer batches (π and μ; the release shuffles single steps): the items' trajectories, shuffled, cut
    into ceil(items / batch_size) batches of about `batch_size` steps (as many optimizer steps as single steps
    give), each a list of whole trajectories, whose shared beginning the fast engine runs once (CHOICES.md)."""
    groups = trajectory_units(items)
    rng.shuffle(groups)
    n_batches = max(1, math.ceil(len(items) / max(1, batch_size)))
    batches: list[list[list[int]]] = [[] for _ in range(n_batches)]
    done = 0
    for g in groups:
        batches[min(n_batches - 1, int((done + len(g) / 2) * n_batches / max(1, len(items))))].append(g)
        done += len(g)
    return [b for b in batches if b]


def warmup_cosine(optimizer, total_steps: int, warmup_fraction: float = 0.03):
    """The release's SFT learning-rate schedule: linear warmup over the first 3% of the optimizer
    steps, then a cosine decay to 0 (a LambdaLR over each group's own learning rate)."""
    warm = max(1, int(warmup_fraction * total_steps))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total_steps - warm))))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def policy_sft_backward(pi, batch: Sequence[tuple[list[int], list[int]]], units: Sequence[Sequence[int]],
                        pass_tokens: int | None = None) -> float:
    """π SFT's loss on one optimizer batch of (policy prompt, action) pairs, backpropagated; returns its
    value: the mean NLL of the target actions' tokens (target tokens only) over the whole batch, so how the
    batch is cut into passes (`units`, e.g. its trajectories, packed up to `pass_tokens`) does not change it."""
    seqs, lens = [p + r for p, r in batch], [len(r) for _, r in batch]
    total = 0.0
    passes = training_passes(pi, seqs, lens, budget=pass_tokens, units=units)
    for p in passes:
        loss = -(p.logprobs * p.mask).sum() / sum(lens)
        loss.backward()
        total += float(loss.detach())
    passes.backward_shared()                     # the fast engine: the shared prompt's gradients, through it once
    return total


def dev_rank(scores: dict) -> tuple:
    """How two dev evaluations compare when a checkpoint is chosen (π SFT's epoch here, the RL epoch in
    arco.select_checkpoint): dev EM (the paper's and the release's only key), then F1, then fewer invalid
    steps; a full tie keeps the earlier epoch (as the release's strict `>` does). Our tie-breaks matter
    only where EM ties, e.g. a tiny run where every epoch scores 0 EM: there the release keeps epoch 1."""
    return scores["em"], scores["f1"], -scores.get("invalid_rate", 0.0)


def train_policy_sft(pi, examples: Sequence[dict], epochs: int, lr: float, batch_size: int = 8, seed: int = 0,
                     progress: bool = True, pass_tokens: int | None = 1024, weight_decay: float = 0.0,
                     evaluate: Callable | None = None, every_epoch: bool = True) -> dict:
    """π warmup (App. B): a LoRA trained on (policy prompt → action), then merged into the weights.

    AdamW with a 3%-warmup cosine schedule (the release's). With `evaluate` (π → its dev scores), π is
    evaluated after every epoch and the epoch with the best dev EM is kept (the release's choice), App.
    B's "the selected policy checkpoint initializes π"; see dev_rank for ties. Without `every_epoch`, only
    the last epoch is evaluated (and kept). Returns the mean loss of
    each epoch, the evaluations, and the chosen epoch with its scores and trajectories.
    """
    from tqdm import tqdm
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
    data = [(chat_prompt_ids(pi.tokenizer, ex["messages"]), encode_response(pi, ex["target"])) for ex in examples]
    add_lora(pi)
    opt = torch.optim.AdamW(trainable_parameters(pi.model), lr=lr, weight_decay=weight_decay)
    schedule = warmup_cosine(opt, epochs * math.ceil(len(data) / max(1, batch_size)))
    rng, losses, evals, best = random.Random(seed), [], [], None
    for epoch in range(epochs):
        pi.model.train()
        total = 0.0
        batches = trajectory_batches(examples, batch_size, rng)
        for batch in tqdm(batches, desc=f"π SFT epoch {epoch + 1}/{epochs}", disable=not progress, leave=False):
            b = [i for g in batch for i in g]
            opt.zero_grad(set_to_none=True)
            total += policy_sft_backward(pi, [data[i] for i in b], trajectory_units([examples[i] for i in b]),
                                         pass_tokens) * len(b)
            opt.step()
            schedule.step()
        losses.append(total / max(len(data), 1))
        pi.model.eval()
        line = f"[warmup] π SFT epoch {epoch + 1}: loss {losses[-1]:.4f}"
        if evaluate is not None and (every_epoch or epoch + 1 == epochs):
            scores, trajs = evaluate(pi)
            evals.append(scores)
            line += f", dev EM {scores['em']:.1f} F1 {scores['f1']:.1f}"
            if best is None or dev_rank(scores) > dev_rank(best["scores"]):
                best = {"epoch": epoch + 1, "scores": scores, "trajectories": trajs,
                        "adapter": {k: v.detach().clone() for k, v in get_peft_model_state_dict(pi.model).items()}}
        print(line, flush=True)
    if best is not None and best["epoch"] != epochs:
        set_peft_model_state_dict(pi.model, best.pop("adapter"))
        print(f"[warmup] π SFT: keeping epoch {best['epoch']} (best dev EM)", flush=True)
    merge_lora(pi)
    return {"losses": losses, "evals": evals, "best": best}


def rubric_items(mu, items: Sequence[dict]):
    """μ SFT items → (StepContext list, teacher Rubric list, projected scores [B, K])."""
    contexts = [StepContext(it["question"], it["prefix"], it["action"], it["searches_left"]) for it in items]
    rubrics = [mu.rubric_from_criteria(it["criteria"]) for it in items]
    targets = torch.tensor([it["scores"] for it in items], dtype=torch.float32, device=mu.backbone.device)
    return contexts, rubrics, targets


def rubric_sft_loss(d: torch.Tensor, targets: torch.Tensor, logprobs: torch.Tensor | None, mask: torch.Tensor,
                    lam: float, token_reduction: str = "sum", n_steps: int | None = None, n_tokens: int | None = None):
    """Eq. 7: −Σ_t log p_θ(r̃_t | q, h_t, a_t) + λ Σ_t ‖d_t − ŝ_t‖², on the steps of a pass.

    `d` [n, K] is the score head's d_t on the full scoring sequence (q, h_t, a_t, r̃_t), `targets` [n, K]
    the projected teacher scores ŝ_t, `logprobs` [n, R] (with `mask`) the teacher rubric's token log-probs:
    the text term, None for the variants with no generated rubric (App. B's ablations "either remove the
    rubric text target or replace it with a fixed rubric": 'none' and 'static', neither with a text term here). `token_reduction` "sum" is Eq. 7's form (the NLL summed over a rubric's tokens and
    the error over the K scores, both averaged over steps); "mean" is the release's (the NLL averaged over
    rubric tokens, the error over steps × K). `n_steps`, `n_tokens`: the whole batch's, when the pass is a
    part of it (the parts' losses then add up to the batch's). Returns (loss, text, score)."""
    n_steps = n_steps or len(d)
    sq = ((d.float() - targets) ** 2).sum()
    score = sq / n_steps if token_reduction == "sum" else sq / (n_steps * d.shape[-1])
    text = sq.new_zeros(())
    if logprobs is not None:
        nll = -(logprobs * mask).sum()
        text = nll / n_steps if token_reduction == "sum" else nll / max(1, n_tokens or int(mask.sum()))
    return text + lam * score, text, score


def rubric_sft_passes(mu, items: Sequence[dict], lam: float, units: Sequence[Sequence[int]],
                      token_reduction: str = "sum", pass_tokens: int | None = None):
    """Eq. 7 (rubric_sft_loss) on each pass of a batch (`units`: index lists into `items` kept in one pass, e.g.
    a trajectory's steps; packed up to `pass_tokens`, None: a pass each), normalized over the whole batch: the
    passes (training_passes) and the (loss, text, score) of each, to iterate. Both heads read the same pass
    (Eq. 2's mean-pooled hidden states, the rubric tokens' log-probs)."""
    contexts, rubrics, targets = rubric_items(mu, items)
    has_text = mu.rubric_mode not in ("static", "none")        # App. B: no rubric text target for these
    seqs = mu.scoring_ids(contexts, rubrics)
    lens = [len(r.token_ids) if has_text else 0 for r in rubrics]
    passes = training_passes(mu.backbone, seqs, lens, budget=pass_tokens, units=units, hidden=True)
    return passes, (rubric_sft_loss(mu.step_scores(mean_pool(p.hidden, p.hidden_mask)).d, targets[p.index],   # Eq. 2
                                    p.logprobs if has_text else None, p.mask, lam, token_reduction, len(items),
                                    sum(lens)) for p in passes)


def rubric_sft_backward(mu, items: Sequence[dict], lam: float, units: Sequence[Sequence[int]],
                        token_reduction: str = "sum", pass_tokens: int | None = None) -> float:
    """Eq. 7 on one optimizer batch, backpropagated pass by pass (`units`, `pass_tokens`); returns its value (how
    the batch is cut into passes does not change it)."""
    total = 0.0
    passes, losses = rubric_sft_passes(mu, items, lam, units, token_reduction, pass_tokens)
    for loss, _, _ in losses:
        loss.backward()
        total += float(loss.detach())
    passes.backward_shared()                     # the fast engine: the shared prompt's gradients, through it once
    return total


def rubric_sft_terms(mu, items: Sequence[dict], lam: float, token_reduction: str = "sum",
                     pass_tokens: int | None = 1024) -> dict:
    """The two terms of Eq. 7 over `items`, without gradients (to show μ SFT lowers both)."""
    mu.eval()
    with torch.no_grad():
        terms = [(float(t), float(sc)) for _, t, sc in rubric_sft_passes(mu, items, lam, trajectory_units(items),
                                                                         token_reduction, pass_tokens)[1]]
    return {"text_nll": sum(t for t, _ in terms), "score_sq_error": sum(sc for _, sc in terms)}


def train_rubric_sft(mu, items: Sequence[dict], epochs: int, lr: float, head_lr: float, lam: float,
                     batch_size: int = 8, seed: int = 0, progress: bool = True, weight_decay: float = 0.0,
                     token_reduction: str = "sum", pass_tokens: int | None = 1024) -> list[float]:
    """μ warmup (App. B, Eq. 7): a LoRA on μ's backbone and the score head, trained together with
    separate learning rates (AdamW, the release's 3%-warmup cosine schedule); the last epoch is kept
    (as in the release, which has no validation split for μ) and its LoRA merged. Returns the mean
    loss of each epoch."""
    from tqdm import tqdm
    add_lora(mu.backbone)
    opt = torch.optim.AdamW(mu.parameter_groups(lr, head_lr), weight_decay=weight_decay)
    schedule = warmup_cosine(opt, epochs * math.ceil(len(items) / max(1, batch_size)))
    rng, losses = random.Random(seed), []
    mu.train()
    for epoch in range(epochs):
        total = 0.0
        for batch in tqdm(trajectory_batches(items, batch_size, rng), desc=f"μ SFT epoch {epoch + 1}/{epochs}",
                          disable=not progress, leave=False):
            b = [items[i] for g in batch for i in g]
            opt.zero_grad(set_to_none=True)
            total += rubric_sft_backward(mu, b, lam, trajectory_units(b), token_reduction, pass_tokens) * len(b)
            opt.step()
            schedule.step()
        losses.append(total / max(len(items), 1))
        print(f"[warmup] μ SFT epoch {epoch + 1}: loss {losses[-1]:.4f}", flush=True)
    mu.eval()
    merge_lora(mu.backbone)
    return losses


def fit_score_head(mu, items: Sequence[dict], steps: int, lr: float, rubrics=None,
                   pass_tokens: int | None = 1024) -> list[float]:
    """Eq. 7's score term minimized further over the score head φ alone, the backbone fixed: each
    step's pooled vector h̄_t (Eq. 2; packed as in rubric_sft_backward) computed once, then `steps`
    full-batch Adam steps on the squared error ‖g_φ(h̄_t) − ŝ_t‖² (mean over steps × K). A choice of ours
    (CHOICES.md): with a laptop's few hundred μ SFT steps, the joint epochs leave the head near the
    targets' mean, while the pooled vectors already separate useful from useless steps. h̄_t is read on
    the teacher's rubric (Eq. 7's text) unless `rubrics` gives others. Returns the term before and after."""
    contexts, teacher, targets = rubric_items(mu, items)
    seqs = mu.scoring_ids(contexts, rubrics or teacher)
    mu.eval()
    with torch.no_grad():
        order, pooled = [], []
        for p in training_passes(mu.backbone, seqs, [0] * len(seqs), budget=pass_tokens, units=trajectory_units(items),
                                 hidden=True):
            order += p.index
            pooled.append(mean_pool(p.hidden, p.hidden_mask))                                    # Eq. 2's h̄_t
        pooled = torch.cat(pooled)[torch.argsort(torch.tensor(order))]                     # back in the items' order

    def error() -> torch.Tensor:
        return ((mu.head(pooled).float() - targets) ** 2).mean()
    with torch.no_grad():
        before = float(error())
    opt = torch.optim.Adam(mu.head.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        error().backward()
        opt.step()
    with torch.no_grad():
        after = float(error())
    print(f"[warmup] μ score head fit: {steps} steps, squared error {before:.4f} -> {after:.4f}", flush=True)
    return [before, after]


def train_pi(args: Args, out_dir: Path, pi_examples: Sequence[dict], retriever) -> dict:
    """π SFT (App. B) with its greedy dev evaluations (the base model first, with --eval-all), π_sft/ saved merged,
    the SFT-only evaluation kept for arco.py's epoch 0, the facts in metrics.json; a π_sft/ already there is kept."""
    old = json.loads((out_dir / "metrics.json").read_text()) if (out_dir / "metrics.json").is_file() else {}
    if (out_dir / "pi_sft" / "config.json").is_file() and "sft_only" in old:
        print(f"[warmup] π SFT: reusing {out_dir / 'pi_sft'}", flush=True)
        return old
    dev = env.load_split(args.dataset, "dev", args.data_dir or None, args.sft_eval_size or args.eval_size, args.seed)
    metrics: dict = {**old, "dataset": args.dataset, "dev_questions": len(dev)}
    settings = eval_settings(dev, args.seed, args.max_new_tokens_pi, args.obs_chars, args.gen_batch)
    pi = load_backbone(args.model, **loading(args))

    def dev_eval(policy):
        with MEMORY.phase("dev evaluation"):
            return env.evaluate(dev, policy_act(policy, 0.0, args.max_new_tokens_pi, args.gen_batch), retriever,
                                obs_chars=args.obs_chars)               # greedy
    if args.eval_all and old.get("base_settings") != settings:    # kept at once: a resumed warmup does not redo it
        print(f"[warmup] evaluating the base policy ({args.model}) on {len(dev)} dev questions", flush=True)
        metrics["base"], _ = dev_eval(pi)
        metrics["base_settings"] = settings
        write_json(out_dir / "metrics.json", metrics)
    torch.manual_seed(args.seed)            # π's LoRA initialization and dropout: a warmup repeats exactly
    with MEMORY.phase("π SFT"):
        sft = train_policy_sft(pi, pi_examples, args.sft_epochs_pi, args.sft_lr_pi, args.sft_batch_pi, args.seed,
                               args.progress, args.pass_tokens, args.weight_decay, dev_eval, args.eval_all)
    metrics["pi_sft_loss_per_epoch"] = sft["losses"]
    metrics["pi_sft_dev_em_per_epoch"] = [e["em"] for e in sft["evals"]]
    metrics["pi_sft_epoch"] = sft["best"]["epoch"]
    metrics["pi_sft_settings"] = pi_sft_settings(args)          # what a run must ask for to reuse this π_sft
    write_atomically(out_dir / "pi_sft", lambda tmp: save_backbone(pi, tmp))   # a kill leaves none
    # The chosen epoch's evaluation is the SFT-only row (greedy: the merged weights decode the same), and what
    # arco.py needs to take it as its epoch 0 instead of repeating it.
    metrics["sft_only"], metrics["sft_only_settings"] = sft["best"]["scores"], settings
    write_jsonl(out_dir / "eval_sft_only.jsonl", [t.to_dict() for t in sft["best"]["trajectories"]])
    base = f"base {metrics['base']['em']:.1f} -> " if "base" in metrics else ""
    print(f"[warmup] dev EM: {base}SFT only {metrics['sft_only']['em']:.1f}", flush=True)
    write_json(out_dir / "metrics.json", metrics)
    return metrics


def train_mu(args, items: Sequence[dict], head_steps: int | None = None) -> tuple[RubricModel, dict]:
    """μ SFT (App. B, Eq. 7) on `items`: a fresh μ's LoRA and score head trained together, then the score-head fit
    (`head_steps`, default --sft-head-steps). Returns μ and its SFT's facts (Eq. 7's terms before/after, losses)."""
    mu_backbone = load_backbone(args.mu_model or args.model, **loading(args))
    torch.manual_seed(args.seed)                # μ's score head, LoRA and dropout (whether π was reused or not)
    mu = RubricModel(mu_backbone, k=args.k, rubric_mode=args.rubric, examples=args.mu_examples,
                     rubric_format=args.rubric_format)
    probe = list(items[:args.warmup_probe])
    facts = {"token_reduction": args.token_reduction, "sft_items": len(items),
             **{key: getattr(args, key) for key in MU_SFT_SETTINGS}}        # what check_mu_settings compares
    facts["mu_sft_terms_before"] = rubric_sft_terms(mu, probe, args.score_weight, args.token_reduction,
                                                    args.pass_tokens)
    with MEMORY.phase("μ SFT"):
        facts["mu_sft_loss_per_epoch"] = train_rubric_sft(mu, items, args.sft_epochs_mu, args.sft_lr_mu,
                                                          args.sft_head_lr, args.score_weight, args.sft_batch_mu,
                                                          args.seed, args.progress, args.weight_decay,
                                                          args.token_reduction, args.pass_tokens)
    steps = args.sft_head_steps if head_steps is None else head_steps
    if steps:
        with MEMORY.phase("score-head fit"):
            facts["mu_head_fit_error"] = fit_score_head(mu, items, steps, args.sft_head_lr,
                                                        pass_tokens=args.pass_tokens)
    facts["mu_sft_terms_after"] = rubric_sft_terms(mu, probe, args.score_weight, args.token_reduction,
                                                   args.pass_tokens)
    return mu, facts


def keep_mu(out_dir: Path, name: str, mu: RubricModel, facts: dict) -> dict:
    """μ saved as out_dir/name (a kill leaves none), its facts in metrics.json["mu"][name] (read again first: a μ
    variant trained beside this one may have added its own)."""
    write_atomically(out_dir / name, mu.save)
    now = json.loads((out_dir / "metrics.json").read_text()) if (out_dir / "metrics.json").is_file() else {}
    metrics = {**now, "mu": {**now.get("mu", {}), name: facts}, **facts}   # the last μ also at the top level
    write_json(out_dir / "metrics.json", metrics)
    return metrics


def on_policy_teacher(args, out_dir: Path, policy: Path | None = None) -> OnPolicyTeacher:
    """π_sft of the warmup in `out_dir` (or the π saved in `policy`, a run's checkpoint) as the player, the oracle
    annotating (--mu-data policy: the release's local-policy mode)."""
    pi, _ = load_backbone_checkpoint(policy or out_dir / "pi_sft", **loading(args))
    return OnPolicyTeacher(env, pi, args.rollout_temperature, args.max_new_tokens_pi, args.gen_batch, args.seed,
                           args.obs_chars)


def policy_records(args, out_dir: Path, questions: Sequence[env.Example], retriever,
                   samples: int | None = None) -> list[dict]:
    """π_sft's own rollouts of the μ SFT questions (`samples` each, default --warmup-samples, at the rollout
    temperature), every step annotated by the oracle from the gold evidence and projected (Eq. 6): the kept
    records, collected into policy_rollouts/ beside the teacher's records, resumable as they are."""
    samples = samples or args.warmup_samples
    folder = out_dir / "policy_rollouts"
    collect(questions, on_policy_teacher(args, out_dir), retriever, folder, samples, args.k, args.tol, args.progress)
    kept, dropped = filter_records(read_jsonl(folder / f"records{collection_suffix(args.k)}.jsonl"), args.k, args.tol)
    print(f"[warmup] μ SFT on π_sft's own rollouts: {len(kept)} trajectories kept (dropped: {dict(dropped) or 'none'})",
          flush=True)
    wanted = {ex.id for ex in questions}             # the records of the asked questions and samples only
    return [r for r in kept if r["id"] in wanted and r["sample"] < samples]


# ----------------------------------------------------------------------------------------
# 5. The warmup run, and what RL starts from
# ----------------------------------------------------------------------------------------

def summarize(records: Sequence[dict], examples: Sequence[env.Example], run: dict, args: Args,
              teacher) -> tuple[dict, list[dict], list[dict]]:
    """(counts of the warmup set: rewards, evidence, drops by reason, SFT sizes, API usage; π SFT; μ SFT)."""
    # A μ SFT step costs 2–3× a π SFT example on CPU: a laptop warmup may teach μ on its first questions only.
    first = {ex.id for ex in examples[:args.sft_questions_mu or len(examples)]}
    kept, dropped = filter_records([r for r in records if r["id"] in first], args.k, args.tol)
    pi_dropped = Counter()
    pi = policy_sft_examples(records, args.min_reward, args.require_evidence, pi_dropped)
    mu = rubric_sft_examples(kept)
    rewards = Counter(f"{r['reward']:g}" for r in records)
    return {"records": len(records), "reward_1": rewards.get("1", 0), "reward_0": rewards.get("0", 0),
            "evidence_found": sum(bool(r.get("evidence_found")) for r in records),
            "variants": dict(Counter(r.get("variant", "") for r in records)),
            "this_run": run, "mu_records_kept": len(kept), "dropped_mu": dict(dropped), "dropped_pi": dict(pi_dropped),
            "policy_sft_examples": len(pi), "rubric_sft_examples": len(mu),
            "teacher_usage_this_run": teacher.usage()}, pi, mu


def run(args: Args) -> Path:
    """The whole warmup: collection (resumable), filtering, SFT datasets, π SFT and its evaluation, μ SFT."""
    if args.dataset not in DATASETS:
        raise DataError(f"unknown dataset '{args.dataset}': choose one of {', '.join(DATASETS)}")
    out_dir = warmup_folder(args)
    check_retriever(out_dir, args.retriever, args.retriever_pooling)
    check_pi_settings(out_dir, args)
    examples = env.load_split(args.dataset, args.split, args.data_dir or None, args.warmup_size or None, args.seed)
    teacher = make_teacher(args)
    retriever = env.shared_retriever(args.retriever or None, args.retriever_pooling)
    write_json(out_dir / "args.json", dataclasses.asdict(args))
    write_json(out_dir / "retriever.json", {"retriever": args.retriever or EMBEDDED_RETRIEVER,
                                            "pooling": args.retriever_pooling})
    ks = collection_suffix(args.k)
    try:
        with MEMORY.phase("warmup collection"):
            run_counts = collect(examples, teacher, retriever, out_dir, args.warmup_samples, args.k, args.tol,
                                 args.progress)
    except KeyboardInterrupt:
        sys.exit(f"interrupted: every finished record is in {out_dir / f'records{ks}.jsonl'}; "
                 f"rerun the same command to resume")
    wanted = {ex.id for ex in examples}
    records = [r for r in read_jsonl(out_dir / f"records{ks}.jsonl") if r["id"] in wanted and r["sample"] < args.warmup_samples]
    summary, pi, mu = summarize(records, examples, run_counts, args, teacher)
    for name, rows in ((f"policy_sft{ks}.jsonl", pi), (f"rubric_sft{ks}.jsonl", mu)):
        write_jsonl(out_dir / name, rows)
    write_json(out_dir / f"summary{ks}.json", summary)
    failed = sum(v for k, v in run_counts.items() if k.startswith("failed_"))
    print(f"warmup records: {summary['records']} (R=1: {summary['reward_1']}, R=0: {summary['reward_0']}, "
          f"evidence found: {summary['evidence_found']}); this run: {run_counts.get('records', 0)} new, "
          f"{run_counts.get('skipped_finished', 0)} already done, {failed} failed")
    print(f"dropped for μ SFT: {summary['dropped_mu'] or 'none'}; not used for π SFT: {summary['dropped_pi'] or 'none'}")
    print(f"π SFT examples: {summary['policy_sft_examples']}; μ SFT examples: {summary['rubric_sft_examples']}")
    if summary["teacher_usage_this_run"]:
        print(f"teacher usage: {summary['teacher_usage_this_run']}")
    if args.collect_only:
        print(f"written to {out_dir}/ (records{ks}.jsonl, summary{ks}.json, policy_sft{ks}.jsonl, "
              f"rubric_sft{ks}.jsonl)")
        return out_dir
    if not pi or not mu:
        raise ValueError(f"nothing to fine-tune on: {len(pi)} π SFT and {len(mu)} μ SFT examples")
    train_pi(args, out_dir, pi, retriever)
    name = mu_dir_name(dataclasses.asdict(args))
    if not args.train_mu:
        return out_dir
    if (out_dir / name / "config.json").is_file():
        check_mu_settings(out_dir, name, args)
        print(f"[warmup] μ SFT: reusing {out_dir / name}", flush=True)
        return out_dir
    if args.mu_data != "teacher":               # π_sft plays the μ SFT questions, the oracle annotates (or both)
        questions = examples[:args.sft_questions_mu or len(examples)]
        mu = rubric_sft_examples(policy_records(args, out_dir, questions, retriever)) + \
            (list(mu) if args.mu_data == "both" else [])
    model, facts = train_mu(args, mu)
    keep_mu(out_dir, name, model, facts)
    print(f"μ SFT, Eq. 7 terms on {min(len(mu), args.warmup_probe)} items: text NLL "
          f"{facts['mu_sft_terms_before']['text_nll']:.2f} -> {facts['mu_sft_terms_after']['text_nll']:.2f}, score "
          f"error {facts['mu_sft_terms_before']['score_sq_error']:.3f} -> "
          f"{facts['mu_sft_terms_after']['score_sq_error']:.3f}")
    print(f"written to {out_dir}/ (pi_sft/, {name}/, metrics.json, records{ks}.jsonl, summary{ks}.json)")
    return out_dir


def run_from_arco(a, train_mu: bool = True) -> Path:
    """The offline oracle warmup with the settings of an arco.py run (its preset and flags): the settings the
    two scripts share (Settings, which arco.Args extends) are copied by name."""
    shared = {f.name: getattr(a, f.name) for f in dataclasses.fields(Settings)}
    return run(Args(**shared, train_mu=train_mu))


@dataclass
class Warmup:
    """What RL starts from (Alg. 1, line 1): π_sft, μ_sft (None for a run without μ), the ids of the questions the
    warmup's records hold, and its folder."""
    folder: Path
    pi: Path
    mu: Path | None
    taught: set[str]


def ensure(args, with_mu: bool) -> Warmup:
    """π_sft/ and the μ this run needs (infra.warmups.mu_dir_name) of the warmup (§3.2, App. B): the offline oracle
    warmup runs for whatever is missing (run_from_arco). Runs that differ only in μ (the ablations, K, --mu-model)
    share one collection and one π SFT; a μ already there is used only if it was fine-tuned as this run asks."""
    folder = warmup_folder(args)
    mu = mu_dir_name(dataclasses.asdict(args)) if with_mu else None
    check_retriever(folder, args.retriever, args.retriever_pooling)
    check_pi_settings(folder, args)
    if mu:
        check_mu_settings(folder, mu, args)
    missing = [n for n in ("pi_sft", mu) if n and not (folder / n / "config.json").is_file()]
    for name in {"pi_sft", mu} - set(missing) - {None}:
        check_intact(folder / name)           # a damaged warmup model is named before anything loads
    if missing:
        print(f"[arco] {folder} has no {' or '.join(m + '/' for m in missing)}: running the offline oracle "
              f"warmup first (warmup.py)", flush=True)
        run_from_arco(args, train_mu=with_mu)
    taught = {r["id"] for path in folder.glob("records*.jsonl") for r in read_jsonl(path)}
    return Warmup(folder, folder / "pi_sft", folder / mu if mu else None, taught)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(Args, argv, description=__doc__)
    for name in {args.model, args.mu_model or args.model}:      # before any folder
        check_model_available(name)
    try:
        run(args)
    except (DataError, TeacherError, ValueError) as e:
        sys.exit(f"error: {scrub(str(e))}")


if __name__ == "__main__":
    main_guard(main, DataError, ModelLoadError)
