"""The synthetic worlds' ground truth (the lab's): which step of a trajectory was useful (its supporting
paragraphs are known), and the oracles' step scores built on it — registered as step scorers (arco.register_scorer)
so that Algorithm 1 can run with them in μ's place: "causal" (potential-based: G_t = R − Φ(h_t), a baseline arm)
and "projection" (issue 33's oracle, which reads the trajectory's future). Not ARCO: analysis arms."""
from __future__ import annotations

from typing import Sequence

import torch

import arco
from evaluate import exact_match

def step_usefulness(trajectory, supporting: Sequence[int] | None = None) -> list[bool]:
    """Ground-truth credit labels, one per step: True = useful, False = useless (the AUC of μ's
    s_t for useful vs useless steps where the hops are known; the study's ground-truth arms).

    Useful: a valid Search whose retrieved paragraph is supporting and was not retrieved by an
    earlier step, or a valid Finish whose answer is EM-correct. Useless: an invalid step, a
    redundant Search (paragraph already retrieved), a wrong-entity Search (non-supporting
    paragraph), a wrong Finish.

    `trajectory` is an env.Trajectory, or its dict form (Trajectory.to_dict(), a row of a run's
    traces/*.jsonl). The dict holds no supporting indices: pass `supporting` (the example's
    `Example.supporting`), or a "supporting" key in the dict is used.
    """
    if not isinstance(trajectory, dict):  # an env.Trajectory
        if supporting is None:
            supporting = trajectory.example.supporting
        trajectory = trajectory.to_dict()
    if supporting is None:
        supporting = trajectory.get("supporting")
    if supporting is None:
        raise ValueError(f"step_usefulness: trajectory {trajectory.get('id')!r} carries no supporting "
                         f"paragraphs; pass supporting= (the example's Example.supporting)")
    support, seen, out = set(supporting), set(), []
    for st in trajectory["steps"]:
        useful = False
        if st.get("valid") and st.get("action") == "search" and st.get("retrieved") is not None:
            useful = st["retrieved"] in support and st["retrieved"] not in seen
            seen.add(st["retrieved"])
        elif st.get("valid") and st.get("action") == "finish":
            useful = exact_match(st.get("argument", ""), trajectory["gold"]) == 1.0
        out.append(useful)
    return out


def projection_credit(useful: Sequence[bool], R: float) -> list[float]:
    """The projection oracle's s_t for one trajectory (issue 33): +1 for a useful step, −1 for a useless one
    (step_usefulness), all shifted by one constant so that Σ_t s_t = R(τ), the decomposition Eq. 5 asks of μ.
    The shift depends on the whole trajectory (its length and outcome): an early step's score looks into the
    future, so this is no ceiling for a μ that sees only the prefix (issue 41)."""
    raw = [1.0 if u else -1.0 for u in useful]
    shift = (float(R) - sum(raw)) / len(raw)
    return [x + shift for x in raw]


def causal_credit(found: Sequence[bool], n_hops: int, R: float) -> list[float]:
    """The causal oracle's s_t for one trajectory (issue 41), potential-based: Φ(h_t) = the share of the chain's
    `n_hops` supporting paragraphs found before step t (found[k]: step k retrieved one not seen before), and
    s_t = Φ(h_{t+1}) − Φ(h_t) for every step but the last, which closes the sum: s_T = R − Φ(h_T). Then
    Σ_t s_t = R (Φ(h_1) = 0) and Eq. 3's return is G_t = R − Φ(h_t); a step's own score uses nothing after
    its own observation."""
    phi, s = 0.0, []
    for t, new in enumerate(found):
        if t == len(found) - 1:
            s.append(float(R) - phi)
        else:
            s.append(new / n_hops)                  # Φ(h_{t+1}) − Φ(h_t)
            phi += new / n_hops
    return s


def ground_truth_scores(traj, credit: str) -> list[float]:
    """The analysis arms' s_t of a trajectory of a world whose supporting paragraphs are known."""
    useful = step_usefulness(traj)
    if credit == "projection":
        return projection_credit(useful, traj.reward)
    found = [u and st.valid and st.action == "search" for u, st in zip(useful, traj.steps)]
    return causal_credit(found, len(traj.example.supporting), traj.reward)


@arco.register_scorer("causal")
def causal_scores(trajs) -> torch.Tensor:
    """The causal oracle's s_t of a batch (flat, trajectory order)."""
    return torch.tensor([x for t in trajs for x in ground_truth_scores(t, "causal")])


@arco.register_scorer("projection")
def projection_scores(trajs) -> torch.Tensor:
    """The projection oracle's s_t of a batch (flat, trajectory order)."""
    return torch.tensor([x for t in trajs for x in ground_truth_scores(t, "projection")])
