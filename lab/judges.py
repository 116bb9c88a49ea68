"""The judges of RQ3 (§4.4): Bind (which action was this checklist written for?) and Spec (how tied to its action is
it?), by an OpenAI-compatible model (OpenAIJudge, with our own prompt wording: the paper shows its prompts only as
figures) or offline by embeddings (embedding_bind)."""
import re
import string
import threading
from collections import Counter
from typing import Sequence

import numpy as np

from infra.openai_teacher import chat_completion
from infra.teachers import TeacherError

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
