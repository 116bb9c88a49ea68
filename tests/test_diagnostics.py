"""Tests of the diagnostics statistics in diagnostics.py (issue 6; paper RQ3 §4.4, RQ4 §4.5, and
RubricForge's false-pass lens): AUC, κ, judge stats, threshold fitting, Spearman, confidence
intervals, step-binding items, rubric redundancy and the synthetic credit labels.

Every expected number below was worked out by hand (the working is in the comments), not by
running the code.
"""
import json
import math
import random
import types

import numpy as np
import pytest

from lab import study
import env
from infra.runs import auc
from lab.mu_credit import crossfit_judge, step_count_reference
from lab.stats import (best_threshold, binding_item, cohen_kappa, judge_stats, mean_ci, proportion_ci, redundancy,
                       redundancy_summary, spearman)
from lab.truth import step_usefulness


# --------------------------------------------------------------------------- AUC
def test_auc_counts_pairs():
    # positives {0.9, 0.7}, negatives {0.8, 0.6}; pairs (pos, neg):
    # (0.9,0.8) win, (0.9,0.6) win, (0.7,0.8) loss, (0.7,0.6) win -> 3 of 4 = 0.75
    assert auc([0.9, 0.8, 0.7, 0.6], [1, 0, 1, 0]) == pytest.approx(0.75)
    assert auc([3, 2, 1], [True, True, False]) == pytest.approx(1.0)   # every positive above
    assert auc([1, 2, 3], [True, True, False]) == pytest.approx(0.0)   # every positive below


def test_auc_ties_count_half():
    # positive 0.5 vs negatives {0.5, 0.2}: tie 1/2 + win 1 = 1.5 of 2 pairs = 0.75
    assert auc([0.5, 0.5, 0.2], [1, 0, 0]) == pytest.approx(0.75)
    # all scores equal: every pair ties -> 1/2
    assert auc([0.3, 0.3, 0.3, 0.3], [1, 0, 1, 0]) == pytest.approx(0.5)
    # positives {2, 1}, negatives {1, 0}: (2,1) 1, (2,0) 1, (1,1) 1/2, (1,0) 1 -> 3.5 / 4 = 0.875
    assert auc([2, 1, 1, 0], [1, 1, 0, 0]) == pytest.approx(0.875)


def test_auc_empty_class_is_none():
    assert auc([0.1, 0.2], [1, 1]) is None
    assert auc([0.1, 0.2], [0, 0]) is None
    assert auc([], []) is None
    with pytest.raises(ValueError):
        auc([0.1], [1, 0])


# --------------------------------------------------------------------------- κ and judge stats
PRED = [1, 1, 1, 0, 1, 0, 0, 0, 0, 0]
TRUTH = [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
# items 0-2 pass/pass (true pass 3); item 3 truly passes but is failed (false fail 1);
# item 4 truly fails but is passed (false pass 1); items 5-9 fail/fail (true fail 5).
# p_o = 8/10 = 0.8; P(pred=1) = 4/10, P(truth=1) = 4/10
# p_e = 0.4*0.4 + 0.6*0.6 = 0.16 + 0.36 = 0.52; κ = (0.8 - 0.52) / (1 - 0.52) = 0.28 / 0.48 = 7/12


def test_cohen_kappa_by_hand():
    assert cohen_kappa(PRED, TRUTH) == pytest.approx(7 / 12)
    assert cohen_kappa([1, 0, 1, 0], [1, 0, 1, 0]) == pytest.approx(1.0)
    # perfect disagreement, balanced: p_o = 0, p_e = 0.5*0.5 + 0.5*0.5 = 0.5 -> (0 - 0.5) / 0.5 = -1
    assert cohen_kappa([1, 0, 1, 0], [0, 1, 0, 1]) == pytest.approx(-1.0)
    # constant judge on balanced truth: p_o = 0.5, p_e = 1*0.5 + 0*0.5 = 0.5 -> κ = 0
    assert cohen_kappa([1, 1, 1, 1], [1, 0, 1, 0]) == pytest.approx(0.0)


def test_cohen_kappa_undefined():
    assert cohen_kappa([1, 1, 1], [1, 1, 1]) is None     # p_e = 1: both constant and equal
    assert cohen_kappa([], []) is None


def test_judge_stats_by_hand():
    r = judge_stats([bool(x) for x in PRED], TRUTH)
    assert (r["n"], r["true_pass"], r["false_pass"], r["true_fail"], r["false_fail"]) == (10, 3, 1, 5, 1)
    assert r["agreement"] == pytest.approx(0.8)
    assert r["kappa"] == pytest.approx(7 / 12)
    # false passes over truly failed: 1 / (1 + 5) = 1/6; false fails over truly passing: 1 / (1 + 3) = 1/4
    assert r["false_pass_rate"] == pytest.approx(1 / 6)
    assert r["false_fail_rate"] == pytest.approx(1 / 4)


def test_judge_stats_missing_class():
    r = judge_stats([1, 0, 1], [1, 1, 1])           # nothing truly failed
    assert r["false_pass_rate"] is None
    assert r["false_fail_rate"] == pytest.approx(1 / 3)   # 1 of the 3 passing ones failed
    r = judge_stats([1, 1], [0, 0])                 # nothing truly passed; both failures passed
    assert r["false_fail_rate"] is None and r["false_pass_rate"] == pytest.approx(1.0)
    r = judge_stats([], [])
    assert r["n"] == 0 and r["agreement"] is None and r["kappa"] is None


# --------------------------------------------------------------------------- threshold
def test_best_threshold_tie_goes_to_the_strictest():
    # sorted: 0.1 (neg), 0.35 (pos), 0.4 (neg), 0.8 (pos); pass iff score > threshold.
    #   -inf : all pass                         -> correct 0.35, 0.8          = 2/4
    #   0.225: 0.1 fails                        -> 0.1, 0.35, 0.8             = 3/4
    #   0.375: 0.1, 0.35 fail                   -> 0.1, 0.8                   = 2/4
    #   0.6  : 0.1, 0.35, 0.4 fail              -> 0.1, 0.4, 0.8              = 3/4
    #   +inf : all fail                         -> 0.1, 0.4                   = 2/4
    # 0.225 and 0.6 tie at 3/4; the higher (stricter) one wins.
    assert best_threshold([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.6)


def test_best_threshold_separable_and_ends():
    # negatives {1, 2}, positives {3, 4}: the midpoint 2.5 gets 4/4, nothing else does
    assert best_threshold([4, 1, 3, 2], [1, 0, 1, 0]) == pytest.approx(2.5)
    # all positive: only -inf (everything passes) gets every item right
    assert best_threshold([0.2, 0.7], [1, 1]) == -math.inf
    # all negative: only +inf
    assert best_threshold([0.2, 0.7], [0, 0]) == math.inf
    # duplicated scores form one candidate boundary: 0.5 (neg, neg, pos), 0.9 (pos)
    #   -inf: 2/4, 0.7: 0.5s fail -> 2 negatives right + 0.9 right = 3/4, +inf: 2/4  -> 0.7
    assert best_threshold([0.5, 0.5, 0.5, 0.9], [0, 0, 1, 1]) == pytest.approx(0.7)
    with pytest.raises(ValueError):
        best_threshold([], [])


def test_crossfit_judge_fits_each_fold_on_the_other():
    # fold 0: sums 1 (fail), 3 (pass); fold 1: sums 2 (fail), 5 (pass), 4 (fail).
    # Fitted on fold 1 (2 neg, 4 neg, 5 pos): thresholds -inf 1/3, 3 (2 fails) 2/3, 4.5 3/3, +inf 2/3 -> 4.5;
    #   fold 0 judged with 4.5: 1 fails (right), 3 fails (a false fail).
    # Fitted on fold 0 (1 neg, 3 pos): -inf 1/2, 2 2/2, +inf 1/2 -> 2;
    #   fold 1 judged with 2: 2 fails (right), 5 passes (right), 4 passes (a false pass).
    # Pooled: tp 1 (5), fp 1 (4), fn 1 (3), tn 2 (1, 2): false-pass 1/3, false-fail 1/2, agreement 3/5.
    j = crossfit_judge([1, 3, 2, 5, 4], [False, True, False, True, False], [0, 0, 1, 1, 1])
    assert j["threshold"] == [pytest.approx(4.5), pytest.approx(2.0)]
    assert (j["true_pass"], j["false_pass"], j["false_fail"], j["true_fail"]) == (1, 1, 1, 2)
    assert j["false_pass_rate"] == pytest.approx(1 / 3) and j["agreement"] == pytest.approx(0.6)


def test_step_count_reference_takes_the_better_direction():
    # Trajectory A has 1 step (useful), B has 3 steps (useless, useful, useless).
    # By count, scores -1 (A's step) and -3 (B's three): positives {-1, -3}, negatives {-3, -3};
    #   pairs: (-1 vs -3) win x2, (-3 vs -3) tie x2 -> (2 + 1) / 4 = 0.75 (better direction already).
    # By position, scores -t: A 0; B 0, -1, -2. Positives {0 (A), -1}, negatives {0 (B), -2}:
    #   (0 vs 0) tie, (0 vs -2) win, (-1 vs 0) loss, (-1 vs -2) win -> 2.5 / 4 = 0.625.
    trajs = [types.SimpleNamespace(steps=[0]), types.SimpleNamespace(steps=[0, 0, 0])]
    ref = step_count_reference(trajs, [[True], [False, True, False]])
    assert ref == {"auc_step_count": pytest.approx(0.75), "auc_step_position": pytest.approx(0.625)}
    # Reversed labels give AUCs of 1 minus these, and the reference reports the better direction again.
    flipped = step_count_reference(trajs, [[False], [True, False, True]])
    assert flipped == {"auc_step_count": pytest.approx(0.75), "auc_step_position": pytest.approx(0.625)}


# --------------------------------------------------------------------------- Spearman
def test_spearman_by_hand():
    # no ties: d = rank differences (0, 1, 1, 0), Σd² = 2, ρ = 1 - 6·2 / (4·(16-1)) = 1 - 12/60 = 0.8
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert spearman([1, 2, 3], [1, 8, 27]) == pytest.approx(1.0)     # monotone, not linear
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_spearman_ties_use_average_ranks():
    # x = (1, 2, 2, 3) -> ranks (1, 2.5, 2.5, 4); y ranks (1, 2, 3, 4); both means 2.5
    # deviations x: (-1.5, 0, 0, 1.5), y: (-1.5, -0.5, 0.5, 1.5)
    # Σxy = 2.25 + 0 + 0 + 2.25 = 4.5; Σx² = 4.5; Σy² = 2.25 + 0.25 + 0.25 + 2.25 = 5
    # ρ = 4.5 / √(4.5·5) = 4.5 / √22.5 = √(4.5/5) = √0.9 ≈ 0.948683
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, abs=1e-6)


def test_spearman_constant_is_none():
    assert spearman([1, 1, 1], [1, 2, 3]) is None
    assert spearman([1, 2, 3], [5, 5, 5]) is None
    assert spearman([1], [2]) is None


# --------------------------------------------------------------------------- intervals
def test_wilson_interval_by_hand():
    # k=5, n=10, z=1.96: p = 0.5, z² = 3.8416, z²/n = 0.38416, 1 + z²/n = 1.38416
    # center = (0.5 + 3.8416/20) / 1.38416 = 0.69208 / 1.38416 = 0.5
    # half = 1.96 / 1.38416 · √(0.5·0.5/10 + 3.8416/400) = 1.416021 · √(0.025 + 0.009604)
    #      = 1.416021 · 0.186022 = 0.263411   -> (0.236589, 0.763411)
    low, high = proportion_ci(5, 10)
    assert low == pytest.approx(0.236589, abs=1e-5)
    assert high == pytest.approx(0.763411, abs=1e-5)
    assert (high - low) / 2 == pytest.approx(0.263411, abs=1e-5)          # the ± a table prints


def test_wilson_interval_at_the_edges():
    # k=0, n=10: center = (0 + 0.19208) / 1.38416 = 0.138771; half = 1.416021 · √0.009604
    #          = 1.416021 · 0.098 = 0.138770 -> (0, 0.277541)
    low, high = proportion_ci(0, 10)
    assert low == pytest.approx(0.0, abs=1e-9)
    assert high == pytest.approx(0.277541, abs=1e-5)
    # k = n mirrors it: (1 - 0.277541, 1) = (0.722459, 1)
    low, high = proportion_ci(10, 10)
    assert low == pytest.approx(0.722459, abs=1e-5) and high == pytest.approx(1.0, abs=1e-9)
    # k=1, n=4: p = 0.25, z²/n = 0.9604, 1 + z²/n = 1.9604
    # center = (0.25 + 3.8416/8) / 1.9604 = (0.25 + 0.4802) / 1.9604 = 0.7302 / 1.9604 = 0.372475
    # half = 1.96 / 1.9604 · √(0.25·0.75/4 + 3.8416/64) = 0.999796 · √(0.046875 + 0.060025)
    #      = 0.999796 · √0.1069 = 0.999796 · 0.326956 = 0.326889 -> (0.045586, 0.699364)
    low, high = proportion_ci(1, 4)
    assert low == pytest.approx(0.045586, abs=1e-5)
    assert high == pytest.approx(0.699364, abs=1e-5)
    for k, n in [(0, 0), (3, 2), (-1, 5)]:
        with pytest.raises(ValueError):
            proportion_ci(k, n)


def test_mean_ci_by_hand():
    # mean 3; sample variance = (4 + 1 + 0 + 1 + 4) / 4 = 2.5; sd = 1.581139
    # half = 1.96 · 1.581139 / √5 = 1.96 · 0.707107 = 1.385929
    mean, half = mean_ci([1, 2, 3, 4, 5])
    assert mean == pytest.approx(3.0)
    assert half == pytest.approx(1.385929, abs=1e-5)
    # two values 0 and 2: mean 1, variance (1 + 1) / 1 = 2, sd √2, half = 1.96 · √2 / √2 = 1.96
    assert mean_ci([0.0, 2.0]) == pytest.approx((1.0, 1.96))
    assert mean_ci([0.7]) == (0.7, 0.0)          # one value: no spread, half-width 0
    assert mean_ci([4, 4, 4]) == (4.0, 0.0)
    with pytest.raises(ValueError):
        mean_ci([])


# --------------------------------------------------------------------------- step binding (RQ3)
ACTIONS = ["Search[Hans Schlegel]", "Search[Bertalan Farkas]", "  Search[Hans  Schlegel] ",
           "Search[Hans Schlegel birth date]", "Search[Bertalan Farkas birth date]",
           "Search[Bertalan Farkas]", "Finish[Hans Schlegel]"]
# normalized (strip + one space): step 2 is the same action as step 0; step 5 the same as step 1.
# Distinct actions other than step 0's: Bertalan Farkas, Hans Schlegel birth date,
# Bertalan Farkas birth date, Finish[Hans Schlegel] -> 4 possible distractors.


def test_binding_item_properties():
    norm = {" ".join(a.split()) for a in ACTIONS}
    golds = set()
    for seed in range(50):
        cands, gi = binding_item(ACTIONS, 0, random.Random(seed))
        assert len(cands) == 4                                      # 3 distractors + gold
        assert cands[gi] == "Search[Hans Schlegel]"                 # the gold, normalized
        distractors = [c for i, c in enumerate(cands) if i != gi]
        assert "Search[Hans Schlegel]" not in distractors           # never the gold, not even step 2
        assert len(set(distractors)) == 3                           # distinct
        assert set(cands) <= norm                                   # all from this trajectory
        golds.add(gi)
    assert golds == {0, 1, 2, 3}                                    # shuffled: gold moves around


def test_binding_item_is_seeded():
    a = binding_item(ACTIONS, 3, random.Random(7))
    b = binding_item(ACTIONS, 3, random.Random(7))
    assert a == b
    cands, gi = a
    assert cands[gi] == "Search[Hans Schlegel birth date]"


def test_binding_item_fewer_and_none():
    # one distinct other action (B; the repeated A is the gold itself) -> 2 candidates, chance 1/2
    cands, gi = binding_item(["Search[A]", "Search[B]", " Search[A]\n", "Search[B]"], 0, random.Random(0))
    assert sorted(cands) == ["Search[A]", "Search[B]"] and cands[gi] == "Search[A]"
    assert 1 / len(cands) == 0.5
    # two distinct others -> 3 candidates, chance 1/3
    cands, gi = binding_item(["Search[A]", "Search[B]", "Finish[C]"], 2, random.Random(0))
    assert len(cands) == 3 and cands[gi] == "Finish[C]"
    # every other action equals the gold after whitespace normalization -> no item
    assert binding_item(["Search[Hans  Schlegel]", " Search[Hans Schlegel] "], 1, random.Random(0)) is None
    assert binding_item(["Finish[x]"], 0, random.Random(0)) is None


# --------------------------------------------------------------------------- redundancy (RQ4)
def test_redundancy_by_hand():
    criteria = ["cites the entity", "cites  the entity ", "names the entity", "stays on budget"]
    vectors = np.array([[1.0, 0.0], [1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    scores = [0.5, 0.2, -0.1, 0.9]
    # #1 starts cluster A. #2: cos with A's first = 1 ≥ 0.8 -> joins A (and its text equals #1's: exact dup).
    # #3: cos((0.9, 0.1), (1, 0)) = 0.9 / √0.82 = 0.9 / 0.905539 = 0.993884 -> joins A.
    # #4: cos((0, 1), (1, 0)) = 0 -> new cluster B.
    # themes 2, ratio 2/4; exact 1/4; joined 2/4; range in A = 0.5 - (-0.1) = 0.6 (B has 1 member)
    r = redundancy(criteria, vectors, scores)
    assert r["k"] == 4 and r["themes"] == 2
    assert r["theme_ratio"] == pytest.approx(0.5)
    assert r["exact_duplicate_rate"] == pytest.approx(0.25)
    assert r["paraphrase_duplicate_rate"] == pytest.approx(0.5)
    assert r["score_range"] == pytest.approx(0.6)


def test_redundancy_compares_with_the_first_member_only():
    # v0 = (1, 0); v1 = (3, 1.5): cos = 3 / √11.25 = 3 / 3.354102 = 0.894427 -> joins v0's cluster.
    # v2 = (3, 4): cos with v0 = 3/5 = 0.6 < 0.8 -> new cluster, although
    # cos with v1 = (9 + 6) / (3.354102 · 5) = 15 / 16.770510 = 0.894427 ≥ 0.8 (vectors unnormalized).
    r = redundancy(["a", "b", "c"], [[1, 0], [3, 1.5], [3, 4]], [0.0, 0.4, 1.0])
    assert r["themes"] == 2
    assert r["paraphrase_duplicate_rate"] == pytest.approx(1 / 3)
    assert r["score_range"] == pytest.approx(0.4)        # cluster {v0, v1}: 0.4 - 0.0


def test_redundancy_joins_the_first_earlier_cluster():
    # threshold 0.7: v0 = (1, 0) starts A; v1 = (0, 1): cos 0 -> starts B;
    # v2 = (1, 1): cos with A's first = 1/√2 = 0.707107 ≥ 0.7, with B's also 0.707107 -> joins A (first).
    # A = {v0, v2} scores {0, 0.3} -> range 0.3 (joining B would have given |1 - 0.3| = 0.7)
    r = redundancy(["a", "b", "c"], [[1, 0], [0, 1], [1, 1]], [0.0, 1.0, 0.3], threshold=0.7)
    assert r["themes"] == 2 and r["score_range"] == pytest.approx(0.3)


def test_redundancy_edges():
    # all distinct themes: no cluster of 2 -> score_range None, rates 0
    r = redundancy(["a", "b"], [[1, 0], [0, 1]], [0.1, 0.2])
    assert (r["themes"], r["exact_duplicate_rate"], r["paraphrase_duplicate_rate"], r["score_range"]) == (2, 0, 0, None)
    # a zero vector has cosine 0 with everything: its own theme
    assert redundancy(["a", "b"], [[0, 0], [0, 0]], [0.1, 0.2])["themes"] == 2
    # K = 0 (an unparsed rubric): nothing to measure
    r = redundancy([], np.zeros((0, 3)), [])
    assert r["k"] == 0 and r["themes"] == 0 and r["theme_ratio"] is None and r["score_range"] is None
    # any dimension
    assert redundancy(["a"], np.ones((1, 384)), [0.5])["themes"] == 1
    with pytest.raises(ValueError):
        redundancy(["a", "b"], [[1, 0]], [0.1, 0.2])


def test_redundancy_summary_means():
    steps = [{"k": 4, "themes": 2, "theme_ratio": 0.5, "exact_duplicate_rate": 0.25,
              "paraphrase_duplicate_rate": 0.5, "score_range": 0.6},
             {"k": 2, "themes": 2, "theme_ratio": 1.0, "exact_duplicate_rate": 0.0,
              "paraphrase_duplicate_rate": 0.0, "score_range": None}]
    s = redundancy_summary(steps)
    # themes (2 + 2)/2 = 2; ratio (0.5 + 1)/2 = 0.75; exact (0.25 + 0)/2 = 0.125; para (0.5 + 0)/2 = 0.25
    # score_range: only the first step has a cluster of ≥ 2 -> 0.6 over 1 step
    assert s["steps"] == 2 and s["themes"] == pytest.approx(2.0) and s["k"] == pytest.approx(3.0)
    assert s["theme_ratio"] == pytest.approx(0.75)
    assert s["exact_duplicate_rate"] == pytest.approx(0.125)
    assert s["paraphrase_duplicate_rate"] == pytest.approx(0.25)
    assert s["score_range"] == pytest.approx(0.6) and s["n_score_range"] == 1
    assert redundancy_summary([])["themes"] is None


# --------------------------------------------------------------------------- credit labels (issue 6)
def _step(action, argument="", retrieved=None, valid=True):
    return {"action": action, "argument": argument, "retrieved": retrieved, "valid": valid,
            "observation": "", "reason": "" if valid else "no Search[...] or Finish[...] found"}


def test_step_usefulness_on_a_dict():
    row = {"id": "x", "gold": ["1850", "eighteen fifty"], "steps": [
        _step("search", "A", 2),              # supporting 2, first time       -> useful
        _step("search", "A again", 2),        # supporting 2 again             -> redundant
        _step("search", "B", 4),              # 4 is not supporting            -> wrong entity
        _step("invalid", valid=False),        # unparseable                    -> useless
        _step("search", "C", 5),              # supporting 5, first time       -> useful
        _step("finish", "1850."),             # EM('1850.', '1850') = 1        -> useful
    ]}
    assert step_usefulness(row, supporting=[2, 5]) == [True, False, False, False, True, True]
    wrong = {"id": "y", "gold": ["1850"], "steps": [_step("finish", "1851")]}
    assert step_usefulness(wrong, supporting=[2, 5]) == [False]
    # an alias counts, and a "supporting" key in the row is used when none is passed
    alias = {"id": "z", "gold": ["1850", "eighteen fifty"], "supporting": [1], "steps": [_step("finish", "Eighteen Fifty")]}
    assert step_usefulness(alias) == [True]
    # the same supporting paragraph twice: the first is useful, the second redundant
    again = {"id": "w", "gold": ["a"], "steps": [_step("search", "x", 4), _step("search", "y", 4)]}
    assert step_usefulness(again, supporting=[4, 5]) == [True, False]
    with pytest.raises(ValueError, match="supporting"):
        step_usefulness({"id": "v", "gold": ["a"], "steps": []})


class _TitleRetriever:
    """Returns the paragraph whose title is exactly the query (the scripted agent only asks titles)."""

    def retrieve(self, examples, queries):
        return [[t for t, _ in ex.paragraphs].index(q) for ex, q in zip(examples, queries)]


def _play(ex, outputs):
    script = iter(outputs)
    return env.rollout([ex], lambda prompts: [next(script) for _ in prompts], _TitleRetriever())[0]


def test_step_usefulness_on_synthetic_trajectories_and_their_traces():
    ex = env.synthetic_examples(1, seed=0, split="dev")[0]
    hop0, hop1 = ex.hops[0]["paragraph"], ex.hops[1]["paragraph"]
    assert sorted(ex.supporting) == sorted([hop0, hop1])       # synthetic: supporting = the hops' paragraphs
    other = next(i for i in range(len(ex.paragraphs)) if i not in ex.supporting)
    title = lambda i: ex.paragraphs[i][0]                      # noqa: E731
    # budget 3, horizon 4: hop 0 (useful), hop 0 again (redundant), a distractor (wrong entity),
    # then the forced Finish with the gold answer (useful)
    t1 = _play(ex, [f"Search[{title(hop0)}]", f"Search[{title(hop0)}]", f"Search[{title(other)}]",
                    f"Finish[{ex.answer}]"])
    # garbage (invalid), hop 1 (useful), a wrong answer (useless)
    t2 = _play(ex, ["I am not sure", f"Search[{title(hop1)}]", "Finish[certainly not this]"])
    expected = {id(t1): [True, False, False, True], id(t2): [False, True, False]}
    assert [s.action for s in t1.steps] == ["search", "search", "search", "finish"]
    assert [s.valid for s in t2.steps] == [False, True, True]
    for t in (t1, t2):
        assert step_usefulness(t) == expected[id(t)]
        as_read = json.loads(json.dumps(t.to_dict()))         # what a JSONL file gives back
        assert step_usefulness(as_read, ex.supporting) == expected[id(t)]
    import arco  # the traces a run writes (observations cut, extra fields) must still work
    rows = [json.loads(json.dumps(r)) for r in arco.trace_rows([t1, t2], epoch=0, batch=0)]
    assert [step_usefulness(r, ex.supporting) for r in rows] == [expected[id(t1)], expected[id(t2)]]


def test_credit_room_counts_failed_trajectories_with_a_useful_step_then_a_useless_one():
    """Failed trajectories only; 'useful then useless' needs a useless step after a useful one."""
    def row(reward, steps):
        return {"reward": reward, "gold": ["1951"], "supporting": [0, 1],
                "steps": [{"valid": True, "action": a, "retrieved": p, "argument": arg} for a, p, arg in steps]}
    rows = [row(0.0, [("search", 0, "A"), ("search", 5, "B"), ("finish", None, "1900")]),   # useful, useless, wrong
            row(0.0, [("search", 4, "B"), ("finish", None, "1900")]),                        # never useful
            row(0.0, [("search", 0, "A"), ("search", 1, "C"), ("finish", None, "1900")]),   # useful, useful, wrong
            row(1.0, [("search", 0, "A"), ("search", 5, "B"), ("finish", None, "1951")])]   # a success: left out
    assert study.credit_room(rows) == {"failed": 3, "useful_then_useless": 2, "share": 2 / 3}


def test_auc_by_step_type_by_hand():
    """Search steps 0.9 (useful) and 0.1 (useless): 1.0; the finish steps hold one class only: None; all four
    steps (the invalid one counts in 'all'): useful 0.9, 0.5 above useless 0.1, 0.2: 1.0."""
    from lab.study import auc_by_step_type
    assert auc_by_step_type([0.9, 0.1, 0.5, 0.2], [1, 0, 1, 0], ["search", "search", "finish", None]) == \
        {"search": 1.0, "finish": None, "all": 1.0}
    assert auc_by_step_type([0.2, 0.9, 0.1, 0.8], [1, 0, 1, 0], ["finish", "finish", "search", "search"]) == \
        {"search": 0.0, "finish": 0.0, "all": 0.0}


def test_credit_summary_averages_the_dense_updates_by_hand():
    """μ's mean s_t per step key over the updates that have it, the mean correlation (None skipped), singleton
    buckets per update, the terminal ones among them and their Finish's mean advantage."""
    updates = [{"mean_s_by_step": {"search@1": 0.5, "finish@2": -0.25}, "corr_excess_searches": 0.2,
                "singleton_buckets": [{"bucket": "terminal", "action": "finish", "A": -0.5},
                                      {"bucket": "search_4", "action": "search", "A": 0.25}]},
               {"mean_s_by_step": {"search@1": 0.25}, "corr_excess_searches": None, "singleton_buckets": []},
               {"mean_s_by_step": {"search@1": 0.0, "finish@2": 0.75}, "corr_excess_searches": -0.1,
                "singleton_buckets": [{"bucket": "terminal", "action": "finish", "A": 1.0}]}]
    out = study.credit_summary(updates)
    assert out["updates"] == 3 and out["mean_s_by_step"] == {"finish@2": 0.25, "search@1": 0.25}
    assert out["corr_excess_searches"] == pytest.approx(0.05)
    assert out["singletons_per_update"] == 1.0 and out["finish_singletons_per_update"] == pytest.approx(2 / 3)
    assert out["finish_singleton_A"] == 0.25
    assert study.credit_summary([])["corr_excess_searches"] is None


def test_dev_curve_puts_every_point_on_the_curve_slice_by_hand(tmp_path):
    """The --eval-every points are on the first --curve-size dev questions already; an epoch-end evaluation (on
    --eval-size) enters the curve with its EM on those same questions, read from its traces."""
    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True)
    (run / "args.json").write_text(json.dumps({"curve_size": 2}))
    rows = [{"kind": "eval", "epoch": 0, "em": 25.0},
            {"kind": "update", "epoch": 1, "batch": 0}, {"kind": "update", "epoch": 1, "batch": 1},
            {"kind": "curve", "epoch": 1, "batch": 1, "em": 50.0},
            {"kind": "update", "epoch": 1, "batch": 2},
            {"kind": "eval", "epoch": 1, "em": 75.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for epoch, rewards in ((0, [0.0, 1.0, 0.0, 0.0]), (1, [1.0, 1.0, 1.0, 0.0])):  # 4 eval questions, slice 2
        (run / "traces" / f"eval_epoch_{epoch}.jsonl").write_text(
            "".join(json.dumps({"id": f"q{i}", "reward": r}) + "\n" for i, r in enumerate(rewards)))
    assert study.dev_curve(run) == [(0, 50.0), (2, 50.0), (3, 100.0)]
