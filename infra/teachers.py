"""What every warmup teacher shares (plumbing beneath warmup.py's teacher protocol): the error of a call or
annotation that failed for good, the groups of questions run one after another or by a pool of API workers
(in_parallel, serialized writes, a retriever they share), and two wording helpers (a teacher
hands its scores over as it read them; App. B's clip-and-fit to K numbers in [−1, 1] is warmup.fit_scores). The teachers: infra/oracle.py (offline: the oracle, and
π_sft playing with the oracle annotating) and infra/openai_teacher.py (any OpenAI-compatible endpoint).

A teacher is given the environment it plays in (env.py, passed in as `world`: this package imports no script) and
answers warmup.py's two calls: `rollout(pairs, retriever)` → (trajectories, metas) and `annotate(traj, meta, K)` →
(K criteria and K scores per step, issues found).
"""
from __future__ import annotations

import threading
from typing import Sequence

class TeacherError(Exception):
    """A teacher call that failed for good (after retries) or an annotation that cannot be parsed."""


_WRITES = threading.Lock()


def serialized(fn):
    """`fn` run under one lock shared by everything this decorates: what the API workers write from their own
    threads (records, failures, counts)."""
    def locked(*args, **kwargs):
        with _WRITES:
            return fn(*args, **kwargs)
    return locked


def in_parallel(teacher, groups: Sequence, retriever, work, progress: bool = True) -> None:
    """`work(group, retriever)` for each group of questions, with a progress bar: one after another, or, for a teacher
    with several workers (the API teacher: teacher.workers), in a pool of threads sharing one retriever
    (LockedRetriever); on an error or Ctrl-C the teacher's calls in flight stop at their next attempt (teacher.stop)
    and what was written stays."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from tqdm import tqdm
    bar = tqdm(total=sum(len(g) for g in groups), desc=f"warmup {teacher.name}", unit="q", disable=not progress)
    if getattr(teacher, "workers", 1) <= 1:
        for g in groups:
            work(g, retriever)
            bar.update(len(g))
    else:
        shared = LockedRetriever(retriever)
        pool = ThreadPoolExecutor(teacher.workers)
        try:
            futures = {pool.submit(work, g, shared): len(g) for g in groups}
            for fut in as_completed(futures):
                fut.result()
                bar.update(futures[fut])
        except BaseException:
            teacher.stop.set()  # in-flight calls end at their next attempt; written records stay
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
    bar.close()


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
