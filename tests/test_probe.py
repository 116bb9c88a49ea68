"""Tests of the gradient probe (probe.py probe, issue 53): the count sketch keeps cosines, the batches and the
schemes' advantages by hand, the Monte-Carlo value baseline by hand, the paired block bootstrap and the RL
check's rule by hand, the table on a synthetic pool, and on a tiny model the per-step gradients
summed with the held-out pool's advantages give the g* that true_gradient's packed passes compute."""
import math

import pytest
import torch

import arco
import env
from lab import probe
from infra import models
from infra import files
from infra.fast import FAST


def test_the_count_sketch_keeps_cosines_on_a_small_case():
    """Random vectors of 50,000 numbers and sums of them: cosines after a 4,096-number sketch within 0.05."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(30_000)), torch.nn.Parameter(torch.zeros(20_000))]
    sketch = probe.Sketch(params, 4096, seed=3)
    base = [torch.randn(50_000, generator=g) for _ in range(4)]
    vecs = base + [base[0] + 0.5 * base[1], base[2] - base[3] + 0.1 * base[0]]
    for i, a in enumerate(vecs):
        for b in vecs[i + 1:]:
            assert float(probe.F_cos(sketch(a), sketch(b))) == pytest.approx(float(probe.F_cos(a, b)), abs=0.05)
    assert torch.allclose(sketch(vecs[0] + vecs[1]), sketch(vecs[0]) + sketch(vecs[1]), atol=1e-4)   # linear
    check = probe.sketch_check(sketch, base)
    assert check["vectors"] == 12 and check["max_abs_cosine_difference"] < 0.05


def test_probe_batches_by_hand():
    """Trajectory i is question i // 4, sample i % 4. 2 × 4: two questions' four samples; 8 × 1: sample k of
    eight questions. Both cut 8 questions into disjoint batches covering the pool once."""
    assert probe.probe_batches(8, 4, "2x4") == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15],
                                                 [16, 17, 18, 19, 20, 21, 22, 23], [24, 25, 26, 27, 28, 29, 30, 31]]
    assert probe.probe_batches(8, 4, "8x1") == [[0, 4, 8, 12, 16, 20, 24, 28], [1, 5, 9, 13, 17, 21, 25, 29],
                                                 [2, 6, 10, 14, 18, 22, 26, 30], [3, 7, 11, 15, 19, 23, 27, 31]]


class Script:
    """Trajectories of scripted actions on a synthetic question (the env's Step/Trajectory)."""

    @staticmethod
    def make(example, actions, reward):
        steps = [env.Step([], a, a.split("[")[0].lower(), a[a.index("[") + 1:-1], "", True, "", 3 - k, False)
                 for k, a in enumerate(actions)]
        return env.Trajectory(example, 3, steps, "x", reward, True)


def test_loo_and_mc_values_by_hand():
    """Four samples of one question: S F (R 1), S F (R 0), S S F (R 1), F (R 0). Leave-one-out: 1 − 1/3, 0 − 2/3,
    1 − 1/3, 0 − 2/3. V̂ at t = 0: the other three's mean R; at t = 1 for the first: the one other sample
    starting with the same search (R 0) ... and the S S F one (R 1): both share "Search[a]", so ½."""
    q = env.synthetic_examples(1)[0]
    trajs = [Script.make(q, ["Search[a]", "Finish[x]"], 1.0), Script.make(q, ["Search[a]", "Finish[y]"], 0.0),
             Script.make(q, ["Search[a]", "Search[b]", "Finish[x]"], 1.0), Script.make(q, ["Finish[y]"], 0.0)]
    assert probe.loo_advantages(trajs) == pytest.approx([2 / 3, -2 / 3, 2 / 3, -2 / 3])
    v = probe.mc_values(trajs)
    assert v[0] == pytest.approx([1 / 3, 1 / 2]) and v[1] == pytest.approx([2 / 3, 1.0])
    assert v[2] == pytest.approx([1 / 3, 1 / 2, 1 / 2])    # t = 2: no other sample searched b: back to t = 1's
    assert v[3] == pytest.approx([2 / 3])


def flat(rows):
    return [x for row in rows for x in row]


def test_scheme_advantages_by_hand():
    """One 2 × 4-like batch of two questions × 2 samples. outcome: R − the question's mean; value: R − V̂; causal
    Eq. 4 vs state: Eq. 4 compares the Finish at t = 1 with every trajectory's last step (terminal bucket),
    the state-only baseline with the other steps at t = 1 (the search of the third trajectory)."""
    q1, q2 = env.synthetic_examples(2)
    trajs = [Script.make(q1, ["Search[a]", "Finish[x]"], 1.0), Script.make(q1, ["Finish[y]"], 0.0),
             Script.make(q2, ["Search[a]", "Search[b]", "Finish[x]"], 1.0), Script.make(q2, ["Finish[y]"], 0.0)]
    scores = {"causal": [[0.5, 0.5], [0.0], [0.25, 0.25, 0.5], [0.0]]}
    values = [[0.5, 1.0], [0.5], [0.5, 1.0, 1.0], [0.5]]
    batch = [0, 1, 2, 3]
    out = probe.scheme_advantages("outcome", batch, trajs, scores, values, "2x4", 0.5, True)
    assert out == [[0.5, 0.5], [-0.5], [0.5, 0.5, 0.5], [-0.5]]
    assert probe.scheme_advantages("value", batch, trajs, scores, values, "2x4", 0.5, True) == \
        [[0.5, 0.0], [-0.5], [0.5, 0.0, 0.0], [-0.5]]
    # G: [1, .5], [0], [1, .75, .5], [0]. Eq. 4: search_1 {1, 1} → 1; search_2 {.75} alone → the batch mean
    # m = (1 + .5 + 0 + 1 + .75 + .5 + 0) / 7 = 3.75 / 7 (fallback); terminal {.5, 0, .5, 0} → .25. α = ½.
    m = 3.75 / 7
    eq4 = probe.scheme_advantages("causal eq4", batch, trajs, scores, values, "2x4", 0.5, True)
    assert flat(eq4) == pytest.approx(flat([[0.0, 0.125], [-0.125], [0.0, 0.5 * (0.75 - m), 0.125], [-0.125]]))
    # state-only: t0 {1, 0, 1, 0} → .5; t1 {.5, .75} → .625; t2 {.5} alone → the batch mean m
    state = probe.scheme_advantages("causal state", batch, trajs, scores, values, "2x4", 0.5, True)
    assert flat(state) == pytest.approx(flat([[0.25, -0.0625], [-0.25], [0.25, 0.0625, 0.5 * (0.5 - m)], [-0.25]]))
    mixed = probe.scheme_advantages("mixed causal", batch, trajs, scores, values, "2x4", 0.5, True)
    assert flat(mixed) == pytest.approx(flat([[a + o for a in row] for row, o in zip(eq4, [0.5, -0.5, 0.5, -0.5])]))
    assert probe.scheme_advantages("outcome", batch, trajs, scores, values, "8x1", 0.5, True) == \
        [[0.5, 0.5], [-0.5], [0.5, 0.5, 0.5], [-0.5]]          # 8 × 1: the batch's mean (here also ½)


def test_per_step_gradients_add_up_to_the_packed_true_gradient(tiny_dir, tmp_path):
    """On a tiny model: Σ_τ A_τ Σ_t (sketched ∇ log π(a_t|h_t)) over the pool's per-step gradients equals the g*
    that true_gradient computes in packed passes of whole trajectories (the same estimator, two paths)."""
    pi = models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=FAST)
    torch.manual_seed(0)
    models.add_lora(pi, dropout=0.0)
    for p in models.trainable_parameters(pi.model):
        p.data.normal_(0, 0.05)
    qs = env.synthetic_examples(2)
    trajs = [Script.make(qs[0], ["Search[a]", "Finish[x]"], 1.0), Script.make(qs[0], ["Finish[y]"], 0.0),
             Script.make(qs[1], ["Search[b]", "Finish[z]"], 0.0), Script.make(qs[1], ["Search[c]", "Finish[w]"], 1.0)]
    for t in trajs:
        for k, st in enumerate(t.steps):
            st.prompt = env.policy_messages(t.example.question, env.format_history(t.steps[:k]), st.searches_left)
    sketch = probe.Sketch(models.trainable_parameters(pi.model), 2048, seed=0)
    temps = {"1": 1.0, "rollout": 0.7}
    both = probe.step_gradients(pi, trajs, sketch, tmp_path / "grads.pt", tmp_path / "sketch.json", check=3,
                                temps=temps)
    assert set(both) == {"1", "rollout"} and both["1"].shape == (7, 2048) and (tmp_path / "sketch.json").is_file()
    assert not torch.allclose(both["1"], both["rollout"])
    again = probe.step_gradients(pi, trajs, sketch, tmp_path / "grads.pt", tmp_path / "sketch.json", temps=temps)
    assert all(torch.equal(again[k], both[k]) for k in temps)                          # resumed: nothing recomputed
    with pytest.raises(env.DataError, match="temperatures 1, rollout"):
        probe.step_gradients(pi, trajs, sketch, tmp_path / "grads.pt", tmp_path / "sketch.json")
    A = probe.loo_advantages(trajs)
    ranges = env.step_ranges(trajs)
    half = len(trajs) // 2
    args = arco.resolve_args(arco.Args(pass_tokens=4096))
    for label, T in temps.items():                  # log π at T: the per-step path and the packed passes agree
        grads = both[label]
        want = [sum(A[i] * grads[ranges[i].start:ranges[i].stop].sum(0) for i in range(h * half, (h + 1) * half))
                / half for h in (0, 1)]
        got = probe.true_gradient(pi, trajs, sketch, args, tmp_path / f"gstar-{label}.pt", temperature=T)
        for h in (0, 1):
            torch.testing.assert_close(got["halves"][h], want[h], rtol=1e-3, atol=1e-5)


def test_block_bootstrap_by_hand():
    """Four batch gradients in two blocks of two, û* = e₁. The estimate (unit weights): ḡ = (1, ½), block means
    (1, 0) and (1, 1), whose spread (1 + 2)/2 − 5/4 = ¼ over (2 − 1) blocks leaves ‖E g‖² = 5/4 − ¼ = 1, so each
    draw's ‖E g‖² is centered by 1 − 5/4 = −¼. The three possible resamples, by hand:
    blocks (1, 1): ‖E g‖² = 1 − ¼ = ¾; spread = mean ‖g_b‖² − ‖E g‖² = (1 + 1 + 1 + 5)/4 − ¾ = 5/4, along 1 →
    noise-to-signal 5/4, cos(ḡ, g*) 2/√5; block 1 twice: ḡ = (1, 0), block spread 0, ‖E g‖² = 1 − ¼, spread
    1 − ¾ = ¼, cos 1; block 2 twice: ḡ = (1, 1), ‖E g‖² = 2 − ¼, spread 3 − 7/4 = 5/4, cos 1/√2.
    A second row (2× the gradients) has the same statistics on every draw: the draw is shared (paired)."""
    G = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [2.0, 1.0]], dtype=torch.float64)
    u = torch.tensor([1.0, 0.0], dtype=torch.float64)
    rows = [(G @ G.T, G @ u), ((2 * G) @ (2 * G).T, (2 * G) @ u)]
    boot = probe.block_bootstrap(rows, batches_per_block=2, resamples=400)
    hand = {(1.25, round(2 / 5 ** 0.5, 6)), (0.25, 1.0), (1.25, round(1 / 2 ** 0.5, 6))}
    seen = {(round(float(a), 6), round(float(c), 6)) for a, c in zip(boot[0]["noise_to_signal"], boot[0]["mean_cos"])}
    assert seen == hand
    torch.testing.assert_close(boot[1]["noise_to_signal"], boot[0]["noise_to_signal"])
    torch.testing.assert_close(boot[1]["mean_cos"], boot[0]["mean_cos"])
    # At unit weights (the first resample's numbers): ‖E g‖² = 1, cos(E g, û*) = ⟨ḡ, û*⟩ / 1 = 1; a noise of ½ per
    # batch removed: spread 1 − ½.
    one = probe.gram_stats(*rows[0], torch.full((4,), 0.5, dtype=torch.float64), torch.ones(1, 4, dtype=torch.float64), 2)
    assert float(one["expected_sq"][0]) == pytest.approx(1.0) and float(one["mean_cos_denoised"][0]) == pytest.approx(1.0)
    assert float(one["spread"][0]) == pytest.approx(1.0)
    assert float(one["noise_to_signal_clean"][0]) == pytest.approx(0.5)


def test_favoured_by_hand():
    """The RL check's rule: at 8 × 1, noise-to-signal ≥ 1.5× below outcome 2 × 4's over its whole interval, and
    the mean gradient's cosine with g* not below outcome 2 × 4's beyond the paired interval."""
    def row(scheme, comp, ratio_hi, dcos_hi):
        return {"scheme": scheme, "composition": comp, "variance_vs_outcome_2x4_ci": [0.1, ratio_hi],
                "mean_cos_vs_outcome_2x4_ci": [-0.2, dcos_hi]}
    rows = [row("outcome", "2x4", 1.2, 0.0), row("outcome", "8x1", 0.5, 0.1),      # outcome itself: never
            row("value", "2x4", 0.3, 0.1),                                          # 2 × 4: not the regime asked
            row("value", "8x1", 0.66, 0.05),                                        # 0.66 ≤ 1/1.5: favoured
            row("causal eq4", "8x1", 0.7, 0.05),                                    # 0.7 > 1/1.5: not enough
            row("warmup eq4", "8x1", 0.4, -0.01)]                                   # closer to g* less: biased
    assert probe.favoured(rows) == ["value"]


def test_probe_stats_and_its_table_on_a_synthetic_pool():
    """16 questions × 4 scripted samples, random per-step gradients and a g* built as the outcome gradient of the
    pool plus noise: every scheme × composition gets a row; outcome at 2 × 4 is the reference (ratio 1, paired
    interval [1, 1], cosine difference [0, 0]); every interval is ordered and inside [−1, 1]; gram_stats' Gram form
    gives the noise-to-signal (tr Cov from the block means) and cos(ḡ, g*) computed directly from the batch gradients; the pairs' de-noised
    cosines are cosines (or NaN: with 2 blocks here there may be no signal left); the table prints one line per row and the favoured list."""
    g = torch.Generator().manual_seed(1)
    qs = env.synthetic_examples(16)
    plans = [["Search[a]", "Finish[x]"], ["Finish[y]"], ["Search[a]", "Search[b]", "Finish[x]"], ["Finish[z]"]]
    trajs = [Script.make(q, plans[(i + k) % 4], float((i * 3 + k) % 5 < 2)) for i, q in enumerate(qs) for k in range(4)]
    offsets = [r.start for r in env.step_ranges(trajs)]
    grads = torch.randn(sum(len(t.steps) for t in trajs), 64, generator=g)
    A = probe.loo_advantages(trajs)
    true = sum(A[i] * grads[offsets[i]:offsets[i] + len(t.steps)].sum(0) for i, t in enumerate(trajs)) / len(trajs)
    gstar = {"g": true + 0.1 * torch.randn(64, generator=g)}
    scores = {"causal": [[t.reward / len(t.steps)] * len(t.steps) for t in trajs]}
    schemes = ["outcome", "value", "causal eq4", "causal state", "verdict causal", "branch value", "branch eq4",
               "branch critic"]
    values = probe.mc_values(trajs)
    noisy = [[[v + 0.1 * float(torch.randn(1, generator=g)) for v in row] for row in values] for _ in "ab"]
    branch = {h: [{"V": V, "Q": V[1:] + [t.reward]} for V, t in zip(Vs, trajs)]
              for h, Vs in (("a", noisy[0]), ("b", noisy[1]),
                            ("full", [[(x + y) / 2 for x, y in zip(*rows)] for rows in zip(*noisy)]))}
    rows = probe.probe_stats(grads, offsets, trajs, scores, values, gstar, schemes, 16, 4, 0.5, True,
                             resamples=300, branch=branch, pairs=[("outcome", "outcome"), ("value", "outcome")])
    assert [(r["scheme"], r["composition"]) for r in rows] == [(s, c) for c in ("2x4", "8x1") for s in schemes]
    ref = rows[0]
    assert ref["variance_vs_outcome_2x4"] == 1.0 and ref["variance_vs_outcome_2x4_ci"] == pytest.approx([1.0, 1.0])
    assert ref["mean_cos_vs_outcome_2x4_ci"] == pytest.approx([0.0, 0.0], abs=1e-12)
    for r in rows:
        for lo, hi in (r["mean_cos_ci"], r["mean_cos_denoised_ci"]):
            assert lo <= hi and -1 <= lo and hi <= 1 and r["batches"] == 8
        batches = probe.probe_batches(16, 4, r["composition"])
        common = (batches, grads, offsets, r["composition"], trajs, scores, values, 0.5, True)
        gb = probe.batch_gradients(r["scheme"], *common, branch=branch["full"])
        mean, u = gb.mean(0), gstar["g"].double() / gstar["g"].double().norm()
        bm = gb.view(-1, 4, gb.shape[1]).mean(1)                          # the block means (4 batches a block)
        expected = float(mean @ mean) - float(((bm - mean) ** 2).sum(1).mean()) / (len(bm) - 1)    # ‖E g_B‖²
        spread = float((gb * gb).sum(1).mean()) - expected                  # tr Cov
        assert r["noise_to_signal"] == pytest.approx(spread / float(mean @ u) ** 2, rel=1e-9)
        assert r["mean_cos"] == pytest.approx(float(probe.F_cos(mean, gstar["g"])), rel=1e-9)
        if r["scheme"].startswith("branch"):       # V̂'s noise: ‖g^a − g^b‖²/4 a batch, its mean off the spread
            ga, gb2 = (probe.batch_gradients(r["scheme"], *common, branch=branch[h]) for h in "ab")
            noise = float(((ga - gb2) ** 2).sum(1).mean()) / 4
            assert r["noise_to_signal_clean"] == pytest.approx((spread - noise) / float(mean @ u) ** 2, rel=1e-9)
        else:
            assert r["noise_to_signal_clean"] is None
    for r in rows[:2] + rows[len(schemes):len(schemes) + 2]:           # outcome and value, both compositions
        (y, (point, (lo, hi))), = r["expected_cos"].items()
        assert y == "outcome" and (math.isnan(point) or (-1 <= point <= 1 and lo <= hi))
    for r in rows:                                    # "vs outcome": at the row's own composition, paired
        o = next(x for x in rows if x["scheme"] == "outcome" and x["composition"] == r["composition"])
        assert r["variance_vs_outcome"] == pytest.approx(r["noise_to_signal"] / o["noise_to_signal"])
        if r["scheme"] == "outcome":
            assert r["variance_vs_outcome_ci"] == pytest.approx([1.0, 1.0])
        if r["scheme"] == "branch critic":            # critic ÷ value, V̂'s noise removed from both
            v = next(x for x in rows if x["scheme"] == "branch value" and x["composition"] == r["composition"])
            assert r["clean_vs_value"] == pytest.approx(r["noise_to_signal_clean"] / v["noise_to_signal_clean"])
            assert r["clean_vs_value_ci"][0] <= r["clean_vs_value_ci"][1]
    branch_full = branch["full"]
    allfail = probe.allfail_stats(grads, offsets, trajs, {**scores, "mu": scores["causal"]}, values, branch, "mu", 16, 4,
                                  0.5, True, resamples=200)
    at = {"T": 1.0, "gstar": {"attenuation": 0.7}, "gstar_halves_cos": 0.5, "rows": rows, "ceiling": rows,
          "favoured": probe.favoured(rows), "allfail": allfail, "allfail_signal": probe.allfail_signal(allfail, "mu"),
          "drift": {"ratio": 1.0, "mean_R": 0.4, "bias_at_mean_R": 0.4}}
    facts = {"point": "sft", "seed": 0, "pool": {"trajectories": 64, "questions": 16, "mean_R": 0.4},
             "held": {"trajectories": 64, "nonzero_advantage": 60}, "at": {"1": at, "rollout": {**at, "T": 0.7}},
             "branch": {"questions": 16, "trajectories": 64, "root_continuations": 4, "continuations": 4,
                        "rollouts": 100, "prefixes": 50}}
    table = probe.probe_markdown(facts)
    assert table.count("\n| ") == 2 * (2 * (len(rows) + 1) + len(allfail["rows"]) + 1)
    assert "favoured at 8 × 1" in table and "value vs outcome (2x4)" in table and "## log π at T = 0.7" in table
    assert branch_full is branch["full"]


# --- issue 60: the branched rollouts and the de-noised statistics --------------------------------------------------

class Titles:
    """A retriever that returns the paragraph whose title the query names (else the first)."""

    @staticmethod
    def retrieve(examples, queries):
        return [next((k for k, (title, _) in enumerate(ex.paragraphs) if title == q), 0) for ex, q in zip(examples, queries)]


def world_policy(example, stochastic: bool):
    """A scripted π on one synthetic question (hop1: the first supporting paragraph's title, distractor: another):
    with the hop1 paragraph in its history it finishes, with the gold answer (stochastic: with probability 0.8,
    else a wrong one); otherwise, with fewer than two searches made, it searches hop1 (stochastic: with probability
    ½, else the distractor; deterministic: always hop1, but after a distractor it finishes wrong); with two
    searches and no hop1, it finishes wrong. Each prompt's draw comes from its own seed (as π's streams)."""
    import random
    hop1 = example.paragraphs[example.supporting[0]][0]
    distractor = next(t for k, (t, _) in enumerate(example.paragraphs) if k not in example.supporting)

    def act(prompts, seeds):
        out = []
        for messages, seed in zip(prompts, seeds):
            history = messages[-1]["content"]
            r = random.Random(seed).random()
            searches = history.count(": Search[")
            if f"Observation: {hop1}:" in history:
                out.append(f"Finish[{example.answer}]" if not stochastic or r < 0.8 else "Finish[nobody]")
            elif searches < 2 and (stochastic or distractor not in history):
                out.append(f"Search[{hop1}]" if not stochastic or r < 0.5 else f"Search[{distractor}]")
            else:
                out.append("Finish[nobody]")
        return out
    return act, hop1, distractor


def played(example, actions):
    """A trajectory of the given actions, played through env (its observations, budget and reward as rollout's)."""
    it = iter(actions)
    return env.rollout([example], lambda prompts, seeds=None: [next(it) for _ in prompts], Titles, max_searches=3,
                       obs_chars=300)[0]


@pytest.mark.parametrize("stochastic", [False, True])
def test_branched_values_equal_their_values_by_enumeration(monkeypatch, tmp_path, stochastic):
    """One question, a trajectory π would not have played: Search[distractor], Search[hop1], Finish[gold] (R 1).
    Deterministic π (world_policy): from h_0 it searches hop1 and finishes right, V 1; from h_1 (a distractor
    searched) it finishes wrong, V 0; from h_2 (hop1 found) it finishes right, V 1. So V̂ = (1, 0, 1),
    Q̂ = V̂(h_{t+1}) = (0, 1, R = 1), exactly, with any number of continuations. Stochastic π: with hop1
    found the answer is right w.p. 0.8; from h_2 V = 0.8; from h_1: ½ hop1 (0.8), ½ the distractor again (then
    two searches, wrong: 0) → 0.4; from h_0: ½ hop1 (0.8), ½ the distractor (then h_1's 0.4) → 0.6. So V̂ ≈
    (0.6, 0.4, 0.8), Q̂ ≈ (0.4, 0.8, 1) from 400 continuations each (3σ ≤ 0.075). The halves average to the whole."""
    q = env.synthetic_examples(1)[0]
    act, hop1, distractor = world_policy(q, stochastic)
    monkeypatch.setattr(probe.passes, "policy_act", lambda pi, *a: act)
    monkeypatch.setattr(probe.env, "shared_retriever", lambda *a: Titles)
    n = 400 if stochastic else 4
    monkeypatch.setattr(probe, "BRANCH", dict(questions=1, continuations=n, root=n, chunk=2))
    monkeypatch.setattr(probe, "PROBE", {**probe.PROBE, "samples": 1})
    t = played(q, [f"Search[{distractor}]", f"Search[{hop1}]", f"Finish[{q.answer}]"])
    assert [st.valid for st in t.steps] == [True, True, True] and t.reward == 1.0
    args = arco.resolve_args(arco.Args(dataset="synthetic"))
    done = probe.branch_rollouts(None, [t], args, tmp_path / "branches.jsonl", 0, "fp")
    assert sorted(done) == [(0, 0), (0, 1), (0, 2)] and all(len(r) == n for r in done.values())
    values = probe.branch_values([t], done, 1, 1)
    V, Q = values["full"][0]["V"], values["full"][0]["Q"]
    if stochastic:
        assert V == pytest.approx([0.6, 0.4, 0.8], abs=0.075) and Q == pytest.approx([0.4, 0.8, 1.0], abs=0.075)
        assert 0 < min(V) and max(V) < 1                      # each continuation its own stream
    else:
        assert V == [1.0, 0.0, 1.0] and Q == [0.0, 1.0, 1.0]
    assert Q[:-1] == V[1:] and Q[-1] == t.reward
    for k in range(3):
        assert (values["a"][0]["V"][k] + values["b"][0]["V"][k]) / 2 == pytest.approx(V[k])
    again = probe.branch_rollouts(None, [t], args, tmp_path / "branches.jsonl", 0, "fp")   # resumed: nothing new
    assert again == done and len(files.read_jsonl(tmp_path / "branches.jsonl")) == 3
    with pytest.raises(env.DataError, match="another pool"):
        probe.branch_rollouts(None, [t], args, tmp_path / "branches.jsonl", 0, "other")
    adv = {name: probe.scheme_advantages(name, [0], [t], {}, None, "8x1", 0.5, True, values["full"])[0]
           for name in ("branch value", "branch critic")}
    assert adv["branch value"] == pytest.approx([1 - v for v in V]) and \
        adv["branch critic"] == pytest.approx([a - b for a, b in zip(Q, V)])


def noisy_batches(mean, B, per_block, batch_sd, block_sd, seed, V_noise=0.0):
    """B batch gradients g_b = mean + a block's shared part (sd block_sd, like 8 × 1 batches that share their
    questions) + the batch's own (sd batch_sd), and, with V_noise, V̂'s sampling noise in two halves a, b:
    g_b^a = … + v_b^a, g_b^b = … + v_b^b, the full estimate carrying their mean."""
    g = torch.Generator().manual_seed(seed)
    d = len(mean)
    blocks = torch.randn(B // per_block, d, generator=g, dtype=torch.float64).repeat_interleave(per_block, 0) * block_sd
    own = torch.randn(B, d, generator=g, dtype=torch.float64) * batch_sd
    va, vb = (torch.randn(B, d, generator=g, dtype=torch.float64) * V_noise for _ in "ab")
    core = mean + blocks + own
    return core + (va + vb) / 2, core + va, core + vb, core


def test_the_de_noised_cosine_recovers_a_known_mean_from_noisy_draws():
    """64 batch gradients of a known mean m (‖m‖ = 1, cos(m, û) = 0.6) with 32× its energy in noise, 12 of it shared
    by the 4 batches of a block (as 8 × 1 batches share questions): cos(ḡ, û) is pulled below 0.5, the de-noised
    cos(E g_B, û) recovers 0.6 (within 0.15, 3σ of ⟨ḡ, û⟩'s own noise, on each of 5 draws; their mean within 0.07),
    and ‖E g_B‖² ≈ ‖m‖²; a batch-level de-noising
    (spread / (B − 1), blocks of one) under-corrects when batches share blocks. V̂'s noise: with two halves
    a, b, the noise energy ‖g^a − g^b‖²/4 removed from the spread gives back the spread of the same batches without
    it, within 10%."""
    d = 400
    u = torch.zeros(d, dtype=torch.float64)
    u[0] = 1.0
    m = torch.zeros(d, dtype=torch.float64)
    m[0], m[1] = 0.6, 0.8                                    # ‖m‖ = 1, cos(m, û) = 0.6
    one = torch.ones(1, 64, dtype=torch.float64)
    found = []
    for seed in range(5):
        g, _, _, _ = noisy_batches(m, 64, 4, batch_sd=(20 / d) ** 0.5, block_sd=(12 / d) ** 0.5, seed=seed)
        st = {k: float(v[0]) for k, v in probe.gram_stats(g @ g.T, g @ u, torch.zeros(64, dtype=torch.float64), one,
                                                          4).items()}
        assert st["mean_cos"] < 0.5
        assert st["mean_cos_denoised"] == pytest.approx(0.6, abs=0.15)
        found.append(st["mean_cos_denoised"])
        assert st["expected_sq"] == pytest.approx(1.0, abs=0.35)
        batch_level = probe.gram_stats(g @ g.T, g @ u, torch.zeros(64, dtype=torch.float64), one, 1)
        assert float(batch_level["mean_cos_denoised"][0]) < st["mean_cos_denoised"] - 0.03
    assert sum(found) / len(found) == pytest.approx(0.6, abs=0.07)
    g, ga, gb, core = noisy_batches(m, 64, 4, batch_sd=0.3, block_sd=0.0, seed=7, V_noise=0.5)
    noise = ((ga - gb) ** 2).sum(1) / 4
    with_v = probe.gram_stats(g @ g.T, g @ u, noise, one, 4)
    without = probe.gram_stats(core @ core.T, core @ u, torch.zeros(64, dtype=torch.float64), one, 4)
    spread = {k: float(v["spread"][0]) for k, v in (("with", with_v), ("without", without))}
    assert spread["with"] > 1.5 * spread["without"]
    clean = float(with_v["noise_to_signal_clean"][0]) * float(with_v["along"][0]) ** 2   # the spread left
    assert clean == pytest.approx(spread["without"], rel=0.1)


def test_bootstrap_draws_of_the_de_noised_square_scatter_around_the_estimate():
    """A draw's truth is the data's ḡ, so an uncentered draw's de-noised ‖E g_B‖² averages ‖ḡ‖², a whole de-noising
    (the block spread over blocks − 1) above the estimate, and its percentile interval can exclude the estimate.
    Centered (block_bootstrap; expected_cos with centered=True), the draws average the estimate, within a tenth of
    that de-noising, for the square and for the cross term of two schemes."""
    d = 300
    u = torch.zeros(d, dtype=torch.float64)
    u[0] = 1.0
    m = torch.zeros(d, dtype=torch.float64)
    m[0], m[1] = 0.6, 0.8
    g = noisy_batches(m, 64, 4, batch_sd=(20 / d) ** 0.5, block_sd=(12 / d) ** 0.5, seed=3)[0]
    K, p, zero = g @ g.T, g @ u, torch.zeros(64, dtype=torch.float64)
    one = probe.gram_stats(K, p, zero, torch.ones(1, 64, dtype=torch.float64), 4)
    estimate, raw = float(one["expected_sq"][0]), float(one["msq"][0])
    assert raw - estimate > 0.5                                   # the de-noising is large here
    centered = probe.block_bootstrap([(K, p)], 4, 2000)[0]["expected_sq"]
    uncentered = probe.gram_stats(K, p, zero, probe.bootstrap_weights(64, 4, 2000), 4)["expected_sq"]
    assert float(centered.mean()) == pytest.approx(estimate, abs=0.1 * (raw - estimate))
    assert float(uncentered.mean()) == pytest.approx(raw, abs=0.1 * (raw - estimate))
    lo, hi = probe.percentile_interval(probe.block_bootstrap([(K, p)], 4, 2000)[0]["mean_cos_denoised"])
    assert lo <= float(one["mean_cos_denoised"][0]) <= hi
    gy = noisy_batches(m, 64, 4, batch_sd=(20 / d) ** 0.5, block_sd=(12 / d) ** 0.5, seed=4)[0]
    W = probe.bootstrap_weights(64, 4, 2000)
    point = float(probe.expected_cos(g, gy, torch.ones(1, 64, dtype=torch.float64), 4)[0])
    drawn = probe.expected_cos(g, gy, W, 4, centered=True)
    plain = probe.expected_cos(g, gy, W, 4)
    assert abs(float(drawn.nanmedian()) - point) < abs(float(plain.nanmedian()) - point)


def test_the_spread_is_tr_cov_when_a_blocks_batches_share_questions():
    """32 batch gradients in 8 blocks of 4 (the ceiling's sizes at 8 × 1), 40% of their noise shared by a block:
    tr Cov = d (0.6 + 0.4) σ² is known. Over 400 draws the de-noised ‖E g_B‖² averages ‖m‖² = 1 and the spread
    within 1% of tr Cov, where the batches' own
    spread Σ‖g_b‖²/B − ‖ḡ‖² falls short by tr Cov / B and the shared part's 3 × 0.4 / B (≈ 7%); with V̂'s noise in
    two halves, the clean spread is the spread without it, on average within 1.5%."""
    d, B, per = 50, 32, 4
    u = torch.zeros(d, dtype=torch.float64)
    u[0] = 1.0
    m = torch.zeros(d, dtype=torch.float64)
    m[0] = 1.0
    one = torch.ones(1, B, dtype=torch.float64)
    true = d * 1.0                                               # σ² = 1 per coordinate: 0.6 own + 0.4 shared
    got, naive, clean, core_spread, sq = [], [], [], [], []
    for seed in range(400):
        g, ga, gb, core = noisy_batches(m, B, per, batch_sd=0.6 ** 0.5, block_sd=0.4 ** 0.5, seed=seed, V_noise=0.5)
        st = probe.gram_stats(core @ core.T, core @ u, torch.zeros(B, dtype=torch.float64), one, per)
        got.append(float(st["spread"][0]))
        sq.append(float(st["expected_sq"][0]))
        naive.append(float((core * core).sum(1).mean() - (core.mean(0) ** 2).sum()))
        noise = ((ga - gb) ** 2).sum(1) / 4
        with_v = probe.gram_stats(g @ g.T, g @ u, noise, one, per)
        clean.append(float(with_v["noise_to_signal_clean"][0] * with_v["along"][0] ** 2))
        core_spread.append(got[-1])
    mean = lambda x: sum(x) / len(x)                              # noqa: E731
    assert mean(got) == pytest.approx(true, rel=0.01)
    assert mean(sq) == pytest.approx(1.0, abs=0.1)              # ‖E g_B‖² = ‖m‖² (÷ blocks, not blocks − 1: ≈ 1.5)
    assert mean(naive) < 0.95 * true                              # the old estimate: ≈ 7% short
    assert mean(clean) == pytest.approx(mean(core_spread), rel=0.015)


def test_expected_cos_of_two_schemes_with_the_same_mean_is_1_and_differs_otherwise():
    """Two noisy schemes around the same mean (independent noise): de-noised cos(E g^X, E g^Y) ≈ 1 while cos(ḡ^X, ḡ^Y)
    is well below; around orthogonal means ≈ 0."""
    d = 300
    m = torch.zeros(d, dtype=torch.float64)
    m[0] = 1.0
    w = torch.zeros(d, dtype=torch.float64)
    w[1] = 1.0
    one = torch.ones(1, 64, dtype=torch.float64)
    gx = noisy_batches(m, 64, 4, 0.35, 0.0, seed=1)[0]
    gy = noisy_batches(m, 64, 4, 0.35, 0.0, seed=2)[0]
    gz = noisy_batches(w, 64, 4, 0.35, 0.0, seed=3)[0]
    assert float(probe.F_cos(gx.mean(0), gy.mean(0))) < 0.8
    assert float(probe.expected_cos(gx, gy, one, 4)[0]) == pytest.approx(1.0, abs=0.15)
    assert float(probe.expected_cos(gx, gz, one, 4)[0]) == pytest.approx(0.0, abs=0.15)


def test_score_drift_and_gstar_attenuation_by_hand():
    """g*'s halves (3, 0) and (1, 2): ⟨h₁, h₂⟩ = 3, g = (2, 1), so √3/√5 is its attenuation. Per-step gradients of
    two questions × 2 samples whose trajectory sums average (1, 0) in both questions with a spread of their own:
    the drift's de-noised square is ‖(1, 0)‖² − spread/(2 − 1), here 1 − 0 (the question means agree)."""
    gstar = {"g": torch.tensor([2.0, 1.0]), "halves": torch.tensor([[3.0, 0.0], [1.0, 2.0]])}
    a = probe.gstar_attenuation(gstar)
    assert a["attenuation"] == pytest.approx(3 ** 0.5 / 5 ** 0.5) and a["signal_norm"] == pytest.approx(3 ** 0.5)
    q = env.synthetic_examples(2)
    trajs = [Script.make(q[0], ["Search[a]", "Finish[x]"], 1.0), Script.make(q[0], ["Finish[x]"], 0.0),
             Script.make(q[1], ["Finish[y]"], 1.0), Script.make(q[1], ["Search[b]", "Finish[y]"], 0.0)]
    grads = torch.tensor([[0.5, 1.0], [0.5, 0.0], [1.0, -1.0], [2.0, 0.0], [-0.5, 0.0], [0.5, 0.0]])
    offsets = [r.start for r in env.step_ranges(trajs)]     # sums: (1, 1), (1, −1), (2, 0), (0, 0)
    d = probe.score_drift(grads, offsets, trajs, 2, gstar)
    assert d["drift_sq"] == pytest.approx(1.0) and d["ratio"] == pytest.approx(1 / 3 ** 0.5)
    assert d["bias_at_mean_R"] == pytest.approx(0.5 / 3 ** 0.5)


def test_a_stage_of_another_pool_is_refused(tmp_path):
    """A cached stage keeps the fingerprint of the pool it was computed on; another pool's is refused, naming the
    file, before anything is computed; a μ-score file whose count is not the pool's steps is refused too."""
    q = env.synthetic_examples(1)[0]
    trajs = [Script.make(q, ["Search[a]", "Finish[x]"], 1.0)]
    torch.save({"trajectories": 1, "rows": {"1": [torch.zeros(4)] * 2}, "fingerprint": "aaaa"}, tmp_path / "grads.pt")
    dummy = type("Pi", (), {"model": torch.nn.Linear(1, 1)})()
    with pytest.raises(env.DataError, match="grads.pt was computed on another pool"):
        probe.step_gradients(dummy, trajs, probe.Sketch([torch.nn.Parameter(torch.zeros(2))], 4), tmp_path / "grads.pt",
                             tmp_path / "sketch.json", fingerprint="bbbb")
    torch.save({"trajectories": 1, "rows": {"1": [torch.zeros(4)] * 2}, "fingerprint": "aaaa"}, tmp_path / "grads.pt")
    assert probe.step_gradients(dummy, trajs, None, tmp_path / "grads.pt", tmp_path / "sketch.json",
                                fingerprint="aaaa")["1"].shape == (2, 4)
    torch.save({"trajectories": 1, "s": torch.zeros(3), "fingerprint": "aaaa"}, tmp_path / "mu.pt")
    with pytest.raises(env.DataError, match="3 step scores, the pool 2 steps"):
        probe.probe_mu_scores(tmp_path / "mu", trajs, None, tmp_path / "mu.pt", "aaaa")
    rows = [probe.traj_row(t, "pi-1") for t in trajs]
    assert probe.pool_id(rows) != probe.pool_id([{**rows[0], "pi": "pi-2"}])


def test_an_odd_number_of_continuations_is_refused():
    """V̂'s noise is measured from two equal halves of the continuations: an odd count cannot be split."""
    q, = env.synthetic_examples(1)
    trajs = [Script.make(q, ["Search[a]", "Finish[x]"], 1.0)]
    with pytest.raises(ValueError, match="odd number of continuations"):
        probe.branch_values(trajs, {(0, 0): [1.0, 0.0, 1.0], (0, 1): [1.0, 0.0]}, 1, 1)
    halves = probe.branch_values(trajs, {(0, 0): [1.0, 0.0, 1.0, 1.0], (0, 1): [1.0, 0.0]}, 1, 1)
    assert halves["a"][0] == {"V": [0.5, 1.0], "Q": [1.0, 1.0]} and halves["b"][0] == {"V": [1.0, 0.0], "Q": [0.0, 1.0]}


# --- issue 67: the groups that all fail, the decomposing μ through Eq. 4 ------------------------------------------

def test_branch_eq4_advantages_by_hand():
    """What ARCO's estimator hands π from a perfect decomposing μ: G_0 = R (the empty prefix sum), G_t = R − V̂(h_t)
    after, through Eq. 4's buckets. A: Search Search Finish, R 1, V̂ (.5, .25, .75) → G (1, .75, .25); B: Search
    Finish, R 0, V̂ (.5, .5) → G (0, −.5). search_1 {1, 0} → ½; search_2 {.75} alone → the batch mean 1.5/5 = .3
    (fallback); terminal {.25, −.5} → −.125. α = ½."""
    q1, q2 = env.synthetic_examples(2)
    trajs = [Script.make(q1, ["Search[a]", "Search[b]", "Finish[x]"], 1.0), Script.make(q2, ["Search[a]", "Finish[y]"], 0.0)]
    branch = [{"V": [0.5, 0.25, 0.75], "Q": [0.25, 0.75, 1.0]}, {"V": [0.5, 0.5], "Q": [0.5, 0.0]}]
    A = probe.scheme_advantages("branch eq4", [0, 1], trajs, {}, None, "8x1", 0.5, True, branch)
    assert flat(A) == pytest.approx([0.25, 0.225, 0.1875, -0.25, -0.1875])
    value = probe.scheme_advantages("branch value", [0, 1], trajs, {}, None, "8x1", 0.5, True, branch)
    assert flat(value) == pytest.approx([0.5, 0.75, 0.25, -0.5, -0.5])       # R − V̂(h_t), V̂(h_0) subtracted too


def test_question_sets_and_success_rate_bins_by_hand():
    """Four questions × 2 samples: q0 (0, 0), q1 (1, 0), q2 (1, 1), q3 (0, 0); p̂ = V̂(h_0) of the root continuations
    0, ½, 0.9, ¼. All fail: q0 (p̂ = 0) and q3 (0 < p̂ ≤ ¼); mixed: q1 (¼ < p̂ ≤ ½); all succeed: q2. Bin edges: the
    upper end is in its bin."""
    qs = env.synthetic_examples(4)
    R = [(0, 0), (1, 0), (1, 1), (0, 0)]
    trajs = [Script.make(q, ["Finish[x]"], float(r)) for q, rs in zip(qs, R) for r in rs]
    p = [0.0, 0.5, 0.9, 0.25]
    branch_full = [{"V": [p[i // 2]], "Q": [t.reward]} for i, t in enumerate(trajs)]
    sets = probe.question_sets(trajs, branch_full, 4, 2)
    assert sets["all fail"] == [0, 3] and sets["mixed"] == [1] and sets["all succeed"] == [2]
    assert sets["all fail, p̂ = 0"] == [0] and sets["all fail, 0 < p̂ ≤ ¼"] == [3]
    assert sets["all fail, ¼ < p̂ ≤ ½"] == [] and sets["mixed, ¼ < p̂ ≤ ½"] == [1] and sets["mixed, p̂ = 0"] == []
    assert [probe.p_bin(x) for x in (0.0, 1 / 16, 0.25, 0.26, 0.5, 0.75, 1.0)] == \
        ["p̂ = 0", "0 < p̂ ≤ ¼", "0 < p̂ ≤ ¼", "¼ < p̂ ≤ ½", "¼ < p̂ ≤ ½", "p̂ > ½", "p̂ > ½"]


def test_the_sets_parts_of_a_batch_gradient_add_up_and_outcome_is_zero_where_a_group_all_fails():
    """On a scripted pool (16 questions × 4 samples, random per-step gradients): the parts of every batch gradient
    that the all-fail, mixed and all-succeed groups contribute add up to the whole (advantages computed on the whole
    batch); outcome RL's part on the all-fail groups is exactly zero, so its inner product with the critic's there is
    0; outcome's own `along` on the mixed groups ÷ itself is 1 on every draw; every set has its counts."""
    g = torch.Generator().manual_seed(2)
    qs = env.synthetic_examples(16)
    plans = [["Search[a]", "Finish[x]"], ["Finish[y]"], ["Search[a]", "Search[b]", "Finish[x]"], ["Finish[z]"]]
    rewards = [[0, 0, 0, 0], [1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0]]
    trajs = [Script.make(q, plans[(i + k) % 4], float(rewards[i % 4][k])) for i, q in enumerate(qs) for k in range(4)]
    offsets = [r.start for r in env.step_ranges(trajs)]
    grads = torch.randn(sum(len(t.steps) for t in trajs), 32, generator=g)
    values = probe.mc_values(trajs)
    noisy = [[[min(1.0, max(0.0, v + 0.2 * float(torch.randn(1, generator=g)))) for v in row] for row in values]
             for _ in "ab"]
    branch = {h: [{"V": V, "Q": V[1:] + [t.reward]} for V, t in zip(Vs, trajs)]
              for h, Vs in (("a", noisy[0]), ("b", noisy[1]),
                            ("full", [[(x + y) / 2 for x, y in zip(*rows)] for rows in zip(*noisy)]))}
    scores = {"mu": [[0.1 * (k + 1) - 0.2 for k in range(len(t.steps))] for t in trajs]}
    batches = probe.probe_batches(16, 4, "2x4")
    sets = probe.question_sets(trajs, branch["full"], 16, 4)
    assert (len(sets["all fail"]), len(sets["mixed"]), len(sets["all succeed"])) == (8, 4, 4)
    for scheme in ("outcome", "mu eq4", "verdict mu", "branch eq4", "branch critic"):
        common = (batches, grads, offsets, "2x4", trajs, scores, values, 0.5, True)
        whole = probe.batch_gradients(scheme, *common, branch=branch["full"])
        parts = [probe.batch_gradients(scheme, *common, branch=branch["full"],
                                       keep={q * 4 + k for q in sets[name] for k in range(4)})
                 for name in ("all fail", "mixed", "all succeed")]
        torch.testing.assert_close(sum(parts), whole)
        if scheme == "outcome":
            assert float(parts[0].abs().max()) == 0.0
    out = probe.allfail_stats(grads, offsets, trajs, scores, values, branch, "mu", 16, 4, 0.5, True, resamples=200)
    row = {(r["set"], r["scheme"]): r for r in out["rows"]}
    assert row[("all fail", "outcome")]["inner"] == 0.0 and row[("all fail", "outcome")]["inner_ci"] == [0.0, 0.0]
    assert row[("mixed", "outcome")]["along_vs_outcome_mixed"] == pytest.approx(1.0)
    assert row[("mixed", "outcome")]["along_vs_outcome_mixed_ci"] == pytest.approx([1.0, 1.0])
    assert out["sets"]["all fail"] == {"questions": 8, "trajectories": 32,
                                       "valid_steps": sum(len(trajs[q * 4 + k].steps) for q in sets["all fail"]
                                                          for k in range(4))}
    assert {s for s, _ in row} == {name for name, qs in sets.items() if qs}
    assert out["auc"]["questions"] == 8 and out["auc"]["steps"] == out["sets"]["all fail"]["valid_steps"]


def test_the_auc_for_a_noisy_sign_is_corrected_back_to_the_true_one():
    """4,000 steps, true advantage ±1 (30% positive), μ's score N(0.8·y, 1): the AUC for the true sign is Φ(0.8/√2)
    ≈ 0.71. Each half's estimate has its sign flipped with probability 0.2 (independently): the AUC against a half's
    signs falls to ≈ 0.5 + κ·0.21; corrected (flip rate from the halves' agreement), it is the true AUC within 0.03.
    By hand on six steps: halves that always agree give flip 0 and κ 1 (nothing to correct)."""
    from infra.runs import auc
    g = torch.Generator().manual_seed(0)
    n = 4000
    y = (torch.rand(n, generator=g) < 0.3).double() * 2 - 1
    s = (0.8 * (y > 0).double() + torch.randn(n, generator=g, dtype=torch.float64)).tolist()
    flip = lambda: torch.where(torch.rand(n, generator=g) < 0.2, -1.0, 1.0).double()   # noqa: E731
    a, b = (y * flip()).tolist(), (y * flip()).tolist()
    out = probe.noisy_label_auc(s, a, b)
    true = auc(s, (y > 0).tolist())
    assert out["flip"] == pytest.approx(0.2, abs=0.03)
    assert out["halves"] < true - 0.05
    assert out["corrected"] == pytest.approx(true, abs=0.03)
    clean = probe.noisy_label_auc([0.9, 0.8, 0.1, 0.2, 0.7, 0.3], [1, 1, -1, -1, 1, -1], [1, 1, -1, -1, 1, -1])
    assert clean["flip"] == 0.0 and clean["kappa"] == pytest.approx(1.0) and clean["corrected"] == 1.0
    assert clean["raw"] == 1.0 and clean["steps_signed"] == 6
