"""ARCO, Algorithm 1: co-evolution of the policy π and the rubric model μ.

Paper: §3.2 (Eq. 3–5) and Appendix A (Algorithm 1). This file will hold the whole training
loop — rollouts, step rubrics and scores, the policy update, the rubric-model update and the
sparse→dense schedule. What is here so far are the equations of the two updates, each a small
named function with the paper's notation, tested against hand-worked numbers that also live in
`tests/vectors.json` (so a port to another framework can check itself against the same numbers):

    reward_to_go          Eq. 3      G_{τ,t} = Σ_{k≥t} s_{τ,k}
    step_buckets          Eq. 3–4    b(τ,t) ∈ {search_1, …, search_n, terminal}
    bucketed_advantages   Eq. 4      A_{τ,t} = α (G_{τ,t} − Ḡ_{B,b(τ,t)})
    outcome_advantages    Alg. 1, l. 31   A_τ = R(τ) − mean_B R
    policy_loss           Eq. 3      −(1/|B|) Σ_τ Σ_{t∈V_τ} A_{τ,t} log p_π(a_t|h_t) + λ_π L_KL
    decomposition_loss    Eq. 5      (1/|B|) Σ_τ (Σ_t s_t − R(τ))²
    rubric_loss           Eq. 5      decomposition_loss + β E_t[Σ_i KL(p_θ ‖ p_ref)_i]
"""
from __future__ import annotations

from typing import Sequence

import torch

TERMINAL = "terminal"


def reward_to_go(s: Sequence[float]) -> list[float]:
    """G_t = Σ_{k=t}^{T} s_k, inclusive of step t, for one trajectory (Eq. 3; Alg. 1, line 28).

    Every step's μ score counts, invalid steps included: μ scores every step (Alg. 1, lines 15–19).
    """
    out, acc = [], 0.0
    for x in reversed(s):
        acc += float(x)
        out.append(acc)
    return out[::-1]


def step_buckets(actions: Sequence[str], valid: Sequence[bool]) -> list[str | None]:
    """b(τ, t) for one trajectory (Eq. 3–4; Alg. 1, line 28).

    The last step is `terminal`, whether it is a Finish or a forced end at the horizon; any
    other valid step is a search, bucketed by its rank among the trajectory's valid searches
    (`search_1`, `search_2`, …). Invalid non-terminal steps get None: they are outside V_τ and
    enter no bucket mean.
    """
    buckets, rank = [], 0
    for t, (a, ok) in enumerate(zip(actions, valid)):
        if t == len(actions) - 1:
            buckets.append(TERMINAL)
        elif ok and a == "search":
            rank += 1
            buckets.append(f"search_{rank}")
        else:
            buckets.append(None)
    return buckets


def bucketed_advantages(G: Sequence[Sequence[float]], buckets: Sequence[Sequence[str | None]],
                        valid: Sequence[Sequence[bool]], alpha: float) -> list[list[float]]:
    """A_{τ,t} = α (G_{τ,t} − Ḡ_{B,b(τ,t)}) over a batch of trajectories (Eq. 4; Alg. 1, line 29).

    Ḡ_{B,b} is the mean of G over I_b = the valid steps of the batch in bucket b. Steps outside
    V_τ get advantage 0 (they are left out of the policy loss).
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for g_tau, b_tau, v_tau in zip(G, buckets, valid):
        for g, b, ok in zip(g_tau, b_tau, v_tau):
            if ok:
                sums[b] = sums.get(b, 0.0) + g
                counts[b] = counts.get(b, 0) + 1
    return [[alpha * (g - sums[b] / counts[b]) if ok else 0.0 for g, b, ok in zip(g_tau, b_tau, v_tau)]
            for g_tau, b_tau, v_tau in zip(G, buckets, valid)]


def outcome_advantages(R: Sequence[float]) -> list[float]:
    """A_τ = R(τ) − mean_B R, shared by every valid step of τ (sparse epochs; Alg. 1, line 31)."""
    mean = sum(R) / len(R)
    return [float(r) - mean for r in R]


def policy_loss(logp: torch.Tensor, advantages: torch.Tensor, n_trajectories: int,
                kl_tokens: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """Eq. 3: −(1/|B|) Σ_τ Σ_{t∈V_τ} A_{τ,t} log p_π(a_t|h_t) + λ_π L_KL^π.

    `logp` and `advantages` hold one entry per valid step of the batch (log p_π(a_t|h_t) is the
    sum of the action's token log-probs; α is already inside the advantages, Alg. 1 line 29).
    L_KL^π is the mean over all action tokens of the batch of the per-token KL(π ‖ π_ref)
    (our choice of reduction: the paper says "token-level KL" without one).
    """
    loss = -(advantages.detach() * logp).sum() / n_trajectories
    if kl_tokens is not None and kl_tokens.numel() and kl_coef:
        loss = loss + kl_coef * kl_tokens.mean()
    return loss


def decomposition_loss(s: torch.Tensor, trajectory: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """Eq. 5, first term: (1/|B|) Σ_τ (Σ_{t=1}^{T} s_t − R(τ))², over all steps of each trajectory.

    `s` holds the step scores of every step of the batch, `trajectory` the index of the
    trajectory each step belongs to, `R` one outcome per trajectory.
    """
    sums = torch.zeros_like(R, dtype=s.dtype).index_add(0, trajectory, s)
    return ((sums - R.to(s.dtype)) ** 2).mean()


def rubric_loss(s: torch.Tensor, trajectory: torch.Tensor, R: torch.Tensor,
                kl_per_step: torch.Tensor | None = None, beta: float = 0.0) -> torch.Tensor:
    """Eq. 5: decomposition_loss + β E_{(h_t,a_t)}[Σ_{i=1}^{|r_t|} KL(p_θ ‖ p_θref)_i].

    `kl_per_step` holds, for each step, the per-token KL summed over its rubric's tokens; the
    expectation over (h_t, a_t) is their mean.
    """
    loss = decomposition_loss(s, trajectory, R)
    if kl_per_step is not None and kl_per_step.numel() and beta:
        loss = loss + beta * kl_per_step.mean()
    return loss
