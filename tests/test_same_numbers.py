"""The faster loop computes what the loop before it computed: one iteration of Algorithm 1's updates on
the tiny model (rubrics, s_t, advantages, Eq. 3 and Eq. 5 losses, KL terms, gradient norms) against the
numbers recorded with the code before the speed-ups (tests/iteration_before.json, commit a03c208)."""
import json
from pathlib import Path

import pytest
import torch

import arco
import env
import rubric_model as rm

BEFORE = json.loads((Path(__file__).parent / "iteration_before.json").read_text())
REL = 1e-4      # float32 sums in another order (packed rows, cached prefixes): relative tolerance
ABS = 1e-6      # and absolute: a KL is a difference of log-probs (~10) computed by another CPU's kernels


class TitleRetriever:
    def retrieve(self, examples, queries):
        return [next((i for i, (t, _) in enumerate(ex.paragraphs) if t in q), 0) for ex, q in zip(examples, queries)]


def perturbed(tiny_dir, seed):
    torch.manual_seed(seed)      # add_lora draws lora_A from the global generator
    bb = rm.add_lora(rm.load_backbone(str(tiny_dir), device="cpu", autocast="off"), dropout=0.0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in bb.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return bb


def close(a, b):
    if isinstance(a, dict):
        return all(close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return b == pytest.approx(a, rel=REL, abs=ABS)
    return a == b


def test_one_iteration_gives_the_numbers_of_the_loop_before_the_speed_ups(tiny_dir):
    examples = env.synthetic_examples(3, split="dev")
    script = iter([f"Search[{examples[0].paragraphs[0][0]}]", f"Search[{examples[1].paragraphs[1][0]}]", "Finish[no]",
                   f"Finish[{examples[0].answer}]", f"Search[{examples[1].paragraphs[2][0]}]",
                   f"Finish[{examples[2].answer}]", f"Finish[{examples[1].answer}]"])
    trajs = env.rollout(examples, lambda prompts: [next(script) for _ in prompts], TitleRetriever())
    got = {"steps": [len(t.steps) for t in trajs], "rewards": [t.reward for t in trajs]}
    pi, mu_bb = perturbed(tiny_dir, 1), perturbed(tiny_dir, 2)
    torch.manual_seed(3)
    mu = rm.RubricModel(mu_bb, k=3, examples=0)
    contexts = [c for t in trajs for c in rm.contexts_from_trajectory(t)]
    mu.eval()
    rubrics, scores = mu.annotate(contexts, temperature=0.0, max_new_tokens=12, batch_size=4)
    got["rubric_tokens"] = [r.token_ids for r in rubrics]
    got["s"] = scores.s.tolist()
    args = arco.resolve_args(arco.Args(token_reduction="mean", kl_mu=0.05))
    A, _ = arco.advantages(trajs, scores.s, True, args)
    got["A"] = A
    opt_pi = torch.optim.SGD(rm.trainable_parameters(pi.model), lr=0.0)
    got["policy"] = arco.policy_update(pi, opt_pi, trajs, A, args, 0.05)
    got["policy_grad_norm"] = float(torch.cat([p.grad.flatten() for p in rm.trainable_parameters(pi.model)]).norm())
    opt_mu = torch.optim.SGD(mu.parameter_groups(0.0, 0.0), lr=0.0)
    got["rubric"] = arco.rubric_update(mu, opt_mu, trajs, contexts, rubrics, args)
    got["rubric_grad_norm"] = float(torch.cat([p.grad.flatten() for g in opt_mu.param_groups for p in g["params"]]).norm())
    before = {k: v for k, v in BEFORE.items() if not k.startswith("_")}
    assert got.keys() == before.keys()
    for key in before:
        assert close(before[key], got[key]), (key, before[key], got[key])
