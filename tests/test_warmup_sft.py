"""warmup.py, SFT half: Eq. 7 by hand, π SFT and μ SFT mechanics on a tiny model, and the whole
warmup (collection → SFT → π_sft/, μ_sft/, metrics.json) end to end on the tiny model."""
import json
from types import SimpleNamespace

import pytest
import torch

import rubric_model as rm
import warmup


class FakeMu:
    """Just enough of RubricModel to check Eq. 7's arithmetic with numbers chosen by hand."""

    def __init__(self, mode):
        self.rubric_mode, self.k = mode, 2
        self.backbone = SimpleNamespace(device=torch.device("cpu"))

    def rubric_from_criteria(self, criteria):
        return rm.Rubric("", list(criteria), True, len(criteria), [1, 2])

    def score(self, contexts, rubrics):
        d = torch.tensor([[0.5, -0.5], [0.0, 1.0]])
        return rm.StepScores(d, d.mean(-1))

    def rubric_logprobs(self, contexts, rubrics):
        lp = torch.tensor([[-1.5, -0.5], [-3.0, -1.0]])      # sums -2 and -4
        return rm.ResponseLogprobs(lp, torch.ones_like(lp, dtype=torch.bool))

    def forward(self, contexts, rubrics, text=True, kl=False):
        """RubricModel.forward's contract: both heads from one pass (no text term without a rubric)."""
        text_lp = self.rubric_logprobs(contexts, rubrics) if self.rubric_mode in ("adaptive", "prefix-free") else None
        return self.score(contexts, rubrics), text_lp


ITEMS = [dict(question="q", prefix="", action="Search[a]", searches_left=3, criteria=["c1", "c2"], scores=[0.3, -0.5]),
         dict(question="q", prefix="h", action="Finish[b]", searches_left=2, criteria=["c3", "c4"], scores=[0.2, 0.6])]


def test_rubric_sft_loss_by_hand():
    # text: NLLs 2 and 4 -> mean 3. score: ||(0.2, 0)||² = 0.04, ||(-0.2, 0.4)||² = 0.2 -> mean 0.12.
    # Eq. 7 with λ = 10: 3 + 10 · 0.12 = 4.2
    loss, text, score = warmup.rubric_sft_loss(FakeMu("adaptive"), ITEMS, lam=10.0)
    assert float(text) == pytest.approx(3.0) and float(score) == pytest.approx(0.12) and float(loss) == pytest.approx(4.2)
    # w/o Rubric and static have no rubric text to learn: only λ · score error
    loss, text, _ = warmup.rubric_sft_loss(FakeMu("none"), ITEMS, lam=10.0)
    assert float(text) == 0.0 and float(loss) == pytest.approx(1.2)




def test_policy_and_rubric_sft_lower_their_losses(tiny_dir, tmp_path, retriever):
    import env
    examples = env.load_split("synthetic", "train", size=3, seed=0)
    warmup.collect(examples, warmup.OracleTeacher(seed=0), retriever, tmp_path, k=2, K=3, progress=False)
    records = warmup.read_jsonl(tmp_path / "records.jsonl")
    pi_examples = warmup.policy_sft_examples(records)
    mu_items = warmup.rubric_sft_examples(warmup.filter_records(records, 3)[0])
    assert pi_examples and mu_items

    pi = rm.load_backbone(str(tiny_dir), device="cpu", autocast="off")
    losses = warmup.train_policy_sft(pi, pi_examples, epochs=4, lr=3e-2, batch_size=4, progress=False, micro_batch=2)
    assert losses[-1] < losses[0]
    assert not hasattr(pi.model, "peft_config") and len(pi.merged) == 1     # merged after SFT

    # Each term of Eq. 7 learns. On this 2-layer, 32-wide model a LoRA on q/v moves the text NLL by a
    # few nats only, less than the noise the λ = 10 score term adds to it: the text term is checked
    # alone (λ = 0), the score error with the full loss.
    torch.manual_seed(0)
    for lam, term in ((0.0, "text_nll"), (10.0, "score_sq_error")):
        mu = rm.RubricModel(rm.load_backbone(str(tiny_dir), device="cpu", autocast="off"), k=3)
        before = warmup.rubric_sft_terms(mu, mu_items, 10.0)
        losses = warmup.train_rubric_sft(mu, mu_items, epochs=4, lr=3e-2, head_lr=1e-2, lam=lam, batch_size=4,
                                         progress=False)
        after = warmup.rubric_sft_terms(mu, mu_items, 10.0)
        assert after[term] < before[term] and losses[-1] < losses[0], (lam, before, after, losses)


def test_warmup_end_to_end_on_tiny_model(tiny_dir, tmp_path, data_dir):
    out = tmp_path / "warmup"
    args = warmup.Args(dataset="synthetic", train_size=3, samples=2, eval_size=3, out_dir=str(out), model=str(tiny_dir),
                       device="cpu", sft_epochs_pi=1, sft_epochs_mu=1, sft_batch_size=4, micro_batch=4,
                       max_new_tokens=8, probe_size=4, progress=False)
    warmup.run(args)
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) >= {"base", "sft_only", "mu_sft_terms_before", "mu_sft_terms_after"}
    assert metrics["base"]["n"] == 3 and 0 <= metrics["sft_only"]["em"] <= 100
    pi, config = rm.load_backbone_checkpoint(out / "pi_sft", device="cpu")
    assert config["merged_adapters"] == 1 and config["adapter"] is None
    mu = rm.RubricModel.load(out / "mu_sft", device="cpu")
    assert mu.k == 3 and mu.rubric_mode == "adaptive"
    ctx = rm.StepContext("q?", "", "Search[x]", 3)
    with torch.no_grad():
        s = mu.score([ctx], [mu.rubric_from_criteria(["a", "b", "c"])]).s
    assert -1 <= float(s) <= 1
