"""What --dry-run prints (plumbing): the schedule and loss scales of a run (describe_plan), and the memory estimate,
the peak memory of one arco.py process on one device, from π's and μ's shapes alone (no weights are loaded), the
weight dtype and the batch settings."""
from __future__ import annotations

import torch

from infra.engines import ENGINES
from infra.models import HUB_SHAPES, model_shape, resolve_autocast, resolve_device, resolve_dtype

GIB = 2 ** 30
RUNTIME_GIB = 1.0            # the process before any model: torch, transformers, the retriever, the data (CPU);


def _attention_widths(c: dict) -> tuple[int, int, int]:
    """head_dim, the query width (heads × head_dim) and the key/value width (KV heads × head_dim) of a config."""
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return hd, c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd


def _parameters(c: dict) -> int:
    h, i, L, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    hd, q, kv = _attention_widths(c)
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + (2 * hd if c.get("model_type") == "qwen3" else 0)
    return L * per_layer + v * h * (1 if c.get("tie_word_embeddings", True) else 2) + h


def _token_bytes(c: dict, b: int) -> dict:
    """Bytes per token of one model: its KV cache, and the activations a training pass keeps for the backward
    through every layer (weights frozen, LoRA on q and v, SDPA attention). Per layer, counted from what
    autograd saves in a Llama/Qwen3 block: the two RMSNorms' float32 inputs (2 × 4h), the LoRA inputs and
    dropout masks (2 × (b + 1) h), SDPA's q, k, v (KV heads repeated) and output (4 q b), Qwen3's q/k norms in
    float32 (4 (q + kv)), the MLP's gate, SiLU and up outputs (3 i b). Per response token, the float32 logits
    of the LM head and what the log-probs and the KL keep (logits, log-softmax, its exp, the difference to
    the reference's, the reference's own: 5 × 4V). Per packed row of L tokens, each layer also keeps the
    [L, L] tree mask in the weights' dtype (the `mask` entry: × L²)."""
    h, i, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    _, q, kv = _attention_widths(c)
    layer = 8 * h + 2 * (b + 1) * h + 4 * q * b + 3 * i * b + (4 * (q + kv) if c.get("model_type") == "qwen3" else 0)
    return {"kv": L * 2 * kv * b, "activations": L * layer, "logits": 5 * 4 * c["vocab_size"], "mask": L * b}


def memory_estimate(args) -> dict:
    """The peak memory of one arco.py process on one device, in GiB, from π's and μ's shapes (model_shape:
    no weights are loaded), the weight dtype and the batch settings. The phases do not overlap: the peak is
    the weights plus the largest of the rollout's KV cache and a training pass's activations. The references
    π_ref, μ_ref cost nothing (the adapter disabled). Context lengths are estimated from the prompts' parts:
    instructions and question (~350 tokens), each search's observation (--obs-chars / 4, or ~200 tokens for a
    whole paragraph) and action, the reply."""
    # the device it is meant for: --device auto with the paper preset means the GPU, whatever this machine has
    device = torch.device("cuda") if args.device == "auto" and args.preset == "paper" else resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    b = torch.finfo(dtype).bits // 8
    shapes = {"π": model_shape(args.model), "μ": model_shape(args.mu_model or args.model)}
    if any(v is None for v in shapes.values()):
        unknown = [n for n, v in shapes.items() if v is None]
        return {"known": False, "text": f"memory: no shape known for {', '.join(unknown)} (not a local folder, "
                                        f"not in the HF cache, not one of {', '.join(HUB_SHAPES)})"}
    if args.reward == "outcome":
        shapes.pop("μ")
    obs = args.obs_chars / 4 if args.obs_chars else 200
    context = 350 + (args.max_searches or 3) * (obs + 30) + args.max_new_tokens_pi
    # π's decoding keeps its keys/values in the autocast dtype (fast.kv_rows), and the fast engine's memo holds
    # the previous round's prompts, up to its token cap, beside the batch being decoded (π only; μ has none)
    kv_b = torch.finfo(torch.bfloat16).bits // 8 if resolve_autocast(args.autocast, device, dtype) else b
    memo = ENGINES[args.engine].memo()
    memo_tokens = min(memo.max_tokens, max(args.eval_size, args.batch_size) * context) if memo is not None else 0
    rows = {"weights": 0.0, "lora + AdamW": 0.0, "rollout KV cache": 0.0, "training pass": 0.0}
    for who, c in shapes.items():
        lora = c["num_hidden_layers"] * 8 * 2 * c["hidden_size"] * 2   # r 8 on q and v: A and B, ≈ 2 × 8 × (h + h)
        rows["weights"] += _parameters(c) * b
        if kv_b < b:        # autocast: a bf16 copy of every linear weight, the LM head's too (Backbone.autocast)
            untied = 0 if c.get("tie_word_embeddings", True) else c["vocab_size"] * c["hidden_size"]
            rows["weights"] += (_parameters(c) - untied) * kv_b
        rows["lora + AdamW"] += lora * 16 + (c["hidden_size"] * 256 * 16 if who == "μ" else 0)  # fp32 w, grad, 2 moments
        per = _token_bytes(c, b)
        new = args.max_new_tokens_pi if who == "π" else args.max_new_tokens_mu
        kv = _token_bytes(c, kv_b)["kv"]
        # a decoding batch's prompts are held twice while it decodes: as stored rows (the memo's, kept for the
        # next round) and as the batch's padded cache, which the prefill first writes with its keys in the
        # weights' dtype (RoPE's float32 under autocast; fast.kv_rows). Measured: RESULTS, issue 43
        first = c["num_hidden_layers"] * _attention_widths(c)[2] * (b + kv_b)
        rows["rollout KV cache"] = max(rows["rollout KV cache"], args.gen_batch * (context + new) * (kv + first)
                                       + (memo_tokens * kv if who == "π" else 0))
        # LM-head rows of one pass (log-probs, KL): a packed row holds each step's new tokens only (its
        # observation and action, then its reply), the shared history once, so replies fill a good part of it
        response = args.pass_tokens * new / (new + obs + 30)
        rows["training pass"] = max(rows["training pass"], args.pass_tokens * per["activations"]
                                    + response * per["logits"] + args.pass_tokens ** 2 * per["mask"])
    peak = (rows["weights"] + rows["lora + AdamW"] + max(rows["rollout KV cache"], rows["training pass"])) / GIB \
        + RUNTIME_GIB
    budget = args.gpu_memory
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in rows.items())
    text = (f"memory (estimate, {str(dtype).replace('torch.', '')} weights, {'+'.join(shapes)}): {parts}, runtime "
            f"{RUNTIME_GIB:.1f} GiB → peak {peak:.1f} GiB on one device, "
            + (f"fits --gpu-memory {budget:g} GiB" if peak <= budget else
               f"does NOT fit --gpu-memory {budget:g} GiB: lower --pass-tokens or --gen-batch"))
    return {"known": True, "peak_gib": peak, "fits": peak <= budget, "dtype": str(dtype),
            **{k: v / GIB for k, v in rows.items()}, "text": text}


def describe_plan(args, plan: list[dict]) -> str:
    """What --dry-run prints: the schedule (arco.epoch_plan's `plan`), the updates per epoch and the loss scales."""
    n_train = args.train_size
    lines = [f"preset {args.preset}, dataset {args.dataset}, reward {args.reward}: {n_train} training questions "
             f"(--train-size; fewer if the data holds fewer), {args.eval_size} dev questions, π = {args.model}, "
             f"μ = {args.mu_model if args.reward == 'arco' else '(none)'}"]
    for e in plan:
        kind = "dense " if e["dense"] else "sparse"
        baseline = (f"A = α (G_t − Ḡ_bucket), α {args.alpha}" + (", one-step buckets take the batch mean"
                                                                     if args.bucket_fallback else "")) \
            if e["dense"] else f"A = R − mean of the {args.sparse_baseline}"
        lines.append(f"  epoch {e['epoch']}: {kind} {e['questions_per_batch']} questions × {e['samples']} = "
                     f"{e['trajectories_per_update']} trajectories per update, {e['updates']} "
                     f"update{'s' if e['updates'] != 1 else ''}; π lr "
                     f"{e['pi_lr']:g}, λ_π {e['kl_pi']:g}; {baseline}"
                     + ("  [selectable]" if e["selectable"] else ""))
    total = sum(e["updates"] * e["trajectories_per_update"] for e in plan)
    lines.append(f"  {sum(e['updates'] for e in plan)} updates, {total} trajectories in all; the checkpoint is the "
                 f"best dev EM among the [selectable] epochs (after the transition)")
    per_step = "mean" if args.token_reduction == "mean" else "sum"
    lines += [
        "loss scales (token reduction: " + args.token_reduction + ")",
        f"  Eq. 3: −(1/|B|) Σ_τ Σ_t A_t log π(a_t|h_t) + λ_π (1/|B|) Σ_τ Σ_t {per_step}_i KL(π‖π_ref)_i; log π at "
        + (f"the rollout's T {args.rollout_temperature:g}" if args.logprob_temperature == "rollout" else
           f"T 1 (π samples at {args.rollout_temperature:g})"),
        f"  Eq. 5: (1/|B|) Σ_τ w_τ (Σ_t s_t − R)²  [w: {'class-balanced' if args.class_balance else '1'}]"
        f" + β {args.kl_mu:g} · " + ("(1/|B|) Σ_τ Σ_t mean_i KL(μ‖μ_ref)_i" if args.token_reduction == "mean"
                                   else "mean_t Σ_i KL(μ‖μ_ref)_i"),
        "  Eq. 7: " + ("mean over tokens of −log p(r̃) + λ · mean over steps × K of (d − ŝ)²"
                       if args.token_reduction == "mean" else "mean over steps of [Σ_i −log p(r̃_i) + λ ‖d − ŝ‖²]")
        + " (λ: warmup.py's --score-weight, release 10)",
        f"  optimizer: AdamW, weight decay {args.weight_decay:g}; μ lr {args.mu_lr:g}, score head {args.head_lr:g}; "
        f"rubrics {'greedy' if not args.rubric_temperature else f'sampled at T {args.rubric_temperature:g}'}",
        f"warmup: {args.warmup_size} questions ({'among' if args.warmup_questions == 'within' else 'apart from'} "
        f"RL's) × {args.warmup_samples} teacher trajectories; π SFT {args.sft_epochs_pi} epochs (lr {args.sft_lr_pi:g}, "
        f"batch {args.sft_batch_pi}, best dev EM kept), μ SFT on "
        f"{f'the first {args.sft_questions_mu} questions' if args.sft_questions_mu else 'every question'}, "
        f"{args.sft_epochs_mu} epochs (lr {args.sft_lr_mu:g}, head {args.sft_head_lr:g}, batch {args.sft_batch_mu}, "
        f"last kept){f', then {args.sft_head_steps} steps on the score head alone' if args.sft_head_steps else ''}"]
    return "\n".join(lines)
