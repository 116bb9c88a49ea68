"""What Eq. 3–4's step credit does to the *expected* policy gradient, by exact enumeration of a toy.

The algebra. Σ_t E[A_t ∇log π(a_t|h_t)] is unchanged by subtracting any b(h_t) that depends on the
prefix only (E[∇log π(a|h) | h] = 0). If μ's scores decompose the outcome exactly, Σ_t s_t = R(τ), then
    G_t = Σ_{k≥t} s_k = R(τ) − Σ_{k<t} s_k,
and Σ_{k<t} s_k reads only the prefix h_t: it is a baseline, so Eq. 3 has outcome REINFORCE's expected
gradient and only its variance changes. What can move the expectation:
  (a) μ's decomposition error e(τ) = Σ_t s_t − R: Eq. 3 then follows μ's own verdict R̂ = R + e(τ);
  (b) Eq. 4's bucket mean Ḡ_b, which depends on the action's own type (search_k vs terminal);
  (c) scores that read the trajectory's future (the projection oracle's shift uses T and R).
The best a prefix-only μ obeying Eq. 5 can give is a value baseline: G_t = R − V^π(h_t).

The toy. Two hops; at state n (searches made so far) the policy searches with P = σ(θ_n), n = 0, 1; at
n = 2 Finish is forced (no parameter). Each search finds the next hop; finishing after k searches gives
R = 1 with probability p_k = 0, ½, 1. At θ = 0 (σ = ½): F (½), S F (¼), S S F (¼), and ∇_θ log π is
+½ on θ_n for a search at n, −½ for a finish at n. J = σ0(½(1−σ1) + σ1), so dJ = (3/16, 1/16).
The population is written as a batch (each outcome repeated 8·P times), so a batch mean over it —
including arco.bucketed_advantages' bucket means — is an exact expectation under π.
"""
from fractions import Fraction as Fr

import arco

SIG = Fr(1, 2)                          # σ(θ_0) = σ(θ_1) = σ(0)
P_SUCCESS = (Fr(0), Fr(1, 2), Fr(1))    # p_k: P(R = 1 | finish after k searches)
C = Fr(1, 4)                            # (iii): μ charges c per search
ZERO = (Fr(0), Fr(0))


def exact(x):
    """arco's functions return floats; every number here is a small-denominator rational."""
    return Fr(x).limit_denominator(10_000)


def outcomes():
    """Every (actions, R, probability) of the toy."""
    for k in range(3):
        p_tau = SIG ** k * ((1 - SIG) if k < 2 else 1)      # k searches, then a finish (forced at k = 2)
        for R in (1, 0):
            p = p_tau * (P_SUCCESS[k] if R else 1 - P_SUCCESS[k])
            if p:
                yield ("search",) * k + ("finish",), R, p


POP = [(a, R) for a, R, p in outcomes() for _ in range(int(p * 8))]   # the population, as a batch of 8


def grad_log_pi(actions):
    """∇_θ log π(a_t | h_t) at θ = 0, per step; step t is taken at state n = t."""
    out = []
    for n, a in enumerate(actions):
        g = [Fr(0), Fr(0)]
        if n < 2:
            g[n] = Fr(1, 2) if a == "search" else Fr(-1, 2)
        out.append(tuple(g))
    return out


def expected_gradient(A):
    """E[Σ_t A_t ∇log π(a_t|h_t)], A[i][t] the advantage of step t of POP[i] (each has weight 1/8)."""
    total = [Fr(0), Fr(0)]
    for (actions, _), A_tau in zip(POP, A):
        for a_t, g in zip(A_tau, grad_log_pi(actions)):
            total[0] += exact(a_t) * g[0] / 8
            total[1] += exact(a_t) * g[1] / 8
    return tuple(total)


def causal_scores(actions, R):
    """Φ(h_t) = hops found before t / 2; s_t = Φ(h_{t+1}) − Φ(h_t), the last step closes: s_T = R − Φ(h_T)."""
    phi = [Fr(min(t, 2), 2) for t in range(len(actions))]        # every step before t was a search
    return [phi[t + 1] - phi[t] for t in range(len(actions) - 1)] + [R - phi[-1]]


def causal_G():
    return [arco.reward_to_go(causal_scores(a, R)) for a, R in POP]


def test_enumeration_and_true_gradient():
    assert list(outcomes()) == [(("finish",), 0, Fr(1, 2)),
                                (("search", "finish"), 1, Fr(1, 8)), (("search", "finish"), 0, Fr(1, 8)),
                                (("search", "search", "finish"), 1, Fr(1, 4))]
    assert len(POP) == 8
    s0 = s1 = SIG                                     # dJ/dθ0 = σ0(1−σ0)(½(1−σ1) + σ1) = ¼·¾
    dJ = (s0 * (1 - s0) * (Fr(1, 2) * (1 - s1) + s1), s0 * s1 * (1 - s1) / 2)   # dJ/dθ1 = σ0·σ1(1−σ1)·½
    assert dJ == (Fr(3, 16), Fr(1, 16))
    # E[∇log π] = 0 (the score function): ½(−½, 0) + ¼(½, −½) + ¼(½, ½)
    assert expected_gradient([[1] * len(a) for a, _ in POP]) == ZERO


def test_i_outcome_advantage():
    """A_t = R. S F: ¼·½·(½, −½) = (1/16, −1/16); S S F: ¼·1·(½, ½) = (1/8, 1/8); F has R = 0."""
    R = [r for _, r in POP]
    assert expected_gradient([[r] * len(a) for a, r in POP]) == (Fr(3, 16), Fr(1, 16))
    A = arco.outcome_advantages(R)                    # R − mean over the population = R − E[R]
    assert [exact(x) for x in A] == [r - Fr(3, 8) for r in R]
    assert expected_gradient([[x] * len(a) for (a, _), x in zip(POP, A)]) == (Fr(3, 16), Fr(1, 16))
    for c in (Fr(1), Fr(-5, 2)):                      # any constant baseline: the same
        assert expected_gradient([[r - c] * len(a) for a, r in POP]) == (Fr(3, 16), Fr(1, 16))


def test_ii_exact_causal_decomposition_is_a_baseline():
    """G_t = R − Φ(h_t). F: (0); S F: (R, R − ½); S S F: (1, ½, 0). Per outcome:
    (S F, 1)·⅛: 1·(½,0) + ½·(0,−½) → (1/16, −1/32); (S F, 0)·⅛: −½·(0,−½) → (0, 1/32);
    (S S F)·¼: 1·(½,0) + ½·(0,½) → (1/8, 1/16). Sum (3/16, 1/16) = (i) exactly.
    (p_k = k/2 = Φ(h_T) here, so a G that lost the last step's score would keep this expectation: the
    rows of G are pinned as literals.)"""
    G = causal_G()
    assert [[exact(g) for g in row] for row in G] == ([[0]] * 4 + [[1, Fr(1, 2)], [0, Fr(-1, 2)]]
                                                      + [[1, Fr(1, 2), 0]] * 2)
    assert all(sum(causal_scores(a, R)) == R for a, R in POP)
    assert expected_gradient(G) == (Fr(3, 16), Fr(1, 16))


def test_iii_decomposition_error_moves_the_expectation():
    """Σ s = R + e(τ), e = −c·#searches on the last step, so G_t = R − Φ(h_t) + e(τ) for every t.
    Extra term E[e Σ_t ∇log π]: S F: ¼·(−¼)·(½, −½) = (−1/32, 1/32); S S F: ¼·(−½)·(½, ½) = (−1/16, −1/16).
    Total (3/16 − 3/32, 1/16 − 1/32) = (3/32, 1/32): the gradient of J − c·E[#searches] = J − c(σ0 + σ0σ1),
    i.e. of μ's verdict R̂, not of R."""
    G = []
    for a, R in POP:
        s = causal_scores(a, R)
        s[-1] -= C * a.count("search")
        G.append(arco.reward_to_go(s))
    assert expected_gradient(G) == (Fr(3, 32), Fr(1, 32))
    d_searches = (SIG * (1 - SIG) * (1 + SIG), SIG * SIG * (1 - SIG))          # ∇(σ0 + σ0σ1) = (3/8, 1/8)
    assert expected_gradient(G) == (Fr(3, 16) - C * d_searches[0], Fr(1, 16) - C * d_searches[1])


def test_iv_projection_oracle_reads_the_future():
    """l_t = +1 (search finding a new hop, finish with R = 1) else −1; s_t = l_t + (R − Σ l)/T.
    (S F, 1): l = (1, 1), s = (½, ½), G = (1, ½) — as causal; (S F, 0): l = (1, −1), s = (1, −1), G = (0, −1);
    (S S F): l = (1, 1, 1), s = (⅓, ⅓, ⅓), G = (1, ⅔, ⅓); F: s = G = (0).
    vs causal G only step 1 differs: (S F, 0) −½·(0, −½)·⅛ = (0, 1/32); (S S F) +⅙·(0, ½)·¼ = (0, 1/48).
    Total (3/16, 1/16 + 5/96) = (3/16, 11/96): θ_1 (search again or stop at n = 1) is pushed harder."""
    G = []
    for a, R in POP:
        l = [1 if (x == "search" or R == 1) else -1 for x in a]       # every search here finds a new hop
        shift = Fr(R - sum(l), len(a))
        s = [x + shift for x in l]
        assert sum(s) == R
        G.append(arco.reward_to_go(s))
    assert [exact(g) for g in G[6]] == [1, Fr(2, 3), Fr(1, 3)]
    assert expected_gradient(G) == (Fr(3, 16), Fr(11, 96))


def test_v_bucket_mean_vs_state_baseline():
    """Causal G (ii), two baselines. State-only b(n) = E[G_t | n_t = n]: n=0: E[R] = 3/8; n=1 (S F, S S F):
    ½·0 + ½·½ = ¼; n=2: 0. A prefix function: expected gradient (3/16, 1/16) = (i).
    Bucket (Eq. 4): search_1 = E[R | search at 0] = ¾; search_2 = ½ (only S S F); terminal pools the
    finishes at n = 0 (G = 0), 1 (E[G] = ½ − ½ = 0), 2 (G = 0): 0. An action-typed baseline b_a on θ_n gives
    d_n σ(1−σ)[(Q_S − b_S) − (Q_F − b_F)] (d_n = P(reach n)), so the bias is −d_n σ(1−σ)(b_S(n) − b_F(n)):
    θ_0: −1·¼·(¾ − 0) = −3/16; θ_1: −½·¼·(½ − 0) = −1/16.
    Both stop-or-search logits lose their whole gradient: (0, 0). (Here p_k = k/2 makes Φ the value of
    finishing, so the search buckets and the terminal bucket are Q(n, search) and Q(n, finish) exactly.)"""
    G = causal_G()
    states = {n: [exact(row[n]) for row in G if len(row) > n] for n in range(3)}
    b_state = {n: sum(g) / len(g) for n, g in states.items()}
    assert b_state == {0: Fr(3, 8), 1: Fr(1, 4), 2: 0}
    assert expected_gradient([[g - b_state[t] for t, g in enumerate(row)] for row in G]) == (Fr(3, 16), Fr(1, 16))

    buckets = [arco.step_buckets(a, [True] * len(a)) for a, _ in POP]
    assert buckets[0] == [arco.TERMINAL] and buckets[4] == ["search_1", arco.TERMINAL]
    assert buckets[6] == ["search_1", "search_2", arco.TERMINAL]
    A = arco.bucketed_advantages(G, buckets, [[True] * len(a) for a, _ in POP], alpha=1.0)
    b_bucket = {b: exact(g - x) for g_row, b_row, a_row in zip(G, buckets, A)          # baseline = G − A
                for g, b, x in zip(g_row, b_row, a_row)}
    assert b_bucket == {"search_1": Fr(3, 4), "search_2": Fr(1, 2), arco.TERMINAL: 0}
    d, v = (1, Fr(1, 2)), SIG * (1 - SIG)            # P(reach n), σ(1−σ)
    bias = tuple(-d[n] * v * (b_bucket[f"search_{n + 1}"] - b_bucket[arco.TERMINAL]) for n in range(2))
    assert bias == (Fr(-3, 16), Fr(-1, 16))
    assert expected_gradient(A) == (Fr(3, 16) + bias[0], Fr(1, 16) + bias[1]) == (0, 0)

    # Outcome-only scores s = (0, …, 0, R), G_t = R: search_1 = ¾, search_2 = 1, terminal = E[R] = 3/8.
    # Bias θ_0: −¼(¾ − 3/8) = −3/32; θ_1: −½·¼(1 − 3/8) = −5/64 → (3/32, −1/64): θ_1's sign flips.
    G_out = [arco.reward_to_go([0] * (len(a) - 1) + [R]) for a, R in POP]
    A_out = arco.bucketed_advantages(G_out, buckets, [[True] * len(a) for a, _ in POP], alpha=1.0)
    assert expected_gradient(A_out) == (Fr(3, 32), Fr(-1, 64))


def test_v_bucket_mean_on_a_hand_batch():
    """Batch F (R=0), S F (R=1), S S F (R=1), causal G: (0); (1, ½); (1, ½, 0). Bucket means: search_1 = 1,
    search_2 = ½ (a singleton: advantage 0), terminal = (0 + ½ + 0)/3 = ⅙. The finish at n = 1 gets ½ − ⅙ = ⅓:
    it is compared with the finishes at n = 0 and 2, not with the search taken at n = 1 (G = ½), against
    which — a state baseline, mean G at n = 1 = ½ — its advantage would be 0."""
    actions = [("finish",), ("search", "finish"), ("search", "search", "finish")]
    G = [arco.reward_to_go(causal_scores(a, R)) for a, R in zip(actions, (0, 1, 1))]
    assert G == [[0.0], [1.0, 0.5], [1.0, 0.5, 0.0]]
    buckets = [arco.step_buckets(a, [True] * len(a)) for a in actions]
    A = arco.bucketed_advantages(G, buckets, [[True] * len(a) for a in actions], alpha=1.0)
    assert [[exact(x) for x in row] for row in A] == [[Fr(-1, 6)], [0, Fr(1, 3)], [0, 0, Fr(-1, 6)]]
    assert G[1][1] - (G[1][1] + G[2][1]) / 2 == 0     # the same finish against the batch's steps at n = 1
