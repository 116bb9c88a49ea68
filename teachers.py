"""The warmup's teachers (§3.2, Appendix B): who plays the warmup questions and writes each step's criteria and
scores. warmup.py collects their trajectories (one record per question and sample), projects the scores (Eq. 6)
and fine-tunes π and μ on them.

1. a teacher's scores read (`clip_and_fit`); 2. the oracle teacher (`--teacher oracle`, offline, deterministic):
it acts from the gold evidence, plays gold and deliberately imperfect trajectories in the real environment, and
annotates every step with K criteria (what it targeted) and K scores (what happened); `OnPolicyTeacher`: π_sft
plays, the oracle annotates (`--mu-data policy`, the release's local-policy mode); 3. the OpenAI-compatible
teacher (`--teacher openai`): one model plays through `env.rollout`, another annotates whole trajectories (our
prompt states the decomposition constraint); robust parsing, retries with backoff, token and cost counters.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

import env
from evaluate import normalize_answer
from rubric_model import policy_act


# ----------------------------------------------------------------------------------------
# 1. A teacher's scores
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
