"""ARCO, Algorithm 1: co-evolution of the policy π and the rubric model μ, in one command.

Paper: §3.2 (Eq. 3–5) and Appendix A (Algorithm 1).

    python arco.py --dataset hotpotqa                  # CPU preset: warmup (if needed), RL, evaluation, report
    python arco.py --dataset hotpotqa --preset paper   # Qwen3-4B-Instruct-2507 and the release hyperparameters
    python arco.py --dataset synthetic --reward outcome        # the binary-EM REINFORCE baseline (no μ)
    python arco.py --dataset hotpotqa --rubric none            # Table 2's "w/o Rubric" (also: static, prefix-free)

One iteration (Alg. 1, lines 5–38) over a batch B of questions × G samples each:

    rollout (π samples, env retrieves)       lines 6–14    env.rollout + rubric_model.generate
    rubrics r_t and scores d_t, s_t (μ)      lines 15–19   annotate()
    R(τ) = EM(answer, gold)                  line 23       env.rollout
    advantages: sparse R − mean_B R, or      lines 26–32   outcome_advantages / reward_to_go,
      dense α(G_t − Ḡ_{B,b}) by bucket                      step_buckets, bucketed_advantages
    π update: Eq. 3 with KL(π‖π_ref)         lines 33–35   policy_update() → policy_loss
    μ update: Eq. 5                          lines 36–38   rubric_update() → rubric_loss

The equations are small named functions at the top, tested against hand-worked numbers that
also live in `tests/vectors.json` (so a port to another framework can check itself):

    reward_to_go          Eq. 3      G_{τ,t} = Σ_{k≥t} s_{τ,k}
    step_buckets          Eq. 3–4    b(τ,t) ∈ {search_1, …, search_n, terminal}
    bucketed_advantages   Eq. 4      A_{τ,t} = α (G_{τ,t} − Ḡ_{B,b(τ,t)})
    outcome_advantages    Alg. 1, l. 31   A_τ = R(τ) − mean_B R
    policy_loss           Eq. 3      −(1/|B|) Σ_τ Σ_{t∈V_τ} A_{τ,t} log p_π(a_t|h_t) + λ_π L_KL
    decomposition_loss    Eq. 5      (1/|B|) Σ_τ (Σ_t s_t − R(τ))²
    rubric_loss           Eq. 5      decomposition_loss + β E_t[Σ_i KL(p_θ ‖ p_ref)_i]
"""
from __future__ import annotations

import json
import math
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from warmup import read_jsonl   # tolerates a last line cut short by a kill (what --resume meets)


@dataclass
class Args:
    dataset: str = field(default="hotpotqa", metadata={"help": "hotpotqa, 2wiki, musique or synthetic"})
    preset: str = field(default="cpu", metadata={"help": "cpu (embedded SmolLM2, minutes on a laptop) or paper "
                                                          "(Qwen3-4B, release hyperparameters, one GPU)",
                                                  "choices": ["cpu", "paper"]})
    name: str = field(default="", metadata={"help": "run name under runs/<dataset>/ (default: from --reward/--rubric/--k)"})
    out_dir: str = field(default="runs", metadata={"help": "root folder of all runs"})
    data_dir: str = field(default="", metadata={"help": "data folder (else $ARCO_DATA_DIR, else a download)"})
    warmup_dir: str = field(default="", metadata={"help": "the warmup folder (pi_sft/, mu_sft*/; default "
                                                           "runs/<dataset>/warmup); what is missing is trained first"})
    resume: bool = field(default=False, metadata={"help": "continue a killed run from its last finished epoch"})
    seed: int = field(default=0, metadata={"help": "seed of data sampling, shuffling and sampling"})
    reward: str = field(default="arco", metadata={"help": "arco (μ's dense rewards after the sparse epochs) or "
                                                           "outcome (binary-EM REINFORCE throughout, no μ: Search-R1-style)",
                                                  "choices": ["arco", "outcome"]})
    rubric: str = field(default="adaptive", metadata={"help": "μ variant (Table 2): adaptive, prefix-free (w/o Prefix), "
                                                               "static (w/o Adaptive), none (w/o Rubric)",
                                                       "choices": ["adaptive", "prefix-free", "static", "none"]})
    k: int = field(default=3, metadata={"help": "criteria per step, K (paper 3; RQ4 sweeps 1, 3, 5, 7, 9)"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda, cuda:1, ..."})
    # The fields below default to the preset's value (None = take it from the preset).
    model: str | None = field(default=None, metadata={"help": "π's backbone: 'embedded' or an HF id/folder"})
    mu_model: str | None = field(default=None, metadata={"help": "μ's backbone (RQ5); default: the same as --model"})
    train_size: int | None = field(default=None, metadata={"help": "training questions (paper 2,000)"})
    eval_size: int | None = field(default=None, metadata={"help": "dev questions evaluated (paper 500)"})
    epochs: int | None = field(default=None, metadata={"help": "RL epochs E (release 8)"})
    dense_start_epoch: int | None = field(default=None, metadata={"help": "η: dense rewards from this epoch on, "
                                                                             "1-based (release 3; Alg. 1 line 4)"})
    batch_size: int | None = field(default=None, metadata={"help": "questions per batch |B|/G (release 64)"})
    group_size: int | None = field(default=None, metadata={"help": "G: sampled trajectories per question (release 4)"})
    rollout_temperature: float | None = field(default=None, metadata={"help": "π's sampling temperature (release 0.7)"})
    rubric_temperature: float | None = field(default=None, metadata={"help": "μ's sampling temperature for r_t"})
    pi_lr_sparse: float | None = field(default=None, metadata={"help": "π LoRA learning rate, sparse epochs (1e-5)"})
    pi_lr_dense: float | None = field(default=None, metadata={"help": "π LoRA learning rate, dense epochs (3e-6)"})
    mu_lr: float | None = field(default=None, metadata={"help": "μ LoRA learning rate (1e-5)"})
    head_lr: float | None = field(default=None, metadata={"help": "μ score-head learning rate (5e-4)"})
    kl_pi: float | None = field(default=None, metadata={"help": "λ_π, KL(π‖π_ref) weight (Eq. 3; 0.05)"})
    kl_mu: float | None = field(default=None, metadata={"help": "β, rubric-token KL(μ‖μ_ref) weight (Eq. 5; 0.05)"})
    alpha: float | None = field(default=None, metadata={"help": "α, dense reward scale (Eq. 3; 0.5)"})
    max_new_tokens_pi: int | None = field(default=None, metadata={"help": "π's max new tokens per action (64)"})
    max_new_tokens_mu: int | None = field(default=None, metadata={"help": "μ's max new tokens per rubric (128)"})
    max_searches: int | None = field(default=None, metadata={"help": "search budget (default: 3, MuSiQue 6)"})
    obs_chars: int | None = field(default=None, metadata={"help": "observation cut, characters"})
    micro_batch: int | None = field(default=None, metadata={"help": "sequences per training forward pass (memory; "
                                                                      "gradients are accumulated)"})
    gen_batch: int | None = field(default=None, metadata={"help": "prompts per generation batch (π and μ)"})
    mu_examples: int | None = field(default=None, metadata={"help": "worked examples in μ's rubric prompt, 0-2 "
                                                                      "(~200 tokens per step each)"})
    warmup_probe: int | None = field(default=None, metadata={"help": "μ SFT items on which the warmup shows Eq. 7's "
                                                                       "terms before/after"})
    sft_epochs_pi: int | None = field(default=None, metadata={"help": "warmup π SFT epochs (release 6)"})
    sft_epochs_mu: int | None = field(default=None, metadata={"help": "warmup μ SFT epochs (release 10)"})
    warmup_samples: int | None = field(default=None, metadata={"help": "warmup: oracle trajectories per question"})
    sft_lr_pi: float | None = field(default=None, metadata={"help": "warmup π SFT learning rate (release 1e-5)"})
    sft_lr_mu: float | None = field(default=None, metadata={"help": "warmup μ SFT learning rate (release 5e-5)"})
    sft_head_lr: float | None = field(default=None, metadata={"help": "warmup μ score-head learning rate (release 1e-3)"})


# Presets: plain dicts. `paper` holds the authors' release config (DESIGN.md, "Facts"); `cpu` is
# sized so that warmup + RL + evaluation of HotpotQA fit in minutes on a 2-core CPU.
PRESETS = {
    "paper": dict(model="Qwen/Qwen3-4B-Instruct-2507", train_size=2000, eval_size=500, epochs=8,
                  dense_start_epoch=3, batch_size=64, group_size=4, rollout_temperature=0.7,
                  rubric_temperature=0.7, pi_lr_sparse=1e-5, pi_lr_dense=3e-6, mu_lr=1e-5, head_lr=5e-4,
                  kl_pi=0.05, kl_mu=0.05, alpha=0.5, max_new_tokens_pi=64, max_new_tokens_mu=128,
                  obs_chars=600, micro_batch=16, gen_batch=64, mu_examples=0, warmup_probe=32,
                  sft_epochs_pi=6, sft_epochs_mu=10, warmup_samples=4, sft_lr_pi=1e-5, sft_lr_mu=5e-5, sft_head_lr=1e-3),
    "cpu": dict(model="embedded", train_size=8, eval_size=20, epochs=2, dense_start_epoch=2, batch_size=4,
                group_size=2, rollout_temperature=0.7, rubric_temperature=0.7, pi_lr_sparse=1e-4,
                pi_lr_dense=5e-5, mu_lr=1e-4, head_lr=1e-3, kl_pi=0.05, kl_mu=0.05, alpha=0.5,
                max_new_tokens_pi=32, max_new_tokens_mu=96, obs_chars=300, micro_batch=2, gen_batch=16,
                mu_examples=0, warmup_probe=8, sft_epochs_pi=3, sft_epochs_mu=2, warmup_samples=2,
                sft_lr_pi=5e-4, sft_lr_mu=3e-4, sft_head_lr=1e-3),
}


def resolve_args(args: Args) -> Args:
    """Fill every preset-driven field the command line left unset."""
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.mu_model is None:
        args.mu_model = args.model
    if not args.name:
        args.name = "outcome" if args.reward == "outcome" else \
            "arco" + ("" if args.rubric == "adaptive" else f"-{args.rubric}") + ("" if args.k == 3 else f"-k{args.k}")
    return args


# ----------------------------------------------------------------------------------------
# The equations (Eq. 3–5, Alg. 1 line 31)
# ----------------------------------------------------------------------------------------

TERMINAL = "terminal"


def reward_to_go(s: Sequence[float]) -> list[float]:
    """G_t = Σ_{k=t}^{T} s_k, inclusive of step t, for one trajectory (Eq. 3; Alg. 1, line 28).

    Every step's μ score counts, invalid steps included: μ scores every step (Alg. 1, lines 15–19).
    """
    out, acc = [], 0.0
    for x in reversed(s):
        acc += float(x)
        out.append(acc)
    return out[::-1]


def step_buckets(actions: Sequence[str], valid: Sequence[bool]) -> list[str | None]:
    """b(τ, t) for one trajectory (Eq. 3–4; Alg. 1, line 28).

    The last step is `terminal`, whether it is a Finish or a forced end at the horizon; any
    other valid step is a search, bucketed by its rank among the trajectory's valid searches
    (`search_1`, `search_2`, …). Invalid non-terminal steps get None: they are outside V_τ and
    enter no bucket mean.
    """
    buckets, rank = [], 0
    for t, (a, ok) in enumerate(zip(actions, valid)):
        if t == len(actions) - 1:
            buckets.append(TERMINAL)
        elif ok and a == "search":
            rank += 1
            buckets.append(f"search_{rank}")
        else:
            buckets.append(None)
    return buckets


def bucketed_advantages(G: Sequence[Sequence[float]], buckets: Sequence[Sequence[str | None]],
                        valid: Sequence[Sequence[bool]], alpha: float) -> list[list[float]]:
    """A_{τ,t} = α (G_{τ,t} − Ḡ_{B,b(τ,t)}) over a batch of trajectories (Eq. 4; Alg. 1, line 29).

    Ḡ_{B,b} is the mean of G over I_b = the valid steps of the batch in bucket b. Steps outside
    V_τ get advantage 0 (they are left out of the policy loss).
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for g_tau, b_tau, v_tau in zip(G, buckets, valid):
        for g, b, ok in zip(g_tau, b_tau, v_tau):
            if ok:
                sums[b] = sums.get(b, 0.0) + g
                counts[b] = counts.get(b, 0) + 1
    return [[alpha * (g - sums[b] / counts[b]) if ok else 0.0 for g, b, ok in zip(g_tau, b_tau, v_tau)]
            for g_tau, b_tau, v_tau in zip(G, buckets, valid)]


def outcome_advantages(R: Sequence[float]) -> list[float]:
    """A_τ = R(τ) − mean_B R, shared by every valid step of τ (sparse epochs; Alg. 1, line 31)."""
    mean = sum(R) / len(R)
    return [float(r) - mean for r in R]


def policy_loss(logp: torch.Tensor, advantages: torch.Tensor, n_trajectories: int,
                kl_tokens: torch.Tensor | None = None, kl_coef: float = 0.0,
                n_kl_tokens: int | None = None) -> torch.Tensor:
    """Eq. 3: −(1/|B|) Σ_τ Σ_{t∈V_τ} A_{τ,t} log p_π(a_t|h_t) + λ_π L_KL^π.

    `logp` and `advantages` hold one entry per valid step (log p_π(a_t|h_t) is the sum of the
    action's token log-probs; α is already inside the advantages, Alg. 1 line 29). L_KL^π is the
    mean, over all action tokens of the batch, of the per-token KL(π ‖ π_ref) — our choice of
    reduction, the paper says "token-level KL" without one. To accumulate gradients over
    micro-batches, pass the whole batch's |B| and token count (`n_kl_tokens`): the micro-batch
    losses then add up to the batch loss.
    """
    loss = -(advantages.detach() * logp).sum() / n_trajectories
    if kl_tokens is not None and kl_tokens.numel() and kl_coef:
        loss = loss + kl_coef * kl_tokens.sum() / (n_kl_tokens or kl_tokens.numel())
    return loss


def decomposition_loss(s: torch.Tensor, trajectory: torch.Tensor, R: torch.Tensor,
                       n_trajectories: int | None = None) -> torch.Tensor:
    """Eq. 5, first term: (1/|B|) Σ_τ (Σ_{t=1}^{T} s_t − R(τ))², over all steps of each trajectory.

    `s` holds the step scores of every step, `trajectory` the index (into `R`) of the trajectory
    each step belongs to, `R` one outcome per trajectory. `n_trajectories` is |B| when `R` is a
    micro-batch of whole trajectories from a larger batch.
    """
    sums = torch.zeros(len(R), dtype=s.dtype, device=s.device).index_add(0, trajectory, s)
    return ((sums - R.to(s.dtype)) ** 2).sum() / (n_trajectories or len(R))


def rubric_loss(s: torch.Tensor, trajectory: torch.Tensor, R: torch.Tensor,
                kl_per_step: torch.Tensor | None = None, beta: float = 0.0,
                n_trajectories: int | None = None, n_steps: int | None = None) -> torch.Tensor:
    """Eq. 5: decomposition_loss + β E_{(h_t,a_t)}[Σ_{i=1}^{|r_t|} KL(p_θ ‖ p_θref)_i].

    `kl_per_step` holds, for each step, the per-token KL summed over its rubric's tokens; the
    expectation over (h_t, a_t) is their mean (over `n_steps` steps when accumulating).
    """
    loss = decomposition_loss(s, trajectory, R, n_trajectories)
    if kl_per_step is not None and kl_per_step.numel() and beta:
        loss = loss + beta * kl_per_step.sum() / (n_steps or kl_per_step.numel())
    return loss


# ----------------------------------------------------------------------------------------
# One iteration of Algorithm 1
# ----------------------------------------------------------------------------------------

def chunks(items: Sequence, size: int) -> list:
    return [items[i:i + size] for i in range(0, len(items), max(1, size))]


def policy_act(pi, temperature: float, max_new_tokens: int, batch_size: int):
    """π as env.rollout's `act`: batched generation (sampling, or greedy at temperature 0)."""
    from rubric_model import generate
    return lambda prompts: generate(pi, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                    batch_size=batch_size)


def annotate(mu, trajs, args: Args) -> tuple[list, list, torch.Tensor, torch.Tensor]:
    """Alg. 1, lines 15–19: μ writes r_t for every step and scores it: d_t, s_t (Eq. 2).

    Returns the step contexts, the rubrics, d [N, K] and s [N] (no gradient), steps in
    trajectory order.
    """
    from rubric_model import contexts_from_trajectory
    contexts = [c for t in trajs for c in contexts_from_trajectory(t)]
    mu.eval()
    rubrics = mu.generate_rubrics(contexts, temperature=args.rubric_temperature,
                                  max_new_tokens=args.max_new_tokens_mu, batch_size=args.gen_batch)
    with torch.no_grad():
        scores = mu.score(contexts, rubrics, batch_size=args.gen_batch)
    return contexts, rubrics, scores.d.float().cpu(), scores.s.float().cpu()


def advantages(trajs, s: torch.Tensor | None, dense: bool, alpha: float) -> tuple[list[list[float]], dict]:
    """Alg. 1, lines 26–32: per-step advantages; 0 on invalid steps (outside V_τ)."""
    valid = [[st.valid for st in t.steps] for t in trajs]
    info: dict = {}
    if not dense:
        A_tau = outcome_advantages([t.reward for t in trajs])                      # line 31
        return [[a if ok else 0.0 for ok in v] for a, v in zip(A_tau, valid)], info
    G, buckets, at = [], [], 0
    for t, v in zip(trajs, valid):
        G.append(reward_to_go(s[at:at + len(t.steps)].tolist()))                   # line 28, Eq. 3
        buckets.append(step_buckets([st.action for st in t.steps], v))
        at += len(t.steps)
    A = bucketed_advantages(G, buckets, valid, alpha)                               # line 29, Eq. 4
    per_bucket: dict[str, list[float]] = {}
    for g_t, b_t, v_t in zip(G, buckets, valid):
        for g, b, ok in zip(g_t, b_t, v_t):
            if ok:
                per_bucket.setdefault(b, []).append(g)
    info = {"G": G, "buckets": buckets, "mean_G_per_bucket": {b: sum(v) / len(v) for b, v in per_bucket.items()}}
    return A, info


class NonFiniteLoss(FloatingPointError):
    pass


def check_finite(name: str, value: float) -> None:
    """Stop before a NaN or inf loss reaches the weights (the run keeps its last good checkpoint)."""
    if not math.isfinite(value):
        raise NonFiniteLoss(f"the {name} loss is {value}")


def policy_update(pi, optimizer, trajs, A: list[list[float]], args: Args, kl_coef: float) -> dict:
    """Alg. 1, lines 33–35: one gradient step on Eq. 3, accumulated over micro-batches."""
    from rubric_model import chat_prompt_ids, encode_response, response_kl, sequence_logprobs
    items = [(chat_prompt_ids(pi.tokenizer, st.prompt), st.output_ids or encode_response(pi, st.output), a)
             for t, a_t in zip(trajs, A) for st, a in zip(t.steps, a_t) if st.valid]
    n_tokens = sum(len(r) for _, r, _ in items)
    pi.model.train()
    optimizer.zero_grad(set_to_none=True)
    total, kl_sum = 0.0, 0.0
    for chunk in chunks(items, args.micro_batch):
        prompts, responses = [p for p, _, _ in chunk], [r for _, r, _ in chunk]
        lp = response_kl(pi, prompts, responses) if kl_coef else sequence_logprobs(pi, prompts, responses)
        kl_tokens = lp.kl[lp.mask] if lp.kl is not None else None
        adv = torch.tensor([a for _, _, a in chunk], dtype=torch.float32, device=lp.logprobs.device)
        loss = policy_loss(lp.sums(), adv, len(trajs), kl_tokens, kl_coef, n_tokens)   # Eq. 3
        loss.backward()
        total += float(loss.detach())
        kl_sum += float(kl_tokens.detach().sum()) if kl_tokens is not None else 0.0
    if items:
        check_finite("policy (Eq. 3)", total)
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
        optimizer.step()
    pi.model.eval()
    return {"policy_loss": total, "kl_pi": kl_sum / max(n_tokens, 1), "policy_steps": len(items)}


def rubric_update(mu, optimizer, trajs, contexts, rubrics, args: Args) -> dict:
    """Alg. 1, lines 36–38: one gradient step on Eq. 5, over micro-batches of whole trajectories."""
    n_traj, n_steps = len(trajs), len(contexts)
    starts, at = [], 0
    for t in trajs:
        starts.append(at)
        at += len(t.steps)
    mu.train()
    optimizer.zero_grad(set_to_none=True)
    total, mse, kl_sum = 0.0, 0.0, 0.0
    per_chunk = max(1, args.micro_batch // max(1, max(len(t.steps) for t in trajs)))
    for group in chunks(list(range(n_traj)), per_chunk):
        idx = [starts[i] + j for i in group for j in range(len(trajs[i].steps))]
        local = torch.tensor([k for k, i in enumerate(group) for _ in trajs[i].steps])
        ctx, rub = [contexts[i] for i in idx], [rubrics[i] for i in idx]
        R = torch.tensor([trajs[i].reward for i in group])
        use_kl = bool(args.kl_mu) and mu.rubric_mode not in ("static", "none")
        scores, rubric_lp = mu.forward(ctx, rub, text=False, kl=use_kl)             # one shared decoder pass
        s = scores.s.float().cpu()
        kl_step = rubric_lp.kl.sum(-1).float().cpu() if use_kl else None            # Σ_i KL_i per step
        loss = rubric_loss(s, local, R, kl_step, args.kl_mu, n_traj, n_steps)        # Eq. 5
        loss.backward()
        total += float(loss.detach())
        mse += float(decomposition_loss(s.detach(), local, R, n_traj))
        kl_sum += float(kl_step.detach().sum()) if kl_step is not None else 0.0
    check_finite("rubric-model (Eq. 5)", total)
    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
    optimizer.step()
    mu.eval()
    return {"rubric_loss": total, "decomposition_mse": mse, "kl_mu": kl_sum / max(n_steps, 1)}


# ----------------------------------------------------------------------------------------
# Evaluation, checkpoints, traces
# ----------------------------------------------------------------------------------------

def evaluate_policy(pi, examples, args: Args, retriever) -> tuple[dict, list]:
    """Greedy dev evaluation (warmup.evaluate_policy): EM, F1, searches, invalid-step rate."""
    import warmup
    return warmup.evaluate_policy(pi, examples, retriever, args.max_new_tokens_pi, args.obs_chars, args.gen_batch,
                                  args.max_searches)


def warmup_evaluation(warmup_dir: Path, args: Args) -> tuple[dict | None, list[dict]]:
    """The warmup's SFT-only dev evaluation, when it was made with this run's settings: epoch 0
    is then not evaluated again. (π at epoch 0 is π_sft plus a fresh LoRA whose B = 0, which
    adds exact zeros: greedy decoding gives the same trajectories; tests/test_arco.py checks it.)"""
    import warmup
    path = warmup_dir / "metrics.json"
    metrics = json.loads(path.read_text()) if path.is_file() else {}
    wanted = warmup.eval_settings(args.eval_size, args.seed, args.max_new_tokens_pi, args.obs_chars, args.gen_batch)
    traces = warmup_dir / "eval_sft_only.jsonl"
    if args.max_searches is not None or metrics.get("sft_only_settings") != wanted or not traces.is_file():
        return None, []
    rows = [{**r, "epoch": 0, "batch": -1} for r in read_jsonl(traces)]
    for r in rows:
        for st in r["steps"]:
            st["observation"] = st["observation"][:160]
    print(f"[arco] epoch 0 (SFT only): the warmup's evaluation, same settings ({traces})", flush=True)
    return metrics["sft_only"], rows


def trace_rows(trajs, epoch: int, batch: int, rubrics=None, d=None, s=None, A=None, info=None) -> list[dict]:
    """One JSON row per trajectory: every step's action, observation head, criteria, d_t, s_t, G_t, A_t."""
    rows, at = [], 0
    for i, t in enumerate(trajs):
        row = t.to_dict()
        row.update(epoch=epoch, batch=batch)
        for j, st in enumerate(row["steps"]):
            st["observation"] = st["observation"][:160]
            if rubrics is not None:
                st["criteria"] = rubrics[at + j].criteria
                st["rubric_parsed"] = rubrics[at + j].parsed
                if not rubrics[at + j].parsed:
                    st["rubric_text"] = rubrics[at + j].text[:300]     # what μ wrote, kept when unparseable
                st["d"] = [round(x, 4) for x in d[at + j].tolist()]
                st["s"] = round(float(s[at + j]), 4)
            if info and "G" in info:
                st["G"] = round(info["G"][i][j], 4)
                st["bucket"] = info["buckets"][i][j]
            if A is not None:
                st["A"] = round(A[i][j], 4)
        at += len(t.steps)
        rows.append(row)
    return rows


def append_jsonl(path: Path, rows: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def save_checkpoint(folder: Path, pi, mu, opt_pi, opt_mu, epoch: int, history: list[dict],
                    next_batch: int = 0) -> None:
    """π's and μ's adapters (+ μ's score head), optimizer states and the metrics so far, as they
    are after `epoch` (or, with next_batch > 0, after batch next_batch − 1 of `epoch`: Ctrl-C).
    Written to a temporary folder, then renamed: a kill never leaves a half checkpoint."""
    from rubric_model import save_backbone
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_backbone(pi, tmp / "pi")
    if mu is not None:
        mu.save(tmp / "mu")
    torch.save({"opt_pi": opt_pi.state_dict(), "opt_mu": opt_mu.state_dict() if opt_mu else None}, tmp / "optim.pt")
    (tmp / "state.json").write_text(json.dumps({"epoch": epoch, "next_batch": next_batch, "history": history},
                                               indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


# ----------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------

def ensure_warmup(args: Args) -> Path:
    """π_sft/ and the μ this run needs (warmup.mu_dir_name) of the warmup (§3.2, App. B): the
    offline oracle warmup runs for whatever is missing. Runs that differ only in μ (the ablations,
    K, --mu-model) share one collection and one π SFT."""
    import warmup
    folder = Path(args.warmup_dir or Path(args.out_dir) / args.dataset / "warmup")
    need = ["pi_sft"] + ([] if args.reward == "outcome" else [mu_folder(args)])
    missing = [n for n in need if not (folder / n / "config.json").is_file()]
    if missing:
        print(f"[arco] {folder} has no {' or '.join(m + '/' for m in missing)}: running the offline oracle "
              f"warmup first (warmup.py)", flush=True)
        warmup.run_from_arco(args, folder)
    return folder


def mu_folder(args: Args) -> str:
    from warmup import mu_dir_name
    return mu_dir_name(args.rubric, args.k, args.mu_model, args.model)


def build_models(args: Args, warmup_dir: Path):
    """π and μ from the warmup, each with a fresh LoRA on top of the merged SFT weights: the
    frozen references π_ref and μ_ref are the same modules with the adapter disabled."""
    from rubric_model import RubricModel, add_lora, load_backbone_checkpoint, merge_lora
    pi, _ = load_backbone_checkpoint(warmup_dir / "pi_sft", device=args.device)
    if hasattr(pi.model, "peft_config"):
        merge_lora(pi)
    add_lora(pi)
    if args.reward == "outcome":
        return pi, None
    mu = RubricModel.load(warmup_dir / mu_folder(args), device=args.device)
    if mu.rubric_mode != args.rubric or mu.k != args.k:
        sys.exit(f"error: the warmup μ in {warmup_dir / mu_folder(args)} has rubric_mode={mu.rubric_mode}, "
                 f"K={mu.k}, but this run asks for --rubric {args.rubric} --k {args.k}")
    if hasattr(mu.backbone.model, "peft_config"):
        merge_lora(mu.backbone)
    add_lora(mu.backbone)
    return pi, mu


def iteration(pi, mu, opt_pi, opt_mu, batch, epoch: int, b: int, dense: bool, args: Args, retriever,
              run_dir: Path) -> dict:
    """One iteration of Algorithm 1 (lines 5–38) on one batch; appends its metrics and traces."""
    import env
    torch.manual_seed(args.seed * 1_000_003 + epoch * 1009 + b)   # resumable: sampling seeded per batch
    row: dict = {"kind": "update", "epoch": epoch, "batch": b, "dense": dense}
    t0 = time.time()
    group = [ex for ex in batch for _ in range(args.group_size)]
    trajs = env.rollout(group, policy_act(pi, args.rollout_temperature, args.max_new_tokens_pi, args.gen_batch),
                        retriever, args.max_searches, args.obs_chars)                    # lines 6–14
    row["seconds_rollout"] = time.time() - t0
    contexts = rubrics = d = s = None
    if mu is not None:
        t0 = time.time()
        contexts, rubrics, d, s = annotate(mu, trajs, args)                             # lines 15–19
        row["seconds_mu_annotate"] = time.time() - t0
    A, info = advantages(trajs, s, dense, args.alpha)                                   # lines 26–32
    t0 = time.time()
    row.update(policy_update(pi, opt_pi, trajs, A, args, args.kl_pi))                   # lines 33–35
    row["seconds_pi_update"] = time.time() - t0
    if mu is not None:
        t0 = time.time()
        row.update(rubric_update(mu, opt_mu, trajs, contexts, rubrics, args))           # lines 36–38
        row["seconds_mu_update"] = time.time() - t0
    steps = [st for t in trajs for st in t.steps]
    row.update(mean_R=sum(t.reward for t in trajs) / len(trajs),
               invalid_rate=sum(not st.valid for st in steps) / len(steps),
               mean_s=float(s.mean()) if s is not None else None,
               rubric_parse_rate=sum(r.parsed for r in rubrics) / len(rubrics) if rubrics else None,
               mean_G_per_bucket=info.get("mean_G_per_bucket"))
    append_jsonl(run_dir / "metrics.jsonl", [row])
    append_jsonl(run_dir / "traces" / f"epoch_{epoch}.jsonl", trace_rows(trajs, epoch, b, rubrics, d, s, A, info))
    return row


class CtrlC:
    """Ctrl-C during RL: the current batch finishes, a checkpoint is saved, the run exits
    (--resume continues from the next batch). A second Ctrl-C stops at once."""

    def __init__(self):
        self.requested = False

    def __enter__(self):
        self.previous = signal.signal(signal.SIGINT, self.handler)
        return self

    def handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\n[arco] Ctrl-C: finishing this batch, then saving a checkpoint (Ctrl-C again to quit at once)",
              flush=True)

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)


def rewrite_jsonl(path: Path, keep) -> None:
    """Keep the rows of a JSONL file for which keep(row) is true (what --resume redoes goes)."""
    if path.exists():
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in read_jsonl(path) if keep(r)))


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The latest finished state: the last epoch checkpoint, or a Ctrl-C checkpoint taken later."""
    epochs = sorted(int(p.name.split("_")[1]) for p in ckpt_dir.glob("epoch_*") if not p.name.endswith(".tmp"))
    last = ckpt_dir / f"epoch_{epochs[-1]}" if epochs else None
    stopped = ckpt_dir / "interrupted"
    if (stopped / "state.json").is_file():
        if last is None or json.loads((stopped / "state.json").read_text())["epoch"] > epochs[-1]:
            return stopped
    return last


def run(args: Args) -> Path:
    """Algorithm 1 end to end; returns the run folder."""
    import env
    run_dir = Path(args.out_dir) / args.dataset / args.name
    ckpt_dir = run_dir / "checkpoints"
    if run_dir.exists() and not args.resume and (run_dir / "metrics.jsonl").exists():
        sys.exit(f"error: {run_dir} already holds a run: pass --resume to continue it, or --name for a new one")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "args.json").write_text(json.dumps(asdict(args), indent=2) + "\n")

    warmup_dir = ensure_warmup(args)
    train = env.load_split(args.dataset, "train", args.data_dir or None, args.train_size, args.seed)
    dev = env.load_split(args.dataset, "dev", args.data_dir or None, args.eval_size, args.seed)
    retriever = env.Retriever()
    torch.manual_seed(args.seed)                 # the fresh LoRA adapters' initialization
    pi, mu = build_models(args, warmup_dir)
    from rubric_model import trainable_parameters
    opt_pi = torch.optim.AdamW(trainable_parameters(pi.model), lr=args.pi_lr_sparse, weight_decay=0.0)
    opt_mu = torch.optim.AdamW(mu.parameter_groups(args.mu_lr, args.head_lr), weight_decay=0.0) if mu else None

    history: list[dict] = []           # one row per evaluation (epoch 0 = before RL = "SFT only")
    start_epoch, start_batch = 1, 0
    last = latest_checkpoint(ckpt_dir) if args.resume else None
    if last is not None:
        pi, mu, opt_pi, opt_mu, start_epoch, start_batch, history = resume_from(last, args)
        done = lambda r: r.get("epoch", 0) < start_epoch or (r["epoch"] == start_epoch and r["kind"] == "update"
                                                            and r["batch"] < start_batch)
        rewrite_jsonl(run_dir / "metrics.jsonl", done)
        for f in (run_dir / "traces").glob("*epoch_*.jsonl"):
            if int(f.stem.split("_")[-1]) >= start_epoch:
                rewrite_jsonl(f, lambda r: not f.name.startswith("eval") and r["batch"] < start_batch
                              and r["epoch"] == start_epoch)
        print(f"[arco] resuming {run_dir} at epoch {start_epoch}, batch {start_batch}", flush=True)
    else:
        (run_dir / "metrics.jsonl").write_text("")
        shutil.rmtree(run_dir / "traces", ignore_errors=True)
        shutil.rmtree(ckpt_dir, ignore_errors=True)
        ev, rows = warmup_evaluation(warmup_dir, args)
        if ev is None:
            ev, trajs = evaluate_policy(pi, dev, args, retriever)
            rows = trace_rows(trajs, 0, -1)
        history.append({"epoch": 0, **ev})
        append_jsonl(run_dir / "metrics.jsonl", [{"kind": "eval", "epoch": 0, **ev}])
        append_jsonl(run_dir / "traces" / "eval_epoch_0.jsonl", rows)
        print(f"[arco] epoch 0 (SFT only): dev EM {ev['em']:.1f} F1 {ev['f1']:.1f}", flush=True)

    from tqdm import tqdm
    with CtrlC() as ctrl_c:
        for epoch in range(start_epoch, args.epochs + 1):                                    # Alg. 1, line 3
            dense = args.reward == "arco" and epoch >= args.dense_start_epoch                  # line 4
            for g in opt_pi.param_groups:
                g["lr"] = args.pi_lr_dense if dense else args.pi_lr_sparse
            order = list(range(len(train)))
            random.Random(f"{args.seed}-{epoch}").shuffle(order)
            batches = chunks([train[i] for i in order], args.batch_size)
            first = start_batch if epoch == start_epoch else 0
            bar = tqdm(range(first, len(batches)), desc=f"epoch {epoch} ({'dense' if dense else 'sparse'})")
            for b in bar:                                                                      # line 5
                try:
                    row = iteration(pi, mu, opt_pi, opt_mu, batches[b], epoch, b, dense, args, retriever, run_dir)
                except NonFiniteLoss as e:
                    kept = latest_checkpoint(ckpt_dir)
                    sys.exit(f"error: {e} at epoch {epoch}, batch {b}; nothing of this batch was saved. The last "
                             f"good checkpoint is {kept or 'none (no epoch finished yet)'}: lower the learning "
                             f"rates and rerun with --resume.")
                tqdm.write(f"[arco] epoch {epoch} batch {b}: R {row['mean_R']:.2f} policy loss "
                           f"{row['policy_loss']:+.4f} KLπ {row['kl_pi']:.4f}"
                           + (f" dec-MSE {row['decomposition_mse']:.4f} KLμ {row['kl_mu']:.4f} "
                              f"s̄ {row['mean_s']:+.3f}" if mu is not None else "")
                           + f" invalid {row['invalid_rate']:.2f}")
                if ctrl_c.requested and b + 1 < len(batches):
                    save_checkpoint(ckpt_dir / "interrupted", pi, mu, opt_pi, opt_mu, epoch, history, b + 1)
                    sys.exit(f"interrupted: checkpoint after epoch {epoch}, batch {b} saved in "
                             f"{ckpt_dir / 'interrupted'}; rerun the same command with --resume to continue")
            bar.close()
            ev, trajs = evaluate_policy(pi, dev, args, retriever)
            history.append({"epoch": epoch, "dense": dense, **ev})
            append_jsonl(run_dir / "metrics.jsonl", [{"kind": "eval", "epoch": epoch, **ev}])
            append_jsonl(run_dir / "traces" / f"eval_epoch_{epoch}.jsonl", trace_rows(trajs, epoch, -1))
            print(f"[arco] epoch {epoch}: dev EM {ev['em']:.1f} F1 {ev['f1']:.1f} "
                  f"invalid {ev['invalid_rate']:.2f}", flush=True)
            save_checkpoint(ckpt_dir / f"epoch_{epoch}", pi, mu, opt_pi, opt_mu, epoch, history)
            shutil.rmtree(ckpt_dir / "interrupted", ignore_errors=True)
            if ctrl_c.requested and epoch < args.epochs:
                sys.exit(f"interrupted: epoch {epoch} is saved in {ckpt_dir / f'epoch_{epoch}'}; rerun the "
                         f"same command with --resume to continue")
    write_selection(run_dir, history, args)
    write_report(run_dir, history, args)
    return run_dir


def resume_from(folder: Path, args: Args):
    """Rebuild π, μ and their optimizers as they were in a checkpoint; returns them with the
    epoch and batch to continue from and the evaluation history so far."""
    from rubric_model import RubricModel, load_backbone_checkpoint, trainable_parameters
    pi, _ = load_backbone_checkpoint(folder / "pi", device=args.device)
    mu = RubricModel.load(folder / "mu", device=args.device) if (folder / "mu").is_dir() else None
    state = torch.load(folder / "optim.pt", weights_only=True)
    opt_pi = torch.optim.AdamW(trainable_parameters(pi.model), lr=args.pi_lr_sparse, weight_decay=0.0)
    opt_pi.load_state_dict(state["opt_pi"])
    opt_mu = None
    if mu is not None:
        opt_mu = torch.optim.AdamW(mu.parameter_groups(args.mu_lr, args.head_lr), weight_decay=0.0)
        opt_mu.load_state_dict(state["opt_mu"])
    saved = json.loads((folder / "state.json").read_text())
    if saved.get("next_batch"):
        return pi, mu, opt_pi, opt_mu, saved["epoch"], saved["next_batch"], saved["history"]
    return pi, mu, opt_pi, opt_mu, saved["epoch"] + 1, 0, saved["history"]


def select_checkpoint(history: list[dict], dense_start_epoch: int) -> dict:
    """The paper's rule: the best dev-EM epoch after the dense transition (ties: the earlier);
    the best overall is recorded beside it."""
    trained = [h for h in history if h["epoch"] >= 1]
    post = [h for h in trained if h["epoch"] >= dense_start_epoch] or trained or history
    best_post = max(post, key=lambda h: (h["em"], -h["epoch"]))
    best_all = max(history, key=lambda h: (h["em"], -h["epoch"]))
    return {"selected_epoch": best_post["epoch"], "selected": best_post,
            "best_overall_epoch": best_all["epoch"], "best_overall": best_all}


def write_selection(run_dir: Path, history: list[dict], args: Args) -> dict:
    sel = select_checkpoint(history, args.dense_start_epoch)
    (run_dir / "selection.json").write_text(json.dumps(sel, indent=2) + "\n")
    return sel


def write_report(run_dir: Path, history: list[dict], args: Args) -> None:
    """report.md: the results per epoch, the selected checkpoint, and a few trajectories with rubrics."""
    sel = select_checkpoint(history, args.dense_start_epoch)
    lines = [f"# ARCO run `{run_dir.name}` on {args.dataset}", "",
             f"preset `{args.preset}`, reward `{args.reward}`, rubric `{args.rubric}`, K = {args.k}, "
             f"π = `{args.model}`, μ = `{args.mu_model}`; {args.train_size} train / {args.eval_size} dev questions, "
             f"{args.epochs} epochs (dense from {args.dense_start_epoch}).", "",
             "| epoch | phase | dev EM | dev F1 | searches / question | invalid steps |", "|---|---|---|---|---|---|"]
    for h in history:
        phase = "SFT only" if h["epoch"] == 0 else ("dense" if h.get("dense") else "sparse")
        lines.append(f"| {h['epoch']} | {phase} | {h['em']:.1f} | {h['f1']:.1f} | {h['mean_searches']:.2f} | "
                     f"{100 * h['invalid_rate']:.0f}% |")
    lines += ["", f"Selected (best dev EM after the dense transition, the paper's rule): epoch "
                  f"{sel['selected_epoch']} — EM {sel['selected']['em']:.1f}, F1 {sel['selected']['f1']:.1f}. "
                  f"Best overall: epoch {sel['best_overall_epoch']} (EM {sel['best_overall']['em']:.1f}).", ""]
    last = max((int(p.stem.split("_")[1]) for p in (run_dir / "traces").glob("epoch_*.jsonl")), default=None)
    if last is not None:
        lines += [f"## Sample training trajectories (epoch {last})", ""]
        for row in read_jsonl(run_dir / "traces" / f"epoch_{last}.jsonl")[:3]:
            lines += [f"**Q:** {row['question']}  **gold:** {row['gold'][0]}  **answer:** {row['answer'] or '—'}  "
                      f"**R = {row['reward']:.0f}**", ""]
            for i, st in enumerate(row["steps"], 1):
                act = f"{st['action'].capitalize()}[{st['argument']}]" if st["valid"] else f"invalid ({st['reason']})"
                extra = f" — s = {st['s']:+.3f}" if "s" in st else ""
                extra += f", G = {st['G']:+.3f}" if "G" in st else ""
                extra += f", A = {st['A']:+.3f}" if "A" in st else ""
                lines.append(f"{i}. `{act}`{extra}")
                for c, dj in zip(st.get("criteria", []), st.get("d", [])):
                    lines.append(f"    - ({dj:+.2f}) {c or '(no criterion)'}")
                if st.get("rubric_text"):
                    lines.append(f"    - μ wrote (unparseable): `{' '.join(st['rubric_text'].split())[:160]}`")
            lines.append("")
    (run_dir / "report.md").write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    from evaluate import parse_args
    args = resolve_args(parse_args(Args, argv, description=__doc__))
    import env
    try:
        run_dir = run(args)
    except env.DataError as e:
        sys.exit(f"error: {e}")
    print(f"[arco] done: {run_dir / 'report.md'}")


if __name__ == "__main__":
    main()
