"""The rubric model μ (§3.1, Eq. 2): one causal-LM backbone f_θ with two heads. The LM head writes K criteria r_t for
a step (q, h_t, a_t); the score head g_φ reads the mean-pooled last hidden states of the whole scoring sequence
(q, h_t, a_t, r_t) and returns d_t ∈ [−1, 1]^K, and s_t = mean_j d_{t,j}. μ's losses live with the algorithm:
Eq. 5 in arco.py, Eq. 7 in warmup.py.

Top to bottom: μ's knobs (MuSettings); 1. Eq. 2's two pieces, `mean_pool` and the tanh `ScoreHead`; 2. μ's prompts (ours, after
Appendix D) and the paper's variants (Table 2: adaptive, prefix-free, static, none); 3. the K criteria: how μ
writes them (a JSON list, or the `slots` frame whose numbers and line breaks the decoder writes) and how they are
read back; 4. `RubricModel`: annotate (write r_t, then d_t and s_t), score, save and load. What an update logs of
μ is infra/runs.py's (mu_at_work). The backbone and its passes (loading, LoRA, generation, log-probs) are the package's:
infra/models.py, infra/passes.py.

    python -m lab.benchmark sample               # an untrained μ writes and scores a rubric for a sample step
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

import env
from infra.files import write_manifest
from infra.models import Backbone, fresh_adapter, load_backbone_checkpoint, save_backbone, trainable_parameters
from infra.passes import (chat_prompt_ids, encode_response, end_of_reply, engine_of, last_hidden_states,
                          length_batches, pad_right)
from infra.settings import from_preset

RUBRIC_MODES = ("adaptive", "prefix-free", "static", "none")   # μ's variants (§3.1, Table 2): ARCO, w/o Prefix, ...
RUBRIC_FORMATS = ("json", "slots")                             # how μ writes its K criteria (SlotFrame)


@dataclass
class MuSettings:
    """μ's knobs (§3.1), each with its presets' values (infra.settings.from_preset); warmup.Settings and arco.Args
    take them."""
    rubric: str = field(default="adaptive", metadata={"help": "μ variant (Table 2): adaptive, prefix-free (w/o Prefix), "
                                                               "static (w/o Adaptive), none (w/o Rubric)",
                                                       "choices": list(RUBRIC_MODES)})
    k: int = field(default=3, metadata={"min": 1, "max": 9, "help": "criteria per step, K (paper 3; RQ4 sweeps 1, 3, 5, 7, 9)"})
    rubric_format: str | None = from_preset(paper="json", cpu="slots", choices=list(RUBRIC_FORMATS),
                                            help="how μ writes its K criteria: json (a JSON list μ must close itself; "
                                                 "release) or slots (K numbered lines whose numbers and line breaks "
                                                 "the decoder writes: K criteria by construction); saved with μ")
    mu_examples: int | None = from_preset(paper=0, cpu=0, max=2,
                                          help="worked examples in μ's rubric prompt, 0-2 (~200 tokens per step each)")
    rubric_temperature: float | None = from_preset(paper=0.0, cpu=0.0, help="μ's temperature for r_t: 0 = greedy "
                                                   "(release); the paper writes r_t ~ p_θ")
    max_new_tokens_mu: int | None = from_preset(paper=128, cpu=64, min=1, help="μ's max new tokens per rubric (128)")



# ----------------------------------------------------------------------------------------
# 1. Eq. 2: mean pooling and the tanh score head
# ----------------------------------------------------------------------------------------

def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """h̄ = mean of the hidden states over non-padding positions. [B, L, H], [B, L] → [B, H]."""
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)


class ScoreHead(nn.Module):
    """g_φ of Eq. 2: h̄ → LayerNorm → Linear → GELU → Linear → tanh → d ∈ [−1, 1]^K. Always fp32.

    The paper says only "two lightweight heads"; our choices: a LayerNorm first (hidden-state scales
    differ a lot across backbones), one hidden layer of `hidden` units, and a near-zero
    initial output layer so an untrained head gives d ≈ 0 (Σ_t s_t starts near 0, not at a
    random offset, in the decomposition loss of Eq. 5).
    """

    def __init__(self, d_model: int, k: int, hidden: int = 256):
        super().__init__()
        self.k, self.d_model = k, d_model
        self.net = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, k))
        nn.init.normal_(self.net[-1].weight, std=0.01)
        nn.init.zeros_(self.net[-1].bias)
        self.float()

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(pooled.float()))                        # Eq. 2: d_t ∈ [−1, 1]^K


# ----------------------------------------------------------------------------------------
# 2. μ's prompts and the paper's variants
# ----------------------------------------------------------------------------------------

# The prompts are ours, after Appendix D: criteria name the entity, relation or missing evidence a search targets,
# and say when a step is judged as a final answer. Two worked examples (a first-hop search and a finish) and opening
# μ's reply with `["` let an untrained small backbone write the JSON at all; they cost ~400 prompt tokens a step,
# so how many are shown is a setting of μ (`examples`, saved with it): none once the warmup SFT taught the format.
RUBRIC_SYSTEM = (
    "You review the steps of a search agent. The agent answers questions that need two or more facts. "
    "At each step it does one thing: Search[query], which returns one passage, or Finish[answer], which "
    "submits its final answer. For one step you write the checklist used to grade that step, as a JSON list "
    "of short sentences and nothing else.")


RUBRIC_SYSTEM_SLOTS = RUBRIC_SYSTEM.replace("as a JSON list of short sentences and nothing else",
                                            "as numbered lines, one short sentence each, and nothing else")
SCORE_ONLY_SYSTEM = (
    "You review the steps of a search agent. The agent answers questions that need two or more facts. "
    "At each step it does one thing: Search[query], which returns one passage, or Finish[answer], which "
    "submits its final answer. You judge how much one step helps to answer the question.")
RUBRIC_INSTRUCTION = (
    "Write exactly {k} criteria for grading this step, as a JSON list of {k} strings. For a search, each criterion "
    "names the person, place, thing, relation or missing fact the query is after. For a finish, say that the step "
    "is graded as the final answer, and whether the passages found so far support it.")
RUBRIC_INSTRUCTION_SLOTS = (
    "Write exactly {k} criteria for grading this step, numbered 1 to {k}, one per line. For a search, each criterion "
    "names the person, place, thing, relation or missing fact the query is after. For a finish, say that the step "
    "is graded as the final answer, and whether the passages found so far support it.")
SCORE_ONLY_INSTRUCTION = "How much does this step help to answer the question?"
RUBRIC_OPENING = '["'       # μ's reply is opened with this; r_t is the tokens that follow it ('json' format)


# How μ writes its K criteria (`rubric_format`, saved with μ): 'json', the release's JSON list (μ closes it itself),
# or 'slots', K numbered lines whose numbers and breaks the decoder writes (SlotFrame): K criteria by construction.
# The worked examples, in an invented world; the first K criteria of each are shown.
_EXAMPLE_QUESTION = "Which river flows through the birth town of the painter Ilsa Marn?"


EXAMPLES = [
    ((_EXAMPLE_QUESTION, "", "Search[Ilsa Marn]", 3), [
        "The query names Ilsa Marn, the painter the question is about.",
        "It looks for her birth town, the first missing fact.",
        "The river can only be searched once the town is known.",
        "The query is short and specific enough to return one passage.",
        "Nothing was searched before, so the query repeats no earlier search.",
        "A passage about Ilsa Marn should name the town needed for the second hop.",
        "It spends one of three searches on the first of two hops, a fair use of the budget.",
        "It does not guess the river before any evidence is found.",
        "The step follows the Search[query] format."]),
    ((_EXAMPLE_QUESTION, "Step 1: Search[Ilsa Marn]\nObservation: Ilsa Marn: Ilsa Marn is a painter born in Odrec.\n"
                         "Step 2: Search[Odrec river]\nObservation: Odrec: Odrec is a town on the river Vell.",
      "Finish[Vell]", 1), [
        "The step is graded as the final answer, not another search.",
        "The answer Vell is backed by the passage about Odrec.",
        "Both hops, birth town and river, were found before finishing.",
        "The answer is a short name, as the question asks.",
        "Finishing with a search left is fine because the evidence is complete.",
        "The answer names the river, not the town or the painter.",
        "The answer keeps the passage's spelling of Vell.",
        "No passage found so far contradicts the answer.",
        "The step follows the Finish[answer] format."]),
]


# "w/o Adaptive": fixed dataset-level criteria reused at every step (the first K are used).
STATIC_CRITERIA = [
    "The step targets an entity or relation that the question depends on.",
    "The step seeks evidence still missing from the steps so far instead of repeating a search.",
    "A final answer is supported by the passages found and is as short as the question needs.",
    "A search query is specific enough to return a single relevant passage.",
    "The step builds on what earlier passages revealed, such as a bridge entity.",
    "The step uses the remaining searches sensibly, neither finishing too early nor wasting them.",
    "The step follows the format Search[query] or Finish[answer].",
    "The step moves the agent closer to resolving the next hop of the question.",
    "The step avoids guessing when the evidence so far is not enough.",
]


@dataclass
class StepContext:
    """What μ sees of one step: q, h_t (as text), a_t, and the searches left before a_t."""
    question: str
    prefix: str
    action: str
    searches_left: int


def step_text(ctx: StepContext, with_prefix: bool = True) -> str:
    """The step block of μ's prompts. Without the prefix (w/o Prefix) μ sees only the question
    and the action: the paper conditions that variant "only on the question and current
    action", so the budget (which reveals the position in the trajectory) goes too."""
    if not with_prefix:
        return f"Question: {ctx.question}\n\nStep to grade: {ctx.action}"
    return (f"Question: {ctx.question}\n\nSteps so far:\n{ctx.prefix or 'None yet.'}\n\n"
            f"Searches left: {ctx.searches_left}\n\nStep to grade: {ctx.action}")


def rubric_messages(ctx: StepContext, k: int, mode: str = "adaptive", examples: int = 2,
                    fmt: str = "json") -> list[dict]:
    """Chat messages of μ's rubric prompt for one step (adaptive, prefix-free and static):
    the first `examples` worked examples as earlier turns, then the step to grade. 'json' puts the
    instruction after each step; 'slots' puts it in the system message, so that every step's prompt
    begins with the same tokens and ends with its own step (the engines run a shared beginning once)."""
    with_prefix = mode != "prefix-free"
    if fmt == "slots":
        system, instruction = RUBRIC_SYSTEM_SLOTS + " " + RUBRIC_INSTRUCTION_SLOTS.format(k=k), ""
    else:
        system, instruction = RUBRIC_SYSTEM, "\n\n" + RUBRIC_INSTRUCTION.format(k=k)
    messages = [{"role": "system", "content": system}]
    for step, criteria in EXAMPLES[:examples]:
        messages += [{"role": "user", "content": step_text(StepContext(*step), with_prefix) + instruction},
                     {"role": "assistant", "content": rubric_text(criteria[:k], fmt)}]
    return messages + [{"role": "user", "content": step_text(ctx, with_prefix) + instruction}]


def score_only_messages(ctx: StepContext) -> list[dict]:
    """w/o Rubric: the score head reads (q, h_t, a_t) with no rubric text."""
    return [{"role": "system", "content": SCORE_ONLY_SYSTEM},
            {"role": "user", "content": step_text(ctx) + "\n\n" + SCORE_ONLY_INSTRUCTION}]


def contexts_from_trajectory(traj) -> list[StepContext]:
    """μ's view of every step of an env.Trajectory: h_t is the history before step t."""
    return [StepContext(traj.example.question, env.format_history(traj.steps[:t]), s.action_text(), s.searches_left)
            for t, s in enumerate(traj.steps)]


# ----------------------------------------------------------------------------------------
# 3. The K criteria: written, and read back
# ----------------------------------------------------------------------------------------

@dataclass
class Rubric:
    """r_t: the criteria μ wrote for one step."""
    text: str                       # the reply as written, opening `["` included (kept even when unparseable)
    criteria: list[str]             # exactly K criteria ("" where fewer were written or unparseable)
    parsed: bool                    # 'json': a valid JSON list of strings; 'slots': K criteria, none empty
    n_written: int                  # how many criteria it held (before padding/cutting to K)
    token_ids: list[int] = field(default_factory=list)  # the rubric's tokens, as scored and KL-regularized

    @property
    def complete(self) -> bool:                 # K criteria, parsed, none empty: the rate the run logs per update
        return self.parsed and all(c.strip() for c in self.criteria)


def rubric_text(criteria: Sequence[str], fmt: str) -> str:
    """K criteria as μ writes them: a JSON list ('json') or K numbered lines ('slots')."""
    if fmt == "json":
        return json.dumps([str(c) for c in criteria])
    return "\n".join(f"{j}. {one_line(c)}" for j, c in enumerate(criteria, 1))


def one_line(text: str) -> str:
    return " ".join(str(text).split())


class SlotFrame:
    """The 'slots' frame: μ's reply is `1. <criterion>\n2. <criterion>\n…K. <criterion>`; the decoder writes the numbers,
    line breaks and end (`steer`), μ the words; a criterion holds no line break and at least MIN_WORDS words (a
    minimum length, as for a whole reply; the oracle teacher's criteria hold 7 or more)."""
    MIN_WORDS = 5

    def __init__(self, tokenizer, k: int, stops: Sequence[int], eot: int):
        self.opens = [tokenizer(f"{j}.", add_special_tokens=False)["input_ids"] for j in range(1, k + 1)]
        newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
        if len(newline) != 1:
            raise ValueError(f"the 'slots' rubric format needs a tokenizer with one token for a line break, got {newline}")
        self.tokenizer, self.k, self.newline, self.eot = tokenizer, k, newline[0], eot
        self.breaks = sorted(set(stops) | {i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i])})
        self._masks: dict[int, torch.Tensor] = {}

    def break_mask(self, size: int, device) -> torch.Tensor:
        """[size] True at the tokens that end a line (a vocabulary padded past the tokenizer's length included)."""
        if size not in self._masks:
            mask = torch.zeros(size, dtype=torch.bool)
            mask[[b for b in self.breaks if b < size]] = True
            self._masks[size] = mask
        return self._masks[size].to(device)

    def steer(self, max_new_tokens: int) -> Callable[[list[int], int, torch.Tensor], int]:
        """The decoder's `steer` (reply ids so far, μ's drawn token, the step's logits → the token written): slot j's
        number "j." while it opens; μ's token inside a slot; if μ ends its line (a line break or end-of-turn token)
        before MIN_WORDS words, its likeliest other token; after them, or at `cap` tokens (room for K slots within
        max_new_tokens), the break to the next slot or, after the K-th, the end of the reply."""
        cap = (max_new_tokens - sum(map(len, self.opens)) - self.k) // self.k
        if cap < 1:
            raise ValueError(f"max_new_tokens {max_new_tokens} leaves no room for {self.k} criteria in the 'slots' frame")
        breaks = set(self.breaks)

        def steer(new: list[int], drawn: int, logits: torch.Tensor) -> int:
            j = new.count(self.newline)                                       # slots closed so far
            start = len(new) - new[::-1].index(self.newline) if j else 0
            at = len(new) - start                                             # tokens written in slot j
            if at < len(self.opens[j]):
                return self.opens[j][at]                                      # the slot's number, "j."
            if at - len(self.opens[j]) >= cap:                                # the slot is full
                return self.newline if j + 1 < self.k else self.eot
            if drawn not in breaks:
                return drawn
            words = self.tokenizer.decode(new[start + len(self.opens[j]):], skip_special_tokens=True).split()
            if len(words) < self.MIN_WORDS:                                   # too short to end: μ's best other token
                return int(logits.float().masked_fill(self.break_mask(logits.shape[-1], logits.device), -math.inf)
                           .argmax())
            return self.newline if j + 1 < self.k else self.eot              # μ ended its line
        return steer

    def ids(self, criteria: Sequence[str]) -> list[int]:
        """The token ids of K criteria written into the frame (teacher rubrics for Eq. 7): the ids the decoder
        writes when μ draws these words (a criterion longer than a slot's cap is not cut here)."""
        out = []
        for j, c in enumerate(criteria):
            words = self.tokenizer(" " + one_line(c), add_special_tokens=False)["input_ids"] if one_line(c) else []
            out += self.opens[j] + words + [self.newline if j + 1 < self.k else self.eot]
        return out


_JSON_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
_TEXT_KEYS = ("criterion", "text", "description", "name", "check")


def _as_criterion(item) -> str:
    if isinstance(item, str):
        return item.strip()
    if isinstance(item, dict):
        for key in _TEXT_KEYS:
            if isinstance(item.get(key), str):
                return item[key].strip()
        return next((v.strip() for v in item.values() if isinstance(v, str)), json.dumps(item))
    return json.dumps(item)


def _json_criteria(text: str) -> list[str] | None:
    """The first JSON list (or object holding a list / strings) in the text, as strings."""
    decoder = json.JSONDecoder()
    for start in (m.start() for m in re.finditer(r"[\[{]", text)):
        try:
            value, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):      # {"criteria": [...]} or {"1": "...", "2": "..."}
            lists = [v for v in value.values() if isinstance(v, list)]
            value = lists[0] if lists else [v for v in value.values() if isinstance(v, (str, dict))]
        if isinstance(value, list) and value:
            return [_as_criterion(v) for v in value]
    return None


def parse_slots(text: str, k: int) -> tuple[list[str], bool, int]:
    """parse_criteria for the 'slots' format: line j is "j. <criterion>"; parsed when all K are there, none empty."""
    criteria = []
    for j, line in enumerate(text.strip().split("\n")[:k], 1):
        line = line.strip()
        criteria.append(line[len(f"{j}."):].strip() if line.startswith(f"{j}.") else line)
    n = sum(1 for c in criteria if c)
    return (criteria + [""] * k)[:k], n == k, n


def parse_criteria(text: str, k: int) -> tuple[list[str], bool, int]:
    """(exactly K criteria, parsed?, how many were written) from μ's reply ('json' format).

    A valid JSON list (also inside code fences or chatter, or under a key) is parsed and
    padded with "" or cut to K. A reply cut off mid-list (it ran past max_new_tokens) is not
    valid JSON: its complete string items are kept but `parsed` is False. Anything else is
    kept only as raw text (Rubric.text), with K empty criteria and `parsed` False.
    """
    items = _json_criteria(text)
    parsed = items is not None
    if items is None:                   # salvage the complete strings of a truncated list
        start = text.find("[")
        items = []
        if start >= 0:
            for m in _JSON_STRING.finditer(text, start):
                try:
                    items.append(json.loads(m.group(0)).strip())
                except json.JSONDecodeError:
                    pass
    n = len(items)
    return (items + [""] * k)[:k], parsed, n


# ----------------------------------------------------------------------------------------
# 4. RubricModel: write, score, save, load
# ----------------------------------------------------------------------------------------

@dataclass
class StepScores:
    d: torch.Tensor                 # [B, K] criterion scores d_t ∈ [−1, 1]^K (Eq. 2)
    s: torch.Tensor                 # [B] step scores s_t = mean_j d_{t,j} (Eq. 2)


class RubricModel:
    """μ: one backbone f_θ, two heads (§3.1). The LM head (the backbone's own) writes r_t; `head` (ScoreHead, g_φ)
    turns the mean-pooled last hidden states of (q, h_t, a_t, r_t) into d_t and s_t (Eq. 2). rubric_mode selects the
    paper's variants (Table 2): 'adaptive' (ARCO), 'prefix-free' (w/o Prefix: no h_t in the prompt), 'static' (w/o
    Adaptive: K fixed criteria) and 'none' (w/o Rubric: the score head reads (q, h_t, a_t) only)."""

    def __init__(self, backbone: Backbone, k: int = 3, rubric_mode: str = "adaptive", head_hidden: int = 256,
                 static_criteria: Sequence[str] | None = None, examples: int = 2, rubric_format: str = "json"):
        if rubric_mode not in RUBRIC_MODES:
            raise ValueError(f"rubric_mode must be one of {RUBRIC_MODES}, got {rubric_mode!r}")
        if rubric_format not in RUBRIC_FORMATS:
            raise ValueError(f"rubric_format must be one of {RUBRIC_FORMATS}, got {rubric_format!r}")
        self.rubric_format = rubric_format
        if not 1 <= k <= len(STATIC_CRITERIA):
            raise ValueError(f"K must be between 1 and {len(STATIC_CRITERIA)}, got {k}")
        if not 0 <= examples <= len(EXAMPLES):
            raise ValueError(f"examples must be between 0 and {len(EXAMPLES)}, got {examples}")
        self.backbone, self.k, self.rubric_mode, self.head_hidden = backbone, k, rubric_mode, head_hidden
        self.examples = examples        # worked examples shown in the rubric prompt
        self.static_criteria = list(static_criteria or STATIC_CRITERIA)[:k]
        if rubric_mode == "static" and len(self.static_criteria) < k:
            raise ValueError(f"static mode needs {k} criteria, got {len(self.static_criteria)}")
        d_model = backbone.model.get_output_embeddings().in_features
        self.head = ScoreHead(d_model, k, head_hidden).to(backbone.device)

    # -- prompts ------------------------------------------------------------------------
    def prompt_ids(self, ctx: StepContext) -> list[int]:
        """The rubric prompt: chat template, assistant turn opened (and started with `["` in the json format);
        for 'none' the score-only prompt."""
        tok = self.backbone.tokenizer
        if self.rubric_mode == "none":
            return chat_prompt_ids(tok, score_only_messages(ctx), add_generation_prompt=False)
        ids = chat_prompt_ids(tok, rubric_messages(ctx, self.k, self.rubric_mode, self.examples, self.rubric_format))
        return ids + (tok(RUBRIC_OPENING, add_special_tokens=False)["input_ids"] if self.rubric_format == "json" else [])

    def prompt_text(self, ctx: StepContext) -> str:
        """The text of μ's rubric prompt for a step (what a copied criterion is looked for in)."""
        return "\n".join(m["content"] for m in rubric_messages(ctx, self.k, self.rubric_mode, self.examples,
                                                               self.rubric_format))

    @property
    def frame(self) -> SlotFrame:
        """The 'slots' frame (built once: it reads the whole vocabulary for tokens holding a line break)."""
        if getattr(self, "_frame", None) is None:
            self._frame = SlotFrame(self.backbone.tokenizer, self.k, *end_of_reply(self.backbone))
        return self._frame

    def rubric_from_criteria(self, criteria: Sequence[str]) -> Rubric:
        """A Rubric for criteria that were not sampled (teacher annotations for Eq. 7, static
        mode): its tokens are the JSON after the opening `["`, then the end-of-turn token ('json'),
        or the K criteria in their frame ('slots'). 'none' has no rubric text: the empty rubric,
        whatever the criteria."""
        if self.rubric_mode == "none":
            return Rubric("", [""] * self.k, True, 0, [])
        if self.rubric_format == "slots":
            padded = (list(criteria) + [""] * self.k)[:self.k]
            return self.rubric_from_ids(self.frame.ids(padded))
        text = json.dumps([str(c) for c in criteria])
        if not text.startswith(RUBRIC_OPENING):
            raise ValueError(f"a rubric needs at least one criterion, got {list(criteria)!r}")
        padded, parsed, n = parse_criteria(text, self.k)
        return Rubric(text, padded, parsed, n, encode_response(self.backbone, text[len(RUBRIC_OPENING):]))

    def rubric_from_ids(self, ids: Sequence[int]) -> Rubric:
        """The Rubric of a reply's token ids (written by μ, or a teacher's criteria encoded)."""
        text = self.backbone.tokenizer.decode(ids, skip_special_tokens=True)
        if self.rubric_format == "slots":
            return Rubric(text, *parse_slots(text, self.k), list(ids))
        text = RUBRIC_OPENING + text
        return Rubric(text, *parse_criteria(text, self.k), list(ids))

    # -- LM head: r_t ~ p_θ(· | q, h_t, a_t) -----------------------------------------------
    def generate_rubrics(self, contexts: Sequence[StepContext], temperature: float = 0.7,
                         max_new_tokens: int = 128, batch_size: int = 16):
        """Alg. 1, line 16: one rubric of K criteria per step ('static': the fixed ones, 'none': an empty one, neither
        generated). 'slots': K criteria by construction (SlotFrame); 'json': a rubric ends where its list closes."""
        return self.annotate(contexts, temperature, max_new_tokens, batch_size, scores=False)[0]

    def steer(self, max_new_tokens: int) -> Callable[[list[int], int, torch.Tensor], int]:
        """The decoder's `steer` for μ's replies: the slot frame ('slots'), or, for 'json', the end-of-turn
        token in place of whatever μ draws once its reply completes the JSON list."""
        if self.rubric_format == "slots":
            return self.frame.steer(max_new_tokens)
        tok, eot = self.backbone.tokenizer, end_of_reply(self.backbone)[1]

        def closing(new: list[int], drawn: int, logits: torch.Tensor) -> int:
            closed = new and "]" in tok.decode(new[-1:]) and \
                _json_criteria(RUBRIC_OPENING + tok.decode(new, skip_special_tokens=True)) is not None
            return eot if closed else drawn
        return closing

    @torch.no_grad()
    def annotate(self, contexts: Sequence[StepContext], temperature: float = 0.7, max_new_tokens: int = 128,
                 batch_size: int = 16, scores: bool = True) -> tuple[list[Rubric], StepScores | None]:
        """Alg. 1, lines 16–19: r_t for every step, and d_t, s_t (Eq. 2). Greedy rubrics are scored from
        the hidden states the generation computes anyway (every rubric token is fed once more), which
        equals a separate score pass over (q, h_t, a_t, r_t) up to floating-point rounding (tested)."""
        if self.rubric_mode in ("static", "none"):
            rubrics = [self.rubric_from_criteria(self.static_criteria if self.rubric_mode == "static" else [])
                       for _ in contexts]
            return rubrics, (self.score(contexts, rubrics, batch_size) if scores else None)
        hidden = scores and temperature == 0
        outs = engine_of(self.backbone).decode(self.backbone, [self.prompt_ids(c) for c in contexts], max_new_tokens,
                                               temperature, batch_size, steer=self.steer(max_new_tokens), hidden=hidden)
        rubrics = [self.rubric_from_ids(g.token_ids) for g, _ in outs]
        if not scores:
            return rubrics, None
        if not hidden:                                   # sampled rubrics: a score pass of their own
            return rubrics, self.score(contexts, rubrics, batch_size)
        if not outs:
            return rubrics, self.step_scores(torch.zeros((0, self.head.d_model), device=self.backbone.device))
        states = [h for _, h in outs]                    # each (q, h_t, a_t, r_t)'s last hidden states [L, H]
        mask = torch.arange(max(len(h) for h in states), device=states[0].device)[None] < \
            torch.tensor([len(h) for h in states], device=states[0].device)[:, None]
        return rubrics, self.step_scores(mean_pool(nn.utils.rnn.pad_sequence(states, batch_first=True), mask))  # Eq. 2

    # -- score head: d_t = g_φ(mean-pool(hidden(q, h_t, a_t, r_t))) ------------------------
    def scoring_ids(self, contexts: Sequence[StepContext], rubrics: Sequence[Rubric] | None) -> list[list[int]]:
        """Token ids of the full scoring sequences: the rubric prompt followed by the rubric's
        own tokens (exactly as written, so they are the tokens the KL term regularizes)."""
        if self.rubric_mode == "none" or rubrics is None:
            if self.rubric_mode != "none":
                raise ValueError(f"rubric_mode {self.rubric_mode!r} scores (q, h_t, a_t, r_t): pass the rubrics")
            return [self.prompt_ids(c) for c in contexts]
        if len(rubrics) != len(contexts):
            raise ValueError(f"{len(contexts)} steps but {len(rubrics)} rubrics")
        return [self.prompt_ids(c) + list(r.token_ids) for c, r in zip(contexts, rubrics)]

    def step_scores(self, pooled: torch.Tensor) -> StepScores:
        """Eq. 2 from the pooled vectors h̄_t [B, H]: d_t = g_φ(h̄_t) ∈ [−1, 1]^K, s_t = (1/K) Σ_j d_{t,j}
        (the one place s_t is computed)."""
        d = self.head(pooled)
        return StepScores(d, d.mean(-1))

    def pooled(self, contexts: Sequence[StepContext], rubrics: Sequence[Rubric] | None = None) -> torch.Tensor:
        """h̄_t [B, H] in fp32: a score-only pass, which never computes the LM head."""
        ids, mask = pad_right(self.scoring_ids(contexts, rubrics), self.backbone.tokenizer.pad_token_id,
                              self.backbone.device)
        return mean_pool(last_hidden_states(self.backbone, ids, mask).float(), mask)

    def score(self, contexts: Sequence[StepContext], rubrics: Sequence[Rubric] | None = None,
              batch_size: int | None = None) -> StepScores:
        """Eq. 2: d_t = g_φ(h̄_t) ∈ [−1, 1]^K and s_t = (1/K) Σ_j d_{t,j}.

        Gradients reach the score head and the backbone's adapter when grad is enabled.
        `batch_size` splits the steps into length-sorted batches (order kept).
        """
        n = len(contexts)
        rubrics = list(rubrics) if rubrics is not None else None
        if not n or batch_size is None or batch_size >= n:
            pooled = self.pooled(contexts, rubrics) if n else torch.zeros((0, self.head.d_model))
        else:
            lengths = [len(c.prefix) + len(rubrics[i].text if rubrics else "") for i, c in enumerate(contexts)]
            parts, order = [], []
            for batch in length_batches(lengths, batch_size):
                parts.append(self.pooled([contexts[i] for i in batch], [rubrics[i] for i in batch] if rubrics else None))
                order += batch
            pooled = torch.cat(parts)[torch.argsort(torch.tensor(order, device=parts[0].device))]
        return self.step_scores(pooled.to(self.backbone.device))                # Eq. 2

    # -- training helpers ----------------------------------------------------------------
    def train(self, mode: bool = True) -> "RubricModel":
        self.backbone.model.train(mode)
        self.head.train(mode)
        return self

    def eval(self) -> "RubricModel":
        return self.train(False)

    def fresh_adapter(self, dropout: float) -> "RubricModel":
        """RL's μ (Alg. 1, line 1): the SFT adapter merged into the backbone's weights, a fresh LoRA on top; μ_ref is
        the same module with that adapter disabled (infra.models.fresh_adapter)."""
        fresh_adapter(self.backbone, dropout)
        return self

    def parameter_groups(self, lr: float, head_lr: float) -> list[dict]:
        """Optimizer groups: the backbone's trainable (LoRA) weights and the score head
        (the release config trains them with different learning rates)."""
        return [{"params": trainable_parameters(self.backbone.model), "lr": lr},
                {"params": list(self.head.parameters()), "lr": head_lr}]

    # -- save / load ---------------------------------------------------------------------
    def config(self) -> dict:
        return {"k": self.k, "rubric_mode": self.rubric_mode, "head_hidden": self.head_hidden,
                "static_criteria": self.static_criteria, "examples": self.examples, "rubric_format": self.rubric_format}

    def save(self, path: str | os.PathLike) -> Path:
        """Adapters (peft format) + score head (safetensors) + config JSON; see save_backbone."""
        from safetensors.torch import save_file
        path = save_backbone(self.backbone, path, extra={"rubric_model": self.config()})
        save_file({k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()},
                  str(path / "score_head.safetensors"))
        write_manifest(path)                     # again, with the head
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, device: str = "auto", dtype: str = "auto",
             autocast: str = "auto", engine=None) -> "RubricModel":
        """A saved μ (save): its backbone as load_backbone_checkpoint rebuilds it, to be run by `engine`
        (infra.engines.ENGINES), and its score head and settings — its K, variant and rubric format among them:
        what a μ was fine-tuned to write is read from μ itself."""
        from safetensors.torch import load_file
        bb, config = load_backbone_checkpoint(path, device, dtype, autocast, engine)
        mu_config = config.get("rubric_model")
        if mu_config is None:
            raise ValueError(f"{Path(path) / 'config.json'} is a backbone checkpoint without a rubric model")
        mu = cls(bb, mu_config["k"], mu_config["rubric_mode"], mu_config["head_hidden"],
                 mu_config["static_criteria"], mu_config.get("examples", 2), mu_config.get("rubric_format", "json"))
        state = load_file(str(Path(path) / "score_head.safetensors"), device=str(bb.device))
        mu.head.load_state_dict(state)
        return mu
