"""arco.py: the policy update against a hand computation on a tiny model, and Algorithm 1 end to
end (warmup → sparse epoch → dense epoch → evaluation → report), with --resume after a kill."""
import dataclasses
import json
import os

import pytest
import torch

import arco
import env
import warmup
from infra.settings import main_guard
from infra.engines import loading
import rubric_model as rm
from lab import study
from infra import models
from infra import passes
from infra.runs import update_line
from infra import settings
from lab import truth
from infra import engines
from infra.fast import FAST
from infra.passes import PLAIN


def scripted_batch():
    """Two synthetic questions played by a script: [Search[title], Finish[no]] and [Finish[answer]]."""
    examples = env.synthetic_examples(2, split="dev")
    title = examples[0].paragraphs[0][0]
    script = iter(["Search[" + title + "]", "Finish[no]", "Finish[" + examples[1].answer + "]"])
    return env.rollout(examples, lambda prompts: [next(script) for _ in prompts], TitleRetriever())


def perturb_lora(bb, seed=1, std=0.05):
    """Give the adapter's B matrices random values, so that π ≠ π_ref and the KL is not zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in bb.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def lora_state(bb):
    return {n: p.detach().clone() for n, p in bb.model.named_parameters() if p.requires_grad}


def step_logps(pi, trajs):
    """log π(a_t|h_t) of every step, the slow way (one sequence at a time, eval mode)."""
    out = []
    pi.model.eval()
    with torch.no_grad():
        for t in trajs:
            for st in t.steps:
                prompt, response = passes.chat_prompt_ids(pi.tokenizer, st.prompt), passes.encode_response(pi, st.output)
                logits = pi.model(torch.tensor([prompt + response])).logits[0].float()
                out.append(float(sum(torch.log_softmax(logits[len(prompt) - 1 + i], -1)[tok]
                                     for i, tok in enumerate(response))))
    return out


def test_policy_update_matches_a_hand_computation_with_the_kl_term(tiny_dir):
    """Eq. 3 on a tiny model with π ≠ π_ref: the loss policy_update reports equals
    −(1/|B|) Σ A log p(a|h) + λ_π (1/|B|) Σ_t mean_i KL(π‖π_ref)_i, recomputed here one sequence and one
    token at a time; with every A = 0 the gradient is the KL term's alone, and it is not zero."""
    pi = models.add_lora(models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=FAST), dropout=0.0)
    perturb_lora(pi)
    trajs = scripted_batch()
    A = [[0.5, -0.25], [1.0]]
    args = arco.resolve_args(arco.Args(token_reduction="mean"))
    params = models.trainable_parameters(pi.model)
    out = arco.policy_update(pi, torch.optim.SGD(params, lr=0.0), trajs, A, args, 0.05)

    expected_pg, expected_kl = 0.0, 0.0
    pi.model.eval()
    with torch.no_grad():
        for t, a_t in zip(trajs, A):
            for st, a in zip(t.steps, a_t):
                ids = passes.chat_prompt_ids(pi.tokenizer, st.prompt)
                response = passes.encode_response(pi, st.output)
                logits = pi.model(torch.tensor([ids + response])).logits[0].float()
                with pi.model.disable_adapter():
                    ref = pi.model(torch.tensor([ids + response])).logits[0].float()
                logp, kl = 0.0, []
                for i, tok in enumerate(response):
                    p = torch.log_softmax(logits[len(ids) - 1 + i], -1)
                    q = torch.log_softmax(ref[len(ids) - 1 + i], -1)
                    logp += float(p[tok])
                    kl.append(float((p.exp() * (p - q)).sum()))        # KL(π ‖ π_ref) at this token
                expected_pg += a * logp
                expected_kl += sum(kl) / len(kl)                         # the release's token mean per step
    expected = -expected_pg / 2 + 0.05 * expected_kl / 2                 # |B| = 2 trajectories
    assert expected_kl > 1e-4                                            # the perturbed adapter is not π_ref
    assert out["policy_steps"] == 3
    assert out["policy_loss"] == pytest.approx(expected, rel=1e-4)

    zero = [[0.0, 0.0], [0.0]]
    arco.policy_update(pi, torch.optim.SGD(params, lr=0.0), trajs, zero, args, 0.05)
    kl_grad = torch.cat([p.grad.flatten() for p in params])
    arco.policy_update(pi, torch.optim.SGD(params, lr=0.0), trajs, zero, args, 0.0)
    assert kl_grad.norm() > 1e-6 and all(p.grad is None or not p.grad.any() for p in params)


@pytest.mark.parametrize("engine", ["fast", "plain"])
def test_policy_update_kl_term_is_kl_of_pi_to_pi_ref_not_the_reverse(tiny_dir, engine):
    """With every A = 0, Eq. 3's loss is λ_π (1/|B|) Σ_t mean_i KL_i alone. A perturbation large enough that
    KL(π ‖ π_ref) and KL(π_ref ‖ π) differ by far more than the tolerance (the LM head scaled up, so that
    the tiny model's distributions are peaked): the reported loss is the first,
    and the reverse direction falls outside the tolerance."""
    pi = models.add_lora(models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=engines.ENGINES[engine]), dropout=0.0)
    perturb_lora(pi, std=2.0)
    with torch.no_grad():                  # peaked distributions: a random tiny model's are near uniform, where
        pi.model.get_output_embeddings().weight.mul_(40)      # the two directions agree to second order
    trajs = scripted_batch()
    args = arco.resolve_args(arco.Args(token_reduction="mean", engine=engine))
    out = arco.policy_update(pi, torch.optim.SGD(models.trainable_parameters(pi.model), lr=0.0), trajs,
                             [[0.0, 0.0], [0.0]], args, 1.0)
    forward = reverse = 0.0
    pi.model.eval()
    with torch.no_grad():
        for st in (st for t in trajs for st in t.steps):
            ids, response = passes.chat_prompt_ids(pi.tokenizer, st.prompt), passes.encode_response(pi, st.output)
            rows = slice(len(ids) - 1, len(ids) - 1 + len(response))
            p = torch.log_softmax(pi.model(torch.tensor([ids + response])).logits[0, rows].float(), -1)
            with pi.model.disable_adapter():
                q = torch.log_softmax(pi.model(torch.tensor([ids + response])).logits[0, rows].float(), -1)
            forward += float((p.exp() * (p - q)).sum(-1).mean()) / 2          # |B| = 2
            reverse += float((q.exp() * (q - p)).sum(-1).mean()) / 2
    assert out["policy_loss"] == pytest.approx(forward, rel=1e-4)
    assert abs(reverse - forward) > 0.1 * forward                        # the directions are told apart


def test_policy_update_skips_zero_advantage_steps_only_when_nothing_changes(tiny_dir, monkeypatch):
    """With λ_π = 0, steps whose advantage is 0 are not computed, and the AdamW step (moments, weight
    decay) lands where computing them lands: here against λ_π = 1e-30, which computes every step and
    whose KL term vanishes next to Eq. 3's. With every A = 0 the step still happens (zero gradients)."""
    trajs = scripted_batch()
    args = arco.resolve_args(arco.Args(token_reduction="mean"))
    computed = []
    real = arco.training_passes
    monkeypatch.setattr(arco, "training_passes", lambda bb, seqs, *a, **kw: computed.append(len(seqs)) or real(bb, seqs, *a, **kw))
    after = {}
    for A, kl in (([[0.5, 0.0], [0.0]], 0.0), ([[0.5, 0.0], [0.0]], 1e-30), ([[0.0, 0.0], [0.0]], 0.0)):
        torch.manual_seed(0)
        pi = models.add_lora(models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=FAST), dropout=0.0)
        perturb_lora(pi)
        opt = torch.optim.AdamW(models.trainable_parameters(pi.model), lr=1e-2, weight_decay=0.01)
        computed.clear()
        before = lora_state(pi)
        out = arco.policy_update(pi, opt, trajs, A, args, kl)
        assert out["policy_steps"] == 3                                  # V_τ, computed or not
        after[(str(A), kl)] = (lora_state(pi), sum(computed), out["policy_loss"], before)
    skipped, full, none = after.values()
    assert (skipped[1], full[1], none[1]) == (1, 3, 0)
    assert skipped[2] == pytest.approx(full[2], rel=1e-6) and none[2] == 0.0
    for name, value in skipped[0].items():
        torch.testing.assert_close(value, full[0][name], rtol=1e-5, atol=1e-7)
    for name, value in none[0].items():     # zero gradients: AdamW moves by its weight decay alone
        torch.testing.assert_close(value, none[3][name] * (1 - 1e-2 * 0.01), rtol=1e-6, atol=1e-9)


def test_policy_update_raises_actions_with_positive_advantage_and_lowers_negative_ones(tiny_dir):
    """One real step (SGD, lr > 0, λ_π = 0.05): the adapter moves; log π of the action with A > 0 rises,
    that of the action with A < 0 falls (each from the same starting adapter)."""
    pi = models.add_lora(models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=FAST), dropout=0.0)
    trajs = scripted_batch()
    args = arco.resolve_args(arco.Args())
    start, before = lora_state(pi), step_logps(pi, trajs)
    for which, sign in ((0, 1.0), (2, -1.0)):                    # Search[title] up, Finish[answer] down
        pi.model.load_state_dict(start, strict=False)
        A = [[sign if which == 0 else 0.0, 0.0], [sign if which == 2 else 0.0]]
        arco.policy_update(pi, torch.optim.SGD(models.trainable_parameters(pi.model), lr=0.5), trajs, A, args, 0.05)
        moved = lora_state(pi)
        assert any(not torch.equal(moved[n], start[n]) for n in start)
        after = step_logps(pi, trajs)
        assert (after[which] - before[which]) * sign > 1e-4, (which, before, after)


def test_rubric_update_moves_lora_and_head_and_lowers_the_decomposition_error(tiny_dir):
    """One Eq. 5 step on a fixed batch: recomputing each step's activations in the backward (gradient
    checkpointing) gives the same loss and gradients as keeping them; the loss is Eq. 5 by hand; a real
    step moves μ's LoRA and its score head and lowers Σ_τ (Σ_t s_t − R)²."""
    bb = models.add_lora(models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=FAST), dropout=0.0)
    perturb_lora(bb)
    torch.manual_seed(0)
    mu = rm.RubricModel(bb, k=3, examples=0)
    trajs = scripted_batch()                                  # both failures first: class weights 1/2 each
    contexts = [c for t in trajs for c in rm.contexts_from_trajectory(t)]
    rubrics = [mu.rubric_from_criteria([f"criterion {i} of step", "b", "c"]) for i in range(len(contexts))]
    groups = mu.parameter_groups(0.0, 0.0)

    def grads(pass_tokens):
        args = arco.resolve_args(arco.Args(pass_tokens=pass_tokens, kl_mu=0.05, class_balance=True))
        out = arco.rubric_update(mu, torch.optim.SGD(groups, lr=0.0), trajs, contexts, rubrics, args)
        return out, [p.grad.clone() for g in groups for p in g["params"]]
    whole, g_whole = grads(10 ** 6)
    split, g_split = grads(1)                                 # every step its own part, recomputed in the backward
    # float32 sums in another order: equal to 1e-4 relative (loss), 1e-6 + 1e-4 relative (gradients)
    assert split["rubric_loss"] == pytest.approx(whole["rubric_loss"], rel=1e-4) and whole["kl_mu"] > 0
    # Eq. 5 as the release scales it (--class-balance, the paper preset), by hand: class weights of R = (0, 0) are 2 / (2 · 2) = 1/2 each; each
    # step's KL is the mean over its rubric tokens; the steps' KLs are summed and divided by |B| = 2.
    with torch.no_grad():
        s = mu.score(contexts, rubrics).s.tolist()
        bb.engine = PLAIN                                   # each step's KL by one ordinary pass per sequence
        kl = list(passes.training_passes(bb, mu.scoring_ids(contexts, rubrics), [len(r.token_ids) for r in rubrics],
                                         budget=None, kl=arco.token_kl, reference=arco.reference))
        bb.engine = FAST
    step_kl = [float(p.kl[0][p.mask[0]].mean()) for p in kl]
    n0 = len(trajs[0].steps)
    decomposition = (sum(s[:n0]) ** 2 + sum(s[n0:]) ** 2) / 2
    assert whole["rubric_loss"] == pytest.approx(0.5 * decomposition + 0.05 * sum(step_kl) / 2, rel=1e-4)
    assert whole["decomposition_mse"] == pytest.approx(decomposition, rel=1e-4)        # logged unweighted

    trajs[0].reward = 1.0                                     # one success, one failure
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(g_whole, g_split))

    def error():
        with torch.no_grad():
            s = mu.score(contexts, rubrics).s
        sums = [float(s[:2].sum()), float(s[2:].sum())]
        return sum((x - t.reward) ** 2 for x, t in zip(sums, trajs))
    lora0, head0, err0 = lora_state(bb), {n: p.clone() for n, p in mu.head.named_parameters()}, error()
    opt = torch.optim.AdamW(mu.parameter_groups(1e-3, 1e-2), weight_decay=0.0)
    arco.rubric_update(mu, opt, trajs, contexts, rubrics, arco.resolve_args(arco.Args()))
    assert any(not torch.equal(p, lora0[n]) for n, p in lora_state(bb).items())
    assert any(not torch.equal(p, head0[n]) for n, p in mu.head.named_parameters())
    assert error() < err0


def test_one_mu_update_at_the_cpu_presets_rates_lowers_the_decomposition_error(tiny_dir, monkeypatch):
    """The `cpu` preset's μ rates and Eq. 5 weights (README, "the default run"): one step of rubric_update lowers
    the decomposition error of its own batch, and the error it logs after the step is the one recomputed here;
    with --no-mu-error-after that forward is not run and the log has no "after"."""
    bb = models.add_lora(models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=FAST), dropout=0.0)
    perturb_lora(bb)
    torch.manual_seed(0)
    mu = rm.RubricModel(bb, k=3, examples=0, rubric_format="slots")
    with torch.no_grad():
        mu.head.net[-1].bias.fill_(0.3)                        # every step scored high: the sums overshoot R
    trajs = scripted_batch()
    trajs[0].reward = 1.0
    contexts = [c for t in trajs for c in rm.contexts_from_trajectory(t)]
    rubrics = [mu.rubric_from_criteria([f"criterion {i}", "b", "c"]) for i in range(len(contexts))]
    args = arco.resolve_args(arco.Args())
    assert args.preset == "cpu"

    def error():
        with torch.no_grad():
            s = mu.score(contexts, rubrics).s
        return (float(s[:2].sum() - 1.0) ** 2 + float(s[2:].sum()) ** 2) / 2
    before = error()
    out = arco.rubric_update(mu, torch.optim.AdamW(mu.parameter_groups(args.mu_lr, args.head_lr),
                                                   weight_decay=args.weight_decay), trajs, contexts, rubrics, args)
    assert out["decomposition_mse"] == pytest.approx(before, rel=1e-4)
    assert out["decomposition_mse_after"] == pytest.approx(error(), rel=1e-4) and error() < before
    passes_run = []                                           # --no-mu-error-after: no after-step forward, no key
    real = arco.training_passes
    monkeypatch.setattr(arco, "training_passes", lambda *a, **k: passes_run.append(1) or real(*a, **k))
    out = arco.rubric_update(mu, torch.optim.SGD(mu.parameter_groups(0.0, 0.0), lr=0.0), trajs, contexts, rubrics,
                             arco.resolve_args(arco.Args(mu_error_after=False)))
    assert len(passes_run) == 1 and "decomposition_mse_after" not in out and "seconds_mu_after" not in out
    line = update_line({**out, "mean_s": 0.0, "mean_R": 0.5, "policy_loss": 0.0, "kl_pi": 0.0, "invalid_rate": 0.0}, 1, 0)
    assert "dec-MSE" in line and " → " not in line


class TitleRetriever:
    def retrieve(self, examples, queries):
        return [next((i for i, (t, _) in enumerate(ex.paragraphs) if t in q), 0) for ex, q in zip(examples, queries)]


def tiny_args(tiny_dir, out, **kw):
    argv = ["--dataset", "synthetic", "--model", str(tiny_dir), "--train-size", "4", "--eval-size", "3",
            "--epochs", "2", "--sparse-epochs", "1", "--batch-size", "4", "--group-size", "2",
            "--max-new-tokens-pi", "8", "--max-new-tokens-mu", "12", "--out-dir", str(out), "--sft-epochs-pi", "1",
            "--sft-epochs-mu", "1", "--warmup-samples", "2", "--device", "cpu",
            "--sft-batch-pi", "16"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return argv


RETRIEVERS_MADE: list = []      # the Retrievers tiny_run made


@pytest.fixture(scope="module")
def tiny_run(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")

    class Counting(env.Retriever):
        def __init__(self, *a, **kw):
            RETRIEVERS_MADE.append(self)
            super().__init__(*a, **kw)
    env._RETRIEVERS.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(env, "Retriever", Counting)
        arco.main(tiny_args(tiny_dir, out))
    env._RETRIEVERS.clear()
    return out


def test_the_warmup_and_the_run_share_one_retriever(tiny_run):
    """`make run` runs the warmup and Algorithm 1 in one process: one Retriever (and its paragraph cache) serves
    both, so no question's paragraphs are encoded twice (the dev questions' were: issue 43)."""
    assert len(RETRIEVERS_MADE) == 1


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_whole_loop_leaves_a_readable_run(tiny_run):
    run = tiny_run / "synthetic" / "arco"
    assert (tiny_run / "synthetic" / "warmup" / "pi_sft" / "config.json").is_file()   # warmup ran first
    args = json.loads((run / "args.json").read_text())
    assert args["epochs"] == 2 and args["preset"] == "cpu" and args["reward"] == "arco"
    rows = read_jsonl(run / "metrics.jsonl")
    evals = [r for r in rows if r["kind"] == "eval"]
    updates = [r for r in rows if r["kind"] == "update"]
    assert [r["epoch"] for r in evals] == [0, 2]             # SFT only, then the epochs selection reads
    # 4 trajectories per update: sparse 2 questions × G = 2 (two updates), dense 4 questions × 1 (one)
    assert [(r["epoch"], r["dense"], r["questions"], r["trajectories"]) for r in updates] == \
        [(1, False, 2, 4), (1, False, 2, 4), (2, True, 4, 4)]
    for r in updates:                                          # the logged numbers are the traces' numbers
        batch = [t for t in read_jsonl(run / "traces" / f"epoch_{r['epoch']}.jsonl") if t["batch"] == r["batch"]]
        steps = [st for t in batch for st in t["steps"]]
        assert r["mean_R"] == pytest.approx(sum(t["reward"] for t in batch) / len(batch))
        assert r["invalid_rate"] == pytest.approx(sum(not st["valid"] for st in steps) / len(steps))
        assert r["mean_s"] == pytest.approx(sum(st["s"] for st in steps) / len(steps), abs=1e-4)
        assert r["policy_steps"] == sum(st["valid"] for st in steps)
        assert len({t["id"] for t in batch}) == r["questions"]
        assert "policy_loss" in r and "rubric_loss" in r           # one π and one μ update per batch, every epoch
        # Eq. 5's decomposition term over every step of a trajectory, invalid ones included (the tiny π writes mostly
        # invalid steps: left out, the term would be near mean R²); the update's s_t are its training pass's (LoRA
        # dropout on), the trace's the annotation's: 5% apart at most
        assert r["decomposition_mse"] == pytest.approx(
            sum((sum(st["s"] for st in t["steps"]) - t["reward"]) ** 2 for t in batch) / len(batch), rel=0.05)
    dense_trace = read_jsonl(run / "traces" / "epoch_2.jsonl")
    assert len(dense_trace) == 4                               # 4 questions × 1
    for row in dense_trace:
        G = [st["G"] for st in row["steps"]]
        s = [st["s"] for st in row["steps"]]
        assert G == pytest.approx(arco.reward_to_go(s), abs=1e-3)   # traces hold Eq. 3 as computed
        assert all(len(st["d"]) == 3 and len(st["criteria"]) == 3 and "A" in st for st in row["steps"])
        assert row["steps"][-1]["bucket"] == "terminal"
    assert (run / "checkpoints" / "epoch_2" / "pi" / "config.json").is_file()
    sel = json.loads((run / "selection.json").read_text())
    assert sel["selected_epoch"] == 2                           # the only post-transition epoch
    report = (run / "report.md").read_text()
    assert "| 0 | SFT only |" in report and "| 2 | dense |" in report and "Selected" in report
    if os.path.exists("/proc/self/statm"):                    # the resident memory by phase (RESULTS' profile)
        memory = {r["phase"]: r for r in json.loads((run / "memory.json").read_text())}
        assert {"rollout", "mu_annotate", "pi_update", "mu_update", "dev evaluation"} <= memory.keys()
        assert all(0 < r["end_gib"] <= r["peak_gib"] + 0.05 and r["runs"] >= 1 for r in memory.values()
                   if r["phase"] != "between phases"), memory
        assert memory["pi_update"]["runs"] >= 3 and memory["mu_update"]["runs"] >= 3     # (one process: all runs)


def numbers(rows):
    """metrics.jsonl without what a clock or the machine decides (seconds, peak memory)."""
    return [{k: v for k, v in r.items() if not k.startswith("seconds") and k != "peak_rss_gib"} for r in rows]


def first_difference(got, before):
    """Where two metrics.jsonl number lists first differ (floats: rel 1e-4), or None."""
    if len(got) != len(before):
        return f"{len(got)} rows against {len(before)}"
    for g, b in zip(got, before):
        if g.keys() != b.keys():
            return f"{b['kind']} {b['epoch']}: keys {sorted(g)} against {sorted(b)}"
        for k, v in b.items():
            same = g[k] == pytest.approx(v, rel=1e-4, abs=1e-6) if isinstance(v, (float, dict)) else g[k] == v
            if not same:                                  # (a dict: mean G per bucket)
                return f"{b['kind']} epoch {b['epoch']} batch {b.get('batch')}: {k} = {g[k]} against {v}"
    return None


def test_the_whole_loop_writes_the_same_numbers_on_both_engines(tiny_run, tiny_dir):
    """The tiny loop (two epochs, three updates, evaluations) with --engine plain against --engine fast, both
    run here on the warmup of tiny_run, LoRA dropout 0 (each engine draws its own dropout masks otherwise),
    autocast off: metrics.jsonl's numbers within rel 1e-4 (float32 sums in another order, through three
    updates and the sampled rollouts they lead to). The engines generate too, so the rollouts are sampled with
    --sampling trajectory: each trajectory draws from its own seeded stream, which the plain engine's
    one-prompt-at-a-time loop and the fast engine's batch draw alike (--sampling batch draws once over the
    fast engine's whole generation batch, which a loop over single prompts cannot repeat)."""
    warm = tiny_run / "synthetic" / "warmup"
    rows = {}
    for engine in ("fast", "plain"):
        arco.main(tiny_args(tiny_dir, tiny_run, name=f"engine-{engine}", warmup_dir=warm, engine=engine,
                            lora_dropout=0, autocast="off", sampling="trajectory"))
        rows[engine] = numbers(read_jsonl(tiny_run / "synthetic" / f"engine-{engine}" / "metrics.jsonl"))
    assert len(rows["fast"]) == 5 and first_difference(rows["plain"], rows["fast"]) is None


@pytest.mark.parametrize("credit", ["projection", "causal"])
def test_the_ground_truth_arms_score_steps_by_their_ground_truth(tiny_run, tiny_dir, credit):
    """The study's oracle arms through the core's one seam (--scorer, --plugin: study.arm_credit(...)), issues
    33 and 41): no μ is loaded or trained, and the dense epoch's s_t are truth.ground_truth_scores of each step (its
    labels from the trace row), Σ_t s_t = R(τ); for the causal oracle G_t = R − Φ(h_t), Φ the share of the
    chain's paragraphs found before step t."""
    warm = tiny_run / "synthetic" / "warmup"
    args = arco.resolve_args(settings.parse_args(arco.Args, tiny_args(tiny_dir, tiny_run, warmup_dir=warm,
                                                                    name=f"{credit}-oracle")))
    run = arco.run(dataclasses.replace(args, **study.arm_credit({"credit": credit})))
    assert run == tiny_run / "synthetic" / f"{credit}-oracle"
    assert not (run / "checkpoints" / "epoch_2" / "mu").exists()
    updates = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "update"]
    assert [r["dense"] for r in updates] == [False, False, True] and "rubric_loss" not in updates[-1]
    for row in read_jsonl(run / "traces" / "epoch_2.jsonl"):
        s = [st["s"] for st in row["steps"]]
        useful = truth.step_usefulness(row)                              # the labels, from the trace row
        if credit == "projection":
            assert s == pytest.approx(truth.projection_credit(useful, row["reward"]), abs=1e-4)
        else:
            found = [u and st["valid"] and st["action"] == "search" for u, st in zip(useful, row["steps"])]
            phi = [sum(found[:t]) / 2 for t in range(len(found))]           # the synthetic worlds: 2 hops
            assert [st["G"] for st in row["steps"]] == pytest.approx([row["reward"] - p for p in phi], abs=1e-4)
        assert sum(s) == pytest.approx(row["reward"], abs=1e-3)
        assert [st["G"] for st in row["steps"]] == pytest.approx(arco.reward_to_go(s), abs=1e-3)


def test_learning_rate_and_kl_switch_at_the_transition(tiny_run, tiny_dir, monkeypatch):
    """Sparse epochs update π with --pi-lr-sparse and λ_π = --kl-pi-sparse, dense ones with the dense
    values (the cpu preset's 2e-4 / 0 and 1e-4 / 0.05); AdamW with the release's weight decay."""
    seen = []
    real = arco.policy_update

    def spy(pi, optimizer, trajs, A, args, kl_pi, workers):
        group = optimizer.param_groups[0]
        seen.append((group["lr"], kl_pi, group["weight_decay"], len(trajs)))
        return real(pi, optimizer, trajs, A, args, kl_pi, workers)
    monkeypatch.setattr(arco, "policy_update", spy)
    arco.main(tiny_args(tiny_dir, tiny_run, name="lr-switch", warmup_dir=tiny_run / "synthetic" / "warmup"))
    assert seen == [(2e-4, 0.0, 0.01, 4), (2e-4, 0.0, 0.01, 4), (1e-4, 0.05, 0.01, 4)]


def test_the_loop_benchmark_times_one_dense_iteration_on_a_saved_batch(tiny_run, tiny_dir):
    """`benchmark.py loop` (arco.py's flags): every phase timed beside its raw rate, on the oracle's
    batch that the first call saves and a later call reads back unchanged."""
    from lab import benchmark
    argv = ["loop"] + tiny_args(tiny_dir, tiny_run, warmup_dir=tiny_run / "synthetic" / "warmup")
    benchmark.main(argv)
    bench = tiny_run / "synthetic" / "benchmark"
    saved = (bench / "batch.jsonl").read_bytes()
    result = json.loads(sorted(bench.glob("loop-*.json"))[-1].read_text())
    assert result["trajectories"] == 4 and result["steps"] >= 4             # --batch-size 4, dense: 4 questions × 1
    assert set(result["phases"]) == {"π rollout", "μ rubrics + scores", "π update", "μ update"}
    assert all(p["seconds"] > 0 and p["raw_seconds"] > 0 and p["tokens"] > 0 for p in result["phases"].values())
    assert result["trajectories_per_minute"] == pytest.approx(60 * 4 / result["seconds"])
    a = arco.resolve_args(arco.parse_args(arco.Args, argv[1:]))
    examples = env.training_questions(a.dataset, a.data_dir or None, a.train_size, a.seed)
    trajs = benchmark.load_batch(bench / "batch.jsonl", examples)
    benchmark.save_batch(tiny_run / "again.jsonl", trajs)
    assert (tiny_run / "again.jsonl").read_bytes() == saved                  # the batch reads back exactly


def test_a_warmup_made_with_another_retriever_is_refused(tiny_run, tiny_dir):
    with pytest.raises(SystemExit, match="retriever all-MiniLM-L6-v2 .*asks for some/other-encoder"):
        arco.main(tiny_args(tiny_dir, tiny_run, name="other-retriever", retriever="some/other-encoder"))
    args = json.loads((tiny_run / "synthetic" / "other-retriever" / "args.json").read_text())
    assert (args["retriever"], args["retriever_pooling"]) == ("some/other-encoder", "mean")


def test_outcome_baseline_has_no_mu(tiny_run, tiny_dir):
    arco.main(tiny_args(tiny_dir, tiny_run, reward="outcome", epochs=1,
                        warmup_dir=tiny_run / "synthetic" / "warmup"))
    run = tiny_run / "synthetic" / "outcome"
    updates = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "update"]
    assert updates and all("decomposition_mse" not in r and not r["dense"] for r in updates)
    assert not (run / "checkpoints" / "epoch_1" / "mu").exists()


def test_an_ablation_reuses_the_warmup_and_trains_only_its_own_mu(tiny_run, tiny_dir, monkeypatch):
    """Table 2's w/o Rubric: the same collection and π SFT as ARCO, a μ of its own (mu_sft-none)."""
    import warmup
    monkeypatch.setattr(warmup, "train_policy_sft", lambda *a, **kw: pytest.fail("π SFT ran a second time"))
    arco.main(tiny_args(tiny_dir, tiny_run, rubric="none", epochs=1))
    warm = tiny_run / "synthetic" / "warmup"
    assert rm.RubricModel.load(warm / "mu_sft-none", device="cpu", engine=FAST).rubric_mode == "none"
    assert rm.RubricModel.load(warm / "mu_sft", device="cpu", engine=FAST).rubric_mode == "adaptive"
    assert set(json.loads((warm / "metrics.json").read_text())["mu"]) == {"mu_sft", "mu_sft-none"}
    updates = [r for r in read_jsonl(tiny_run / "synthetic" / "arco-none" / "metrics.jsonl") if r["kind"] == "update"]
    assert updates and all(r["kl_mu"] == 0 and r["decomposition_mse"] >= 0 for r in updates)


def test_a_k_ablation_collects_its_own_annotations_and_shares_pi_sft(tiny_run, tiny_dir, monkeypatch):
    """RQ4's K = 5 beside the K = 3 run: its K-criteria collection goes to records-k5.jsonl (the K = 3
    records untouched), its μ to mu_sft-k5/, and π SFT is the folder's one."""
    import warmup
    warm = tiny_run / "synthetic" / "warmup"
    before = (warm / "records.jsonl").read_bytes()
    monkeypatch.setattr(warmup, "train_policy_sft", lambda *a, **kw: pytest.fail("π SFT ran a second time"))
    arco.main(tiny_args(tiny_dir, tiny_run, k=5, epochs=1, max_new_tokens_mu=20))
    assert (warm / "records.jsonl").read_bytes() == before
    records = read_jsonl(warm / "records-k5.jsonl")
    assert records and all(r["K"] == 5 for r in records)
    # §4.5: the same warmup trajectories, annotated again with K = 5 (the oracle's depend only on the seed)
    def actions(rs):
        return {(r["id"], r["sample"]): [(st["action"], st["argument"]) for st in r["steps"]] for r in rs}
    assert actions(records) == actions(read_jsonl(warm / "records.jsonl"))
    assert all(len(r["criteria"]) == len(r["scores"]) == 5 for r in read_jsonl(warm / "rubric_sft-k5.jsonl"))
    assert rm.RubricModel.load(warm / "mu_sft-k5", device="cpu", engine=FAST).k == 5
    rows = read_jsonl(tiny_run / "synthetic" / "arco-k5" / "traces" / "epoch_1.jsonl")
    assert rows and all(len(st["d"]) == 5 for r in rows for st in r["steps"])


def test_epoch_0_is_the_warmups_sft_only_evaluation_and_equals_a_fresh_one(tiny_run, tiny_dir):
    """arco.py takes the warmup's SFT-only evaluation as epoch 0 (same settings); evaluating π_sft
    plus the fresh B = 0 adapter again gives exactly the same numbers and trajectories."""
    warm, run = tiny_run / "synthetic" / "warmup", tiny_run / "synthetic" / "arco"
    sft_only = json.loads((warm / "metrics.json").read_text())["sft_only"]
    ev0 = next(r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval")
    assert {k: ev0[k] for k in sft_only} == sft_only
    args = arco.resolve_args(settings.parse_args(arco.Args, tiny_args(tiny_dir, tiny_run)))
    torch.manual_seed(args.seed)
    pi = models.fresh_adapter(models.load_backbone_checkpoint(warm / "pi_sft", **loading(args))[0], args.lora_dropout)
    dev = env.load_split("synthetic", "dev", None, args.eval_size, args.seed)
    ev, trajs = arco.dev_evaluation(pi, dev, args, env.Retriever())
    assert ev == sft_only
    assert [[st.output for st in t.steps] for t in trajs] == \
        [[st["output"] for st in r["steps"]] for r in read_jsonl(run / "traces" / "eval_epoch_0.jsonl")]


def test_a_kept_sft_only_evaluation_is_served_only_for_the_same_dev_questions(tmp_path):
    """The epoch-0 evaluation kept beside a warmup is keyed by the dev questions themselves (a digest of ids, text,
    answers, paragraphs), not only by their number: another --data-dir's dev split of the same size, or another
    sample, is evaluated anew; the same questions are served the kept one."""
    from infra.warmups import eval_settings, sft_only
    dev = env.load_split("synthetic", "dev", None, 4, 0)
    other = env.load_split("synthetic", "dev", None, 4, 1)                      # another seed: other questions
    assert [e.id for e in dev] != [e.id for e in other]
    edited = [dataclasses.replace(dev[0], answers=["another answer"])] + dev[1:]  # same ids, another gold answer
    calls = []

    def evaluate(tag):
        return lambda: calls.append(tag) or ({"em": float(len(calls))}, [{"id": tag, "steps": []}])
    key = lambda questions: eval_settings(questions, 0, 8, 100, 4)                # noqa: E731
    assert sft_only(tmp_path, key(dev), evaluate("dev"))[0] == {"em": 1.0}       # evaluated, kept
    assert sft_only(tmp_path, key(dev), evaluate("again"))[0] == {"em": 1.0}     # served: same questions
    assert sft_only(tmp_path, key(other), evaluate("other"))[0] == {"em": 2.0}   # same size, other questions
    assert sft_only(tmp_path, key(edited), evaluate("edited"))[0] == {"em": 3.0}
    assert calls == ["dev", "other", "edited"]
    assert key(dev)["eval_size"] == key(other)["eval_size"] == 4 and key(dev)["dev"] != key(other)["dev"]


def evals(run):
    return [(r["epoch"], r["em"], r["f1"], r["invalid_rate"]) for r in read_jsonl(run / "metrics.jsonl")
            if r["kind"] == "eval"]


def updates(run):
    return [(r["epoch"], r["batch"], r["mean_R"], round(r["policy_loss"], 5), round(r["decomposition_mse"], 5))
            for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "update"]


def failing_on_call(real, n, action):
    """`real`, except that its n-th call first does `action` (raise, send a signal, ...)."""
    calls = {"n": 0}

    def wrapped(*a, **kw):
        calls["n"] += 1
        if calls["n"] == n:
            action()
        return real(*a, **kw)
    return wrapped


def test_resume_after_a_kill_mid_epoch(tiny_run, tiny_dir, monkeypatch):
    """A hard kill (nothing saved) in epoch 2: --resume redoes epoch 2 from the epoch-1 checkpoint."""
    warm = tiny_run / "synthetic" / "warmup"

    def kill():
        raise RuntimeError("simulated kill")
    real_update = arco.rubric_update
    monkeypatch.setattr(arco, "rubric_update", failing_on_call(real_update, 3, kill))   # epoch 2, batch 0
    with pytest.raises(RuntimeError, match="simulated kill"):
        arco.main(tiny_args(tiny_dir, tiny_run, name="killed", warmup_dir=warm))
    monkeypatch.setattr(arco, "rubric_update", real_update)
    with pytest.raises(SystemExit, match="--resume"):             # never overwritten by accident
        arco.main(tiny_args(tiny_dir, tiny_run, name="killed", warmup_dir=warm))
    arco.main(tiny_args(tiny_dir, tiny_run, name="killed", warmup_dir=warm, resume=True))
    run, ref = tiny_run / "synthetic" / "killed", tiny_run / "synthetic" / "arco"
    assert evals(run) == evals(ref)
    assert updates(run) == updates(ref)
    assert len(read_jsonl(run / "traces" / "epoch_2.jsonl")) == 4          # redone rows are not duplicated


def test_ctrl_c_finishes_the_batch_saves_and_resumes_from_the_next_one(tiny_run, tiny_dir, monkeypatch):
    """Ctrl-C (SIGINT) in epoch 1, batch 0: the batch finishes, a checkpoint is saved, the run exits;
    --resume continues at batch 1 and ends exactly where the uninterrupted run ended."""
    import os
    import signal
    warm = tiny_run / "synthetic" / "warmup"
    handler_before = signal.getsignal(signal.SIGINT)            # SIG_IGN under nohup, for example
    real_update = arco.rubric_update
    monkeypatch.setattr(arco, "rubric_update",
                        failing_on_call(real_update, 1, lambda: os.kill(os.getpid(), signal.SIGINT)))
    with pytest.raises(SystemExit, match="interrupted.*--resume"):
        arco.main(tiny_args(tiny_dir, tiny_run, name="ctrl-c", warmup_dir=warm))
    run, ref = tiny_run / "synthetic" / "ctrl-c", tiny_run / "synthetic" / "arco"
    state = json.loads((run / "checkpoints" / "interrupted" / "state.json").read_text())
    assert (state["epoch"], state["next_batch"]) == (1, 1)
    assert updates(run) == updates(ref)[:1]                                   # batch 0 of epoch 1 finished
    monkeypatch.setattr(arco, "rubric_update", real_update)
    seen = []
    real_iteration = arco.iteration
    monkeypatch.setattr(arco, "iteration", lambda *a, **kw: seen.append(a[5:7]) or real_iteration(*a, **kw))
    arco.main(tiny_args(tiny_dir, tiny_run, name="ctrl-c", warmup_dir=warm, resume=True))
    assert seen == [(1, 1), (2, 0)]                                          # only what was left
    assert evals(run) == evals(ref) and updates(run) == updates(ref)
    assert not (run / "checkpoints" / "interrupted").exists()
    assert signal.getsignal(signal.SIGINT) is handler_before                  # handler restored


def test_a_nan_loss_stops_with_a_clear_message_and_keeps_the_last_checkpoint(tiny_run, tiny_dir, monkeypatch):
    warm = tiny_run / "synthetic" / "warmup"
    real_loss, real_update = arco.rubric_loss, arco.rubric_update
    batches = {"n": 0}

    def counting_update(*a, **kw):
        batches["n"] += 1
        return real_update(*a, **kw)

    def nan_from_epoch_2(*a, **kw):                                 # batches 1-2 are epoch 1
        loss = real_loss(*a, **kw)
        return loss * float("nan") if batches["n"] >= 3 else loss
    monkeypatch.setattr(arco, "rubric_update", counting_update)
    monkeypatch.setattr(arco, "rubric_loss", nan_from_epoch_2)
    with pytest.raises(SystemExit, match=r"rubric-model \(Eq. 5\) loss is nan at epoch 2, batch 0.*epoch_1"):
        arco.main(tiny_args(tiny_dir, tiny_run, name="nan", warmup_dir=warm))
    ckpts = tiny_run / "synthetic" / "nan" / "checkpoints"
    assert (ckpts / "epoch_1" / "state.json").is_file() and not (ckpts / "epoch_2").exists()


def test_whole_loop_on_the_embedded_model_and_real_hotpotqa(tmp_path, data_dir):
    """Algorithm 1 end to end with the real embedded SmolLM2 for π and μ, on a few real HotpotQA
    questions: warmup → sparse epoch → dense epoch → evaluations → report, with sane files."""
    argv = ["--dataset", "hotpotqa", "--data-dir", data_dir, "--train-size", "2", "--eval-size", "2",
            "--epochs", "2", "--sparse-epochs", "1", "--batch-size", "2", "--group-size", "2",
            "--max-new-tokens-pi", "16", "--max-new-tokens-mu", "24", "--sft-epochs-pi", "1", "--sft-epochs-mu", "1",
            "--warmup-samples", "2", "--warmup-probe", "2", "--out-dir", str(tmp_path), "--device", "cpu",
            "--sft-batch-pi", "16"]
    arco.main(argv)
    run = tmp_path / "hotpotqa" / "arco"
    args = json.loads((run / "args.json").read_text())
    assert args["model"] == "embedded" and args["mu_model"] == "embedded" and args["max_new_tokens_mu"] == 24
    assert json.loads((tmp_path / "hotpotqa" / "warmup" / "retriever.json").read_text()) == \
        {"retriever": settings.EMBEDDED_RETRIEVER, "pooling": "mean"}
    rows = read_jsonl(run / "metrics.jsonl")
    evals = [r for r in rows if r["kind"] == "eval"]
    updates = [r for r in rows if r["kind"] == "update"]
    assert [r["epoch"] for r in evals] == [0, 2] and all(r["n"] == 2 for r in evals)   # SFT only, then selectable
    assert [(r["epoch"], r["dense"], r["questions"], r["trajectories"]) for r in updates] == \
        [(1, False, 1, 2), (1, False, 1, 2), (2, True, 2, 2)]
    for r in updates:
        batch_rows = [t for t in read_jsonl(run / "traces" / f"epoch_{r['epoch']}.jsonl") if t["batch"] == r["batch"]]
        steps = [st for t in batch_rows for st in t["steps"]]
        assert r["policy_steps"] == sum(st["valid"] for st in steps)            # V_τ, invalid out
        assert r["mean_s"] == pytest.approx(sum(st["s"] for st in steps) / len(steps), abs=1e-4)
        assert r["rubric_parse_rate"] == pytest.approx(sum(st["rubric_parsed"] for st in steps) / len(steps))
        assert min(r["seconds_rollout"], r["seconds_mu_annotate"], r["seconds_pi_update"], r["seconds_mu_update"]) > 0
        assert 0.1 < r["peak_rss_gib"] < 64
        assert r["dense"] or r["kl_pi"] == 0                                    # λ_π = 0: no KL pass when sparse
    trace = read_jsonl(run / "traces" / "epoch_2.jsonl")
    assert len(trace) == 2                                                    # 2 questions × 1
    for row in trace:
        for st in row["steps"]:
            assert len(st["criteria"]) == 3 and len(st["d"]) == 3
            assert st["s"] == pytest.approx(sum(st["d"]) / 3, abs=1e-3)         # Eq. 2
            assert st["rubric_parsed"] or st.get("rubric_text")               # what μ wrote, always kept
        assert [st["G"] for st in row["steps"]] == pytest.approx(arco.reward_to_go([st["s"] for st in row["steps"]]),
                                                                 abs=1e-3)
    assert (run / "checkpoints" / "epoch_2" / "mu" / "score_head.safetensors").is_file()
    assert json.loads((run / "selection.json").read_text())["selected_epoch"] == 2
    assert "## Sample training trajectories (epoch 2)" in (run / "report.md").read_text()


def cut_short(path):
    """A file cut short, as a full disk or a killed copy leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def test_a_damaged_checkpoint_is_named_and_the_run_resumes_from_the_previous_intact_one(tiny_run, tiny_dir, capsys):
    """The latest checkpoint's weights cut short: --resume names the file and redoes epoch 2 from epoch 1's
    checkpoint, ending where the run ended; every checkpoint cut short: one error naming the folder."""
    import shutil
    ref = tiny_run / "synthetic" / "arco"
    run = tiny_run / "synthetic" / "damaged"
    shutil.copytree(ref, run)
    warm = tiny_run / "synthetic" / "warmup"
    cut_short(run / "checkpoints" / "epoch_2" / "pi" / "adapter" / "adapter_model.safetensors")
    arco.main(tiny_args(tiny_dir, tiny_run, name="damaged", warmup_dir=warm, resume=True))
    out = capsys.readouterr().out
    assert "checkpoint epoch_2 is damaged" in out and "adapter_model.safetensors has" in out
    assert "resuming" in out and "at epoch 2, batch 0" in out
    assert evals(run) == evals(ref) and updates(run) == updates(ref)
    for epoch in (1, 2):
        cut_short(run / "checkpoints" / f"epoch_{epoch}" / "optim.pt")
    with pytest.raises(SystemExit, match=r"every checkpoint in .*damaged/checkpoints is damaged"):
        arco.main(tiny_args(tiny_dir, tiny_run, name="damaged", warmup_dir=warm, resume=True))


def test_a_damaged_warmup_model_is_named_before_anything_loads(tiny_run, tiny_dir):
    import shutil
    warm = tiny_run / "synthetic" / "warmup-damaged"
    shutil.copytree(tiny_run / "synthetic" / "warmup", warm)
    cut_short(warm / "mu_sft" / "score_head.safetensors")
    with pytest.raises(SystemExit, match=r"damaged checkpoint: .*mu_sft/score_head.safetensors has \d+ bytes"):
        arco.main(tiny_args(tiny_dir, tiny_run, name="warm-damaged", warmup_dir=warm))


def test_the_reward_is_exact_match_not_a_partial_overlap():
    """R(τ) = EM (Alg. 1, line 23): "Lee" against the gold "Ann Lee" overlaps (F1 2/3 > 0.5) but R = 0, in
    env.answer_reward and at the end of a rollout; the full name gets R = 1."""
    from evaluate import f1_score
    assert f1_score("Lee", "Ann Lee") > 0.5 and env.answer_reward("Lee", ["Ann Lee"]) == 0.0
    assert env.answer_reward("ann lee", ["Ann Lee"]) == 1.0
    examples = env.synthetic_examples(2, split="dev")
    for ex in examples:
        ex.answers = ["Ann Lee"]
    answers = iter(["Finish[Lee]", "Finish[Ann Lee]"])
    trajs = env.rollout(examples, lambda prompts: [next(answers) for _ in prompts], TitleRetriever())
    assert [t.reward for t in trajs] == [0.0, 1.0]


def test_rubric_update_pools_the_mean_of_each_sequences_hidden_states(tiny_dir):
    """The vectors Eq. 5's score head reads in rubric_update (packed passes, a shared prefix) are mean_pool of
    each full scoring sequence's last hidden states, as a plain pass computes them — not a rescaled mean (the
    head's LayerNorm would hide a uniform rescaling from every loss-level test)."""
    bb = models.add_lora(models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=FAST), dropout=0.0)
    perturb_lora(bb)
    mu = rm.RubricModel(bb, k=3, examples=0)
    trajs = scripted_batch()
    contexts = [c for t in trajs for c in rm.contexts_from_trajectory(t)]
    rubrics = [mu.rubric_from_criteria([f"criterion {i}", "b", "c"]) for i in range(len(contexts))]
    seen = []
    hook = mu.head.register_forward_pre_hook(lambda module, inp: seen.append(inp[0].detach().clone()))
    for pass_tokens in (10 ** 6, 1):                   # one packed pass; every step its own (checkpointed) part
        seen.clear()
        arco.rubric_update(mu, torch.optim.SGD(mu.parameter_groups(0.0, 0.0), lr=0.0), trajs, contexts, rubrics,
                           arco.resolve_args(arco.Args(pass_tokens=pass_tokens)))
        pooled = torch.cat(seen)[:len(contexts)]        # once per pass, outside the checkpointing (then the
        #                                                 logged error after the step reads them again)
        with torch.no_grad():
            plain = mu.pooled(contexts, rubrics)        # right-padded pass, rm.mean_pool over the real tokens
        assert pooled.shape == plain.shape and torch.allclose(pooled, plain, atol=1e-5)
    hook.remove()


@pytest.mark.parametrize("engine", [PLAIN, FAST], ids=["plain", "fast"])
def test_a_constant_advantage_moves_pi_only_when_log_pi_is_not_at_the_sampling_temperature(engine):
    """By enumeration on a tiny π with a 16-token vocabulary and one-token actions: Eq. 3's expected gradient
    under a constant advantage A, Σ_a p_T(a) · ∇(−A log π(a|h)), a ~ softmax(z / T) as the rollout samples. With
    --logprob-temperature rollout (log π of softmax(z / T)) it is zero: a baseline is neutral. With 1 (the
    release) it is −A Σ_a (p_T(a) − p_1(a)) ∇z_a, the formula's amount, computed here from the logits z."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    bb = models.Backbone(LlamaForCausalLM(config), None, "tiny-16", engine=engine)
    models.add_lora(bb, dropout=0.0)
    perturb_lora(bb, std=0.3)
    params = models.trainable_parameters(bb.model)
    prompt, A, T = [1, 5, 7, 3], 0.8, 0.7
    seqs, lens = [prompt + [a] for a in range(16)], [1] * 16

    def logits() -> torch.Tensor:                                   # z at the position that picks the action
        return passes.lm_logits(bb, passes.last_hidden_states(bb, torch.tensor([prompt]),
                                                              torch.ones(1, len(prompt), dtype=torch.long))[0, -1])
    with torch.no_grad():
        z = logits()
    p_T, p_1 = torch.softmax(z / T, -1), torch.softmax(z, -1)

    def expected_gradient(logprob_temperature: str) -> torch.Tensor:
        args = arco.Args(rollout_temperature=T, logprob_temperature=logprob_temperature)
        for p in params:
            p.grad = None
        update = passes.training_passes(bb, seqs, lens, budget=None, temperature=arco.log_pi_temperature(args))
        for p in update:
            arco.policy_loss(p.logprobs.sum(-1), A * p_T[p.index], 1).backward()     # weights p_T(a): the expectation
        update.backward_shared()                       # the fast engine: the shared prompt's part of the gradient
        return torch.cat([p.grad.reshape(-1) for p in params])

    at_rollout, at_one = expected_gradient("rollout"), expected_gradient("1")
    for p in params:
        p.grad = None
    (-A * ((p_T - p_1) * logits()).sum()).backward()              # −A Σ_a (p_T(a) − p_1(a)) ∇z_a
    formula = torch.cat([p.grad.reshape(-1) for p in params])
    assert float(at_one.norm()) > 1e-3
    assert torch.allclose(at_one, formula, atol=1e-6 * float(formula.abs().max()) + 1e-9, rtol=1e-4)
    assert float(at_rollout.norm()) < 1e-5 * float(at_one.norm())


def test_an_rl_step_clips_the_gradient_to_norm_1():
    """CHOICES' "not a difference": the release clips every RL step's gradient at norm 1.0. A gradient of norm 10
    moves a parameter by 1 under SGD at rate 1 (clipped), one of norm 0.5 by 0.5 (untouched)."""
    assert arco.GRAD_CLIP == 1.0
    for norm, moved in ((10.0, 1.0), (0.5, 0.5)):
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = torch.tensor([norm, 0.0, 0.0, 0.0])
        arco.gradient_step(torch.optim.SGD([p], lr=1.0), "test", arco.ALONE, 0.0)
        assert float(p.detach().norm()) == pytest.approx(moved)


def test_dev_evaluation_is_greedy(monkeypatch):
    """CHOICES' "not a difference": the dev evaluation decodes greedily (temperature 0), as the release does."""
    seen = []
    monkeypatch.setattr(arco, "policy_act", lambda pi, temperature, *a: seen.append(temperature) or
                        (lambda prompts, seeds=None: ["Finish[x]"] * len(prompts)))
    args = arco.resolve_args(arco.Args(dataset="synthetic"))
    ev, trajs = arco.dev_evaluation(None, env.synthetic_examples(2, split="dev"), args, TitleRetriever())
    assert seen == [0.0] and ev["n"] == 2


def test_a_warmup_made_for_another_base_model_is_refused(tiny_run, tiny_dir, tiny_qwen3_dir):
    """A warmup's π_sft is reused only by runs asking for its base model and π SFT settings (issue 66: a run with
    --model another one silently trained the warmup's SmolLM2 π_sft): one error line naming both, before RL."""
    for flag, value in (("model", tiny_qwen3_dir), ("sft_lr_pi", 0.123)):
        with pytest.raises(SystemExit) as e:
            main_guard(lambda: arco.main(tiny_args(tiny_dir, tiny_run, name=f"other-{flag}", **{flag: value})),
                       env.DataError)
        assert e.value.code == 2
    made = json.loads((tiny_run / "synthetic" / "warmup" / "metrics.json").read_text())["pi_sft_settings"]
    assert made["model"] == str(tiny_dir) and made["sft_epochs_pi"] == 1
    with pytest.raises(env.DataError, match=rf"made with --model {tiny_dir}, this run asks for --model {tiny_qwen3_dir}"):
        warmup.ensure(arco.resolve_args(settings.parse_args(arco.Args, tiny_args(tiny_dir, tiny_run) +
                                                                         ["--model", str(tiny_qwen3_dir)])), True)


def test_init_from_applies_this_commands_mu_learning_rates(tiny_run, tiny_dir):
    """--init-from starts from another run's checkpoint with its optimizers' moments, but the learning rates are the
    command's: the child's μ optimizer steps at --mu-lr / --head-lr, not the parent's (issue 66)."""
    parent = tiny_run / "synthetic" / "arco" / "checkpoints" / "epoch_1"
    before = torch.load(parent / "optim.pt", weights_only=True)["opt_mu"]["param_groups"]
    assert [g["lr"] for g in before] != [0.0123, 0.0456]
    arco.main(tiny_args(tiny_dir, tiny_run, name="init-rates", init_from=parent, mu_lr=0.0123, head_lr=0.0456))
    after = torch.load(tiny_run / "synthetic" / "init-rates" / "checkpoints" / "epoch_2" / "optim.pt",
                       weights_only=True)["opt_mu"]["param_groups"]
    assert [g["lr"] for g in after] == [0.0123, 0.0456]
