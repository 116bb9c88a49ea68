"""The one seam (issues 59, 65): step scorers and advantage estimators registered by name (arco.register_scorer,
arco.register_estimator; verl's pattern), chosen on the command line (--scorer, --estimator, a --plugin module that
registers them), and logging hooks apart from credit. On a scripted batch, by hand: the advantages each registered
estimator computes are the ones π's loss receives (Eq. 3's policy_loss), for ARCO's own and the lab's mixed arm,
dense and sparse; an unknown name and a name taken twice are refused; a scorer in μ's place builds no μ; a run keeps
its scheme through --resume (a kill after its first checkpoint) and refuses another, in one line."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import arco
import env
from infra import models, runs
from infra.fast import FAST
from lab import study, truth  # noqa: F401  (the lab registers its scorers and its estimator on import)
from test_arco import tiny_args

ROOT = Path(__file__).resolve().parents[1]


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
    args = arco.resolve_args(arco.Args(dataset="synthetic", pass_tokens=100_000, scorer="causal", estimator=estimator,
                                       plugin=["lab.study"]))
    arco.check_scheme(args)
    torch.manual_seed(0)
    pi = models.add_lora(models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=FAST), dropout=0.0)
    opt = torch.optim.AdamW(models.trainable_parameters(pi.model), lr=1e-3)
    phase = {"dense": dense, "samples": 2, "kl_pi": 0.05}                  # λ_π > 0: every valid step is computed
    u = arco.iteration(pi, None, opt, None, questions, 2, 0, 1, phase, args, None)
    assert [x for a in u.adv.A for x in a] == pytest.approx(want)
    assert sorted(x for part in received for x in part) == pytest.approx(sorted(want))   # Eq. 3 got exactly these
    assert u.s.tolist() == pytest.approx([0.5, 0.5, 0.0, 0.0, 0.0, 0.5, 0.5])          # the causal scorer's s_t
    assert "rubric_loss" not in u.row                                                   # no μ


def scheme(**kw) -> arco.Args:
    return arco.resolve_args(arco.Args(**{"scorer": "mu", "estimator": "arco", "plugin": [], **kw}))


def test_unknown_names_and_names_taken_twice_are_refused():
    with pytest.raises(env.DataError, match="no step scorer named 'oracle'"):
        arco.check_scheme(scheme(scorer="oracle"))
    with pytest.raises(env.DataError, match="no advantage estimator named 'grpo'"):
        arco.check_scheme(scheme(estimator="grpo"))
    arco.check_scheme(scheme())
    arco.check_scheme(scheme(scorer="causal", estimator="mixed", plugin=["lab.study"]))
    with pytest.raises(ValueError, match="an advantage estimator named 'mixed' is registered already") as e:
        arco.register_estimator("mixed")(lambda batch: None)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="a step scorer named 'mu' is registered already"):
        arco.register_scorer("mu")(lambda trajs: None)
    assert arco.ESTIMATORS["mixed"] is study.mixed_advantages                      # the first one kept


def test_a_new_scheme_is_a_registered_function():
    """The README's example: a scorer of one's own, registered by name, and the run's --scorer names it; an
    estimator receives a CreditBatch and returns Advantages."""
    @arco.register_scorer("even-credit")
    def even(trajs):
        return torch.tensor([t.reward / len(t.steps) for t in trajs for _ in t.steps])     # Σ_t s_t = R
    try:
        _, trajs = scripted_batch()
        arco.check_scheme(scheme(scorer="even-credit"))
        s = arco.SCORERS["even-credit"](trajs)
        adv = arco.ESTIMATORS["arco"](arco.CreditBatch(trajs, s, True, scheme(dataset="synthetic")))
        assert [round(sum(s[r.start:r.stop].tolist()), 6) for r in env.step_ranges(trajs)] == [1.0, 0.0, 0.0, 1.0]
        assert isinstance(adv, arco.Advantages) and adv.G is not None and set(adv.mean_G_per_bucket) == \
            {"search_1", "terminal"}
    finally:
        arco.SCORERS.pop("even-credit")


def test_the_studys_arms_name_their_scheme():
    """The fork study's arms (lab/study.py ARMS) reach Algorithm 1 as the seam's names, its own module the plugin:
    the mixed arm is the "mixed" estimator with μ's scores, the oracles are scorers in μ's place, ARCO and outcome
    RL are ARCO's scheme."""
    plugin = ["lab.study"]
    assert study.arm_credit({"mixed": True}) == {"scorer": "mu", "estimator": "mixed", "plugin": plugin}
    assert study.arm_credit({"credit": "causal"}) == {"scorer": "causal", "estimator": "arco", "plugin": plugin}
    assert study.arm_credit({"credit": "projection"}) == {"scorer": "projection", "estimator": "arco", "plugin": plugin}
    assert study.arm_credit({}) == {"scorer": "mu", "estimator": "arco", "plugin": plugin}
    for arm, (_, own) in study.ARMS.items():
        options = study.split_settings(own(arco.Args()) if callable(own) else own)[1]
        arco.check_scheme(scheme(**study.arm_credit({**study.LAB_OPTIONS, **options})))


def test_resume_keeps_the_runs_scheme_and_refuses_another(tmp_path):
    """keep_scheme: a flag left unset takes the run's recorded value (--resume) or its parent's (--init-from), else
    ARCO's; --resume under another scheme is one `error:` line."""
    run = tmp_path / "synthetic" / "r"
    run.mkdir(parents=True)
    (run / "args.json").write_text(json.dumps({"scorer": "mu", "estimator": "mixed", "plugin": ["lab.study"]}))
    args = arco.Args(dataset="synthetic", name="r", out_dir=str(tmp_path), resume=True)
    runs.keep_scheme(args)
    assert (args.scorer, args.estimator, args.plugin) == ("mu", "mixed", ["lab.study"])
    with pytest.raises(SystemExit) as e:
        runs.keep_scheme(arco.Args(dataset="synthetic", name="r", out_dir=str(tmp_path), resume=True, estimator="arco"))
    assert str(e.value).startswith("error: ") and "ran with --estimator mixed" in str(e.value) and "\n" not in str(e.value)
    child = arco.Args(dataset="synthetic", name="c", out_dir=str(tmp_path), init_from=str(run / "checkpoints" / "epoch_1"),
                      estimator="arco")
    runs.keep_scheme(child)                                            # a new run from it may choose its own
    assert (child.scorer, child.estimator, child.plugin) == ("mu", "arco", ["lab.study"])
    fresh = arco.Args(dataset="synthetic", name="n", out_dir=str(tmp_path))
    runs.keep_scheme(fresh)
    assert (fresh.scorer, fresh.estimator, fresh.plugin) == ("mu", "arco", [])


KILL_AT_THE_DENSE_EPOCH = """
import os, signal, sys
sys.path.insert(0, {root!r})
import arco
real = arco.policy_update
def killing(pi, optimizer, trajs, A, args, kl_pi, *rest, **kw):
    if kl_pi:                         # the dense epoch's first update (λ_π > 0 there only): after epoch 1's checkpoint
        os.kill(os.getpid(), signal.SIGKILL)
    return real(pi, optimizer, trajs, A, args, kl_pi, *rest, **kw)
arco.policy_update = killing
arco.main(sys.argv[1:])
"""


def test_a_plugin_run_killed_after_its_first_checkpoint_resumes_with_its_estimator(tiny_dir, tmp_path, monkeypatch):
    """`python arco.py --dataset synthetic --plugin lab.study --estimator mixed ...`, killed (SIGKILL) at its dense
    epoch's first update, after epoch 1's checkpoint; `--resume` without the three flags continues with the mixed
    estimator (every dense update asks it for its advantages; args.json keeps the scheme); `--resume --estimator
    arco` is refused in one line, before anything is written."""
    argv = tiny_args(tiny_dir, tmp_path, plugin="lab.study", estimator="mixed", name="a-run")
    killed = subprocess.run([sys.executable, "-c", KILL_AT_THE_DENSE_EPOCH.format(root=str(ROOT)), *argv],
                            cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert killed.returncode == -9, killed.stderr[-2000:]
    run = tmp_path / "synthetic" / "a-run"
    assert (run / "checkpoints" / "epoch_1").is_dir() and not (run / "checkpoints" / "epoch_2").exists()
    resume = [a for a in argv if a not in ("--plugin", "lab.study", "--estimator", "mixed")] + ["--resume"]
    assert "mixed" not in resume and "--plugin" not in resume
    before = (run / "metrics.jsonl").read_text()
    refused = subprocess.run([sys.executable, "arco.py", *resume, "--estimator", "arco"], cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "ran with --estimator mixed" in refused.stderr and (run / "metrics.jsonl").read_text() == before
    asked = []
    real = arco.ESTIMATORS["mixed"]
    monkeypatch.setitem(arco.ESTIMATORS, "mixed", lambda batch: asked.append(batch.dense) or real(batch))
    arco.main(resume)
    assert asked and all(asked)                              # epoch 2 (dense), batch by batch, by the mixed estimator
    recorded = json.loads((run / "args.json").read_text())
    assert (recorded["scorer"], recorded["estimator"], recorded["plugin"]) == ("mu", "mixed", ["lab.study"])
    assert (run / "checkpoints" / "epoch_2").is_dir()
