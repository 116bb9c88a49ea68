"""Eq. 3–5 and Alg. 1 line 31 against the hand-worked golden vectors in tests/vectors.json."""
import json
from pathlib import Path

import pytest
import torch

import arco

V = json.loads((Path(__file__).parent / "vectors.json").read_text())


@pytest.mark.parametrize("case", V["reward_to_go"])
def test_reward_to_go(case):
    assert arco.reward_to_go(case["s"]) == pytest.approx(case["G"])


@pytest.mark.parametrize("case", V["step_buckets"])
def test_step_buckets(case):
    assert arco.step_buckets(case["actions"], case["valid"]) == case["buckets"]


@pytest.mark.parametrize("case", V["bucketed_advantages"])
def test_bucketed_advantages(case):
    A = arco.bucketed_advantages(case["G"], case["buckets"], case["valid"], case["alpha"])
    assert [a == pytest.approx(e) for a, e in zip(A, case["A"])] == [True] * len(A)


def test_bucket_baseline_is_per_bucket_not_global():
    # Same G at search_1 and terminal in two buckets: a global mean would give nonzero advantages.
    A = arco.bucketed_advantages([[1.0, 0.0], [1.0, 0.0]], [["search_1", "terminal"]] * 2, [[True, True]] * 2, 1.0)
    assert A == [[0.0, 0.0], [0.0, 0.0]]


@pytest.mark.parametrize("case", V["outcome_advantages"])
def test_outcome_advantages(case):
    assert arco.outcome_advantages(case["R"]) == pytest.approx(case["A"])


@pytest.mark.parametrize("case", V["policy_loss"])
def test_policy_loss(case):
    logp = torch.tensor(case["logp"], dtype=torch.float64, requires_grad=True)
    loss = arco.policy_loss(logp, torch.tensor(case["advantages"], dtype=torch.float64), case["n_trajectories"],
                            torch.tensor(case["kl_tokens"], dtype=torch.float64), case["kl_coef"])
    loss.backward()
    assert float(loss.detach()) == pytest.approx(case["loss"])
    assert logp.grad.tolist() == pytest.approx(case["grad_logp"])


@pytest.mark.parametrize("case", V["decomposition_loss"])
def test_decomposition_loss(case):
    s = torch.tensor(case["s"], dtype=torch.float64, requires_grad=True)
    loss = arco.decomposition_loss(s, torch.tensor(case["trajectory"]), torch.tensor(case["R"], dtype=torch.float64))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(case["loss"])
    assert s.grad.tolist() == pytest.approx(case["grad_s"])


@pytest.mark.parametrize("case", V["rubric_loss"])
def test_rubric_loss(case):
    loss = arco.rubric_loss(torch.tensor(case["s"], dtype=torch.float64), torch.tensor(case["trajectory"]),
                            torch.tensor(case["R"], dtype=torch.float64),
                            torch.tensor(case["kl_per_step"], dtype=torch.float64), case["beta"])
    assert float(loss.detach()) == pytest.approx(case["loss"])
