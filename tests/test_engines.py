"""The two engines compute the same numbers: the plain one (rubric_model.py: one ordinary forward per sequence,
a plain sampling loop; the code a porter reads) is the reference the fast one (fast.py: shared prefixes, packed
rows, token budgets, checkpointing, a cached decoder) is checked against, both computed here, on this machine,
with autocast off (float32 kernels; bf16 autocast rounds the two engines' sums differently): the training
passes, one iteration's updates, greedy and seeded rollouts, μ's greedy rubrics and their scores; and a whole
tiny run with --engine plain never touches fast.py, killed and resumed or not."""
import json

import pytest
import torch

import arco
import env
from infra import fast
import rubric_model as rm
from rubric_model import mean_pool
from test_arco import numbers, read_jsonl, tiny_args
from infra import models
from infra import passes
from infra import engines
from infra.fast import FAST

REL, ABS = 1e-4, 1e-6          # float32 sums in another order


class TitleRetriever:
    def retrieve(self, examples, queries):
        return [next((i for i, (t, _) in enumerate(ex.paragraphs) if t in q), 0) for ex, q in zip(examples, queries)]


def perturbed(model_dir, seed, engine="fast"):
    torch.manual_seed(seed)      # add_lora draws lora_A from the global generator
    bb = models.add_lora(models.load_backbone(str(model_dir), device="cpu", autocast="off", engine=engines.ENGINES[engine]), dropout=0.0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in bb.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return bb


def scripted_trajectories():
    """Three synthetic questions played by a script: 3, 2 and 2 steps."""
    examples = env.synthetic_examples(3, split="dev")
    script = iter([f"Search[{examples[0].paragraphs[0][0]}]", f"Search[{examples[1].paragraphs[1][0]}]", "Finish[no]",
                   f"Finish[{examples[0].answer}]", f"Search[{examples[1].paragraphs[2][0]}]",
                   f"Finish[{examples[2].answer}]", f"Finish[{examples[1].answer}]"])
    return env.rollout(examples, lambda prompts: [next(script) for _ in prompts], TitleRetriever())


@pytest.mark.parametrize("budget", [None, 10 ** 6, 6])
def test_the_passes_of_both_engines_hold_the_same_numbers(tiny_any_dir, budget):
    """Per sequence: the response's token log-probs, the per-token KL to the reference, the pooled vector
    and their gradients; budget 6 cuts the unit of three sequences (11 tokens after the common [1, 2]) into
    checkpointed parts."""
    bb = perturbed(tiny_any_dir, 1)
    seqs = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 10, 11, 12], [1, 2, 3, 8, 9], [1, 2, 13, 14, 15, 16]]
    lens = [3, 4, 1, 2]
    units = [[0, 1, 2], [3]]
    bb.model.train()
    got = {}
    for engine in ("plain", "fast"):
        bb.engine = engines.ENGINES[engine]
        params = models.trainable_parameters(bb.model)
        for p in params:
            p.grad = None
        rows = {}
        tp = passes.training_passes(bb, seqs, lens, budget=budget, units=units, kl=arco.token_kl,
                                    reference=arco.reference, hidden=True)
        for p in tp:
            loss = 0.0
            pooled = mean_pool(p.hidden, p.hidden_mask)                      # Eq. 2's h̄, rubric_model's function
            for j, i in enumerate(p.index):
                r = lens[i]
                rows[i] = (p.logprobs[j, :r].detach(), p.kl[j, :r].detach(), pooled[j].detach(), p.mask[j].sum())
                loss = loss + p.logprobs[j, :r].sum() * (i + 1) + p.kl[j, :r].sum() + pooled[j].square().sum() * 1e-3
            loss.backward()
        tp.backward_shared()
        got[engine] = rows, [p.grad.clone() for p in params]
    (plain, g_plain), (fast, g_fast) = got["plain"], got["fast"]
    assert sorted(plain) == sorted(fast) == [0, 1, 2, 3]
    for i in plain:
        for a, b in zip(plain[i], fast[i]):
            torch.testing.assert_close(b, a, rtol=REL, atol=ABS)
        assert int(plain[i][3]) == lens[i]
    assert max(float(k.max()) for _, k, _, _ in plain.values()) > 1e-4        # π ≠ π_ref: the KL is not zero
    for a, b in zip(g_plain, g_fast):
        torch.testing.assert_close(b, a, rtol=REL, atol=ABS)


def dense_iteration(pi, mu, trajs, engine="fast"):
    """One dense iteration's numbers at learning rate 0: μ's s_t, A_t, both updates' logs and every gradient."""
    args = arco.resolve_args(arco.Args(token_reduction="mean", kl_mu=0.05, engine=engine, pass_tokens=200))
    contexts, rubrics, d, s = arco.annotate(mu, trajs, args)
    A = arco.advantages(arco.CreditBatch(trajs, s, True, args)).A
    opt_pi = torch.optim.SGD(models.trainable_parameters(pi.model), lr=0.0)
    policy = arco.policy_update(pi, opt_pi, trajs, A, args, 0.05)
    opt_mu = torch.optim.SGD(mu.parameter_groups(0.0, 0.0), lr=0.0)
    rubric = numbers([arco.rubric_update(mu, opt_mu, trajs, contexts, rubrics, args)])[0]    # its clock reading aside
    grads = [None if p.grad is None else p.grad.clone() for opt in (opt_pi, opt_mu) for g in opt.param_groups
             for p in g["params"]]
    return policy, rubric, grads, s, A


def test_one_iteration_is_the_same_on_both_engines(tiny_dir):
    """Algorithm 1's updates on one batch (μ's rubrics and s_t, dense advantages, Eq. 3 with its KL,
    Eq. 5 with its KL): losses, logged numbers and every gradient, plain against fast."""
    trajs = scripted_trajectories()
    results = {}
    for engine in ("plain", "fast"):
        pi, mu_bb = perturbed(tiny_dir, 1, engine), perturbed(tiny_dir, 2, engine)
        torch.manual_seed(3)
        mu = rm.RubricModel(mu_bb, k=3, examples=0)
        results[engine] = dense_iteration(pi, mu, trajs, engine)
    (pp, rp, gp, sp, Ap), (pf, rf, gf, sf, Af) = results["plain"], results["fast"]
    torch.testing.assert_close(sf, sp, rtol=REL, atol=ABS)  # μ's rubrics and scores (each engine's decoding)
    assert [a for row in Af for a in row] == pytest.approx([a for row in Ap for a in row], rel=REL, abs=ABS)
    assert pp["policy_steps"] == pf["policy_steps"] == sum(st.valid for t in trajs for st in t.steps) > 4
    for got, want in ((pf, pp), (rf, rp)):
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=REL, abs=ABS), k
    assert pp["kl_pi"] > 1e-4 and rp["kl_mu"] > 0 and rp["decomposition_mse"] > 0
    for a, b in zip(gp, gf):
        torch.testing.assert_close(b, a, rtol=REL, atol=ABS)


# ----------------------------------------------------------------------------- generation: rollouts and rubrics
def rollouts(bb, examples, temperature, seeds=None):
    """π's rollouts of `examples` (env.rollout with policy_act), each step's generated ids."""
    trajs = env.rollout(examples, passes.policy_act(bb, temperature, 12, 2), TitleRetriever(), seeds=seeds)
    return trajs, [[st.output_ids for st in t.steps] for t in trajs]


def greedy_rubrics(bb, contexts):
    """μ's greedy rubrics of `contexts` (RubricModel.annotate, the score head seeded alike) and their d_t."""
    torch.manual_seed(0)
    mu = rm.RubricModel(bb, k=3, examples=0)
    with torch.no_grad():
        mu.head.net[-1].weight.normal_(std=0.5)             # scores far from 0, so a difference would show
    rubrics, scores = mu.annotate(contexts, temperature=0.0, max_new_tokens=16, batch_size=2)
    return [r.token_ids for r in rubrics], scores.d


def both_engines(bb, run):
    """`run(bb)` with the backbone's engine set to fast, then plain (the engine is read at each call)."""
    out = {}
    for engine in ("fast", "plain"):
        bb.engine = engines.ENGINES[engine]
        out[engine] = run(bb)
    return out["fast"], out["plain"]


def test_greedy_rollouts_and_rubrics_are_the_same_on_both_engines(tiny_any_dir):
    """Greedy: π's rollouts (policy_act at temperature 0; the fast engine's memo, packed prefill and batch
    against one prompt at a time) write the same tokens, and μ's greedy rubrics (annotate, scored from the
    generation's own hidden states) the same tokens and d_t."""
    bb = perturbed(tiny_any_dir, 3)
    examples = env.synthetic_examples(3, split="dev")
    (trajs, fast_ids), (_, plain_ids) = both_engines(bb, lambda b: rollouts(b, examples, 0.0))
    assert fast_ids == plain_ids and sum(len(t) for t in fast_ids) >= 3
    contexts = [c for t in trajs for c in rm.contexts_from_trajectory(t)]
    (fast_r, fast_d), (plain_r, plain_d) = both_engines(bb, lambda b: greedy_rubrics(b, contexts))
    assert fast_r == plain_r
    torch.testing.assert_close(plain_d, fast_d, rtol=REL, atol=1e-5)


def test_seeded_sampled_rollouts_are_the_same_on_both_engines(tiny_any_dir):
    """Sampling with per-trajectory seeds (--sampling trajectory): each prompt draws from its own generator,
    so the one-prompt-at-a-time loop draws what the fast engine's batch draws."""
    bb = perturbed(tiny_any_dir, 4)
    examples = env.synthetic_examples(4, split="dev")
    (_, fast_ids), (_, plain_ids) = both_engines(bb, lambda b: rollouts(b, examples, 0.7, seeds=[11, 12, 13, 14]))
    assert fast_ids == plain_ids
    (_, again), _ = both_engines(bb, lambda b: rollouts(b, examples, 0.7, seeds=[21, 12, 13, 14]))
    assert again[1:] == fast_ids[1:] and again[0] != fast_ids[0]          # a stream per trajectory


def test_the_embedded_model_writes_the_same_rollouts_and_rubrics_on_both_engines(smol_dir):
    """The same on the embedded SmolLM2 (float32, autocast off), 2 synthetic questions: greedy rollouts, and μ's
    greedy rubrics of their steps."""
    bb = models.load_backbone(str(smol_dir), device="cpu", autocast="off", engine=FAST)
    examples = env.synthetic_examples(2, split="dev")
    (trajs, fast_ids), (_, plain_ids) = both_engines(bb, lambda b: rollouts(b, examples, 0.0))
    assert fast_ids == plain_ids
    contexts = [c for t in trajs for c in rm.contexts_from_trajectory(t)][:3]
    (fast_r, fast_d), (plain_r, plain_d) = both_engines(bb, lambda b: greedy_rubrics(b, contexts))
    assert fast_r == plain_r and all(fast_r)
    torch.testing.assert_close(plain_d, fast_d, rtol=1e-3, atol=1e-4)


# ----------------------------------------------------------------------------- --engine plain, end to end
def no_fast_engine(monkeypatch):
    """Every public function and class of infra/fast.py, and its entry in infra.engines.ENGINES, raise when used."""
    def refuse(*a, **kw):
        raise AssertionError("fast.py was used by a --engine plain run")
    for name, value in vars(fast).items():
        if not name.startswith("_") and callable(value) and getattr(value, "__module__", None) == "infra.fast":
            monkeypatch.setattr(fast, name, refuse)
    monkeypatch.setitem(engines.ENGINES, "fast", passes.Engine(passes=refuse, decode=refuse, memo=refuse, check=refuse))


def test_a_plain_run_never_uses_fast_and_resumes_to_the_same_numbers(tiny_dir, tmp_path, monkeypatch):
    """With every public name of fast.py raising, the tiny command with --engine plain runs whole: the warmup (its
    collection, π SFT with its dev evaluations, μ SFT, the head fit), the rollouts, μ's rubrics and scores, both
    updates, the evaluations. Then the same run killed in its dense epoch (nothing saved) and resumed ends with
    the uninterrupted run's metrics.jsonl, exactly (computed here: no numbers recorded elsewhere)."""
    no_fast_engine(monkeypatch)
    with pytest.raises(AssertionError, match="fast.py was used"):       # the fast engine is out of reach
        models.load_backbone(str(tiny_dir), device="cpu", engine=engines.ENGINES["fast"])
    argv = dict(engine="plain", autocast="off")
    arco.main(tiny_args(tiny_dir, tmp_path, **argv))
    ref = tmp_path / "synthetic" / "arco"
    rows = read_jsonl(ref / "metrics.jsonl")
    assert [r["epoch"] for r in rows if r["kind"] == "eval"] == [0, 2]
    assert [r["dense"] for r in rows if r["kind"] == "update"] == [False, False, True]
    assert json.loads((ref / "args.json").read_text())["engine"] == "plain"

    calls, real_update = [], arco.rubric_update

    def killing(*a, **kw):
        calls.append(1)
        if len(calls) == 3:                                  # epoch 2 (dense), batch 0: a hard kill, nothing saved
            raise RuntimeError("simulated kill")
        return real_update(*a, **kw)
    warm = tmp_path / "synthetic" / "warmup"
    monkeypatch.setattr(arco, "rubric_update", killing)
    with pytest.raises(RuntimeError, match="simulated kill"):
        arco.main(tiny_args(tiny_dir, tmp_path, name="killed", warmup_dir=warm, **argv))
    monkeypatch.setattr(arco, "rubric_update", real_update)
    arco.main(tiny_args(tiny_dir, tmp_path, name="killed", warmup_dir=warm, resume=True, **argv))
    assert numbers(read_jsonl(tmp_path / "synthetic" / "killed" / "metrics.jsonl")) == numbers(rows)



def test_decoding_keeps_keys_in_the_values_dtype_with_the_same_numbers(tiny_any_dir, monkeypatch):
    """Under bf16 autocast RoPE leaves the keys in float32 and the values in bf16; the fast engine keeps the
    keys in bf16 too (fast.kv_rows, the growing cache), a third less memory for the memo and the decoding
    cache (RESULTS, "memory"). Attention casts them to bf16 anyway, so the rollouts' tokens and μ's
    scores are exactly those with float32 keys (fast.as_values switched off), and the memo holds bf16 keys."""
    bb = perturbed(tiny_any_dir, 3)
    bb.autocast_dtype = torch.bfloat16
    examples = env.synthetic_examples(3, split="dev")
    contexts = [c for t in rollouts(bb, examples, 0.0)[0] for c in rm.contexts_from_trajectory(t)]

    def memo_after_a_rollout():
        policy = passes.policy_act(bb, 0.0, 12, 2)
        env.rollout(examples, policy, TitleRetriever())
        return next(c.cell_contents for c in policy.__closure__ if isinstance(c.cell_contents, fast.PromptMemo))
    (_, ids), (_, d), memo = rollouts(bb, examples, 0.0), greedy_rubrics(bb, contexts), memo_after_a_rollout()
    assert memo.entries and all(k.dtype == v.dtype == torch.bfloat16 for _, kv in memo.entries for k, v in kv)
    monkeypatch.setattr(fast, "as_values", lambda keys, values: keys)
    (_, ids_f32), (_, d_f32), memo = rollouts(bb, examples, 0.0), greedy_rubrics(bb, contexts), memo_after_a_rollout()
    assert any(k.dtype == torch.float32 for _, kv in memo.entries for k, _ in kv)     # the premise
    assert ids == ids_f32 and sum(map(len, ids)) >= 3
    assert torch.equal(d, d_f32)


def test_autocast_runs_on_bf16_copies_of_the_frozen_weights_with_the_same_numbers(tiny_any_dir, monkeypatch):
    """Backbone.autocast swaps each frozen linear weight for a bf16 copy made once, instead of autocast's cast at
    every call (issue 43: a third of a decoding step, a copy per pass kept for backward). The same rounding, so
    one iteration of Algorithm 1 under bf16 autocast (rollouts, μ's rubrics and s_t, both updates' losses and
    gradients) is bit for bit what it is with the swap switched off; outside the context every weight is float32
    again (the tied embedding included), and merge_lora's new weights get new copies."""
    def one_iteration():
        pi, mu_bb = perturbed(tiny_any_dir, 1), perturbed(tiny_any_dir, 2)
        for bb in (pi, mu_bb):
            bb.autocast_dtype = torch.bfloat16
        torch.manual_seed(3)
        mu = rm.RubricModel(mu_bb, k=3, examples=0)
        examples = env.synthetic_examples(3, split="dev")
        trajs, ids = rollouts(pi, examples, 0.0)
        policy, rubric, grads, s, A = dense_iteration(pi, mu, trajs)
        return pi, (ids, s, A, policy, rubric, grads)

    pi, swapped = one_iteration()
    frozen = [m for m in pi.model.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]
    assert len(pi.lowered) >= len(frozen) > 4
    lora = [m for name, m in pi.model.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" in name]
    with pi.autocast():
        assert all(m.weight.dtype == torch.bfloat16 for m in frozen)
        assert lora and all(m.weight.dtype == torch.float32 and m.weight.requires_grad for m in lora)
    with torch.no_grad(), pi.autocast():                                   # no gradient: LoRA lowered too
        assert all(m.weight.dtype == torch.bfloat16 for m in frozen + lora)
        assert pi.model.get_input_embeddings().weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in pi.model.parameters())
    monkeypatch.setattr(models.Backbone, "lower_frozen_weights", lambda self: [])
    _, cast = one_iteration()
    assert swapped[0] == cast[0] and sum(map(len, cast[0])) >= 3                     # rollouts' tokens
    torch.testing.assert_close(swapped[1], cast[1], rtol=0, atol=0)                  # s_t
    assert swapped[2] == cast[2] and swapped[3] == cast[3] and swapped[4] == cast[4]  # A, both updates' numbers
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(swapped[5], cast[5]))
    assert sum(g is not None for g in cast[5]) > 4
    monkeypatch.undo()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad(), pi.autocast():
        before = pi.model(input_ids=ids).logits
    models.merge_lora(pi)                     # lora_B ≠ 0: the merged weights differ from the copies made before
    assert pi.lowered == []
    with torch.no_grad(), pi.autocast():
        merged = pi.model(input_ids=ids).logits
    monkeypatch.setattr(models.Backbone, "lower_frozen_weights", lambda self: [])
    with torch.no_grad(), pi.autocast():
        assert torch.equal(merged, pi.model(input_ids=ids).logits) and not torch.equal(merged, before)


def test_the_memo_lets_a_stored_prompt_go_after_its_last_reader(tiny_dir):
    """fast.PromptMemo: each stored prompt's keys/values are let go as soon as the last prompt of the call that
    starts with it has been prefilled, so the previous round's memo shrinks while this round's grows (RESULTS,
    "memory"); which entry a prompt reads is the longest stored beginning, as before."""
    bb = models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=FAST)
    memo = fast.PromptMemo()
    memo.begin(bb, [])
    kv_a, kv_b = [(torch.ones(1), torch.ones(1))], [(torch.zeros(1), torch.zeros(1))]
    memo.store([1, 2, 3], kv_a)
    memo.store([1, 2, 4, 5], kv_b)
    memo.end()
    a, b1, b2, other = [1, 2, 3, 9], [1, 2, 4, 5, 6], [1, 2, 4, 5, 7, 8], [7, 7]
    memo.begin(bb, [a, b1, b2, other])
    assert memo.longest(a) == (kv_a, 3) and memo.entries[0][1] is None       # its only reader: let go
    assert memo.longest(b1) == (kv_b, 4) and memo.entries[1][1] is kv_b      # b2 still reads it
    assert memo.longest(other) == ([], 0)
    assert memo.longest(b2) == (kv_b, 4) and memo.entries[1][1] is None
