"""Eq. 3–5 and Alg. 1 line 31 against the hand-worked golden vectors in tests/vectors.json, and
arco.advantages (Alg. 1, lines 26–32) on hand-built trajectories in both phases."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import arco
import evaluate
import rubric_model
import warmup
from lab import study
from lab import truth

V = json.loads((Path(__file__).parent / "vectors.json").read_text())


def approx_rows(got, expected):
    """Row by row, with the number of rows and of entries per row checked (zip alone would not)."""
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert len(g) == len(e) and g == pytest.approx(e)


def t64(x):
    return torch.tensor(x, dtype=torch.float64) if x is not None else None


@pytest.mark.parametrize("case", V["reward_to_go"])
def test_reward_to_go(case):
    assert arco.reward_to_go(case["s"]) == pytest.approx(case["G"])
    assert len(arco.reward_to_go(case["s"])) == len(case["G"])


@pytest.mark.parametrize("case", V["step_buckets"])
def test_step_buckets(case):
    assert arco.step_buckets(case["actions"], case["valid"]) == case["buckets"]


@pytest.mark.parametrize("case", V["bucketed_advantages"])
def test_bucketed_advantages(case):
    A = arco.bucketed_advantages(case["G"], case["buckets"], case["valid"], case["alpha"], case["singleton_fallback"])
    approx_rows(A, case["A"])


def test_bucket_baseline_is_per_bucket_not_global():
    # Same G at search_1 and terminal in two buckets: a global mean would give nonzero advantages.
    A = arco.bucketed_advantages([[1.0, 0.0], [1.0, 0.0]], [["search_1", "terminal"]] * 2, [[True, True]] * 2, 1.0)
    assert A == [[0.0, 0.0], [0.0, 0.0]]


@pytest.mark.parametrize("case", V["outcome_advantages"])
def test_outcome_advantages(case):
    A = arco.outcome_advantages(case["R"], case["groups"])
    assert len(A) == len(case["A"]) and A == pytest.approx(case["A"])


@pytest.mark.parametrize("case", V["reduce_tokens"])
def test_reduce_tokens(case):
    out = arco.reduce_tokens(t64(case["per_token"]), torch.tensor(case["mask"]).bool(), case["how"])
    assert out.tolist() == pytest.approx(case["out"]) and len(out) == len(case["out"])


@pytest.mark.parametrize("case", V["policy_loss"])
def test_policy_loss(case):
    logp = torch.tensor(case["logp"], dtype=torch.float64, requires_grad=True)
    kl = torch.tensor(case["kl_per_step"], dtype=torch.float64, requires_grad=True)
    loss = arco.policy_loss(logp, t64(case["advantages"]), case["n_trajectories"], kl, case["kl_coef"])
    loss.backward()
    assert float(loss.detach()) == pytest.approx(case["loss"])
    assert logp.grad.tolist() == pytest.approx(case["grad_logp"])
    got_kl_grad = kl.grad.tolist() if kl.grad is not None else [0.0] * len(case["kl_per_step"])
    assert got_kl_grad == pytest.approx(case["grad_kl_per_step"])     # the KL term carries gradient


def test_policy_loss_micro_batches_add_up_to_the_batch():
    c = V["policy_loss"][0]
    logp, adv, kl = t64(c["logp"]), t64(c["advantages"]), t64(c["kl_per_step"])
    parts = [arco.policy_loss(logp[i:j], adv[i:j], 2, kl[i:j], c["kl_coef"]) for i, j in ((0, 2), (2, 5))]
    assert float(sum(parts)) == pytest.approx(c["loss"])


@pytest.mark.parametrize("case", V["class_weights"])
def test_class_weights(case):
    assert arco.class_weights(case["R"]) == pytest.approx(case["w"])


@pytest.mark.parametrize("case", V["decomposition_loss"])
def test_decomposition_loss(case):
    s = torch.tensor(case["s"], dtype=torch.float64, requires_grad=True)
    loss = arco.decomposition_loss(s, torch.tensor(case["trajectory"]), t64(case["R"]), weights=t64(case["weights"]))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(case["loss"])
    assert s.grad.tolist() == pytest.approx(case["grad_s"])


def test_decomposition_loss_of_a_pass_counts_only_its_trajectories():
    """A pass holding trajectory 1 only (s = 0.1, −0.2, 0.5 of the first vector; R = [1, 0], |B| = 2): the
    term of trajectory 1 alone, (0.4 − 0)² / 2 = 0.08, not trajectory 0's (0 − 1)² added; the two passes'
    terms add up to the batch's 0.085."""
    R = t64([1, 0])
    second = arco.decomposition_loss(t64([0.1, -0.2, 0.5]), torch.tensor([1, 1, 1]), R, 2)
    first = arco.decomposition_loss(t64([0.2, 0.3, 0.4]), torch.tensor([0, 0, 0]), R, 2)
    assert float(second) == pytest.approx(0.08) and float(first + second) == pytest.approx(0.085)


@pytest.mark.parametrize("case", V["projection_credit"])
def test_projection_credit(case):
    s = truth.projection_credit(case["useful"], case["R"])
    assert s == pytest.approx(case["s"]) and sum(s) == pytest.approx(case["R"])           # Σ_t s_t = R(τ)
    useful = [x for x, u in zip(s, case["useful"]) if u]
    assert all(u > x for u in useful for x, k in zip(s, case["useful"]) if not k)         # order kept


@pytest.mark.parametrize("case", V["causal_credit"])
def test_causal_credit(case):
    """The causal oracle (issue 41): Σ_t s_t = R, Eq. 3's G_t = R − Φ(h_t), and no step's score reads a later
    step: the same prefix gives the same scores before the last step whatever follows."""
    s = truth.causal_credit(case["found"], case["n_hops"], case["R"])
    assert s == pytest.approx(case["s"]) and sum(s) == pytest.approx(case["R"])
    assert arco.reward_to_go(s) == pytest.approx(case["G"])
    for t in range(len(s) - 1):
        for tail in ([True], [False, False], [True, True, False]):
            for R in (0.0, 1.0):
                other = truth.causal_credit(case["found"][:t + 1] + tail, case["n_hops"], R)
                assert other[:t + 1] == pytest.approx(s[:t + 1])


@pytest.mark.parametrize("case", V["rubric_loss"])
def test_rubric_loss(case):
    loss = arco.rubric_loss(t64(case["s"]), torch.tensor(case["trajectory"]), t64(case["R"]), t64(case["kl_per_step"]),
                            case["beta"], case["kl_divisor"], weights=t64(case["weights"]))
    assert float(loss.detach()) == pytest.approx(case["loss"])


# --------------------------------------------------------------------- arco.advantages, both phases
def trajectory(qid, reward, steps):
    """A stand-in for env.Trajectory: what arco.advantages reads."""
    return SimpleNamespace(example=SimpleNamespace(dataset="synthetic", id=qid), reward=reward,
                           steps=[SimpleNamespace(action=a, valid=ok) for a, ok in steps])


def phase_args(**kw):
    args = arco.Args(**{"alpha": 0.5, "bucket_fallback": False, "sparse_baseline": "group", **kw})
    return arco.resolve_args(args)


def test_sparse_advantages_group_and_batch_baselines_by_hand():
    # Two questions × 2 samples; the second sample of q1 has an invalid (non-final) step.
    trajs = [trajectory("q1", 1.0, [("search", True), ("finish", True)]),
             trajectory("q1", 0.0, [("invalid", False), ("finish", True)]),
             trajectory("q2", 0.0, [("finish", True)]),
             trajectory("q2", 0.0, [("search", True), ("finish", True)])]
    adv = arco.advantages(arco.CreditBatch(trajs, None, False, phase_args(sparse_baseline="group")))
    # q1's group mean 0.5: +0.5 / -0.5 on every valid step, 0 on the invalid one; q2's group mean 0: 0
    assert adv == arco.Advantages([[0.5, 0.5], [0.0, -0.5], [0.0], [0.0, 0.0]])       # nothing else to log
    A = arco.advantages(arco.CreditBatch(trajs, None, False, phase_args(sparse_baseline="batch"))).A
    # batch mean 1/4: 0.75 for the success, -0.25 for the failures
    approx_rows(A, [[0.75, 0.75], [0.0, -0.25], [-0.25], [-0.25, -0.25]])


def test_dense_advantages_by_hand():
    trajs = [trajectory("q1", 1.0, [("search", True), ("search", True), ("finish", True)]),
             trajectory("q2", 0.0, [("invalid", False), ("search", True), ("finish", True)])]
    s = torch.tensor([0.4, 0.4, 0.2, 4.6, 0.1, 0.3])
    # G: [1.0, 0.6, 0.2] and [5.0, 0.4, 0.3]; the invalid step (G = 5.0) enters no bucket:
    # search_1 (1.0 + 0.4)/2 = 0.7, search_2 0.6 alone, terminal (0.2 + 0.3)/2 = 0.25
    adv = arco.advantages(arco.CreditBatch(trajs, s, True, phase_args(alpha=1.0)))
    approx_rows(adv.A, [[0.3, 0.0, -0.05], [0.0, -0.3, 0.05]])
    approx_rows(adv.G, [[1.0, 0.6, 0.2], [5.0, 0.4, 0.3]])
    assert adv.buckets == [["search_1", "search_2", "terminal"], [None, "search_1", "terminal"]]
    assert adv.mean_G_per_bucket == pytest.approx({"search_1": 0.7, "search_2": 0.6, "terminal": 0.25})
    # the release's fallback: search_2's one step takes the mean G of the 5 valid steps, 2.5/5 = 0.5
    A = arco.advantages(arco.CreditBatch(trajs, s, True, phase_args(alpha=1.0, bucket_fallback=True))).A
    approx_rows(A, [[0.3, 0.1, -0.05], [0.0, -0.3, 0.05]])


def test_mixed_advantages_by_hand():
    """The study's mixed arm (study.mixed_advantages, not ARCO): the outcome advantage R(τ) − its group's mean added
    to every valid step's dense advantage α (G_t − Ḡ_b); invalid steps stay 0; sparse epochs as Algorithm 1."""
    trajs = [trajectory("q1", 1.0, [("search", True), ("search", True), ("finish", True)]),
             trajectory("q1", 0.0, [("invalid", False), ("search", True), ("finish", True)])]
    s = torch.tensor([0.4, 0.4, 0.2, 4.6, 0.1, 0.3])
    # dense part as in test_dense_advantages_by_hand: [0.3, 0.0, -0.05], [0, -0.3, 0.05]; outcome: q1's mean
    # 0.5, so +0.5 and -0.5
    batch = lambda dense, **kw: arco.CreditBatch(trajs, s, dense, phase_args(alpha=1.0, dense_samples=2, **kw))  # noqa
    approx_rows(study.mixed_advantages(batch(True)).A, [[0.8, 0.5, 0.45], [0.0, -0.8, -0.45]])
    approx_rows(study.mixed_advantages(batch(True, sparse_baseline="batch")).A,
                [[0.8, 0.5, 0.45], [0.0, -0.8, -0.45]])                    # one question: the batch mean is its mean
    assert study.mixed_advantages(batch(False)) == arco.advantages(batch(False))


def test_credit_stats_by_hand():
    """The per-update credit statistics of issue 41: mean s_t by step type and position over valid steps, the
    correlation of Σ_t s_t − R with the number of searches, and the one-step buckets with their advantage."""
    trajs = [trajectory("q1", 1.0, [("search", True), ("search", True), ("finish", True)]),
             trajectory("q2", 0.0, [("invalid", False), ("search", True), ("finish", True)]),
             trajectory("q3", 0.0, [("search", True), ("finish", True)])]
    s = torch.tensor([0.4, 0.4, 0.2, 4.6, 0.1, 0.3, 0.5, -0.5])
    adv = arco.advantages(arco.CreditBatch(trajs, s, True, phase_args(alpha=1.0)))
    stats = study.credit_stats(trajs, s, adv)
    assert stats["mean_s_by_step"] == pytest.approx({"search@1": 0.45, "search@2": 0.25, "finish@3": 0.25,
                                                     "finish@2": -0.5})
    # Σ s − R: 0.0, 5.0, 0.0 against 2, 1, 1 searches: r = −0.5 (by hand: deviations (−5/3, 10/3, −5/3) and
    # (2/3, −1/3, −1/3), covariance −50/9 / 2, sds 2.887 and 0.577)
    assert stats["corr_excess_searches"] == pytest.approx(-0.5, abs=1e-6)
    # search_2 holds one step (q1's second search): Eq. 4 gives it advantage 0
    assert stats["singleton_buckets"] == [{"bucket": "search_2", "action": "search", "A": 0.0}]
    assert study.credit_stats(trajs, None, arco.Advantages(adv.A)) == {}
    # Buckets of two are not singletons: here search_1, search_2 and the terminal bucket hold two steps each,
    # search_3 one (the first trajectory's third search)
    pair = [trajectory("a", 1.0, [("search", True)] * 3 + [("finish", True)]),
            trajectory("b", 0.0, [("search", True)] * 2 + [("finish", True)])]
    s2 = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0, 0.0, 0.0])
    adv2 = arco.advantages(arco.CreditBatch(pair, s2, True, phase_args(alpha=1.0)))
    assert study.credit_stats(pair, s2, adv2)["singleton_buckets"] == \
        [{"bucket": "search_3", "action": "search", "A": 0.0}]
    # The oracles' Σ_t s_t = R up to rounding: no correlation of rounding error with length
    s = torch.tensor([0.1, 0.2, 0.7, 0.3, 0.3, -0.6, 0.3, -0.3]) + 1e-7 * torch.arange(8.0)   # sums 1, 0, 0
    assert study.credit_stats(trajs, s, adv)["corr_excess_searches"] is None


# --------------------------------------------------------------------- the vectors of Eq. 2, 6, 7, the token KL, EM/F1
@pytest.mark.parametrize("case", V["token_kl"])
def test_token_kl(case):
    """Eq. 3's and Eq. 5's KL(p_θ ‖ p_ref), its value and its gradient with respect to the logits (what a port's KL
    loss must reproduce: verl's k2 has this expected gradient, its k1 none; PORTING.md)."""
    z = torch.tensor(case["logits"], dtype=torch.float64, requires_grad=True)
    kl = arco.token_kl(torch.log_softmax(z, -1), torch.log_softmax(t64(case["ref_logits"]), -1))
    kl.backward()
    assert float(kl.detach()) == pytest.approx(case["kl"]) and z.grad.tolist() == pytest.approx(case["grad_logits"])
    p, logp = torch.softmax(z.detach(), -1), torch.log_softmax(t64(case["ref_logits"]), -1)
    k2 = sum(float(p[a]) * float(torch.log(p[a]) - logp[a]) * torch.autograd.functional.jacobian(
        lambda x: torch.log_softmax(x, -1)[a], z.detach()) for a in range(len(p)))
    assert k2.tolist() == pytest.approx(case["grad_logits"])


@pytest.mark.parametrize("case", V["mean_pool"])
def test_mean_pool(case):
    approx_rows(rubric_model.mean_pool(t64(case["hidden"]), torch.tensor(case["mask"])).tolist(), case["pooled"])


@pytest.mark.parametrize("case", V["step_scores"])
def test_step_scores(case):
    """Eq. 2's s_t = mean_j d_t,j (the score head g_φ stands in as the identity: its weights are learned)."""
    out = rubric_model.RubricModel.step_scores(SimpleNamespace(head=lambda x: x), t64(case["d"]))
    assert out.s.tolist() == pytest.approx(case["s"])


@pytest.mark.parametrize("case", V["bucket_sums"])
def test_bucket_sums(case):
    assert arco.bucket_sums(case["G"], case["buckets"], case["valid"]) == (pytest.approx(case["sums"]), case["counts"])


@pytest.mark.parametrize("case", V["fit_scores"])
def test_fit_scores(case):
    assert warmup.fit_scores(case["raw"], case["K"]) == (pytest.approx(case["scores"]), case["issues"])


@pytest.mark.parametrize("case", V["project_scores"])
def test_project_scores(case):
    out = warmup.project_scores(case["scores"], case["R"])
    if case["projected"] is None:
        assert out is None
    else:
        approx_rows(out, case["projected"])
        assert sum(sum(r) / len(r) for r in out) == pytest.approx(case["R"])      # Σ_t mean_j ŝ_{t,j} = R


@pytest.mark.parametrize("case", V["rubric_sft_loss"])
def test_rubric_sft_loss(case):
    d = torch.tensor(case["d"], dtype=torch.float64, requires_grad=True)
    logp = torch.tensor(case["logprobs"], dtype=torch.float64, requires_grad=True)
    loss, text, score = warmup.rubric_sft_loss(d, t64(case["targets"]), logp, torch.tensor(case["mask"]).bool(),
                                               case["lam"], case["token_reduction"])
    loss.backward()
    assert (float(loss.detach()), float(text), float(score)) == pytest.approx((case["loss"], case["text"],
                                                                               case["score"]))
    approx_rows(d.grad.tolist(), case["grad_d"])
    approx_rows(logp.grad.tolist(), case["grad_logprobs"])


@pytest.mark.parametrize("case", V["em_f1"])
def test_em_f1(case):
    assert evaluate.normalize_answer(case["prediction"]) == case["normalized"]
    assert evaluate.exact_match(case["prediction"], case["gold"]) == case["em"]
    assert evaluate.f1_score(case["prediction"], case["gold"]) == pytest.approx(case["f1"])


# What computes, of the README's equation rows, and has no vector: the loops and updates that call the functions
# above (tested by hand in test_arco.py, test_warmup_sft.py), the learned score head, and what selects or plays.
NO_VECTOR = {"annotate", "RubricModel.annotate", "ScoreHead", "advantages", "policy_update", "rubric_update",
             "log_pi_temperature", "reference", "train_rubric_sft", "train_policy_sft", "filter_records",
             "policy_sft_examples", "answer_reward", "select_checkpoint", "dev_evaluation"}


def test_the_vectors_cover_every_equation_function_the_readme_names():
    """README: "tests/vectors.json holds hand-worked inputs, outputs and gradients of every equation function above"
    — every function of its equation rows has a section here (EM/F1's three share one), but those NO_VECTOR lists."""
    from test_paper_map import EQUATION, paper_table
    names = {n.split(".", 1)[1] for paper, ns in paper_table() if EQUATION.search(paper) for n in ns}
    have = set(V) | {"normalize_answer", "exact_match", "f1_score"} | {"RubricModel.step_scores"}
    assert names - have - NO_VECTOR == set(), sorted(names - have - NO_VECTOR)
