"""The offline oracle teacher (`--teacher oracle`, deterministic) and π_sft playing with the oracle annotating
(`--mu-data policy`: the release's local-policy mode) — our stand-ins for the paper's GPT teacher (§3.2, App. B).

The oracle acts from the gold evidence: it plays gold and deliberately imperfect trajectories in the real
environment (`oracle_script`), and annotates every step with K criteria (what the step targeted) and K scores (what
happened) (`oracle_rubric`). `OnPolicyTeacher`: π_sft plays, the oracle annotates each of its steps from what it
retrieved. The environment (`world`, env.py) is given to each teacher: this package imports no script.
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any, Sequence

from infra.passes import policy_act
from infra.teachers import cycle, plural

# `world` below is env.py, the environment a teacher plays and judges in (this package imports no script);
# Example and Trajectory are its types, duck-typed here.
Example = Trajectory = Any

def _bare(title: str) -> str:
    """A title without its disambiguation: "Black Book (film)" -> "Black Book"."""
    return re.sub(r"\s*\(.*\)\s*$", "", title).strip() or title


def _argument(world, kind: str, text: str) -> str:
    """What the environment's parser (env.parse_action) will read out of `Kind[text]` (brackets inside would end
    it early)."""
    text = text.replace("[", "(").replace("]", ")")
    return world.parse_action(f"{kind}[{text}]").argument


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


def gold_targets(world, ex: Example) -> list[Target]:
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
        t.queries = list(dict.fromkeys(a for a in (_argument(world, "search", q) for q in t.queries) if a))
    return out


def choose_queries(world, examples: Sequence[Example], retriever) -> list[list[Target]]:
    """Gold targets of each example, each with the first candidate query that retrieves it.

    The oracle tries its natural candidates against the real retriever (batched, one round per
    candidate rank) and keeps the first that brings back the target paragraph; if none does it
    keeps the first candidate, and the trajectory will honestly miss that evidence.
    """
    plans = [gold_targets(world, ex) for ex in examples]
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


def _wrong_answer(world, ex: Example, rng: random.Random, targets: Sequence[Target]) -> str:
    """A plausible wrong answer: the opposite of yes/no, else an intermediate or compared entity, else a distractor."""
    for yes_no, opposite in (("yes", "no"), ("no", "yes")):
        if world.answer_reward(yes_no, [ex.answer]):        # the gold answer reads yes (or no) under EM
            return opposite
    near = [t.answer for t in targets if t.answer] + [_bare(ex.paragraphs[i][0]) for i in ex.supporting]
    far = [_bare(t) for i, (t, _) in enumerate(ex.paragraphs) if i not in ex.supporting]
    rng.shuffle(far)
    for cand in near + far + ["unknown"]:
        cand = _argument(world, "finish", cand)
        if cand and not world.answer_reward(cand, ex.answers):
            return cand
    return "none of these"


@dataclass
class Intent:
    """What a scripted step was meant to do (the oracle's rubrics are written from it)."""
    kind: str                    # gold / wrong_entity / redundant / finish
    target: Target | None = None
    hop: int = 0                 # position of the target among the gold targets (1-based)


def oracle_script(world, ex: Example, sample: int, plan: list[Target], budget: int,
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
            wrong = Target(d, _bare(title), "", [title], query=_argument(world, "search", title))
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
        answer = _argument(world, "finish", found[-1]) if found and not world.answer_reward(found[-1], ex.answers) \
            else _wrong_answer(world, ex, rng, plan)
    else:
        answer = _wrong_answer(world, ex, rng, plan)
    return variant, searches + [(f"Finish[{_argument(world, 'finish', answer)}]", Intent("finish"))]


class ScriptedPolicy:
    """`act` for env.rollout that replays one script per trajectory.

    env.rollout asks, each round, for the still-active trajectories in their original order; this
    class keeps the same bookkeeping (a trajectory ends at Finish or after budget + 1 steps) and
    checks that every prompt is for the question it expects.
    """

    def __init__(self, world, questions: Sequence[str], scripts: Sequence[Sequence[str]], horizons: Sequence[int]):
        self.world, self.questions, self.scripts, self.horizons = world, list(questions), list(scripts), list(horizons)
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
            if self.world.parse_action(out).kind != "finish" and self.steps[i] < self.horizons[i]:
                still.append(i)
        self.active = still
        return outputs


def evidence_found(traj: Trajectory) -> bool:
    """Did the trajectory's searches retrieve every supporting paragraph?"""
    seen = {s.retrieved for s in traj.steps if s.action == "search" and s.valid}
    return set(traj.example.supporting) <= seen


def oracle_rubric(world, traj: Trajectory, intents: Sequence[Intent], n_targets: int,
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
    queries: list[str] = []
    criteria, scores = [], []
    for step, intent in zip(traj.steps, intents):
        if step.action == "search" and step.valid:
            t = intent.target
            what = t.what() if t else f'"{step.argument}"'
            where = f" (hop {intent.hop} of {n_targets})" if intent.kind != "wrong_entity" and intent.hop else ""
            new_q = not any(world.answer_reward(step.argument, [q]) for q in queries)   # no earlier query alike
            new_p = step.retrieved not in seen
            hit = step.retrieved in supporting
            relevant = t is not None and t.paragraph in supporting
            # Short sentences: μ writes them at every step of RL, so their length is decoding time.
            c = [f"Search[{step.argument}] targets {what}, evidence the question needs{where}",
                 f"Returns a paragraph on {what} that supports the answer",
                 f"{t.entity or step.argument} was not searched or retrieved before" if t
                 else "The query was not searched before",
                 "The query is short and names one entity or relation",
                 f"Worth a search ({plural(step.searches_left, 'search')} left): the evidence is still missing"]
            s = [1.0 if relevant else -1.0,
                 (1.0 if new_p else 0.0) if hit else -1.0,
                 1.0 if new_q and new_p else -1.0,
                 1.0 if len(step.argument.split()) <= 12 else 0.0,
                 1.0 if hit and new_p else -1.0]
            queries.append(step.argument)
            seen.add(step.retrieved)
        elif step.action == "finish":
            right = world.answer_reward(step.argument, ex.answers) == 1.0
            have = len(seen & supporting)
            complete = have == len(supporting)
            titles = ", ".join(_bare(ex.paragraphs[i][0]) for i in sorted(seen & supporting)) or "nothing relevant"
            c = [f"Judged as the final answer: {step.argument} is what the question asks for",
                 f"\"{step.argument}\" is backed by the evidence found (on {titles})",
                 f"Right time to stop: {have} of {len(supporting)} supporting paragraphs found, "
                 f"{plural(step.searches_left, 'search')} left",
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
        criteria.append(cycle(c, K))
        scores.append(cycle(s, K))
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

    def __init__(self, world, seed: int = 0, obs_chars: int = 400):
        self.world, self.seed, self.obs_chars = world, seed, obs_chars

    def usage(self) -> dict:
        return {}

    def rollout(self, pairs: Sequence[tuple[Example, int]], retriever) -> tuple[list[Trajectory], list[dict]]:
        unique = list({(ex.dataset, ex.id): ex for ex, _ in pairs}.values())
        plans = dict(zip([(ex.dataset, ex.id) for ex in unique], choose_queries(self.world, unique, retriever)))
        scripts, metas, horizons = [], [], []
        for ex, sample in pairs:
            budget = self.world.DEFAULT_MAX_SEARCHES.get(ex.dataset, 3)
            plan = plans[(ex.dataset, ex.id)]
            variant, steps = oracle_script(self.world, ex, sample, plan, budget, self.seed)
            scripts.append([a for a, _ in steps])
            horizons.append(budget + 1)
            metas.append({"variant": variant, "imperfect": variant != "gold", "intents": [i for _, i in steps],
                          "n_targets": len(plan), "evidence_fits_budget": len(plan) <= budget})
        act = ScriptedPolicy(self.world, [ex.question for ex, _ in pairs], scripts, horizons)
        trajs = self.world.rollout([ex for ex, _ in pairs], act, retriever, obs_chars=self.obs_chars)
        return trajs, metas

    def annotate(self, traj: Trajectory, meta: dict, K: int) -> tuple[list[list[str]], list, list[str]]:
        criteria, scores = oracle_rubric(self.world, traj, meta["intents"], meta["n_targets"], K)
        return criteria, scores, []


def inferred_intents(traj: Trajectory, plan: Sequence[Target]) -> list[Intent]:
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

    def __init__(self, world, pi, temperature: float, max_new_tokens: int, gen_batch: int, seed: int = 0,
                 obs_chars: int = 400):
        super().__init__(world, seed, obs_chars)
        self.act = policy_act(pi, temperature, max_new_tokens, gen_batch)

    def rollout(self, pairs: Sequence[tuple[Example, int]], retriever) -> tuple[list[Trajectory], list[dict]]:
        unique = list({(ex.dataset, ex.id): ex for ex, _ in pairs}.values())
        plans = dict(zip([(ex.dataset, ex.id) for ex in unique], choose_queries(self.world, unique, retriever)))
        seeds = [int(hashlib.sha256(f"{self.seed}-{ex.id}-{s}".encode()).hexdigest()[:14], 16) for ex, s in pairs]
        trajs = self.world.rollout([ex for ex, _ in pairs], self.act, retriever, obs_chars=self.obs_chars, seeds=seeds)
        metas = [{"variant": "policy", "imperfect": t.reward < 1.0, "n_targets": len(plans[(ex.dataset, ex.id)]),
                  "intents": inferred_intents(t, plans[(ex.dataset, ex.id)])} for (ex, _), t in zip(pairs, trajs)]
        return trajs, metas
