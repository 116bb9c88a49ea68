"""The OpenAI-compatible teacher (`--teacher openai`, the paper's setting: GPT models): one model plays the warmup
questions in the real environment, another annotates whole trajectories with K criteria and K scores per step (our
prompt states the decomposition constraint, App. B / App. E); robust parsing, retries with backoff, token and cost
counters. `chat_completion` is also diagnostics' judge's one API call. The environment (`world`, env.py) is given
to the teacher: this package imports no script.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from typing import Any, Iterable, Sequence

from infra.files import scrub
from infra.teachers import TeacherError

# Example and Trajectory: env.py's types, duck-typed here (this package imports no script).
Example = Trajectory = Any

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


def trajectory_text(traj: Trajectory) -> str:
    lines = []
    for i, s in enumerate(traj.steps, 1):
        lines.append(f"Step {i} (searches left: {s.searches_left}): {s.action_text() or '(no action)'}")
        lines.append(f"Result: {s.observation}")
    return "\n".join(lines)


def annotation_messages(traj: Trajectory, K: int) -> list[dict]:
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
    """A trajectory annotation -> (criteria T×K, each step's scores as the teacher wrote them, issues found).

    Copes with code fences and prose around the JSON, trailing commas, a bare list of steps,
    criteria given as objects with their own "score", 0-based step numbers, numeric strings.
    A missing step gets no criteria (its steps are dropped from μ SFT) and no scores; criteria are cut to K
    (fewer than K leaves empty ones); the scores are warmup.fit_scores' to clip, cut or pad (App. B), the
    issues it finds logged there. Raises TeacherError when no list of steps can be read.
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
            scores.append([])
            continue
        raw_c = e.get("criteria") or e.get("rubric") or e.get("checklist") or []
        raw_c = raw_c if isinstance(raw_c, list) else [raw_c]
        crit = [_criterion_text(c) for c in raw_c][:K]
        if len(crit) != K or not all(crit):
            issues.append(f"step {t}: {sum(bool(c) for c in crit)} criteria for K={K}")
        raw_s = e.get("scores")
        if raw_s is None and raw_c and all(isinstance(c, dict) and "score" in c for c in raw_c):
            raw_s = [c["score"] for c in raw_c]
        criteria.append(crit + [""] * (K - len(crit)))
        scores.append(raw_s)
    return criteria, scores, issues


def chat_completion(client, model: str, messages: list[dict], temperature: float, max_tokens: int, max_retries: int,
                    backoff: float, counters: Counter, lock: threading.Lock, stop: threading.Event | None = None) -> str:
    """One chat completion on any OpenAI-compatible endpoint: the one API call of the teacher and of
    the lab's judge (lab/diagnostics.py). HTTP 408/409/429/5xx, timeouts and connection errors are retried after
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
                               f"{scrub(str(e), getattr(client, 'api_key', None))[:300]}") from None
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

    def __init__(self, world, policy_model: str = "gpt-4o-mini", rubric_model: str = "gpt-4o-mini", temperature: float = 0.7,
                 max_retries: int = 5, backoff: float = 1.0, timeout: float = 60.0, concurrency: int = 8,
                 policy_max_tokens: int = 128, rubric_max_tokens: int = 2048, price_input: float = 0.15,
                 price_output: float = 0.60, obs_chars: int = 400, format_retries: int = 1, client=None):
        import openai
        try:
            self.client = client or openai.OpenAI(timeout=timeout, max_retries=0)
        except openai.OpenAIError as e:
            raise TeacherError(f"cannot start the API client: {scrub(str(e))} (set OPENAI_API_KEY, and OPENAI_BASE_URL "
                               f"for a server other than OpenAI's)") from None
        self.policy_model, self.rubric_model, self.temperature = policy_model, rubric_model, temperature
        self.max_retries, self.backoff, self.workers = max_retries, backoff, max(1, concurrency)
        self.policy_max_tokens, self.rubric_max_tokens = policy_max_tokens, rubric_max_tokens
        # USD per 1M tokens. Defaults: OpenAI's published list price of gpt-4o-mini ($0.15 input,
        # $0.60 output per 1M tokens, openai.com/api/pricing, 2024-07); set --price-* for other models.
        self.price_input, self.price_output = price_input, price_output
        self.obs_chars, self.format_retries = obs_chars, format_retries
        self.world = world                                  # env.py: where the API model plays
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

    def rollout(self, pairs: Sequence[tuple[Example, int]], retriever) -> tuple[list[Trajectory], list[dict]]:
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

        trajs = self.world.rollout([ex for ex, _ in pairs], act, retriever, obs_chars=self.obs_chars)
        if failed:
            raise TeacherError(f"policy: {failed[0]}")
        return trajs, [{"variant": "policy"} for _ in pairs]

    def annotate(self, traj: Trajectory, meta: dict, K: int) -> tuple[list[list[str]], list, list[str]]:
        messages = annotation_messages(traj, K)
        for attempt in range(self.format_retries + 1):
            text = self.chat(self.rubric_model, messages, 0.0, self.rubric_max_tokens)
            try:
                return parse_annotation(text, len(traj.steps), K)
            except TeacherError as e:
                if attempt == self.format_retries:
                    raise TeacherError(f"rubric: {e}; reply began {text[:120]!r}") from None
        raise TeacherError("no annotation")
