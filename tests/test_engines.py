"""The two engines of rubric_model.training_passes compute the same numbers: the plain one (one ordinary
forward per sequence, the code a porter reads) is the reference the fast one (shared prefixes, packed rows,
token budgets, checkpointing) is checked against, both computed here, on this machine, with autocast off
(float32 kernels; bf16 autocast rounds the two engines' sums differently)."""
import pytest
import torch

import arco
import env
import rubric_model as rm

REL, ABS = 1e-4, 1e-6          # float32 sums in another order


class TitleRetriever:
    def retrieve(self, examples, queries):
        return [next((i for i, (t, _) in enumerate(ex.paragraphs) if t in q), 0) for ex, q in zip(examples, queries)]


def perturbed(model_dir, seed):
    torch.manual_seed(seed)      # add_lora draws lora_A from the global generator
    bb = rm.add_lora(rm.load_backbone(str(model_dir), device="cpu", autocast="off"), dropout=0.0)
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
        params = rm.trainable_parameters(bb.model)
        for p in params:
            p.grad = None
        rows = {}
        for p in rm.training_passes(bb, seqs, lens, kl=True, engine=engine, budget=budget, units=units):
            loss = 0.0
            for j, i in enumerate(p.index):
                r = lens[i]
                rows[i] = (p.logprobs[j, :r].detach(), p.kl[j, :r].detach(), p.pooled[j].detach(), p.mask[j].sum())
                loss = loss + p.logprobs[j, :r].sum() * (i + 1) + p.kl[j, :r].sum() + p.pooled[j].square().sum() * 1e-3
            loss.backward()
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


def test_one_iteration_is_the_same_on_both_engines(tiny_dir):
    """Algorithm 1's updates on one batch (μ's rubrics and s_t, dense advantages, Eq. 3 with its KL,
    Eq. 5 with its KL): losses, logged numbers and every gradient, plain against fast."""
    trajs = scripted_trajectories()
    results = {}
    for engine in ("plain", "fast"):
        pi, mu_bb = perturbed(tiny_dir, 1), perturbed(tiny_dir, 2)
        torch.manual_seed(3)
        mu = rm.RubricModel(mu_bb, k=3, examples=0)
        args = arco.resolve_args(arco.Args(token_reduction="mean", kl_mu=0.05, engine=engine, pass_tokens=200))
        contexts, rubrics, d, s = arco.annotate(mu, trajs, args)
        A, _ = arco.advantages(trajs, s, True, args)
        opt_pi = torch.optim.SGD(rm.trainable_parameters(pi.model), lr=0.0)
        policy = arco.policy_update(pi, opt_pi, trajs, A, args, 0.05)
        opt_mu = torch.optim.SGD(mu.parameter_groups(0.0, 0.0), lr=0.0)
        rubric = arco.rubric_update(mu, opt_mu, trajs, contexts, rubrics, args)
        grads = [p.grad.clone() for opt in (opt_pi, opt_mu) for g in opt.param_groups for p in g["params"]]
        results[engine] = (policy, rubric, grads, s, A)
    (pp, rp, gp, sp, Ap), (pf, rf, gf, sf, Af) = results["plain"], results["fast"]
    assert torch.equal(sp, sf) and Ap == Af                  # μ's scores do not depend on the engine
    assert pp["policy_steps"] == pf["policy_steps"] == sum(st.valid for t in trajs for st in t.steps) > 4
    for got, want in ((pf, pp), (rf, rp)):
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=REL, abs=ABS), k
    assert pp["kl_pi"] > 1e-4 and rp["kl_mu"] > 0 and rp["decomposition_mse"] > 0
    for a, b in zip(gp, gf):
        torch.testing.assert_close(b, a, rtol=REL, atol=ABS)
