"""Tests of the gradient probe (probe.py probe, issue 53): the count sketch keeps cosines, the batches and the
schemes' advantages by hand, the Monte-Carlo value baseline by hand, the paired block bootstrap and the RL
check's rule by hand, the table on a synthetic pool, and on a tiny model the per-step gradients
summed with the held-out pool's advantages give the g* that true_gradient's packed passes compute."""
import pytest
import torch

import arco
import env
import rubric_model as rm
import probe


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
    pi = rm.load_backbone(str(tiny_dir), device="cpu", autocast="off")
    torch.manual_seed(0)
    rm.add_lora(pi, dropout=0.0)
    for p in rm.trainable_parameters(pi.model):
        p.data.normal_(0, 0.05)
    qs = env.synthetic_examples(2)
    trajs = [Script.make(qs[0], ["Search[a]", "Finish[x]"], 1.0), Script.make(qs[0], ["Finish[y]"], 0.0),
             Script.make(qs[1], ["Search[b]", "Finish[z]"], 0.0), Script.make(qs[1], ["Search[c]", "Finish[w]"], 1.0)]
    for t in trajs:
        for k, st in enumerate(t.steps):
            st.prompt = env.policy_messages(t.example.question, env.format_history(t.steps[:k]), st.searches_left)
    sketch = probe.Sketch(rm.trainable_parameters(pi.model), 2048, seed=0)
    grads = probe.step_gradients(pi, trajs, sketch, tmp_path / "grads.pt", tmp_path / "sketch.json", check=3)
    assert grads.shape == (7, 2048) and (tmp_path / "sketch.json").is_file()
    again = probe.step_gradients(pi, trajs, sketch, tmp_path / "grads.pt", tmp_path / "sketch.json")
    assert torch.equal(again, grads)                                                   # resumed: nothing recomputed
    A = probe.loo_advantages(trajs)
    ranges = env.step_ranges(trajs)
    half = len(trajs) // 2
    want = [sum(A[i] * grads[ranges[i].start:ranges[i].stop].sum(0) for i in range(h * half, (h + 1) * half)) / half
            for h in (0, 1)]
    args = arco.resolve_args(arco.Args(pass_tokens=4096))
    got = probe.true_gradient(pi, trajs, sketch, args, tmp_path / "gstar.pt")
    for h in (0, 1):
        torch.testing.assert_close(got["halves"][h], want[h], rtol=1e-3, atol=1e-5)


def test_block_bootstrap_by_hand():
    """Four batch gradients in two blocks of two, û* = e₁. The three possible resamples, by hand:
    blocks (1, 1): ḡ = (1, ½), spread = (1 + 1 + 1 + 5)/4 − 5/4 = ¾, along 1 → noise-to-signal ¾, cos(ḡ, g*) 2/√5;
    block 1 twice: ḡ = (1, 0), spread 0, cos 1; block 2 twice: ḡ = (1, 1), spread 3 − 2 = 1, cos 1/√2.
    A second row (2× the gradients) has the same statistics on every draw: the draw is shared (paired)."""
    G = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [2.0, 1.0]], dtype=torch.float64)
    u = torch.tensor([1.0, 0.0], dtype=torch.float64)
    rows = [(G @ G.T, G @ u), ((2 * G) @ (2 * G).T, (2 * G) @ u)]
    boot = probe.block_bootstrap(rows, batches_per_block=2, resamples=400)
    hand = {(0.75, round(2 / 5 ** 0.5, 6)), (0.0, 1.0), (1.0, round(1 / 2 ** 0.5, 6))}
    seen = {(round(float(a), 6), round(float(c), 6)) for a, c in zip(boot[0]["noise_to_signal"], boot[0]["mean_cos"])}
    assert seen == hand
    torch.testing.assert_close(boot[1]["noise_to_signal"], boot[0]["noise_to_signal"])
    torch.testing.assert_close(boot[1]["mean_cos"], boot[0]["mean_cos"])


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


def test_probe_stats_and_its_table_on_a_synthetic_pool(monkeypatch):
    """16 questions × 4 scripted samples, random per-step gradients and a g* built as the outcome gradient of the
    pool plus noise: every scheme × composition gets a row; outcome at 2 × 4 is the reference (ratio 1, paired
    interval [1, 1], cosine difference [0, 0]); every interval is ordered and inside [−1, 1]; the bootstrap's
    Gram form at unit weights (one block holding every batch) gives the rows' own noise-to-signal and cos(ḡ, g*),
    computed directly from the batch gradients; the table prints one line per row and the favoured list."""
    seen, bootstrap = [], probe.block_bootstrap

    def recording(grams, *a, **k):                   # keeps the Gram matrices probe_stats hands the bootstrap
        seen.append(grams)
        return bootstrap(grams, *a, **k)
    monkeypatch.setattr(probe, "block_bootstrap", recording)
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
    schemes = ["outcome", "value", "causal eq4", "causal state"]
    rows = probe.probe_stats(grads, offsets, trajs, scores, probe.mc_values(trajs), gstar, schemes, 16, 4, 0.5, True,
                             resamples=300)
    assert [(r["scheme"], r["composition"]) for r in rows] == [(s, c) for c in ("2x4", "8x1") for s in schemes]
    ref = rows[0]
    assert ref["variance_vs_outcome_2x4"] == 1.0 and ref["variance_vs_outcome_2x4_ci"] == pytest.approx([1.0, 1.0])
    assert ref["mean_cos_vs_outcome_2x4_ci"] == pytest.approx([0.0, 0.0], abs=1e-12)
    for r in rows:
        lo, hi = r["mean_cos_ci"]
        assert lo <= hi and -1 <= lo and hi <= 1 and r["batches"] == 8
    unit = bootstrap(seen[0], batches_per_block=8, resamples=1)
    for r, b in zip(rows, unit, strict=True):
        assert float(b["noise_to_signal"][0]) == pytest.approx(r["noise_to_signal"], rel=1e-9)
        assert float(b["mean_cos"][0]) == pytest.approx(r["mean_cos"], rel=1e-9)
    facts = {"point": "sft", "seed": 0, "pool": {"trajectories": 64, "questions": 16, "mean_R": 0.4},
             "held": {"trajectories": 64, "nonzero_advantage": 60}, "gstar_halves_cos": 0.5, "rows": rows,
             "favoured": probe.favoured(rows)}
    table = probe.probe_markdown(facts)
    assert table.count("\n| ") == len(rows) + 1 and "favoured at 8 × 1" in table
