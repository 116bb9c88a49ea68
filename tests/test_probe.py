"""Tests of the gradient probe (probe.py probe, issue 53): the count sketch keeps cosines, the batches and the
schemes' advantages by hand, the Monte-Carlo value baseline by hand, and on a tiny model the per-step gradients
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
