"""The one seam (issue 59): step scorers and advantage estimators registered by name (arco.register_scorer,
arco.register_estimator; verl's pattern), chosen by arco.Credit, and logging hooks apart from credit. On a scripted
batch, by hand: the advantages each registered estimator computes are the ones π's loss receives (Eq. 3's
policy_loss), for ARCO's own and the lab's mixed arm, dense and sparse; an unknown name is refused; a scorer in μ's
place builds no μ."""
import pytest
import torch

import arco
import env
from infra import models
from infra.fast import FAST
from lab import study, truth  # noqa: F401  (the lab registers its scorers and its estimator on import)


class Titles:
    """A retriever that returns the paragraph whose title the query names."""

    @staticmethod
    def retrieve(examples, queries):
        return [next(k for k, (title, _) in enumerate(ex.paragraphs) if title == q) for ex, q in zip(examples, queries)]


def played(example, actions):
    it = iter(actions)
    return env.rollout([example], lambda prompts, seeds=None: [next(it) for _ in prompts], Titles, max_searches=3,
                       obs_chars=300)[0]


def scripted_batch():
    """Two questions × two samples (the sparse composition, G = 2), played in the environment:
    q1: τ1 Search[hop 1] Finish[gold] (R 1), τ2 Finish[wrong] (R 0); q2: τ3 Search[distractor] Finish[wrong] (R 0),
    τ4 Search[hop 1] Finish[gold] (R 1)."""
    q1, q2 = env.synthetic_examples(2)
    hop = lambda q: q.paragraphs[q.supporting[0]][0]                                       # noqa: E731
    other = lambda q: next(t for k, (t, _) in enumerate(q.paragraphs) if k not in q.supporting)   # noqa: E731
    return [q1, q2], [played(q1, [f"Search[{hop(q1)}]", f"Finish[{q1.answer}]"]), played(q1, ["Finish[nobody]"]),
                      played(q2, [f"Search[{other(q2)}]", "Finish[nobody]"]),
                      played(q2, [f"Search[{hop(q2)}]", f"Finish[{q2.answer}]"])]


# By hand. The causal oracle's s_t (synthetic worlds: 2 hops): a search that finds a hop adds Φ 1/2, the last step
# closes Σ s = R: τ1 (1/2, 1/2), τ2 (0), τ3 (0, 0), τ4 (1/2, 1/2); G = reward-to-go: τ1 (1, 1/2), τ2 (0), τ3 (0, 0),
# τ4 (1, 1/2). Eq. 4's buckets: search_1 {1, 0, 1} → 2/3; terminal {1/2, 0, 0, 1/2} → 1/4; α = 1/2:
ARCO_DENSE = [1 / 6, 1 / 8, -1 / 8, -1 / 3, -1 / 8, 1 / 6, 1 / 8]
# Outcome advantages, each question's mean as the baseline (--sparse-baseline group): τ1 +1/2, τ2 −1/2, τ3 −1/2,
# τ4 +1/2 at every valid step; the mixed arm adds them to ARCO's dense ones.
OUTCOME = [1 / 2, 1 / 2, -1 / 2, -1 / 2, -1 / 2, 1 / 2, 1 / 2]
MIXED_DENSE = [a + o for a, o in zip(ARCO_DENSE, OUTCOME)]


@pytest.mark.parametrize("estimator, dense, want", [("arco", True, ARCO_DENSE), ("mixed", True, MIXED_DENSE),
                                                    ("arco", False, OUTCOME), ("mixed", False, OUTCOME)])
def test_each_registered_estimators_advantages_are_what_pis_loss_receives(tiny_dir, monkeypatch, estimator, dense,
                                                                         want):
    questions, trajs = scripted_batch()
    for t in trajs:
        assert [st.valid for st in t.steps] == [True] * len(t.steps)
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.0, 1.0]
    monkeypatch.setattr(arco, "sample_trajectories", lambda *a, **k: trajs)
    received = []
    real_loss = arco.policy_loss
    monkeypatch.setattr(arco, "policy_loss", lambda logp, adv, *a, **k: received.append(adv.tolist())
                        or real_loss(logp, adv, *a, **k))
    args = arco.resolve_args(arco.Args(dataset="synthetic", pass_tokens=100_000))
    torch.manual_seed(0)
    pi = models.add_lora(models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=FAST), dropout=0.0)
    opt = torch.optim.AdamW(models.trainable_parameters(pi.model), lr=1e-3)
    phase = {"dense": dense, "samples": 2, "kl_pi": 0.05}                  # λ_π > 0: every valid step is computed
    u = arco.iteration(pi, None, opt, None, questions, 2, 0, 1, phase, args, None,
                       arco.Credit(scorer="causal", estimator=estimator))
    assert [x for a in u.A for x in a] == pytest.approx(want)
    assert sorted(x for part in received for x in part) == pytest.approx(sorted(want))   # Eq. 3 got exactly these
    assert u.s.tolist() == pytest.approx([0.5, 0.5, 0.0, 0.0, 0.0, 0.5, 0.5])          # the causal scorer's s_t
    assert "rubric_loss" not in u.row                                                   # no μ


def test_unknown_names_are_refused_and_a_registered_scorer_builds_no_mu():
    with pytest.raises(env.DataError, match="no step scorer named 'oracle'"):
        arco.Credit(scorer="oracle").check()
    with pytest.raises(env.DataError, match="no advantage estimator named 'grpo'"):
        arco.Credit(estimator="grpo").check()
    arco.Credit().check()
    arco.Credit(scorer="causal", estimator="mixed").check()


def test_a_new_scheme_is_a_registered_function():
    """The README's example: a scorer of one's own, registered by name, and the run's Credit names it."""
    @arco.register_scorer("even-credit")
    def even(trajs):
        return torch.tensor([t.reward / len(t.steps) for t in trajs for _ in t.steps])     # Σ_t s_t = R
    try:
        _, trajs = scripted_batch()
        arco.Credit(scorer="even-credit").check()
        s = arco.SCORERS["even-credit"](trajs)
        args = arco.resolve_args(arco.Args(dataset="synthetic"))
        A, info = arco.ESTIMATORS["arco"](trajs, s, True, args)
        assert [round(sum(s[r.start:r.stop].tolist()), 6) for r in env.step_ranges(trajs)] == [1.0, 0.0, 0.0, 1.0]
        assert set(info) == {"G", "buckets", "mean_G_per_bucket"}
    finally:
        arco.SCORERS.pop("even-credit")


def test_the_studys_arms_name_their_scheme():
    """The fork study's arms (lab/study.py ARMS) reach Algorithm 1 as Credit names: the mixed arm is the "mixed"
    estimator with μ's scores, the oracles are scorers in μ's place, ARCO and outcome RL are Credit()."""
    assert study.arm_credit({"mixed": True}) == arco.Credit(scorer="mu", estimator="mixed")
    assert study.arm_credit({"credit": "causal"}) == arco.Credit(scorer="causal", estimator="arco")
    assert study.arm_credit({"credit": "projection"}) == arco.Credit(scorer="projection", estimator="arco")
    assert study.arm_credit({}) == arco.Credit()
    for arm, (_, own) in study.ARMS.items():
        options = study.split_settings(own(arco.Args()) if callable(own) else own)[1]
        study.arm_credit({**study.LAB_OPTIONS, **options}).check()
