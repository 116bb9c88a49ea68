"""What every warmup teacher shares (plumbing beneath warmup.py's teacher protocol): reading a teacher's scores
(`clip_and_fit`: K numbers in [−1, 1]), the error of a call or annotation that failed for good, a retriever that
several API workers can share, and two wording helpers. The teachers: infra/oracle.py (offline: the oracle, and
π_sft playing with the oracle annotating) and infra/openai_teacher.py (any OpenAI-compatible endpoint).

A teacher is given the environment it plays in (env.py, passed in as `world`: this package imports no script) and
answers warmup.py's two calls: `rollout(pairs, retriever)` → (trajectories, metas) and `annotate(traj, meta, K)` →
(K criteria and K scores per step, issues found).
"""
from __future__ import annotations

import math
import threading
from typing import Sequence

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


class TeacherError(Exception):
    """A teacher call that failed for good (after retries) or an annotation that cannot be parsed."""


class LockedRetriever:
    """One retrieval at a time when API workers share the retriever."""

    def __init__(self, retriever):
        self.retriever, self.lock = retriever, threading.Lock()

    def retrieve(self, examples, queries):
        with self.lock:
            return self.retriever.retrieve(examples, queries)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("h") else "s")


def cycle(items: Sequence, K: int) -> list:
    return [items[j % len(items)] for j in range(K)]
