"""Supervised warmup of ARCO: teacher trajectories, trajectory-level rubrics, score projection.

Paper: §3.2 ("a closed-source LLM teacher collects trajectories and step rubrics ... π is SFT-
initialized on the trajectories, μ by a text-LM loss on the criteria plus an MSE on projected
criterion scores") and Appendix B (warmup details, Eq. 6 and Eq. 7).

What lives here, top to bottom:
  1. Eq. 6: `clip_and_fit` (teacher scores -> K numbers in [-1, 1]) and `project_scores` (one
     shared shift, found by bisection, then clipping, so that the per-step means of a trajectory
     sum to its reward R(τ); the teacher's order of scores is kept);
  2. the oracle teacher (`--teacher oracle`, default: offline, free, deterministic): it acts from
     the gold evidence (MuSiQue decomposition, 2Wiki evidence triples, synthetic hops, HotpotQA
     supporting titles), plays gold and deliberately imperfect trajectories in the real
     environment, and annotates every step with K criteria naming what the step targeted and K
     scores from what actually happened;
  3. the OpenAI-compatible teacher (`--teacher openai`): one model acts as the policy through
     `env.rollout`, another annotates each whole trajectory (our own trajectory-level prompt that
     states the decomposition constraint); robust parsing, retries with exponential backoff,
     token and cost counters;
  4. collection: k samples per question, one JSON record per (question, sample) appended and
     fsync'ed to `runs/<dataset>/warmup/records.jsonl` as it finishes; a rerun resumes; a collection
     for another K goes beside it (`records-k5.jsonl`, `collection_suffix`);
  5. filtering (Eq. 6 within a tolerance; steps with empty criteria) and the two SFT datasets:
     `policy_sft_examples` (π: the exact RL policy prompt -> the action string) and
     `rubric_sft_examples` (μ: question, prefix h_t, action a_t, K criteria, K projected scores).

The SFT training itself (π SFT; μ SFT with Eq. 7) builds on rubric_model.py.

    python warmup.py --dataset synthetic --train-size 200        # oracle teacher, offline
    python warmup.py --dataset hotpotqa --teacher openai         # needs OPENAI_API_KEY (and OPENAI_BASE_URL)
    python warmup.py --check-gold --dataset all --split dev      # gold-evidence retrieval rates
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

import env
import fast  # registers --engine fast
from evaluate import MEMORY, auc_by_step_type, main_guard, normalize_answer, parse_args
from rubric_model import (ENGINES, RUBRIC_FORMATS, RUBRIC_MODES, ModelLoadError, ModelSettings, RubricModel, StepContext, add_lora,
                          chat_prompt_ids, check_model_available, contexts_from_trajectory, encode_response,
                          load_backbone, load_backbone_checkpoint, merge_lora, policy_act, save_backbone,
                          trainable_parameters, training_passes, write_atomically)


PRESET_NAMES = ("cpu", "paper")


def from_preset(paper, cpu, **metadata) -> dataclasses.Field:
    """A setting that takes its --preset's value unless the command line gives one, declared with both values
    beside it: `paper`, the authors' release recipe for HotpotQA/Qwen (configs/hotpotqa/*.yaml and
    src/training/rl_trainer.py of the public repository zihangtian/ARCO; the README's difference table lists
    every value that is not the paper's text), and `cpu`, the same semantics at a laptop's size. The field's
    default is None (what the command line left unset); fill_from_preset puts the preset's value there."""
    return field(default=None, metadata={**metadata, "presets": {"paper": paper, "cpu": cpu}})


def fill_from_preset(args) -> None:
    """Every preset-driven field of `args` (declared with from_preset) left None takes its --preset's value."""
    for f in dataclasses.fields(args):
        if "presets" in f.metadata and getattr(args, f.name) is None:
            setattr(args, f.name, f.metadata["presets"][args.preset])


def preset_table(cls: type) -> dict[str, dict]:
    """{preset: {setting: value}} of a settings class, read from its fields' declarations (never typed twice)."""
    fields = [f for f in dataclasses.fields(cls) if "presets" in f.metadata]
    return {name: {f.name: f.metadata["presets"][name] for f in fields} for name in PRESET_NAMES}


@dataclass
class Settings(ModelSettings):
    """The knobs warmup.py and arco.py share, declared once (arco.Args and Args below extend them). Those
    declared with `from_preset(paper=..., cpu=...)` take the --preset's value when the command line leaves them
    unset; the README's table "paper | release | this implementation" says where each value comes from."""
    rollout_temperature: float | None = from_preset(paper=0.7, cpu=0.7, help="π's sampling temperature (release 0.7)")
    base_eval: bool | None = from_preset(paper=True, cpu=False, help="evaluate the base model on the dev questions "
                                         "before π SFT (the warmup's first row; the embedded SmolLM2 scores 0 EM: "
                                         "it has not learned the action format, README)")
    eval_every_epoch: bool | None = from_preset(paper=True, cpu=False, help="evaluate on the dev questions after "
                                                "every π SFT epoch (the best is kept) and every RL epoch (release); "
                                                "off: after the last π SFT epoch (kept) and after the RL epochs "
                                                "§4.1's checkpoint selection reads (those after --sparse-epochs)")
    sft_eval_size: int = field(default=0, metadata={
        "help": "dev questions of the warmup's base and π SFT evaluations (the choice of π SFT's epoch); 0 = "
                "--eval-size. A smaller one saves the warmup's time; arco.py then evaluates epoch 0 itself"})
    mu_data: str = field(default="teacher", metadata={
        "help": "μ SFT data: teacher (the oracle's or API teacher's own trajectories, App. B), policy (π_sft's own "
                "rollouts of the μ SFT questions, each step annotated by the oracle from the gold evidence; issue 33) "
                "or both", "choices": ["teacher", "policy", "both"]})
    engine: str = field(default="fast", metadata={"help": "how π's and μ's passes and replies are computed: fast "
                                                           "(shared beginnings once, packed, a cached decoder) or "
                                                           "plain (one forward per sequence, a plain sampling loop: "
                                                           "the code to read); the same numbers",
                                                   "choices": sorted(ENGINES)})
    preset: str = field(default="cpu", metadata={"help": "cpu (embedded SmolLM2, minutes on a laptop) or paper "
                                                          "(Qwen3-4B and the authors' release recipe, one GPU)",
                                                  "choices": list(PRESET_NAMES)})
    model: str | None = from_preset(paper="Qwen/Qwen3-4B-Instruct-2507", cpu="embedded",
                                    help="π's backbone: 'embedded' or an HF id/folder")
    mu_model: str | None = field(default=None, metadata={"help": "μ's backbone (RQ5); default: the same as --model"})
    data_dir: str = field(default="", metadata={"path": "dir", "help": "data folder (else $ARCO_DATA_DIR, else a download)"})
    seed: int = field(default=0, metadata={"help": "seed of data sampling, shuffling and sampling"})
    retriever: str | None = from_preset(paper="princeton-nlp/unsup-simcse-roberta-base", cpu="",
                                        help="encoder of the top-1 retriever: '' = the embedded all-MiniLM-L6-v2, or "
                                             "an HF id/folder (paper: SimCSE)")
    retriever_pooling: str | None = from_preset(paper="cls", cpu="mean", choices=["mean", "cls"],
                                                help="mean (MiniLM) or cls (SimCSE)")
    eval_size: int | None = from_preset(paper=500, cpu=100, min=1, help="dev questions evaluated (paper 500)")
    obs_chars: int | None = from_preset(paper=0, cpu=300, help="observation cut, characters (0 = the whole paragraph)")
    max_new_tokens_pi: int | None = from_preset(paper=64, cpu=32, min=1, help="π's max new tokens per action (64)")
    gen_batch: int | None = from_preset(paper=64, cpu=32, min=1, help="prompts per generation batch (π and μ)")
    pass_tokens: int | None = from_preset(paper=8192, cpu=1024, min=1, help="most tokens in one training pass "
                                          "(memory), SFT and RL: a batch is cut into passes of whole trajectories; a "
                                          "trajectory longer than this is recomputed in the backward (checkpointing)")
    token_reduction: str | None = from_preset(paper="mean", cpu="mean", choices=["mean", "sum"],
                                              help="mean (release) or sum (the paper's Σ_i) over the tokens of a step "
                                                   "in the KL terms of Eq. 3 and Eq. 5 and in Eq. 7 (see README)")
    weight_decay: float | None = from_preset(paper=0.01, cpu=0.01,
                                             help="AdamW weight decay of every optimizer, RL and SFT (release 0.01)")
    mu_examples: int | None = from_preset(paper=0, cpu=0, max=2,
                                          help="worked examples in μ's rubric prompt, 0-2 (~200 tokens per step each)")
    warmup_size: int | None = from_preset(paper=1000, cpu=150, min=1, help="warmup questions (release 1,000)")
    warmup_samples: int | None = from_preset(paper=3, cpu=2, min=1,
                                             help="warmup: teacher trajectories per question (release 3)")
    warmup_probe: int | None = from_preset(paper=32, cpu=8,
                                           help="μ SFT items on which the warmup shows Eq. 7's terms before/after")
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
    max_new_tokens_mu: int | None = from_preset(paper=128, cpu=64, min=1, help="μ's max new tokens per rubric (128)")
    rubric_format: str | None = from_preset(paper="json", cpu="slots", choices=list(RUBRIC_FORMATS),
                                            help="how μ writes its K criteria: json (a JSON list μ must close itself; "
                                                 "release) or slots (K numbered lines whose numbers and line breaks "
                                                 "the decoder writes: K criteria by construction); saved with μ")
    # What μ's SFT learns from (issue 41); each non-default value gets a μ folder of its own (mu_dir_name).
    criteria: str = field(default="verdict", metadata={
        "help": "the criteria text of μ SFT: verdict (the oracle's: it names what happened, e.g. 'hop 2 of 3', the "
                "gold target, 'k of N supporting paragraphs found') or check (checks written from the step's visible "
                "context alone, check_criteria: the verdict lives in the scores only)", "choices": ["verdict", "check"]})
    head_fit: str = field(default="teacher", metadata={
        "help": "what the score-head fit (--sft-head-steps) reads: teacher (the teacher's criteria, as Eq. 7) or own "
                "(μ's own greedy rubric of each SFT step: the text the head reads at RL time)",
        "choices": ["teacher", "own"]})
    balance_finishes: bool = field(default=False, metadata={
        "help": "μ SFT and the head fit: repeat the rarer of right and wrong Finish steps until both weigh alike"})
    policy_samples: int | None = field(default=None, metadata={"min": 1,
        "help": "--mu-data policy/both: π_sft's rollouts per μ SFT question (default: --warmup-samples)"})


@dataclass
class Args(Settings):
    """warmup.py's knobs: the shared ones (Settings), then its own."""
    dataset: str = field(default="hotpotqa", metadata={
        "help": "hotpotqa, 2wiki, musique, synthetic or synthetic-long (--check-gold also takes all)"})
    split: str = field(default="train", metadata={
        "help": "split the warmup questions come from (with --check-gold: the split measured)"})
    temperature: float = field(default=1.0, metadata={
        "help": "sampling temperature of the API policy (release: 1.0, configs/hotpotqa/hotpotqa.yaml)"})
    teacher: str = field(default="oracle", metadata={
        "help": "oracle (offline, from the gold evidence) or openai (any OpenAI-compatible endpoint)",
        "choices": ["oracle", "openai"]})
    teacher_policy_model: str = field(default="gpt-4o-mini", metadata={
        "help": "API model that acts as the policy (paper: gpt-4o-mini)"})
    teacher_rubric_model: str = field(default="gpt-4o-mini", metadata={
        "help": "API model that annotates whole trajectories with criteria and scores"})
    out_dir: str = field(default="", metadata={"help": "output folder; empty = runs/<dataset>/warmup"})
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
    check_gold: bool = field(default=False, metadata={
        "help": "only measure how often the oracle's gold trajectories retrieve every supporting paragraph"})
    check_size: int = field(default=0, metadata={
        "help": "questions measured by --check-gold (0 = the whole split; synthetic: 200)"})
    progress: bool = field(default=True, metadata={"help": "show progress bars"})
    collect_only: bool = field(default=False, metadata={"help": "stop after collection and the SFT datasets"})
    score_weight: float = field(default=10.0, metadata={"help": "λ of Eq. 7, the criterion-score loss weight (release: 10)"})
    train_mu: bool = field(default=True, metadata={"help": "also train μ (arco.py's outcome baseline needs only π)"})

    def __post_init__(self):
        fill_from_preset(self)


# ----------------------------------------------------------------------------------------
# 1. Teacher scores and their projection (App. B, Eq. 6)
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
    """`clip_and_fit`, plus the list of problems found (for the annotation log)."""
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


def clip_and_fit(raw, K: int) -> list[float]:
    """Teacher scores (numbers or numeric strings) -> exactly K floats in [-1, 1] (App. B).

    Clipped to [-1, 1]; cut to the first K; padded with 0.0 (the neutral score: "no opinion")
    when fewer than K were given. A value that is not a number (a word, a bool, null, NaN) also
    becomes 0.0. A single number stands for a list of one.
    """
    return fit_scores(raw, K)[0]


def step_means_sum(scores: Sequence[Sequence[float]]) -> float:
    """Σ_t (1/K) Σ_j s_{t,j}: the left-hand side of Eq. 6."""
    return sum(sum(row) / len(row) for row in scores)


def _shifted(scores: Sequence[Sequence[float]], c: float) -> list[list[float]]:
    return [[min(1.0, max(-1.0, v + c)) for v in row] for row in scores]


def project_scores(scores: Sequence[Sequence[float]], reward: float, tol: float = 1e-6) -> list[list[float]] | None:
    """Eq. 6: scores ŝ in [-1, 1] with Σ_t mean_j ŝ_{t,j} = R(τ) (within `tol`), keeping the teacher's order.

    `scores` is T rows of K teacher scores already in [-1, 1] (see `clip_and_fit`). The map is
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
            raise ValueError(f"project_scores: step {t + 1} has a score outside [-1, 1]: {row} (use clip_and_fit)")
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
# 2. The oracle teacher: gold-evidence trajectories, imperfect ones, rule-based rubrics
# ----------------------------------------------------------------------------------------

class TeacherError(Exception):
    """A teacher call that failed for good (after retries) or an annotation that cannot be parsed."""


def _bare(title: str) -> str:
    """A title without its disambiguation: "Black Book (film)" -> "Black Book"."""
    return re.sub(r"\s*\(.*\)\s*$", "", title).strip() or title


def _argument(kind: str, text: str) -> str:
    """What env.parse_action will read out of `Kind[text]` (brackets inside would end it early)."""
    text = text.replace("[", "(").replace("]", ")")
    return env.parse_action(f"{kind}[{text}]").argument


@dataclass
class Target:
    """One piece of gold evidence the oracle looks up: a supporting paragraph and what it holds."""
    paragraph: int
    entity: str           # the entity being looked up ("" when unknown)
    relation: str         # the relation asked about ("" when unknown)
    queries: list[str]    # natural candidate queries, preferred first
    answer: str = ""      # the hop's answer when the dataset gives one
    query: str = ""       # the candidate chosen (the first one that retrieves this paragraph)
    hit: bool = False     # whether `query` retrieves this paragraph

    def what(self) -> str:
        if self.entity and self.relation:
            return f"{self.entity} ({self.relation})"
        return self.entity or f'"{self.queries[0]}"'


def _hop_entity_relation(query: str, title: str, previous: Sequence[str]) -> tuple[str, str]:
    """Split a hop query into (entity, relation) where the layout allows it."""
    if ">>" in query:  # MuSiQue: "Tenement >> location of formation"
        left, right = query.split(">>", 1)
        return left.strip(), right.strip()
    for name in [_bare(title), title]:  # 2Wiki / synthetic: "<subject> <relation>"
        if query.lower().startswith(name.lower() + " "):
            return name, query[len(name):].strip()
    for prev in previous:  # a later MuSiQue hop names the previous hop's answer
        if prev and prev.lower() in query.lower():
            return prev, ""
    if _bare(title).lower() in query.lower():
        return _bare(title), ""
    return "", ""


def gold_targets(ex: env.Example) -> list[Target]:
    """The supporting paragraphs in the order a careful agent would look them up, with queries.

    Where the dataset gives hops (MuSiQue decomposition with earlier answers filled in, 2Wiki
    evidence triples, synthetic worlds) they fix the order and the query; a paragraph that serves
    several hops (2Wiki "date of birth" and "date of death" of one person) is looked up once.
    HotpotQA gives only supporting titles: a paragraph whose title the question names comes first
    (the bridge entity's paragraph then names the second title). Candidate queries are the hop's
    own query, then the paragraph's title, then the title with the relation or with the question's
    words that its paragraph contains, then (first target only) the question itself: all words
    an agent could know at that point.
    """
    def words(text: str) -> set[str]:
        return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if len(w) > 2}

    qwords = [w for w in re.findall(r"[A-Za-z0-9']+", ex.question) if len(w) > 3]

    def with_question_words(i: int) -> list[str]:  # the title plus question words its paragraph shares
        title, text = ex.paragraphs[i]
        shared = [w for w in qwords if w.lower() in text.lower() and w.lower() not in title.lower()][:3]
        return [f"{_bare(title)} {' '.join(shared)}"] if shared else []

    # Each hop's paragraph; a hop whose evidence subject matched no supporting title (2Wiki names
    # people differently in evidences and titles) goes to the unclaimed supporting paragraph whose
    # title shares most words with its query, so the order of the hops is kept.
    claimed = {h.get("paragraph") for h in ex.hops} & set(ex.supporting)
    hop_paragraphs = []
    for hop in ex.hops:
        p = hop.get("paragraph")
        if p not in ex.supporting:
            free = [i for i in ex.supporting if i not in claimed]
            overlap = {i: len(words(ex.paragraphs[i][0]) & words(str(hop["query"]))) for i in free}
            p = max(free, key=lambda i: overlap[i]) if free and max(overlap.values()) > 0 else None
            if p is not None:
                claimed.add(p)
        hop_paragraphs.append(p)
    targets: dict[int, Target] = {}
    answers: list[str] = []
    for hop, p in zip(ex.hops, hop_paragraphs):
        if p is None:
            answers.append(str(hop.get("answer", "")))
            continue
        q = " ".join(str(hop["query"]).replace(">>", " ").split())
        title = ex.paragraphs[p][0]
        entity, relation = _hop_entity_relation(str(hop["query"]), title, answers)
        if p in targets:  # one more relation of an entity already targeted
            if relation and relation not in targets[p].relation:
                targets[p].relation = f"{targets[p].relation} and {relation}" if targets[p].relation else relation
        else:
            queries = [q, title] + ([f"{_bare(title)} {relation}"] if relation else []) + with_question_words(p)
            targets[p] = Target(p, entity or "", relation, queries, answer=str(hop.get("answer", "")))
        answers.append(str(hop.get("answer", "")))
    question = ex.question.lower()
    rest = [i for i in ex.supporting if i not in targets]
    if not ex.hops:  # HotpotQA: titles the question names first, else supporting_facts order
        rest.sort(key=lambda i: _bare(ex.paragraphs[i][0]).lower() not in question)
    for i in rest:
        title = ex.paragraphs[i][0]
        targets[i] = Target(i, _bare(title), "", [title] + with_question_words(i) + [_bare(title)])
    out = list(targets.values())
    if out:
        out[0].queries.append(ex.question)
    for t in out:  # queries exactly as the environment will read them, without repeats
        t.queries = list(dict.fromkeys(a for a in (_argument("search", q) for q in t.queries) if a))
    return out


def choose_queries(examples: Sequence[env.Example], retriever) -> list[list[Target]]:
    """Gold targets of each example, each with the first candidate query that retrieves it.

    The oracle tries its natural candidates against the real retriever (batched, one round per
    candidate rank) and keeps the first that brings back the target paragraph; if none does it
    keeps the first candidate, and the trajectory will honestly miss that evidence.
    """
    plans = [gold_targets(ex) for ex in examples]
    todo = [(e, t) for e, plan in enumerate(plans) for t in plan]
    rank = 0
    while todo:
        batch = [(e, t) for e, t in todo if rank < len(t.queries)]
        if not batch:
            break
        got = retriever.retrieve([examples[e] for e, _ in batch], [t.queries[rank] for _, t in batch])
        for (e, t), g in zip(batch, got):
            if g == t.paragraph:
                t.query, t.hit = t.queries[rank], True
        todo = [(e, t) for e, t in batch if not t.hit]
        rank += 1
    for plan in plans:
        for t in plan:
            t.query = t.query or t.queries[0]
    return plans


VARIANTS = ("wrong_answer", "premature", "wrong_entity", "redundant", "missed_hop")


def _wrong_answer(ex: env.Example, rng: random.Random, targets: Sequence[Target]) -> str:
    """A plausible wrong answer: the opposite of yes/no, else an intermediate or compared entity, else a distractor."""
    gold = normalize_answer(ex.answer)
    if gold in ("yes", "no"):
        return "no" if gold == "yes" else "yes"
    near = [t.answer for t in targets if t.answer] + [_bare(ex.paragraphs[i][0]) for i in ex.supporting]
    far = [_bare(t) for i, (t, _) in enumerate(ex.paragraphs) if i not in ex.supporting]
    rng.shuffle(far)
    for cand in near + far + ["unknown"]:
        cand = _argument("finish", cand)
        if cand and not env.answer_reward(cand, ex.answers):
            return cand
    return "none of these"


@dataclass
class Intent:
    """What a scripted step was meant to do (the oracle's rubrics are written from it)."""
    kind: str                    # gold / wrong_entity / redundant / finish
    target: Target | None = None
    hop: int = 0                 # position of the target among the gold targets (1-based)


def oracle_script(ex: env.Example, sample: int, plan: list[Target], budget: int,
                  seed: int) -> tuple[str, list[tuple[str, Intent]]]:
    """(variant, [(action text, intent)]) of one oracle trajectory.

    Sample 0 is gold: every gold target the budget allows, then Finish[gold answer]. Later samples
    rotate through the imperfect variants from a seeded offset per question: a wrong-entity search
    (a distractor paragraph's title) or a redundant one (a query repeated) slipped in among the gold
    searches — still R = 1 when the budget leaves room for all the evidence, otherwise finished with a
    wrong guess; a premature finish (fewer hops, a guessed answer: an intermediate entity); a wrong
    answer after all the gold searches; a missed hop (a distractor's title searched in place of one
    gold hop, the evidence left incomplete, a wrong answer): a failure whose steps are partly useful,
    the kind of trajectory step-level credit is for.
    """
    gold = [(f"Search[{t.query}]", Intent("gold", t, i + 1)) for i, t in enumerate(plan)]
    if sample == 0:
        variant = "gold"
    else:
        offset = random.Random(f"{seed}-{ex.dataset}-{ex.id}").randrange(len(VARIANTS))
        variant = VARIANTS[(offset + sample - 1) % len(VARIANTS)]
    rng = random.Random(f"{seed}-{ex.dataset}-{ex.id}-{sample}")
    searches = gold
    if variant in ("wrong_entity", "missed_hop"):
        others = [i for i in range(len(ex.paragraphs)) if i not in ex.supporting]
        distractor = []
        if others:
            d = rng.choice(others)
            title = ex.paragraphs[d][0]
            wrong = Target(d, _bare(title), "", [title], query=_argument("search", title))
            distractor = [(f"Search[{wrong.query}]", Intent("wrong_entity", wrong))]
        if variant == "wrong_entity":
            at = rng.randrange(min(len(gold), budget) + 1)
            searches = gold[:at] + distractor + gold[at:]
        elif gold:                                           # missed_hop: the distractor replaces hop `at`
            at = rng.randrange(min(len(gold), budget))
            searches = gold[:at] + distractor + gold[at + 1:]
    elif variant == "redundant":
        at = rng.randrange(max(1, min(len(gold), budget)))
        again = (gold[at][0], Intent("redundant", gold[at][1].target, gold[at][1].hop))
        searches = gold[:at + 1] + [again] + gold[at + 1:]
    elif variant == "premature":
        searches = gold[:rng.randrange(len(gold))] if gold else []
    searches = searches[:budget]
    covered = {i.target.paragraph for _, i in searches if i.kind == "gold"}
    right = variant in ("wrong_entity", "redundant") and covered >= {t.paragraph for t in plan}
    if variant == "gold":
        answer = ex.answer  # even when the budget is short of the evidence: then evidence_found is False
    elif right:
        answer = ex.answer
    elif variant == "premature":
        found = [i.target.answer for _, i in searches if i.target and i.target.answer]
        answer = _argument("finish", found[-1]) if found and not env.answer_reward(found[-1], ex.answers) \
            else _wrong_answer(ex, rng, plan)
    else:
        answer = _wrong_answer(ex, rng, plan)
    return variant, searches + [(f"Finish[{_argument('finish', answer)}]", Intent("finish"))]


class ScriptedPolicy:
    """`act` for env.rollout that replays one script per trajectory.

    env.rollout asks, each round, for the still-active trajectories in their original order; this
    class keeps the same bookkeeping (a trajectory ends at Finish or after budget + 1 steps) and
    checks that every prompt is for the question it expects.
    """

    def __init__(self, questions: Sequence[str], scripts: Sequence[Sequence[str]], horizons: Sequence[int]):
        self.questions, self.scripts, self.horizons = list(questions), list(scripts), list(horizons)
        self.active = list(range(len(scripts)))
        self.steps = [0] * len(scripts)

    def __call__(self, prompts: list[list[dict]]) -> list[str]:
        if len(prompts) != len(self.active):
            raise RuntimeError(f"scripted policy: {len(prompts)} prompts for {len(self.active)} active trajectories")
        outputs = []
        for i, p in zip(self.active, prompts):
            if not p[-1]["content"].startswith(f"Question: {self.questions[i]}\n"):
                raise RuntimeError(f"scripted policy: prompt out of order (expected question {self.questions[i]!r})")
            s = self.scripts[i]
            outputs.append(s[self.steps[i]] if self.steps[i] < len(s) else s[-1])
        still = []
        for i, out in zip(self.active, outputs):
            self.steps[i] += 1
            if env.parse_action(out).kind != "finish" and self.steps[i] < self.horizons[i]:
                still.append(i)
        self.active = still
        return outputs


def evidence_found(traj: env.Trajectory) -> bool:
    """Did the trajectory's searches retrieve every supporting paragraph?"""
    seen = {s.retrieved for s in traj.steps if s.action == "search" and s.valid}
    return set(traj.example.supporting) <= seen


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("h") else "s")


def _cycle(items: Sequence, K: int) -> list:
    return [items[j % len(items)] for j in range(K)]


def oracle_rubric(traj: env.Trajectory, intents: Sequence[Intent], n_targets: int,
                  K: int) -> tuple[list[list[str]], list[list[float]]]:
    """K criteria and K scores per step, written from what each step targeted and scored on what happened.

    Search criteria name the entity / relation looked up (Appendix D: criteria should say what
    distinguishes this search from its neighbours): is it evidence the question needs, did the
    search bring back a supporting paragraph, is it new (not a repeated query or paragraph). Finish
    criteria say the step is judged as a final answer: is it right, is it supported by the evidence
    retrieved, was it time to stop. With K beyond the five templates per kind they repeat.
    """
    ex = traj.example
    supporting = set(ex.supporting)
    seen: set[int] = set()
    queries: set[str] = set()
    criteria, scores = [], []
    for step, intent in zip(traj.steps, intents):
        if step.action == "search" and step.valid:
            t = intent.target
            what = t.what() if t else f'"{step.argument}"'
            where = f" (hop {intent.hop} of {n_targets})" if intent.kind != "wrong_entity" and intent.hop else ""
            new_q = normalize_answer(step.argument) not in queries
            new_p = step.retrieved not in seen
            hit = step.retrieved in supporting
            relevant = t is not None and t.paragraph in supporting
            # Short sentences: μ writes them at every step of RL, so their length is decoding time.
            c = [f"Search[{step.argument}] targets {what}, evidence the question needs{where}",
                 f"Returns a paragraph on {what} that supports the answer",
                 f"{t.entity or step.argument} was not searched or retrieved before" if t
                 else "The query was not searched before",
                 "The query is short and names one entity or relation",
                 f"Worth a search ({_plural(step.searches_left, 'search')} left): the evidence is still missing"]
            s = [1.0 if relevant else -1.0,
                 (1.0 if new_p else 0.0) if hit else -1.0,
                 1.0 if new_q and new_p else -1.0,
                 1.0 if len(step.argument.split()) <= 12 else 0.0,
                 1.0 if hit and new_p else -1.0]
            queries.add(normalize_answer(step.argument))
            seen.add(step.retrieved)
        elif step.action == "finish":
            right = env.answer_reward(step.argument, ex.answers) == 1.0
            have = len(seen & supporting)
            complete = have == len(supporting)
            titles = ", ".join(_bare(ex.paragraphs[i][0]) for i in sorted(seen & supporting)) or "nothing relevant"
            c = [f"Judged as the final answer: {step.argument} is what the question asks for",
                 f"\"{step.argument}\" is backed by the evidence found (on {titles})",
                 f"Right time to stop: {have} of {len(supporting)} supporting paragraphs found, "
                 f"{_plural(step.searches_left, 'search')} left",
                 "A short, well-formed answer (a name, date, number or yes/no)",
                 f"\"{step.argument}\" agrees with the facts found"]
            s = [1.0 if right else -1.0,
                 (1.0 if complete else 0.0) if right else -1.0,
                 1.0 if complete else (0.0 if step.searches_left == 0 else -1.0),
                 1.0 if len(step.argument.split()) <= 8 else 0.0,
                 1.0 if right and complete else (0.0 if right else -1.0)]
        else:  # the oracle never writes one; kept so any trajectory can be annotated
            c = ["The output is one well-formed Search[query] or Finish[answer] action",
                 f"The step makes progress on the question ({step.reason})"]
            s = [-1.0, -1.0]
        criteria.append(_cycle(c, K))
        scores.append(_cycle(s, K))
    return criteria, scores


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
             f"A search is still needed, with {_plural(step.searches_left, 'search')} left"]
    elif step.valid and step.action == "finish":
        c = [f"Finish[{arg}] gives what the question asks for",
             f"\"{arg}\" is stated in the paragraphs found: {titles}",
             f"Time to stop: the {len(found)} paragraph{'' if len(found) == 1 else 's'} found cover every link the "
             f"question names, "
             f"{_plural(step.searches_left, 'search')} left",
             "A short, well-formed answer (a name, date, number or yes/no)",
             f"\"{arg}\" agrees with the facts found"]
    else:
        c = ["The output is one well-formed Search[query] or Finish[answer] action",
             f"The step makes progress on the question ({step.reason})"]
    return _cycle(c, K)


class OracleTeacher:
    """Offline teacher from the gold evidence; deterministic from `seed` (see `oracle_script`).

    A question whose evidence needs more searches than the budget (2Wiki bridge_comparison: four
    supporting paragraphs, three searches) gets a gold trajectory that searches the first `budget`
    targets in hop order and still submits the gold answer: `evidence_found` is False, so it
    trains μ (its Finish is scored as not fully supported) but is never a π SFT example.
    """
    name = "oracle"
    questions_per_call = 64   # questions per batched rollout
    workers = 1

    def __init__(self, seed: int = 0, obs_chars: int = 400):
        self.seed, self.obs_chars = seed, obs_chars

    def usage(self) -> dict:
        return {}

    def rollout(self, pairs: Sequence[tuple[env.Example, int]], retriever) -> tuple[list[env.Trajectory], list[dict]]:
        unique = list({(ex.dataset, ex.id): ex for ex, _ in pairs}.values())
        plans = dict(zip([(ex.dataset, ex.id) for ex in unique], choose_queries(unique, retriever)))
        scripts, metas, horizons = [], [], []
        for ex, sample in pairs:
            budget = env.DEFAULT_MAX_SEARCHES.get(ex.dataset, 3)
            plan = plans[(ex.dataset, ex.id)]
            variant, steps = oracle_script(ex, sample, plan, budget, self.seed)
            scripts.append([a for a, _ in steps])
            horizons.append(budget + 1)
            metas.append({"variant": variant, "imperfect": variant != "gold", "intents": [i for _, i in steps],
                          "n_targets": len(plan), "evidence_fits_budget": len(plan) <= budget})
        act = ScriptedPolicy([ex.question for ex, _ in pairs], scripts, horizons)
        trajs = env.rollout([ex for ex, _ in pairs], act, retriever, obs_chars=self.obs_chars)
        return trajs, metas

    def annotate(self, traj: env.Trajectory, meta: dict, K: int) -> tuple[list[list[str]], list, list[str]]:
        criteria, scores = oracle_rubric(traj, meta["intents"], meta["n_targets"], K)
        return criteria, scores, []


def inferred_intents(traj: env.Trajectory, plan: Sequence[Target]) -> list[Intent]:
    """What a step of any policy's trajectory did, read from what it retrieved (for oracle_rubric): a search
    that brought back a gold target's paragraph served that hop (repeats included: oracle_rubric scores them
    as not new), any other search a wrong entity; a Finish is a finish."""
    hop_of = {t.paragraph: (i, t) for i, t in enumerate(plan, 1)}
    out = []
    for st in traj.steps:
        if st.valid and st.action == "search" and st.retrieved in hop_of:
            hop, target = hop_of[st.retrieved]
            out.append(Intent("gold", target, hop))
        else:
            out.append(Intent("finish" if st.valid and st.action == "finish" else "wrong_entity"))
    return out


class OnPolicyTeacher(OracleTeacher):
    """π_sft plays the warmup questions (sampled at `temperature`, one seeded stream per trajectory) and the
    oracle annotates each of its steps from the gold evidence (issue 33: μ learns π's own mistakes; the
    authors' release has a collection mode where a local policy plays and the teacher annotates)."""
    name = "oracle-on-policy"

    def __init__(self, pi, temperature: float, max_new_tokens: int, gen_batch: int, seed: int = 0, obs_chars: int = 400):
        super().__init__(seed, obs_chars)
        self.act = policy_act(pi, temperature, max_new_tokens, gen_batch)

    def rollout(self, pairs: Sequence[tuple[env.Example, int]], retriever) -> tuple[list[env.Trajectory], list[dict]]:
        unique = list({(ex.dataset, ex.id): ex for ex, _ in pairs}.values())
        plans = dict(zip([(ex.dataset, ex.id) for ex in unique], choose_queries(unique, retriever)))
        seeds = [int(hashlib.sha256(f"{self.seed}-{ex.id}-{s}".encode()).hexdigest()[:14], 16) for ex, s in pairs]
        trajs = env.rollout([ex for ex, _ in pairs], self.act, retriever, obs_chars=self.obs_chars, seeds=seeds)
        metas = [{"variant": "policy", "imperfect": t.reward < 1.0, "n_targets": len(plans[(ex.dataset, ex.id)]),
                  "intents": inferred_intents(t, plans[(ex.dataset, ex.id)])} for (ex, _), t in zip(pairs, trajs)]
        return trajs, metas


def gold_evidence_rate(examples: Sequence[env.Example], retriever, obs_chars: int = 400) -> dict:
    """Play the oracle's gold trajectory on every example and measure the evidence it retrieved.

    `all_evidence`: share of questions whose searches retrieved every supporting paragraph;
    `fits_budget`: questions with no more supporting paragraphs than searches (2Wiki
    bridge_comparison needs 4 with a budget of 3) and the share of those with all evidence.
    """
    teacher = OracleTeacher(obs_chars=obs_chars)
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


# ----------------------------------------------------------------------------------------
# 3. The OpenAI-compatible teacher (policy through env.rollout; trajectory-level rubric)
# ----------------------------------------------------------------------------------------

ANNOTATION_SYSTEM_PROMPT = (
    "You grade the individual steps of a search agent. For each step you write a short checklist of "
    "criteria that are specific to that step, and you score the step against each criterion. "
    "You reply with JSON only.")

TRAJECTORY_RUBRIC_PROMPT = (
    "An agent answered a question that needs several facts. It could not see the documents; each turn "
    "it chose one action:\n"
    "Search[query] returns the single paragraph that best matches the query ({budget} searches in all), and\n"
    "Finish[answer] submits an answer and ends the episode.\n\n"
    "Question: {question}\n"
    "Correct answer: {gold}\n"
    "Agent's final answer: {answer}\n"
    "Outcome R = {reward} (1 if the final answer matches the correct answer exactly, else 0)\n\n"
    "The agent's steps:\n{steps}\n\n"
    "For each of the {T} steps write exactly {K} criteria and {K} scores.\n"
    "- A criterion is one short sentence that checks one aspect of that particular action. Name the "
    "entity, the relation or the missing piece of evidence the step is after, so that the criterion could "
    "not be mistaken for one written about another step. For a Finish step, say that it is judged as a "
    "final answer and whether the evidence gathered so far supports it.\n"
    "- A score is a number from -1 (the action clearly fails the criterion) to 1 (it clearly meets it).\n"
    "- The credit has to add up to the outcome: take the mean of each step's {K} scores; the {T} means "
    "must sum to R = {reward}. Give more credit to steps that moved the agent toward the outcome, and "
    "less or negative credit to wasted, repeated or misleading steps.\n\n"
    "Reply with a single JSON object and nothing else, one entry per step in order:\n"
    '{{"steps": [{{"step": 1, "criteria": ["...", ...], "scores": [0.5, ...]}}, ...]}}')


def trajectory_text(traj: env.Trajectory) -> str:
    lines = []
    for i, s in enumerate(traj.steps, 1):
        lines.append(f"Step {i} (searches left: {s.searches_left}): {s.action_text() or '(no action)'}")
        lines.append(f"Result: {s.observation}")
    return "\n".join(lines)


def annotation_messages(traj: env.Trajectory, K: int) -> list[dict]:
    """The trajectory-level annotation request (our wording; App. B / App. E describe its role)."""
    user = TRAJECTORY_RUBRIC_PROMPT.format(
        budget=traj.max_searches, question=traj.example.question, gold=" / ".join(traj.example.answers),
        answer=traj.answer or "(none: the agent never finished)", reward=f"{traj.reward:g}",
        steps=trajectory_text(traj), T=len(traj.steps), K=K)
    return [{"role": "system", "content": ANNOTATION_SYSTEM_PROMPT}, {"role": "user", "content": user}]


def _json_objects(text: str) -> Iterable:
    """Every JSON value we can read out of a model's reply, most likely first."""
    text = text or ""
    chunks = re.findall(r"```(?:json)?\s*(.*?)```", text, flags=re.DOTALL) + [text]
    for chunk in chunks:
        for start, end in (("{", "}"), ("[", "]")):
            a, b = chunk.find(start), chunk.rfind(end)
            if a < 0 or b <= a:
                continue
            body = chunk[a:b + 1]
            for candidate in (body, re.sub(r",\s*([}\]])", r"\1", body)):  # trailing commas
                try:
                    yield json.loads(candidate)
                    break
                except json.JSONDecodeError:
                    pass


def _step_entries(obj) -> list | None:
    if isinstance(obj, list):
        return obj
    if isinstance(obj, dict):
        for key in ("steps", "annotations", "rubrics", "trajectory"):
            if isinstance(obj.get(key), list):
                return obj[key]
        lists = [v for v in obj.values() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)]
        if lists:
            return lists[0]
        numbered = [(int(m.group()), v) for k, v in obj.items() if isinstance(v, dict) and (m := re.search(r"\d+", k))]
        if numbered:
            return [dict(v, step=n) for n, v in sorted(numbered, key=lambda x: x[0])]
    return None


def _criterion_text(c) -> str:
    if isinstance(c, dict):
        for key in ("criterion", "text", "description", "name", "check"):
            if isinstance(c.get(key), str):
                return c[key].strip()
        return ""
    return c.strip() if isinstance(c, str) else ""


def parse_annotation(text: str, T: int, K: int) -> tuple[list[list[str]], list[list[float]], list[str]]:
    """A trajectory annotation -> (criteria T×K, scores T×K in [-1, 1], issues found).

    Copes with code fences and prose around the JSON, trailing commas, a bare list of steps,
    criteria given as objects with their own "score", 0-based step numbers, numeric strings.
    A missing step gets no criteria (its steps are dropped from μ SFT) and neutral 0.0 scores;
    criteria are cut to K (fewer than K leaves empty ones); scores go through `fit_scores`
    (clipped, cut or padded with 0.0). Raises TeacherError when no list of steps can be read.
    """
    entries = next((e for obj in _json_objects(text) if (e := _step_entries(obj)) is not None), None)
    if entries is None:
        raise TeacherError("annotation is not JSON with a list of steps")
    numbers = []
    for pos, e in enumerate(entries):
        n = e.get("step") if isinstance(e, dict) else None
        try:
            n = int(str(n).strip().split()[-1])
        except (TypeError, ValueError, IndexError):
            n = pos + 1
        numbers.append(n)
    if numbers and min(numbers) == 0:
        numbers = [n + 1 for n in numbers]
    by_step: dict[int, dict] = {}
    issues = []
    for n, e in zip(numbers, entries):
        if not isinstance(e, dict) or not 1 <= n <= T or n in by_step:
            issues.append(f"ignored entry for step {n}")
            continue
        by_step[n] = e
    criteria, scores = [], []
    for t in range(1, T + 1):
        e = by_step.get(t)
        if e is None:
            issues.append(f"step {t} missing")
            criteria.append([""] * K)
            scores.append([0.0] * K)
            continue
        raw_c = e.get("criteria") or e.get("rubric") or e.get("checklist") or []
        raw_c = raw_c if isinstance(raw_c, list) else [raw_c]
        crit = [_criterion_text(c) for c in raw_c][:K]
        if len(crit) != K or not all(crit):
            issues.append(f"step {t}: {sum(bool(c) for c in crit)} criteria for K={K}")
        raw_s = e.get("scores")
        if raw_s is None and raw_c and all(isinstance(c, dict) and "score" in c for c in raw_c):
            raw_s = [c["score"] for c in raw_c]
        s, why = fit_scores(raw_s, K)
        issues += [f"step {t}: {w}" for w in why]
        criteria.append(crit + [""] * (K - len(crit)))
        scores.append(s)
    return criteria, scores, issues


def chat_completion(client, model: str, messages: list[dict], temperature: float, max_tokens: int, max_retries: int,
                    backoff: float, counters: Counter, lock: threading.Lock, stop: threading.Event | None = None) -> str:
    """One chat completion on any OpenAI-compatible endpoint: the one API call of the teacher and of
    diagnostics.py's judge. HTTP 408/409/429/5xx, timeouts and connection errors are retried after
    backoff · 2^attempt s (at most 60); other errors, and errors that outlast the retries, raise
    TeacherError with the API key scrubbed. Counts calls, retries, failed_calls and tokens."""
    import openai                                   # optional: only the API teacher and judge need it

    def count(key: str, k: int = 1) -> None:
        with lock:
            counters[key] += k
    for attempt in range(max_retries + 1):
        if stop is not None and stop.is_set():
            raise KeyboardInterrupt
        count("calls")
        try:
            r = client.chat.completions.create(model=model, messages=messages, temperature=temperature,
                                               max_tokens=max_tokens)
        except openai.OpenAIError as e:
            status = getattr(e, "status_code", None)
            transient = isinstance(e, (openai.APITimeoutError, openai.APIConnectionError)) or (
                isinstance(e, openai.APIStatusError) and (status in (408, 409, 429) or status >= 500))
            if transient and attempt < max_retries:
                count("retries")
                time.sleep(min(backoff * 2 ** attempt, 60.0))
                continue
            count("failed_calls")
            raise TeacherError(f"{type(e).__name__}{f' {status}' if status else ''}: "
                               f"{env.scrub(str(e), getattr(client, 'api_key', None))[:300]}") from None
        if r.usage is not None:
            count("prompt_tokens", r.usage.prompt_tokens or 0)
            count("completion_tokens", r.usage.completion_tokens or 0)
        return (r.choices[0].message.content or "") if r.choices else ""
    raise TeacherError("no attempt made")  # max_retries < 0


class OpenAITeacher:
    """Policy and rubric annotator served by any OpenAI-compatible endpoint.

    The key and the endpoint come from the environment only (OPENAI_API_KEY, OPENAI_BASE_URL),
    as the `openai` package reads them; they are never stored. Calls are retried on HTTP 408/409/
    429/5xx, timeouts and connection errors with exponential backoff (backoff · 2^attempt, capped at
    60 s); other HTTP errors, and errors that outlast the retries, fail the question (recorded,
    skipped, never fatal). An annotation that cannot be parsed is asked for once more.
    """
    name = "openai"
    questions_per_call = 1   # one question (its k samples) per job: a failure skips just that question

    def __init__(self, policy_model: str = "gpt-4o-mini", rubric_model: str = "gpt-4o-mini", temperature: float = 0.7,
                 max_retries: int = 5, backoff: float = 1.0, timeout: float = 60.0, concurrency: int = 8,
                 policy_max_tokens: int = 128, rubric_max_tokens: int = 2048, price_input: float = 0.15,
                 price_output: float = 0.60, obs_chars: int = 400, format_retries: int = 1, client=None):
        import openai
        try:
            self.client = client or openai.OpenAI(timeout=timeout, max_retries=0)
        except openai.OpenAIError as e:
            raise TeacherError(f"cannot start the API client: {env.scrub(str(e))} (set OPENAI_API_KEY, and OPENAI_BASE_URL "
                               f"for a server other than OpenAI's)") from None
        self.policy_model, self.rubric_model, self.temperature = policy_model, rubric_model, temperature
        self.max_retries, self.backoff, self.workers = max_retries, backoff, max(1, concurrency)
        self.policy_max_tokens, self.rubric_max_tokens = policy_max_tokens, rubric_max_tokens
        # USD per 1M tokens. Defaults: OpenAI's published list price of gpt-4o-mini ($0.15 input,
        # $0.60 output per 1M tokens, openai.com/api/pricing, 2024-07); set --price-* for other models.
        self.price_input, self.price_output = price_input, price_output
        self.obs_chars, self.format_retries = obs_chars, format_retries
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.counters = Counter()

    def usage(self) -> dict:
        c = self.counters
        cost = (c["prompt_tokens"] * self.price_input + c["completion_tokens"] * self.price_output) / 1e6
        return {"calls": c["calls"], "retries": c["retries"], "failed_calls": c["failed_calls"],
                "prompt_tokens": c["prompt_tokens"], "completion_tokens": c["completion_tokens"],
                "cost_usd": round(cost, 6)}

    def chat(self, model: str, messages: list[dict], temperature: float, max_tokens: int) -> str:
        return chat_completion(self.client, model, messages, temperature, max_tokens, self.max_retries, self.backoff,
                               self.counters, self.lock, self.stop)

    def rollout(self, pairs: Sequence[tuple[env.Example, int]], retriever) -> tuple[list[env.Trajectory], list[dict]]:
        """The API model plays the k samples of a question in the real environment."""
        failed: list[TeacherError] = []

        def act(prompts: list[list[dict]]) -> list[str]:
            outputs = []
            for p in prompts:
                if failed:
                    break
                try:
                    outputs.append(self.chat(self.policy_model, p, self.temperature, self.policy_max_tokens))
                except TeacherError as e:
                    failed.append(e)
            return outputs if not failed else ["Finish[teacher error]"] * len(prompts)  # end the episode at once

        trajs = env.rollout([ex for ex, _ in pairs], act, retriever, obs_chars=self.obs_chars)
        if failed:
            raise TeacherError(f"policy: {failed[0]}")
        return trajs, [{"variant": "policy"} for _ in pairs]

    def annotate(self, traj: env.Trajectory, meta: dict, K: int) -> tuple[list[list[str]], list, list[str]]:
        messages = annotation_messages(traj, K)
        for attempt in range(self.format_retries + 1):
            text = self.chat(self.rubric_model, messages, 0.0, self.rubric_max_tokens)
            try:
                return parse_annotation(text, len(traj.steps), K)
            except TeacherError as e:
                if attempt == self.format_retries:
                    raise TeacherError(f"rubric: {e}; reply began {text[:120]!r}") from None
        raise TeacherError("no annotation")


class LockedRetriever:
    """One retrieval at a time when API workers share the retriever."""

    def __init__(self, retriever):
        self.retriever, self.lock = retriever, threading.Lock()

    def retrieve(self, examples, queries):
        with self.lock:
            return self.retriever.retrieve(examples, queries)


# ----------------------------------------------------------------------------------------
# 4. Collection: records appended as they finish, resumable
# ----------------------------------------------------------------------------------------

def make_record(ex: env.Example, sample: int, traj: env.Trajectory, meta: dict, criteria: list[list[str]],
                raw_scores: list, issues: list[str], K: int, tol: float, teacher: str) -> dict:
    """One warmup record: the whole trajectory as logged by the environment, its rubric, Eq. 6."""
    T = len(traj.steps)  # rows beyond T are cut, missing ones padded (no criteria, neutral scores)
    teacher_scores = [clip_and_fit(row, K) for row in (list(raw_scores) + [[]] * T)[:T]]
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
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from tqdm import tqdm
    out_dir = Path(out_dir)
    ks = collection_suffix(K)
    path = out_dir / f"records{ks}.jsonl"
    old = env.read_jsonl(path, repair=True)
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
    lock = threading.Lock()  # API workers write from their own threads

    def write(rec: dict) -> None:
        with lock:
            env.write_jsonl(path, [rec], append=True)
            counts["records"] += 1
            counts[f"reward_{rec['reward']:g}"] += 1

    def fail(rec: dict) -> None:
        with lock:
            env.write_jsonl(out_dir / f"failures{ks}.jsonl", [rec], append=True)
            counts[f"failed_{rec['stage']}"] += 1

    groups = [jobs[i:i + teacher.questions_per_call] for i in range(0, len(jobs), teacher.questions_per_call)]
    bar = tqdm(total=len(jobs), desc=f"warmup {teacher.name}", unit="q", disable=not progress)
    if getattr(teacher, "workers", 1) <= 1:
        for g in groups:
            _run_group(teacher, g, retriever, K, tol, write, fail)
            bar.update(len(g))
    else:
        shared = LockedRetriever(retriever)
        pool = ThreadPoolExecutor(teacher.workers)
        try:
            futures = {pool.submit(_run_group, teacher, g, shared, K, tol, write, fail): len(g) for g in groups}
            for fut in as_completed(futures):
                fut.result()
                bar.update(futures[fut])
        except BaseException:
            teacher.stop.set()  # in-flight calls end at their next attempt; written records stay
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
    bar.close()
    return dict(counts)


# ----------------------------------------------------------------------------------------
# 5. Filtering (App. B) and the SFT datasets
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


def _steps(record: dict) -> list[env.Step]:
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
        steps = _steps(r)
        for t, s in enumerate(steps):
            if not s.valid:
                dropped["invalid_step"] += 1
                continue
            out.append({"id": r["id"], "sample": r["sample"], "step": t,
                        "messages": env.policy_messages(r["question"], env.format_history(steps[:t]), s.searches_left,
                                                        s.forced_finish),
                        "target": s.action_text()})
    return out


def rubric_sft_examples(records: Sequence[dict], criteria: str = "verdict") -> list[dict]:
    """μ SFT data (App. B, "Rubric warmup"; Eq. 7): one item per step with K non-empty criteria.

    Each item: question, prefix h_t (the history text before the step, as π saw it), action a_t,
    searches left, the K criteria r̃_t and the K projected scores ŝ_t. Pass records through
    `filter_records` first. `criteria` "check" replaces the teacher's criteria text by check_criteria
    (the scores are the teacher's, slot for slot; for the oracle teacher's records).
    """
    out = []
    for r in records:
        steps = _steps(r)
        for t, (s, raw) in enumerate(zip(steps, r["steps"])):
            if not criteria_ok(raw, r["K"]) or raw.get("scores") is None:
                continue
            text = check_criteria(steps[:t], s, r["K"]) if criteria == "check" else list(raw["criteria"])
            out.append({"id": r["id"], "sample": r["sample"], "step": t, "question": r["question"],
                        "prefix": env.format_history(steps[:t]), "action": s.action_text(),
                        "searches_left": s.searches_left, "forced_finish": s.forced_finish,
                        "criteria": text, "scores": list(raw["scores"])})
    return out


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


# ----------------------------------------------------------------------------------------
# 6. π SFT and μ SFT (App. B, Eq. 7)
# ----------------------------------------------------------------------------------------

def trajectory_units(items: Sequence[dict]) -> list[list[int]]:
    """The indices of each trajectory's items (same id and sample; items without them stand alone), in order of
    first appearance: a training pass holds whole trajectories."""
    units: dict = {}
    for i, it in enumerate(items):
        units.setdefault((it["id"], it.get("sample", 0)) if "id" in it else i, []).append(i)
    return list(units.values())


def trajectory_batches(items: Sequence[dict], batch_size: int, rng: random.Random) -> list[list[list[int]]]:
    """SFT's optimizer batches (π and μ): the items' trajectories (same id and sample) in a shuffled order, cut
    into ceil(items / batch_size) batches of about `batch_size` steps each (a trajectory goes where the middle of
    its steps falls), so an epoch takes as many optimizer steps as batches of single steps would. Each batch
    is a list of trajectories (index lists): the training passes hold whole trajectories, whose shared
    beginning (system prompt, question, history) the fast engine runs once. A choice of ours (CHOICES.md):
    the release shuffles single steps."""
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
    for p in training_passes(pi, seqs, lens, budget=pass_tokens, units=units):
        loss = -(p.logprobs * p.mask).sum() / sum(lens)
        loss.backward()
        total += float(loss.detach())
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
    the text term, None for the variants with no generated rubric (App. B: 'static' and 'none' "remove the
    rubric text target"). `token_reduction` "sum" is Eq. 7's form (the NLL summed over a rubric's tokens and
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
    a trajectory's steps; packed up to `pass_tokens`, None: a pass each), normalized over the whole batch: yields
    (loss, text, score) per pass. Both heads read the same pass (Eq. 2's pooled vector, the rubric tokens'
    log-probs)."""
    contexts, rubrics, targets = rubric_items(mu, items)
    has_text = mu.rubric_mode not in ("static", "none")        # App. B: no rubric text target for these
    seqs = mu.scoring_ids(contexts, rubrics)
    lens = [len(r.token_ids) if has_text else 0 for r in rubrics]
    for p in training_passes(mu.backbone, seqs, lens, budget=pass_tokens, units=units):
        yield rubric_sft_loss(mu.step_scores(p.pooled).d, targets[p.index], p.logprobs if has_text else None, p.mask,
                              lam, token_reduction, len(items), sum(lens))


def rubric_sft_backward(mu, items: Sequence[dict], lam: float, units: Sequence[Sequence[int]],
                        token_reduction: str = "sum", pass_tokens: int | None = None) -> float:
    """Eq. 7 on one optimizer batch, backpropagated pass by pass (`units`, `pass_tokens`); returns its value (how
    the batch is cut into passes does not change it)."""
    total = 0.0
    for loss, _, _ in rubric_sft_passes(mu, items, lam, units, token_reduction, pass_tokens):
        loss.backward()
        total += float(loss.detach())
    return total


def rubric_sft_terms(mu, items: Sequence[dict], lam: float, token_reduction: str = "sum",
                     pass_tokens: int | None = 1024) -> dict:
    """The two terms of Eq. 7 over `items`, without gradients (to show μ SFT lowers both)."""
    mu.eval()
    with torch.no_grad():
        terms = [(float(t), float(sc)) for _, t, sc in rubric_sft_passes(mu, items, lam, trajectory_units(items),
                                                                         token_reduction, pass_tokens)]
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


def fit_score_head(mu, items: Sequence[dict], steps: int, lr: float, own: bool = False,
                   max_new_tokens: int = 128, gen_batch: int = 16, pass_tokens: int | None = 1024) -> list[float]:
    """Eq. 7's score term minimized further over the score head φ alone, the backbone fixed: each
    step's pooled vector h̄_t (Eq. 2; packed as in rubric_sft_backward) computed once, then `steps`
    full-batch Adam steps on the squared error ‖g_φ(h̄_t) − ŝ_t‖² (mean over steps × K). A choice of ours
    (README, "Where the paper is silent"): with a laptop's few hundred μ SFT steps, the joint epochs leave
    the head near the targets' mean (it ranked even its own training steps at AUC 0.65), while the pooled
    vectors already separate useful from useless steps. h̄_t is read on the teacher's rubric (Eq. 7's
    text), or with `own` (--head-fit own, issue 41) on μ's own greedy rubric of the step: the text the head
    reads at RL time, where the teacher's cues are absent. Returns the term before and after."""
    contexts, rubrics, targets = rubric_items(mu, items)
    if own:                           # μ writes r_t itself (greedy, as at RL time); the head learns to read that
        mu.eval()
        with torch.no_grad():
            rubrics = mu.generate_rubrics(contexts, 0.0, max_new_tokens, gen_batch)
    seqs = mu.scoring_ids(contexts, rubrics)
    mu.eval()
    with torch.no_grad():
        passes = list(training_passes(mu.backbone, seqs, [0] * len(seqs), budget=pass_tokens,
                                      units=trajectory_units(items)))
        order = torch.tensor([i for p in passes for i in p.index])
        pooled = torch.cat([p.pooled for p in passes])[torch.argsort(order)]          # back in the items' order

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


def eval_settings(eval_size: int, seed: int, max_new_tokens: int, obs_chars: int, gen_batch: int) -> dict:
    """What decides a greedy dev evaluation (with the policy): same settings, same trajectories."""
    return {"eval_size": eval_size, "seed": seed, "max_new_tokens": max_new_tokens, "obs_chars": obs_chars,
            "gen_batch": gen_batch}


def collection_suffix(K: int) -> str:
    """'' for K = 3, else '-k{K}': the suffix of a collection's files in a warmup folder (records, failures,
    the two SFT sets, summary). Every criterion list of a collection has exactly K items, so a run with
    another K collects its own annotations beside the first collection and still shares the folder's
    π SFT, as its μ folder does (`mu_sft-k5`). §4.5 (RQ4) reuses the warmup trajectories and re-runs only
    the annotation for each K: the oracle teacher does exactly that (its trajectories depend only on the
    seed); the OpenAI teacher samples its trajectories again."""
    return "" if K == 3 else f"-k{K}"


def mu_dir_name(settings: dict) -> str:
    """The folder of a warmup's μ, from a run's settings (asdict of the arguments, or a run's args.json):
    `mu_sft` for ARCO's own μ (adaptive, K = 3, π's backbone, the teacher's data and text), and one folder
    per variant beside it (`mu_sft-none`, `mu_sft-k5`, `mu_sft-policy-q40-check-ownhead`, ...), so that
    every run of the paper's comparisons and every row of the μ ladder shares one collection and one π SFT.
    A setting missing from `settings` (a run made before it existed) counts as its default."""
    def get(key: str, default):
        return default if settings.get(key) is None else settings[key]
    suffix = "" if get("rubric", "adaptive") == "adaptive" else f"-{settings['rubric']}"
    suffix += collection_suffix(get("k", 3))
    mu_model, model = get("mu_model", ""), get("model", "embedded")
    if mu_model and mu_model != model:
        suffix += "-" + re.sub(r"[^A-Za-z0-9._-]+", "_", mu_model.strip("/").split("/")[-1])
    if get("mu_data", "teacher") != "teacher":           # π_sft's rollouts: of how many questions, how many each
        suffix += f"-{settings['mu_data']}-q{get('sft_questions_mu', 0) or 'all'}"
        suffix += f"-n{settings['policy_samples']}" if get("policy_samples", None) else ""
    suffix += "-check" if get("criteria", "verdict") == "check" else ""
    suffix += "-ownhead" if get("head_fit", "teacher") == "own" and get("sft_head_steps", 0) else ""
    return "mu_sft" + suffix + ("-bal" if get("balance_finishes", False) else "")


def run_sft(args: "Args", out_dir: Path, pi_examples: Sequence[dict], mu_items: Sequence[dict], retriever,
            mu_questions: Sequence[env.Example] = ()) -> dict:
    """π SFT and μ SFT, the merged π_sft/ and μ_sft/ saved, and the dev evaluation of the base
    and the SFT-only policy (greedy) into metrics.json. A π_sft/ or μ folder already in
    out_dir (an earlier warmup of the same collection) is kept, not trained again."""
    dev = env.load_split(args.dataset, "dev", args.data_dir or None, args.sft_eval_size or args.eval_size or None,
                         args.seed)
    old = json.loads((out_dir / "metrics.json").read_text()) if (out_dir / "metrics.json").is_file() else {}
    metrics: dict = {**old, "dataset": args.dataset, "dev_questions": len(dev)}
    settings = eval_settings(args.sft_eval_size or args.eval_size, args.seed, args.max_new_tokens_pi, args.obs_chars,
                             args.gen_batch)
    if (out_dir / "pi_sft" / "config.json").is_file() and "sft_only" in old:
        print(f"[warmup] π SFT: reusing {out_dir / 'pi_sft'}", flush=True)
    else:
        pi = load_backbone(args.model, device=args.device, dtype=args.dtype, autocast=args.autocast, engine=args.engine)
        def dev_eval(policy):
            with MEMORY.phase("dev evaluation"):
                return env.evaluate(dev, policy_act(policy, 0.0, args.max_new_tokens_pi, args.gen_batch), retriever,
                                    obs_chars=args.obs_chars)               # greedy
        if args.base_eval and old.get("base_settings") != settings:   # kept at once: a resumed warmup does not redo it
            print(f"[warmup] evaluating the base policy ({args.model}) on {len(dev)} dev questions", flush=True)
            metrics["base"], _ = dev_eval(pi)
            metrics["base_settings"] = settings
            env.write_json(out_dir / "metrics.json", metrics)
        torch.manual_seed(args.seed)            # π's LoRA initialization and dropout: a warmup repeats exactly
        with MEMORY.phase("π SFT"):
            sft = train_policy_sft(pi, pi_examples, args.sft_epochs_pi, args.sft_lr_pi, args.sft_batch_pi, args.seed,
                                   args.progress, args.pass_tokens, args.weight_decay, dev_eval, args.eval_every_epoch)
        metrics["pi_sft_loss_per_epoch"] = sft["losses"]
        metrics["pi_sft_dev_em_per_epoch"] = [e["em"] for e in sft["evals"]]
        metrics["pi_sft_epoch"] = sft["best"]["epoch"]
        write_atomically(out_dir / "pi_sft", lambda tmp: save_backbone(pi, tmp))   # a kill leaves none
        # The chosen epoch's evaluation is the SFT-only row (greedy: the merged weights decode the same).
        metrics["sft_only"], trajs = sft["best"]["scores"], sft["best"]["trajectories"]
        # What arco.py needs to take this evaluation as its epoch 0 instead of repeating it.
        metrics["sft_only_settings"] = settings
        env.write_jsonl(out_dir / "eval_sft_only.jsonl", [t.to_dict() for t in trajs])
        base = f"base {metrics['base']['em']:.1f} -> " if "base" in metrics else ""
        print(f"[warmup] dev EM: {base}SFT only {metrics['sft_only']['em']:.1f}", flush=True)
        del pi
        env.write_json(out_dir / "metrics.json", metrics)
    name = mu_dir_name(dataclasses.asdict(args))
    if not args.train_mu:
        return metrics
    if (out_dir / name / "config.json").is_file():
        check_mu_settings(out_dir, name, args)
        print(f"[warmup] μ SFT: reusing {out_dir / name}", flush=True)
        return metrics
    if args.mu_data != "teacher":               # issue 33: μ learns on π_sft's own rollouts (or on both)
        mu_items = policy_items(args, out_dir, mu_questions, retriever) + (list(mu_items) if args.mu_data == "both" else [])
    if args.balance_finishes:
        mu_items = balanced_finishes(mu_items)
    mu_backbone = load_backbone(args.mu_model or args.model, device=args.device, dtype=args.dtype,
                                autocast=args.autocast, engine=args.engine)
    torch.manual_seed(args.seed)                # μ's score head, LoRA and dropout (whether π was reused or not)
    mu = RubricModel(mu_backbone, k=args.k, rubric_mode=args.rubric, examples=args.mu_examples,
                     rubric_format=args.rubric_format)
    probe = list(mu_items[:args.warmup_probe])
    m = metrics.setdefault("mu", {}).setdefault(name, {})
    m["token_reduction"] = args.token_reduction
    m.update({key: getattr(args, key) for key in MU_SFT_SETTINGS})          # what check_mu_settings compares
    finishes = [it for it in mu_items if it["action"].startswith("Finish[")]
    m.update(sft_items=len(mu_items), sft_finishes=len(finishes), sft_right_finishes=sum(map(right_finish, finishes)))
    m["mu_sft_terms_before"] = rubric_sft_terms(mu, probe, args.score_weight, args.token_reduction, args.pass_tokens)
    with MEMORY.phase("μ SFT"):
        m["mu_sft_loss_per_epoch"] = train_rubric_sft(mu, mu_items, args.sft_epochs_mu, args.sft_lr_mu,
                                                      args.sft_head_lr, args.score_weight, args.sft_batch_mu,
                                                      args.seed, args.progress, args.weight_decay, args.token_reduction,
                                                      args.pass_tokens)
    if args.sft_head_steps:
        with MEMORY.phase("score-head fit"):
            m["mu_head_fit_error"] = fit_score_head(mu, mu_items, args.sft_head_steps, args.sft_head_lr,
                                                    own=args.head_fit == "own", max_new_tokens=args.max_new_tokens_mu,
                                                    gen_batch=args.gen_batch, pass_tokens=args.pass_tokens)
    m["mu_sft_terms_after"] = rubric_sft_terms(mu, probe, args.score_weight, args.token_reduction, args.pass_tokens)
    write_atomically(out_dir / name, mu.save)                                 # a kill leaves none
    # metrics.json read again before writing: another warmup of the folder (a μ variant trained beside this one)
    # may have added its μ meanwhile.
    now = json.loads((out_dir / "metrics.json").read_text()) if (out_dir / "metrics.json").is_file() else {}
    metrics = {**metrics, **now, "mu": {**now.get("mu", {}), name: m}}
    metrics.update(m)                 # the last μ trained, also at the top level (as before variants)
    env.write_json(out_dir / "metrics.json", metrics)
    return metrics


def on_policy_teacher(args: "Args", out_dir: Path, policy: Path | None = None) -> OnPolicyTeacher:
    """π_sft of the warmup in `out_dir` (or the π saved in `policy`, a run's checkpoint) as a teacher."""
    pi, _ = load_backbone_checkpoint(policy or out_dir / "pi_sft", device=args.device, dtype=args.dtype,
                                     autocast=args.autocast, engine=args.engine)
    return OnPolicyTeacher(pi, args.rollout_temperature, args.max_new_tokens_pi, args.gen_batch, args.seed,
                           args.obs_chars)


def policy_items(args: "Args", out_dir: Path, questions: Sequence[env.Example], retriever) -> list[dict]:
    """μ SFT items from π_sft's own rollouts of the μ SFT questions (--warmup-samples each, at the rollout
    temperature), every step annotated by the oracle from the gold evidence and projected (Eq. 6); collected
    into policy_rollouts/ beside the teacher's records, resumable as they are."""
    folder = out_dir / "policy_rollouts"
    collect(questions, on_policy_teacher(args, out_dir), retriever, folder, args.policy_samples or args.warmup_samples,
            args.k, args.tol, args.progress)
    kept, dropped = filter_records(env.read_jsonl(folder / f"records{collection_suffix(args.k)}.jsonl"), args.k, args.tol)
    print(f"[warmup] μ SFT on π_sft's own rollouts: {len(kept)} trajectories kept (dropped: {dict(dropped) or 'none'})",
          flush=True)
    wanted = {ex.id for ex in questions}             # the records of the asked questions and samples only
    kept = [r for r in kept if r["id"] in wanted and r["sample"] < (args.policy_samples or args.warmup_samples)]
    return rubric_sft_examples(kept, args.criteria)


POLICY_PROBE_QUESTIONS = 100     # held-out dev questions π_sft plays once each for μ's step AUC before RL


def policy_dev_rollouts(args, out_dir: Path, retriever, policy: Path | None = None) -> list[env.Trajectory]:
    """π_sft's seeded rollouts of POLICY_PROBE_QUESTIONS held-out dev questions (one each, at the rollout
    temperature): the steps on which every μ of a warmup is measured before RL (policy_dev_auc). With `policy`
    (a run's saved π), that π plays the same questions with the same seeds."""
    dev = env.load_split(args.dataset, "dev", args.data_dir or None, POLICY_PROBE_QUESTIONS, args.seed + 1)
    return on_policy_teacher(args, out_dir, policy).rollout([(ex, 0) for ex in dev], retriever)[0]


def policy_dev_auc(mu, trajs: Sequence[env.Trajectory], gen_batch: int, max_new_tokens: int = 128) -> dict:
    """μ's step credit on a policy's own rollouts (policy_dev_rollouts: π_sft's before any RL, or a saved π's):
    the AUC of s_t for useful vs useless steps (env.step_usefulness) by step type (study.py shows each μ's)."""
    contexts = [c for t in trajs for c in contexts_from_trajectory(t)]
    mu.eval()
    with torch.no_grad():
        _, scores = mu.annotate(contexts, 0.0, max_new_tokens, gen_batch)      # μ's own greedy rubric
    steps = [st for t in trajs for st in t.steps]
    labels = [u for t in trajs for u in env.step_usefulness(t)]
    out = {"questions": len(trajs), "steps": len(steps), "useful_share": sum(labels) / max(1, len(labels)),
           **auc_by_step_type(scores.s.tolist(), labels, [st.action if st.valid else None for st in steps])}
    print(f"[warmup] μ's AUC on the policy's own dev steps: search {out['search']}, finish {out['finish']}", flush=True)
    return out


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------

def make_teacher(args: Args):
    if args.teacher == "oracle":
        return OracleTeacher(seed=args.seed, obs_chars=args.obs_chars)
    return OpenAITeacher(args.teacher_policy_model, args.teacher_rubric_model, args.temperature, args.max_retries,
                         args.backoff, args.timeout, args.concurrency, args.policy_max_tokens, args.rubric_max_tokens,
                         args.price_input, args.price_output, args.obs_chars)


def summarize(records: Sequence[dict], examples: Sequence[env.Example], run: dict, args: Args,
              teacher) -> tuple[dict, list[dict], list[dict]]:
    """(counts of the warmup set: rewards, evidence, drops by reason, SFT sizes, API usage; π SFT; μ SFT)."""
    # A μ SFT step costs 2–3× a π SFT example on CPU: a laptop warmup may teach μ on its first questions only.
    first = {ex.id for ex in examples[:args.sft_questions_mu or len(examples)]}
    kept, dropped = filter_records([r for r in records if r["id"] in first], args.k, args.tol)
    pi_dropped = Counter()
    pi = policy_sft_examples(records, args.min_reward, args.require_evidence, pi_dropped)
    mu = rubric_sft_examples(kept, args.criteria)
    rewards = Counter(f"{r['reward']:g}" for r in records)
    return {"records": len(records), "reward_1": rewards.get("1", 0), "reward_0": rewards.get("0", 0),
            "evidence_found": sum(bool(r.get("evidence_found")) for r in records),
            "variants": dict(Counter(r.get("variant", "") for r in records)),
            "this_run": run, "mu_records_kept": len(kept), "dropped_mu": dict(dropped), "dropped_pi": dict(pi_dropped),
            "policy_sft_examples": len(pi), "rubric_sft_examples": len(mu),
            "teacher_usage_this_run": teacher.usage()}, pi, mu


def check_gold(args: Args) -> None:
    """--check-gold: how often the oracle's gold trajectories retrieve every supporting paragraph."""
    retriever = env.Retriever(args.retriever or None, pooling=args.retriever_pooling)
    names = [d for d in env.DATASETS] if args.dataset == "all" else [args.dataset]
    for ds in names:
        examples = env.load_split(ds, args.split, args.data_dir or None, args.check_size or None, args.seed)
        r = gold_evidence_rate(examples, retriever, args.obs_chars)
        print(f"{ds}/{args.split}: {r['questions']} questions; the gold trajectory retrieved every supporting "
              f"paragraph for {100 * r['all_evidence']:.1f}% (R = 1 for {100 * r['reward']:.1f}%); "
              f"{r['fits_budget']} need no more searches than the budget ({env.DEFAULT_MAX_SEARCHES[ds]}), "
              f"{100 * r['all_evidence_when_fits']:.1f}% of those; by type: "
              + ", ".join(f"{t} {100 * v['all_evidence']:.0f}% of {v['n']}" for t, v in r["by_type"].items()))


def check_retriever(folder: Path, retriever: str, pooling: str) -> None:
    """A warmup folder keeps the retriever its trajectories were played with (retriever.json); a
    warmup or an RL run with another retriever stops here, naming both, instead of mixing them."""
    path = Path(folder) / "retriever.json"
    wanted = {"retriever": retriever or env.EMBEDDED_RETRIEVER, "pooling": pooling}
    if path.is_file():
        have = json.loads(path.read_text())
        if have != wanted:
            raise env.DataError(f"the warmup in {folder} was made with retriever {have['retriever']} "
                                f"({have['pooling']} pooling), this run asks for {wanted['retriever']} "
                                f"({wanted['pooling']} pooling); pass the same --retriever / --retriever-pooling, "
                                f"or another --warmup-dir")
    elif (Path(folder) / "records.jsonl").is_file() or (Path(folder) / "pi_sft").is_dir():
        if wanted["retriever"] != env.EMBEDDED_RETRIEVER or pooling != "mean":   # made before retriever.json
            raise env.DataError(f"the warmup in {folder} records no retriever (it predates retriever.json, so it "
                                f"used {env.EMBEDDED_RETRIEVER}); this run asks for {wanted['retriever']}")


# The μ SFT settings a warmup keeps in metrics.json (same names in arco.py and warmup.py), each with the
# value a warmup made before the setting existed had (None: such a warmup passes the check).
MU_SFT_SETTINGS = {"sft_questions_mu": None, "sft_head_steps": 0, "rubric_format": "json"}


def check_mu_settings(folder: Path, name: str, args) -> None:
    """A warmup μ is reused only by runs that ask for the μ SFT it had (MU_SFT_SETTINGS); otherwise RL
    would silently start from another μ."""
    path = Path(folder) / "metrics.json"
    if not (Path(folder) / name / "config.json").is_file():
        return                                                       # no μ there yet: nothing is reused
    made = json.loads(path.read_text()).get("mu", {}).get(name, {}) if path.is_file() else {}
    for key, predated in MU_SFT_SETTINGS.items():
        value = getattr(args, key)
        had = made.get(key, value if predated is None else predated)
        if had != value:
            flag = "--" + key.replace("_", "-")
            raise env.DataError(f"the μ in {Path(folder) / name} was fine-tuned with {flag} {had}, this run asks "
                                f"for {value}; pass the same, another --warmup-dir, or delete "
                                f"{Path(folder) / name} to fine-tune μ again")


def run(args: Args) -> Path:
    """The whole warmup: collection (resumable), filtering, SFT datasets, π SFT, μ SFT, evaluation."""
    if args.dataset not in env.DATASETS:
        raise env.DataError(f"unknown dataset '{args.dataset}': choose one of {', '.join(env.DATASETS)}")
    out_dir = Path(args.out_dir or Path("runs") / args.dataset / "warmup")
    check_retriever(out_dir, args.retriever, args.retriever_pooling)
    examples = env.load_split(args.dataset, args.split, args.data_dir or None, args.warmup_size or None, args.seed)
    teacher = make_teacher(args)
    retriever = env.shared_retriever(args.retriever or None, args.retriever_pooling)
    env.write_json(out_dir / "args.json", dataclasses.asdict(args))
    env.write_json(out_dir / "retriever.json", {"retriever": args.retriever or env.EMBEDDED_RETRIEVER,
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
    records = [r for r in env.read_jsonl(out_dir / f"records{ks}.jsonl") if r["id"] in wanted and r["sample"] < args.warmup_samples]
    summary, pi, mu = summarize(records, examples, run_counts, args, teacher)
    for name, rows in ((f"policy_sft{ks}.jsonl", pi), (f"rubric_sft{ks}.jsonl", mu)):
        env.write_jsonl(out_dir / name, rows)
    env.write_json(out_dir / f"summary{ks}.json", summary)
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
    m = run_sft(args, out_dir, pi, mu, retriever, examples[:args.sft_questions_mu or len(examples)]).get("mu", {}).get(
        mu_dir_name(dataclasses.asdict(args)))
    if m and "mu_sft_terms_after" in m:
        print(f"μ SFT, Eq. 7 terms on {min(len(mu), args.warmup_probe)} items: text NLL "
              f"{m['mu_sft_terms_before']['text_nll']:.2f} -> {m['mu_sft_terms_after']['text_nll']:.2f}, score "
              f"error {m['mu_sft_terms_before']['score_sq_error']:.3f} -> "
              f"{m['mu_sft_terms_after']['score_sq_error']:.3f}")
    print(f"written to {out_dir}/ (pi_sft/, {mu_dir_name(dataclasses.asdict(args))}/, "
          f"metrics.json, records{ks}.jsonl, summary{ks}.json)")
    return out_dir


def run_from_arco(a, out_dir: Path) -> Path:
    """The offline oracle warmup with the settings of an arco.py run (its preset and flags): the settings the
    two scripts share (Settings, which arco.Args extends) are copied by name, and the dataset."""
    shared = {f.name: getattr(a, f.name) for f in dataclasses.fields(Settings)}
    return run(Args(**shared, dataset=a.dataset, out_dir=str(out_dir), train_mu=a.reward == "arco" and a.credit == "mu"))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(Args, argv, description=__doc__)
    if not args.check_gold:
        for name in {args.model, args.mu_model or args.model}:      # before any folder
            check_model_available(name)
    try:
        if args.check_gold:
            check_gold(args)
        else:
            run(args)
    except (env.DataError, TeacherError, ValueError) as e:
        sys.exit(f"error: {env.scrub(str(e))}")


if __name__ == "__main__":
    main_guard(main, env.DataError, ModelLoadError)
