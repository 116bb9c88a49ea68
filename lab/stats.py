"""The statistics behind the diagnostics of μ (RQ3, RQ4, the judge and credit-assignment checks): κ, false passes, a
fitted threshold, Spearman's ρ, confidence intervals, step-binding items, rubric redundancy. Plain Python; numpy
only in `redundancy`."""
from collections import defaultdict
from typing import Any, Sequence

import numpy as np

from infra.runs import average_ranks

# --------------------------------------------------------------------------- diagnostics: statistics (issue 6)
# Small pure functions behind the diagnostics of μ (RQ3, RQ4, and the judge / credit-assignment
# checks): ranks, AUC, κ, false passes, confidence intervals, step-binding items, rubric
# redundancy, and which synthetic steps were useful. Plain Python; numpy only in `redundancy`.

def cohen_kappa(pred: Sequence[bool | int], truth: Sequence[bool | int]) -> float | None:
    """Cohen's κ of two binary labelings: (p_o − p_e) / (1 − p_e), p_o the observed agreement,
    p_e the agreement expected from the two marginals. None when undefined: no items, or
    p_e = 1 (both sides constant and equal)."""
    if len(pred) != len(truth):
        raise ValueError(f"cohen_kappa: {len(pred)} predictions but {len(truth)} labels")
    n = len(pred)
    if n == 0:
        return None
    a, b = [bool(x) for x in pred], [bool(y) for y in truth]
    p_o = sum(x == y for x, y in zip(a, b)) / n
    pa, pb = sum(a) / n, sum(b) / n
    p_e = pa * pb + (1 - pa) * (1 - pb)
    return None if p_e == 1 else (p_o - p_e) / (1 - p_e)


def judge_stats(pred_pass: Sequence[bool | int], truth_pass: Sequence[bool | int]) -> dict:
    """How a pass/fail judge agrees with the true outcome (RubricForge's false-pass lens).

    false_pass_rate = share of truly failed trajectories the judge passes (the dangerous error:
    it certifies a broken agent); false_fail_rate = share of truly passing ones it fails. Each
    is None when its denominator is empty; agreement and kappa are None with no items.
    """
    if len(pred_pass) != len(truth_pass):
        raise ValueError(f"judge_stats: {len(pred_pass)} verdicts but {len(truth_pass)} labels")
    pairs = [(bool(p), bool(t)) for p, t in zip(pred_pass, truth_pass)]
    tp = sum(p and t for p, t in pairs)
    fp = sum(p and not t for p, t in pairs)          # false passes
    fn = sum(t and not p for p, t in pairs)          # false fails
    tn = len(pairs) - tp - fp - fn
    return {"n": len(pairs), "agreement": (tp + tn) / len(pairs) if pairs else None,
            "kappa": cohen_kappa(pred_pass, truth_pass),
            "false_pass_rate": fp / (fp + tn) if fp + tn else None,
            "false_fail_rate": fn / (fn + tp) if fn + tp else None,
            "true_pass": tp, "false_pass": fp, "true_fail": tn, "false_fail": fn}


def best_threshold(scores: Sequence[float], labels: Sequence[bool | int]) -> float:
    """The threshold on `scores` that maximizes agreement with `labels` (fit it on train data).

    A score passes when score > threshold. Candidates: −inf (everything passes), the midpoint
    between each pair of consecutive distinct scores, and +inf (nothing passes). Ties in
    agreement go to the HIGHEST candidate, the strictest judge: fewer false passes.
    """
    if len(scores) != len(labels):
        raise ValueError(f"best_threshold: {len(scores)} scores but {len(labels)} labels")
    if not scores:
        raise ValueError("best_threshold: no scores")
    counts: dict[float, list[int]] = defaultdict(lambda: [0, 0])  # score -> [negatives, positives]
    for s, y in zip(scores, labels):
        counts[s][bool(y)] += 1
    values = sorted(counts)
    correct = sum(bool(y) for y in labels)                     # threshold −inf: all pass
    best, best_thr = correct, float("-inf")
    for j, v in enumerate(values):                            # the threshold moves just above v
        correct += counts[v][0] - counts[v][1]
        thr = (v + values[j + 1]) / 2 if j + 1 < len(values) else float("inf")
        if correct >= best:                                   # >=: a later (higher) one wins ties
            best, best_thr = correct, thr
    return best_thr


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's ρ: Pearson correlation of the average ranks (ties share a rank). None when
    either side is constant or there are fewer than 2 items."""
    if len(x) != len(y):
        raise ValueError(f"spearman: {len(x)} vs {len(y)} values")
    if len(x) < 2:
        return None
    rx, ry = average_ranks(x), average_ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / (sxx * syy) ** 0.5


Z95 = 1.96  # two-sided 95% normal quantile, used by every interval below


def proportion_ci(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n (stays inside [0, 1] and is sensible at
    k = 0 or k = n, unlike p ± z·√(p(1−p)/n)). Tables report ± its half-width, (high − low) / 2,
    as Table 3 (RQ3) gives Bind ± 95% CI half-widths."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"proportion_ci: need 0 <= k <= n and n > 0, got k={k}, n={n}")
    p, z2 = k / n, z * z
    center = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * (p * (1 - p) / n + z2 / (4 * n * n)) ** 0.5
    return max(0.0, center - half), min(1.0, center + half)


def mean_ci(values: Sequence[float], z: float = Z95) -> tuple[float, float]:
    """(mean, half-width) of the normal-approximation 95% interval mean ± z·sd/√n, with the
    sample sd (n − 1 denominator). With one value the half-width is 0 (no spread to measure)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_ci: no values")
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
    return mean, z * sd / n ** 0.5


def _norm_text(s: str) -> str:
    """Strip and collapse whitespace: two texts equal after this are the same action / criterion."""
    return " ".join(str(s).split())


def binding_item(actions: Sequence[str], t: int, rng: Any) -> tuple[list[str], int] | None:
    """One step-binding item (RQ3, §4.4): the gold is actions[t], the action the rubric of step t
    was written for; the distractors are up to three other distinct actions of the SAME
    trajectory (`actions` = every step's action text, e.g. Step.action_text()).

    Texts are compared and returned whitespace-normalized (`_norm_text`). Distractors never equal
    the gold and are distinct; with more than three, `rng` (a random.Random) samples three, then
    shuffles the candidates. Fewer than three distractors give fewer candidates (chance is then
    1 / len(candidates), not 25%); none gives None (the item is skipped).
    Returns (candidates, index of the gold among them).
    """
    gold = _norm_text(actions[t])
    pool = []
    for j, a in enumerate(actions):
        a = _norm_text(a)
        if j != t and a != gold and a not in pool:
            pool.append(a)
    if not pool:
        return None
    candidates = rng.sample(pool, min(3, len(pool))) + [gold]
    rng.shuffle(candidates)
    return candidates, candidates.index(gold)


def redundancy(criteria: Sequence[str], vectors: Any, scores: Sequence[float],
               threshold: float = 0.8) -> dict:
    """Redundancy of one step's K criteria (RQ4, §4.5, Fig. 3B–C and 4).

    Themes are clusters of the criteria's embeddings (`vectors`: K rows, any dimension), formed
    greedily in order: a criterion joins the first earlier cluster whose FIRST member has cosine
    ≥ `threshold` with it, else starts a new one (the paper runs K-Means; this needs no K and is
    deterministic). Returns k, themes, theme_ratio (themes / K), exact_duplicate_rate (share of
    criteria whose `_norm_text` equals an earlier one's), paraphrase_duplicate_rate (share that
    joined an existing cluster: every semantic duplicate, exact ones included), and score_range
    (largest max − min of `scores` (μ's d_t) within a cluster of ≥ 2 criteria; None if none).
    Rates are None when K = 0. A zero vector has cosine 0 with everything.
    """
    k = len(criteria)
    if len(scores) != k or len(vectors) != k:
        raise ValueError(f"redundancy: {k} criteria, {len(vectors)} vectors, {len(scores)} scores")
    if k == 0:
        return {"k": 0, "themes": 0, "theme_ratio": None, "exact_duplicate_rate": None,
                "paraphrase_duplicate_rate": None, "score_range": None}
    v = np.asarray(vectors, dtype=float).reshape(k, -1)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    unit = np.divide(v, norms, out=np.zeros_like(v), where=norms > 0)
    clusters: list[list[int]] = []
    joined = exact = 0
    seen: set[str] = set()
    for i in range(k):
        text = _norm_text(criteria[i])
        exact += text in seen
        seen.add(text)
        home = next((c for c in clusters if float(unit[c[0]] @ unit[i]) >= threshold), None)
        if home is None:
            clusters.append([i])
        else:
            home.append(i)
            joined += 1
    ranges = [max(scores[i] for i in c) - min(scores[i] for i in c) for c in clusters if len(c) >= 2]
    return {"k": k, "themes": len(clusters), "theme_ratio": len(clusters) / k,
            "exact_duplicate_rate": exact / k, "paraphrase_duplicate_rate": joined / k,
            "score_range": float(max(ranges)) if ranges else None}


def redundancy_summary(per_step: Sequence[dict]) -> dict:
    """Means over steps of each `redundancy` number (Fig. 3B–C average over dev steps); a step
    whose value is None (K = 0, or no cluster of ≥ 2 for score_range) is left out of that mean,
    whose count is kept as `n_<key>`. `steps` is the number of steps given."""
    out: dict[str, Any] = {"steps": len(per_step)}
    for key in ("k", "themes", "theme_ratio", "exact_duplicate_rate", "paraphrase_duplicate_rate", "score_range"):
        vals = [r[key] for r in per_step if r.get(key) is not None]
        out[key] = sum(vals) / len(vals) if vals else None
        out[f"n_{key}"] = len(vals)
    return out
