"""ARCO, Algorithm 1: co-evolution of the policy π and the rubric model μ, in one command.

Paper: §3.2 (Eq. 3–5) and Appendix A (Algorithm 1).

    python arco.py --dataset hotpotqa                  # CPU preset: warmup (if needed), RL, evaluation, report
    python arco.py --dataset hotpotqa --preset paper   # Qwen3-4B-Instruct-2507 and the authors' release recipe
    python arco.py --dataset hotpotqa --preset paper --dry-run   # its schedule and loss scales, no model
    python arco.py --dataset synthetic --reward outcome        # the binary-EM REINFORCE baseline (no μ)
    python arco.py --dataset hotpotqa --rubric none            # Table 2's "w/o Rubric" (also: static, prefix-free)

The schedule (Alg. 1, lines 3–5; `epoch_plan`): `--sparse-epochs` epochs train π on R(τ) alone, the
rest on μ's dense rewards. An update takes `--batch-size` trajectories: batch_size / G questions × G
samples in a sparse epoch, batch_size questions × 1 in a dense one (the release's composition).

One iteration (Alg. 1, lines 5–38) over a batch B:

    rollout (π samples, env retrieves)       lines 6–14    env.rollout + rubric_model.generate
    rubrics r_t and scores d_t, s_t (μ)      lines 15–19   annotate()
    R(τ) = EM(answer, gold)                  line 23       env.rollout
    advantages: sparse R − mean R, or        lines 26–32   outcome_advantages / reward_to_go,
      dense α(G_t − Ḡ_{B,b}) by bucket                      step_buckets, bucketed_advantages
    π update: Eq. 3 with KL(π‖π_ref)         lines 33–35   policy_update() → policy_loss
    μ update: Eq. 5                          lines 36–38   rubric_update() → rubric_loss

The equations are small named functions, tested against hand-worked numbers that also live in
`tests/vectors.json` (so a port to another framework can check itself):

    reward_to_go          Eq. 3      G_{τ,t} = Σ_{k≥t} s_{τ,k}
    step_buckets          Eq. 3–4    b(τ,t) ∈ {search_1, …, search_n, terminal}
    bucketed_advantages   Eq. 4      A_{τ,t} = α (G_{τ,t} − Ḡ_{B,b(τ,t)})
    outcome_advantages    Alg. 1, l. 31   A_τ = R(τ) − mean R over the batch or the question's group
    reduce_tokens         Eq. 3, 5   a step's per-token KL: sum (paper) or mean (release) (rubric_model)
    policy_loss           Eq. 3      −(1/|B|) Σ_τ Σ_{t∈V_τ} A_{τ,t} log p_π(a_t|h_t) + λ_π L_KL
    class_weights         (release)  w_τ of the decomposition term
    decomposition_loss    Eq. 5      (1/|B|) Σ_τ w_τ (Σ_t s_t − R(τ))²
    rubric_loss           Eq. 5      decomposition_loss + β Σ_t KL_t / (steps or |B|)

Read top to bottom: the knobs (Args, each with its presets' values; those shared with warmup.py in warmup.Settings),
the schedule, the equations, one iteration, the run (Algorithm 1's outer loop); "Plumbing" after it is bookkeeping
(checks, warmup reuse, the one call each to the engines and torchrun's ranks, logs, checkpoints, --resume, Ctrl-C,
reports, the memory estimate). `--engine plain`: one forward per sequence, a plain sampling loop (the code to read).
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

import env
import warmup
from evaluate import MEMORY, UsageError, auc, main_guard, parse_args
from rubric_model import (ENGINES, HUB_SHAPES, ModelLoadError, RubricModel, add_lora, check_intact, check_model_available,
                          contexts_from_trajectory, copied_from_prompt, damaged, load_backbone_checkpoint, merge_lora, model_shape,
                          policy_act, policy_sequences, reduce_tokens, resolve_autocast, resolve_device, resolve_dtype,
                          save_backbone, trainable_parameters, training_passes, write_atomically, write_manifest)
from warmup import dev_rank, fill_from_preset, from_preset, mu_dir_name, preset_table


@dataclass
class Args(warmup.Settings):
    """arco.py's knobs; those it shares with warmup.py are declared once, in warmup.Settings."""
    dataset: str = field(default="hotpotqa", metadata={"help": "hotpotqa, 2wiki, musique, synthetic (2-hop worlds) or "
                                                                "synthetic-long (3-4 hops, look-alikes, budget 5)",
                                                        "choices": list(env.DATASETS)})
    name: str = field(default="", metadata={"help": "run name under runs/<dataset>/ (default: from --reward/--rubric/--k)"})
    out_dir: str = field(default="runs", metadata={"help": "root folder of all runs"})
    warmup_dir: str = field(default="", metadata={"help": "the warmup folder (pi_sft/, mu_sft*/; default "
                                                           "runs/<dataset>/warmup); what is missing is trained first"})
    resume: bool = field(default=False, metadata={"help": "continue a killed run from its last finished epoch"})
    dry_run: bool = field(default=False, metadata={"help": "print the training schedule and the loss scales, then exit "
                                                            "(no data, no model)"})
    reward: str = field(default="arco", metadata={"help": "arco (μ's dense rewards after the sparse epochs) or "
                                                           "outcome (binary-EM REINFORCE throughout, no μ: Search-R1-style)",
                                                  "choices": ["arco", "outcome"]})
    credit: str = field(default="mu", metadata={"help": "the dense epochs' s_t: mu (ARCO), or an analysis arm with no μ, "
                                                         "not ARCO (env.ground_truth_scores): projection (ground truth "
                                                         "shifted to Σ_t s_t = R) or causal (G_t = R − share of hops found)",
                                                 "choices": ["mu", "projection", "causal"]})
    mixed: bool = field(default=False, metadata={"help": "dense epochs add the outcome advantage: an analysis arm "
                                                          "beyond the paper (PRIME-style), not ARCO"})
    fork_from: str = field(default="", metadata={"path": "dir", "help": "start from another run's checkpoint folder "
                                                                         "(π, μ, optimizers, logs): a study's arms"})
    eval_every: int = field(default=0, metadata={"help": "evaluate on the first --curve-size dev questions every this "
                                                          "many updates too (a learning curve; 0: at epoch ends only)"})
    curve_size: int = field(default=200, metadata={"min": 1, "help": "dev questions of the --eval-every evaluations"})
    gpu_memory: float = field(default=80.0, metadata={"above": 0, "help": "GiB of the one device --dry-run's memory estimate "
                                                              "checks the run against (the paper: one 80 GB GPU)"})
    sampling: str = field(default="batch", metadata={
        "help": "π's random stream when sampling rollouts: batch (one draw over the generation batch, as "
                "transformers' generate) or trajectory (one seeded stream per trajectory: the same rollouts "
                "whatever the rank layout; a torchrun run needs it)", "choices": ["batch", "trajectory"]})
    # from_preset(paper=..., cpu=...): the --preset's value unless given (why each value: README's flag table)
    train_size: int | None = from_preset(paper=2000, cpu=8, min=1, help="training questions (paper 2,000)")
    epochs: int | None = from_preset(paper=8, cpu=2, min=1, help="RL epochs E (release 8)")
    sparse_epochs: int | None = from_preset(paper=3, cpu=1, help="epochs trained on R(τ) alone before the dense ones "
                                            "(release 3: dense_start_epoch 3, 0-based; Alg. 1's η = this + 1)")
    batch_size: int | None = from_preset(paper=64, cpu=16, min=1,
                                         help="trajectories per update (release 64): sparse epochs take batch_size / "
                                              "G questions × G samples, dense epochs batch_size questions × 1")
    dense_samples: int | None = from_preset(paper=1, cpu=1, min=1,
                                            help="samples per question in dense epochs (release 1; G: as many updates "
                                                 "per epoch as a sparse one, for matched comparisons)")
    group_size: int | None = from_preset(paper=4, cpu=4, min=1,
                                         help="G: samples per question in sparse epochs (release 4; Alg. 1's text: 1)")
    sparse_baseline: str | None = from_preset(paper="group", cpu="group", choices=["group", "batch"],
                                              help="baseline of R(τ) in sparse epochs: group (mean of the question's "
                                                   "G samples, release) or batch (mean over the batch, Alg. 1 line 31)")
    bucket_fallback: bool | None = from_preset(paper=True, cpu=True,
                                               help="a bucket with one step takes the batch's mean G as its baseline "
                                                    "(release) instead of its own G (Eq. 4: advantage 0)")
    class_balance: bool | None = from_preset(paper=True, cpu=True, help="weight Eq. 5's decomposition term so that "
                                             "successes and failures weigh alike (release; not in the paper)")
    rubric_temperature: float | None = from_preset(paper=0.0, cpu=0.0, help="μ's temperature for r_t: 0 = greedy "
                                                   "(release); the paper writes r_t ~ p_θ")
    pi_lr_sparse: float | None = from_preset(paper=1e-5, cpu=2e-4, help="π LoRA learning rate, sparse epochs (1e-5)")
    pi_lr_dense: float | None = from_preset(paper=3e-6, cpu=1e-4, help="π LoRA learning rate, dense epochs (3e-6)")
    mu_lr: float | None = from_preset(paper=1e-5, cpu=1e-5, help="μ LoRA learning rate (1e-5)")
    head_lr: float | None = from_preset(paper=5e-4, cpu=5e-5, help="μ score-head learning rate (5e-4)")
    kl_pi_sparse: float | None = from_preset(paper=0.0, cpu=0.0, help="λ_π in sparse epochs (Eq. 3; release 0, Alg. 1 "
                                             "line 35 has the KL in every epoch)")
    kl_pi_dense: float | None = from_preset(paper=0.05, cpu=0.05, help="λ_π in dense epochs (Eq. 3; release 0.05)")
    kl_mu: float | None = from_preset(paper=0.05, cpu=0.05, help="β, rubric-token KL(μ‖μ_ref) weight (Eq. 5; 0.05)")
    alpha: float | None = from_preset(paper=0.5, cpu=0.5, help="α, dense reward scale (Eq. 3; 0.5)")
    lora_dropout: float | None = from_preset(paper=0.05, cpu=0.05, below=1,
                                             help="dropout of π's and μ's RL LoRA adapters (release 0.05); 0 makes a "
                                                  "torchrun run's updates those of the single-process run")
    max_searches: int | None = field(default=None, metadata={"min": 1, "help": "search budget (default: 3, MuSiQue 6)"})
    warmup_questions: str | None = from_preset(paper="within", cpu="within", choices=["within", "before"],
                                               help="within: RL's training questions and the warmup's are the first "
                                                    "of one seeded order, so the fewer lie among the others (release: "
                                                    "its 1,000 warmup questions among its 2,000); before: RL's "
                                                    "training questions leave out every question of the warmup's "
                                                    "records (π was not fine-tuned on them)")


# --- The schedule (Alg. 1, lines 3–5) ---------------------------------------------------

def is_dense(epoch: int, args: Args) -> bool:
    """Alg. 1, line 4: use_dense ← (epoch ≥ η), epochs counted from 1, η = sparse_epochs + 1. The
    outcome baseline (no μ) is sparse throughout."""
    return args.reward == "arco" and epoch > args.sparse_epochs


def epoch_plan(args: Args, n_train: int) -> list[dict]:
    """Per epoch: its phase and batch composition, as the release makes them. `batch_size` counts
    trajectories: a sparse epoch takes batch_size / G questions × G samples each (GRPO-style groups),
    a dense epoch batch_size questions × 1 sample (the release; --dense-samples G matches a dense epoch's
    updates to a sparse one's, for a fair comparison of where the advantage comes from). Every epoch goes
    once through all n_train questions, the last batch smaller when they do not divide (no drop_last).
    `selectable` marks the epochs after the transition, among which the paper picks its checkpoint (§4.1)."""
    plan = []
    for epoch in range(1, args.epochs + 1):
        dense = is_dense(epoch, args)
        samples = args.dense_samples if dense else args.group_size
        questions = args.batch_size // samples
        plan.append({"epoch": epoch, "dense": dense, "questions_per_batch": questions, "samples": samples,
                     "trajectories_per_update": questions * samples, "updates": math.ceil(n_train / questions),
                     "pi_lr": args.pi_lr_dense if dense else args.pi_lr_sparse,
                     "kl_pi": args.kl_pi_dense if dense else args.kl_pi_sparse,
                     "selectable": epoch > args.sparse_epochs})
    return plan


def epoch_batches(train: Sequence, epoch: int, args: Args) -> list[list]:
    """The questions of each batch of an epoch (Alg. 1, line 5): a seeded shuffle of all training
    questions, cut into batches of epoch_plan's size (the last one may be smaller)."""
    order = list(range(len(train)))
    random.Random(f"{args.seed}-{epoch}").shuffle(order)
    return chunks([train[i] for i in order], epoch_plan(args, len(train))[epoch - 1]["questions_per_batch"])


# --- The equations (Eq. 3–5, Alg. 1 line 31) --------------------------------------------

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
                        valid: Sequence[Sequence[bool]], alpha: float,
                        singleton_fallback: bool = False) -> list[list[float]]:
    """A_{τ,t} = α (G_{τ,t} − Ḡ_{B,b(τ,t)}) over a batch of trajectories (Eq. 4; Alg. 1, line 29).

    Ḡ_{B,b} is the mean of G over I_b = the valid steps of the batch in bucket b. Steps outside
    V_τ get advantage 0 (they are left out of the policy loss). With `singleton_fallback` (the
    release's dense_bucket_fallback_to_global), a bucket holding one step takes the mean G of all
    the batch's valid steps as its baseline; Eq. 4 alone gives such a step advantage 0.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for g_tau, b_tau, v_tau in zip(G, buckets, valid):
        for g, b, ok in zip(g_tau, b_tau, v_tau):
            if ok:
                sums[b] = sums.get(b, 0.0) + g
                counts[b] = counts.get(b, 0) + 1
    batch_mean = sum(sums.values()) / max(1, sum(counts.values()))

    def baseline(b: str) -> float:
        return batch_mean if singleton_fallback and counts[b] == 1 else sums[b] / counts[b]
    return [[alpha * (g - baseline(b)) if ok else 0.0 for g, b, ok in zip(g_tau, b_tau, v_tau)]
            for g_tau, b_tau, v_tau in zip(G, buckets, valid)]


def outcome_advantages(R: Sequence[float], groups: Sequence | None = None) -> list[float]:
    """A_τ = R(τ) − the mean R of τ's group, shared by every valid step of τ (sparse epochs).

    `groups` names each trajectory's question: the baseline is then the mean of that question's G
    samples (the release, GRPO-style, without a division by the standard deviation). Without it the
    baseline is the mean over the whole batch, R(τ) − mean_B R, as Alg. 1, line 31 writes it.
    """
    keys = list(groups) if groups is not None else [None] * len(R)
    total: dict = {}
    for key, r in zip(keys, R):
        n, acc = total.get(key, (0, 0.0))
        total[key] = (n + 1, acc + float(r))
    return [float(r) - total[key][1] / total[key][0] for key, r in zip(keys, R)]


def policy_loss(logp: torch.Tensor, advantages: torch.Tensor, n_trajectories: int,
                kl_per_step: torch.Tensor | None = None, kl_pi: float = 0.0) -> torch.Tensor:
    """Eq. 3: −(1/|B|) Σ_τ Σ_{t∈V_τ} A_{τ,t} log p_π(a_t|h_t) + λ_π L_KL^π.

    `logp`, `advantages` and `kl_per_step` hold one entry per valid step: log p_π(a_t|h_t) is the sum
    of the action's token log-probs; α is already inside the advantages (Alg. 1, line 29); KL_t is the
    step's per-token KL(π ‖ π_ref) reduced over its tokens (reduce_tokens). L_KL^π = (1/|B|) Σ_τ Σ_t KL_t,
    the release's reduction (the paper says only "a token-level KL"). Pass the whole batch's |B| when
    accumulating over micro-batches: their losses then add up to the batch's.
    """
    loss = -(advantages.detach() * logp).sum() / n_trajectories
    if kl_per_step is not None and kl_per_step.numel() and kl_pi:
        loss = loss + kl_pi * kl_per_step.sum() / n_trajectories
    return loss


def class_weights(R: Sequence[float]) -> list[float]:
    """The release's weights of Eq. 5's decomposition term (not in the paper): successes (R > 0.5)
    weigh N / (2 n_success) each and failures N / (2 n_failure), so both classes weigh N / 2 in all
    (a count of 0 is taken as 1)."""
    n = len(R)
    pos = sum(float(r) > 0.5 for r in R)
    return [n / (2 * max(pos, 1)) if float(r) > 0.5 else n / (2 * max(n - pos, 1)) for r in R]


def decomposition_loss(s: torch.Tensor, trajectory: torch.Tensor, R: torch.Tensor,
                       n_trajectories: int | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 5, first term: (1/|B|) Σ_τ w_τ (Σ_{t=1}^{T} s_t − R(τ))², over all steps of each trajectory.

    `s` holds the step scores of every step, `trajectory` the index (into `R`) of the trajectory
    each step belongs to, `R` one outcome per trajectory, `weights` w_τ (1 in the paper; see
    class_weights). The sum runs over the trajectories with steps in `s`: a training pass holds whole
    trajectories, and the passes' terms add up to the batch's (`n_trajectories` = the batch's |B|).
    """
    sums = torch.zeros(len(R), dtype=s.dtype, device=s.device).index_add(0, trajectory, s)
    err = (sums - R.to(s.dtype)) ** 2
    if weights is not None:
        err = err * weights.to(s.dtype)
    present = torch.zeros(len(R), dtype=torch.bool, device=s.device).index_fill(0, trajectory, True)
    return err[present].sum() / (n_trajectories or len(R))


def rubric_loss(s: torch.Tensor, trajectory: torch.Tensor, R: torch.Tensor,
                kl_per_step: torch.Tensor | None = None, beta: float = 0.0, kl_divisor: int | None = None,
                n_trajectories: int | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 5: decomposition_loss + β · Σ_t KL_t / kl_divisor.

    KL_t is step t's per-token KL(p_θ ‖ p_θref) over its rubric's tokens, summed (the paper's Σ_i)
    or averaged (the release): reduce_tokens. The paper's E_{(h_t,a_t)} is the mean over the batch's
    steps (kl_divisor = the number of steps); the release sums over a trajectory's steps and divides
    by |B| (kl_divisor = |B|). When accumulating over micro-batches pass the whole batch's divisors.
    """
    loss = decomposition_loss(s, trajectory, R, n_trajectories, weights)
    if kl_per_step is not None and kl_per_step.numel() and beta:
        loss = loss + beta * kl_per_step.sum() / (kl_divisor or kl_per_step.numel())
    return loss


# --- One iteration of Algorithm 1 (lines 5–38) ------------------------------------------

def annotate(mu, trajs, args: Args) -> tuple[list, list, torch.Tensor, torch.Tensor]:
    """Alg. 1, lines 15–19: μ writes r_t for every step and scores it: d_t, s_t (Eq. 2).

    Returns the step contexts, the rubrics, d [N, K] and s [N] (no gradient), steps in
    trajectory order.
    """
    contexts = [c for t in trajs for c in contexts_from_trajectory(t)]
    return (contexts, *written_and_scored(mu, contexts, args))


def advantages(trajs, s: torch.Tensor | None, dense: bool, args: Args) -> tuple[list[list[float]], dict]:
    """Alg. 1, lines 26–32: per-step advantages; 0 on invalid steps (outside V_τ)."""
    valid = [[st.valid for st in t.steps] for t in trajs]
    info: dict = {}
    groups = [(t.example.dataset, t.example.id) for t in trajs] if args.sparse_baseline == "group" else None
    A_tau = outcome_advantages([t.reward for t in trajs], groups)                                  # line 31
    if not dense:
        return [[a if ok else 0.0 for ok in v] for a, v in zip(A_tau, valid)], info
    G = [reward_to_go(s[r.start:r.stop].tolist()) for r in env.step_ranges(trajs)]  # line 28, Eq. 3
    buckets = [step_buckets([st.action for st in t.steps], v) for t, v in zip(trajs, valid)]
    A = bucketed_advantages(G, buckets, valid, args.alpha, args.bucket_fallback)   # line 29, Eq. 4
    if args.mixed:              # the mixed analysis arm, not ARCO: A_t = A_outcome(τ) + α (G_t − Ḡ_b)
        A = [[a + o if ok else 0.0 for a, ok in zip(a_t, v)] for a_t, o, v in zip(A, A_tau, valid)]
    info = {"G": G, "buckets": buckets, "mean_G_per_bucket": bucket_means(G, buckets, valid)}
    return A, info


def policy_update(pi, optimizer, trajs, A: list[list[float]], args: Args, kl_pi: float) -> dict:
    """Alg. 1, lines 33–35: one gradient step on Eq. 3 over the batch's valid steps, λ_π = `kl_pi`."""
    steps = [(st, a) for t, a_t in zip(trajs, A) for st, a in zip(t.steps, a_t) if st.valid]          # V_τ
    n_valid = len(steps)
    if not kl_pi:     # with λ_π = 0 a step of advantage 0 adds nothing to Eq. 3's value or gradient: skipped
        steps = [(st, a) for st, a in steps if a != 0.0]
    seqs, lens = policy_sequences(pi, [st for st, _ in steps])                   # (h_t, a_t) as π reads them
    adv = torch.tensor([a for _, a in steps])
    pi.model.train()
    optimizer.zero_grad(set_to_none=True)
    loss_sum = kl_sum = 0.0
    for p in passes(pi, seqs, lens, args, kl=bool(kl_pi)):
        kl = reduce_tokens(p.kl, p.mask, args.token_reduction) if kl_pi else None     # KL_t(π ‖ π_ref)
        loss = policy_loss(p.logprobs.sum(-1), adv[p.index].to(p.logprobs.device), len(trajs), kl, kl_pi)  # Eq. 3
        loss.backward()
        loss_sum += float(loss.detach())
        kl_sum += float(p.kl.detach().sum()) if kl_pi else 0.0
    loss_sum, kl_sum = gradient_step(optimizer, "policy (Eq. 3)", loss_sum, kl_sum, step=n_valid > 0)
    pi.model.eval()
    return {"policy_loss": loss_sum, "kl_pi": kl_sum / max(sum(lens), 1), "policy_steps": n_valid}


def rubric_update(mu, optimizer, trajs, contexts, rubrics, args: Args) -> dict:
    """Alg. 1, lines 36–38: one gradient step on Eq. 5. Its decomposition term couples the steps of a
    trajectory, so each pass holds whole trajectories."""
    R = torch.tensor([float(t.reward) for t in trajs])
    w = torch.tensor(class_weights(R.tolist()) if args.class_balance else [1.0] * len(trajs))
    kl_divisor = len(trajs) if args.token_reduction == "mean" else len(contexts)       # see rubric_loss
    use_kl = bool(args.kl_mu) and mu.rubric_mode not in ("static", "none")     # no generated r_t to regularize
    seqs = mu.scoring_ids(contexts, rubrics)                                      # (q, h_t, a_t, r_t)
    lens = [len(r.token_ids) if use_kl else 0 for r in rubrics]
    of = torch.tensor([k for k, t in enumerate(trajs) for _ in t.steps])          # each step's trajectory
    mu.train()
    optimizer.zero_grad(set_to_none=True)
    loss_sum = mse = kl_sum = 0.0
    for p in passes(mu.backbone, seqs, lens, args, kl=use_kl, units=env.step_ranges(trajs)):
        s = mu.step_scores(p.pooled).s.float().cpu()                                                  # Eq. 2
        kl = reduce_tokens(p.kl, p.mask, args.token_reduction).float().cpu() if use_kl else None   # KL_t(μ ‖ μ_ref)
        loss = rubric_loss(s, of[p.index], R, kl, args.kl_mu, kl_divisor, len(trajs), w)             # Eq. 5
        loss.backward()
        loss_sum += float(loss.detach())
        mse += float(decomposition_loss(s.detach(), of[p.index], R, len(trajs)))
        kl_sum += float(p.kl.detach().sum()) if use_kl else 0.0
    loss_sum, mse, kl_sum = gradient_step(optimizer, "rubric-model (Eq. 5)", loss_sum, mse, kl_sum)
    mu.eval()
    with torch.no_grad():       # for the log: the same trajectories' decomposition error after the step (no LM head)
        after = sum(float(decomposition_loss(mu.step_scores(p.pooled).s.float().cpu(), of[p.index], R, len(trajs)))
                    for p in passes(mu.backbone, seqs, [0] * len(seqs), args, units=env.step_ranges(trajs)))
    return {"rubric_loss": loss_sum, "decomposition_mse": mse, "decomposition_mse_after": dp.sum(after)[0],
            "kl_mu": kl_sum / max(sum(lens), 1)}


def iteration(pi, mu, opt_pi, opt_mu, batch, epoch: int, b: int, phase: dict, args: Args, retriever,
              run_dir: Path) -> dict:
    """One iteration of Algorithm 1 (lines 5–38) on one batch, in the epoch's `phase` (an epoch_plan
    entry: sparse or dense, λ_π); appends its metrics and traces."""
    row: dict = {"kind": "update", "epoch": epoch, "batch": b, "dense": phase["dense"]}
    group = [ex for ex in batch for _ in range(phase["samples"])]           # B: G samples per question if sparse
    with timed(row, "rollout"):                  # plumbing: row["seconds_rollout"], the phase's memory
        trajs = sample_trajectories(pi, group, epoch, b, args, retriever)                    # lines 6–14
    contexts = rubrics = d = s = None
    if mu is not None:
        with timed(row, "mu_annotate"):
            contexts, rubrics, d, s = annotate(mu, trajs, args)                                  # lines 15–19
    if args.credit != "mu":                      # an analysis arm: ground-truth step scores in place of μ's
        s = torch.tensor([x for t in trajs for x in env.ground_truth_scores(t, args.credit)])
    A, info = advantages(trajs, s, phase["dense"], args)                                          # lines 26–32
    with timed(row, "pi_update"):
        row.update(policy_update(pi, opt_pi, trajs, A, args, phase["kl_pi"]))                      # lines 33–35
    if mu is not None:
        with timed(row, "mu_update"):
            row.update(rubric_update(mu, opt_mu, trajs, contexts, rubrics, args))                  # lines 36–38
    steps = [st for t in trajs for st in t.steps]
    row.update(trajectories=len(trajs), questions=len(batch), mean_R=sum(t.reward for t in trajs) / len(trajs),
               invalid_rate=sum(not st.valid for st in steps) / len(steps),
               mean_s=float(s.mean()) if s is not None else None,
               mean_G_per_bucket=info.get("mean_G_per_bucket"), peak_rss_gib=peak_rss_gib(),
               **mu_at_work(mu, trajs, contexts, rubrics, s), **credit_stats(trajs, s, A, info))
    log_iteration(run_dir, row, trace_rows(trajs, epoch, b, rubrics, d, s, A, info))
    return row


# --- The run: Algorithm 1 from the warmup to the selected checkpoint --------------------

def run(args: Args) -> Path:
    """Algorithm 1 end to end, the warmup first where it is missing; returns the run folder."""
    run_dir, last = open_run(args)                                   # plumbing: a new folder, or --resume's
    warmup_dir = ensure_warmup(args)                                 # §3.2, App. B: π_sft and μ_sft (rank 0)
    train = training_questions(args, warmup_dir)                     # D
    dev = env.load_split(args.dataset, "dev", args.data_dir or None, args.eval_size, args.seed)
    retriever = env.shared_retriever(args.retriever or None, args.retriever_pooling)       # R
    torch.manual_seed(args.seed)                 # the fresh LoRA adapters' initialization
    pi, mu = build_models(args, warmup_dir)                          # line 1: π ← π_sft, μ ← μ_sft
    opt_pi, opt_mu = make_optimizers(pi, mu, args)
    if last is None and args.fork_from:          # a study's arm: from the shared sparse phase's checkpoint
        last = fork(run_dir, Path(args.fork_from), args)
    if last is None:                             # epoch 0: the SFT-only policy's dev evaluation
        history, start_epoch, start_batch = [sft_only_evaluation(run_dir, warmup_dir, pi, dev, args, retriever)], 1, 0
    else:
        pi, mu, opt_pi, opt_mu, start_epoch, start_batch, history = resume_from(last, run_dir, args)

    try:
        with CtrlC() as ctrl_c:
            for epoch in range(start_epoch, args.epochs + 1):                                # Alg. 1, line 3
                phase = epoch_plan(args, len(train))[epoch - 1]             # line 4: sparse or dense, λ_π, lr
                for g in opt_pi.param_groups:
                    g["lr"] = phase["pi_lr"]
                batches = epoch_batches(train, epoch, args)
                first = start_batch if epoch == start_epoch else 0
                for b in progress(range(first, len(batches)), f"epoch {epoch} ({'dense' if phase['dense'] else 'sparse'})"):
                    row = iteration(pi, mu, opt_pi, opt_mu, batches[b], epoch, b, phase, args, retriever,
                                    run_dir)                                                   # lines 5–38
                    show(update_line(row, epoch, b))
                    if args.eval_every and (b + 1) % args.eval_every == 0 and b + 1 < len(batches):
                        learning_curve_point(run_dir, epoch, b, pi, dev[:args.curve_size], args, retriever)
                    if ctrl_c.agreed() and b + 1 < len(batches):
                        ctrl_c.stop(run_dir, pi, mu, opt_pi, opt_mu, epoch, history, b + 1)
                if args.eval_every_epoch or phase["selectable"] or epoch == args.epochs:   # the dev evaluation
                    ev, trajs = evaluate_policy(pi, dev, args, retriever)
                    history.append(log_evaluation(run_dir, epoch, ev, trace_rows(trajs, epoch, -1), phase["dense"]))
                save_checkpoint(run_dir / "checkpoints" / f"epoch_{epoch}", pi, mu, opt_pi, opt_mu, epoch, history)
                if ctrl_c.agreed() and epoch < args.epochs:
                    ctrl_c.stop(run_dir, pi, mu, opt_pi, opt_mu, epoch, history)
    except NonFiniteLoss as e:
        kept = latest_checkpoint(run_dir / "checkpoints")
        sys.exit(f"error: {e} at epoch {epoch}, batch {b}; nothing of this batch was saved. The last good "
                 f"checkpoint is {kept or 'none (no epoch finished yet)'}: lower the learning rates and rerun "
                 f"with --resume.")
    write_selection(run_dir, history, args)
    write_report(run_dir, history, args)
    return run_dir


def select_checkpoint(history: list[dict], sparse_epochs: int) -> dict:
    """The paper's rule (§4.1): the best dev-EM epoch after the dense transition, i.e. after the
    `sparse_epochs` sparse ones (EM ties: warmup.dev_rank, then the earlier); the best overall, epoch 0
    included, is recorded beside it. (The release has no selection code: its per-epoch evaluations are
    read by hand.)"""
    trained = [h for h in history if h["epoch"] >= 1]
    post = [h for h in trained if h["epoch"] > sparse_epochs] or trained or history
    best_post = max(post, key=lambda h: (*dev_rank(h), -h["epoch"]))
    best_all = max(history, key=lambda h: (*dev_rank(h), -h["epoch"]))
    return {"selected_epoch": best_post["epoch"], "selected": best_post,
            "best_overall_epoch": best_all["epoch"], "best_overall": best_all}


# ----------------------------------------------------------------------------------------
# Plumbing: the warmup and the models, evaluation logs, checkpoints, --resume, Ctrl-C, reports
# ----------------------------------------------------------------------------------------

PRESETS = preset_table(Args)        # {preset: {setting: value}}, read from the declarations of Args (and Settings)


def resolve_args(args: Args) -> Args:
    """Fill every preset-driven field the command line left unset, then check the combination."""
    if args.warmup_size is None and args.train_size is not None:     # a smaller --train-size shrinks the warmup too
        args.warmup_size = min(PRESETS[args.preset]["warmup_size"], args.train_size)
    fill_from_preset(args)
    if args.mu_model is None:
        args.mu_model = args.model
    if not args.name:
        args.name = "outcome" if args.reward == "outcome" else f"{args.credit}-oracle" if args.credit != "mu" else \
            "arco" + ("" if args.rubric == "adaptive" else f"-{args.rubric}") + ("" if args.k == 3 else f"-k{args.k}")
        args.name += "-mixed" if args.mixed else ""
    problems = []
    if not 0 <= args.sparse_epochs <= args.epochs:
        problems.append(f"--sparse-epochs {args.sparse_epochs} must be between 0 and --epochs {args.epochs}")
    if args.group_size < 1 or args.batch_size % args.group_size:
        problems.append(f"--batch-size {args.batch_size} (trajectories) must be a multiple of --group-size "
                        f"{args.group_size}")
    if args.sparse_baseline == "group" and args.group_size < 2 and (args.sparse_epochs or args.reward == "outcome"):
        problems.append("--sparse-baseline group needs --group-size 2 or more (one sample is its own baseline: A = 0)")
    if args.batch_size % args.dense_samples:
        problems.append(f"--batch-size {args.batch_size} (trajectories) must be a multiple of --dense-samples "
                        f"{args.dense_samples}")
    if (args.credit != "mu" or args.mixed) and args.reward == "outcome":
        problems.append(f"--credit {args.credit}{' --mixed' if args.mixed else ''} needs --reward arco (outcome RL "
                        f"has no dense epochs)")
    if args.mixed and args.sparse_baseline == "group" and args.dense_samples < 2:
        problems.append("--mixed with --sparse-baseline group needs --dense-samples 2 or more (its outcome advantage "
                        "is R minus the question's mean)")
    if args.rubric_format == "slots" and args.rubric in ("adaptive", "prefix-free") and args.max_new_tokens_mu < 4 * args.k:
        problems.append(f"--rubric-format slots writes {args.k} numbered criteria of at least one word each: "
                        f"--max-new-tokens-mu must be at least {4 * args.k}, got {args.max_new_tokens_mu}")
    if problems:
        sys.exit("error: " + "; ".join(problems))
    return args


def chunks(items: Sequence, size: int) -> list:
    return [items[i:i + size] for i in range(0, len(items), max(1, size))]


class NonFiniteLoss(FloatingPointError):
    pass


def check_finite(name: str, value: float) -> None:
    """Stop before a NaN or inf loss reaches the weights (the run keeps its last good checkpoint)."""
    if not math.isfinite(value):
        raise NonFiniteLoss(f"the {name} loss is {value}")


def ensure_warmup(args: Args) -> Path:
    """π_sft/ and the μ this run needs (warmup.mu_dir_name) of the warmup (§3.2, App. B): the
    offline oracle warmup runs for whatever is missing. Runs that differ only in μ (the ablations,
    K, --mu-model) share one collection and one π SFT."""
    folder = Path(args.warmup_dir or Path(args.out_dir) / args.dataset / "warmup")
    need = ["pi_sft"] + ([mu_folder(args)] if uses_mu(args) else [])
    warmup.check_retriever(folder, args.retriever, args.retriever_pooling)
    for name in need[1:]:                     # μ's folder, when this run needs one
        warmup.check_mu_settings(folder, name, args)
    missing = [n for n in need if not (folder / n / "config.json").is_file()]
    for name in set(need) - set(missing):
        check_intact(folder / name)           # a damaged warmup model is named before anything loads
    dp.barrier()                              # every rank has read the folder before rank 0 writes in it
    if missing and dp.main:
        print(f"[arco] {folder} has no {' or '.join(m + '/' for m in missing)}: running the offline oracle "
              f"warmup first (warmup.py)", flush=True)
        warmup.run_from_arco(args, folder)
    dp.barrier()                              # under torchrun the other ranks wait for rank 0's warmup
    return folder


def training_questions(args: Args, warmup_dir: Path) -> list:
    """Alg. 1's training set D: train_size questions of the seeded training order (env.sample). The warmup
    (warmup.run_from_arco) takes the first warmup_size of the same order; `--warmup-questions within` starts
    D there too, so the smaller set lies in the larger (the release: its 1,000 warmup questions are among
    its 2,000; the `cpu` preset: its 8 RL questions are among its 150 warmup questions — on HotpotQA the
    only ones a 135M π ever solves); `before` leaves out every question of the warmup's records (RL on
    questions π was not fine-tuned on)."""
    if args.warmup_questions == "within":
        return env.load_split(args.dataset, "train", args.data_dir or None, args.train_size, args.seed)
    taught = {r["id"] for path in warmup_dir.glob("records*.jsonl") for r in env.read_jsonl(path)}
    order = env.load_split(args.dataset, "train", args.data_dir or None, len(taught) + args.train_size, args.seed)
    questions = [q for q in order if q.id not in taught][:args.train_size]
    if not questions:
        sys.exit(f"error: the {args.dataset} training split has no question the warmup in {warmup_dir} did not "
                 f"use; lower --warmup-size or pass --warmup-questions within")
    if len(questions) < args.train_size:
        print(f"[arco] note: {len(questions)} training questions besides the warmup's (asked {args.train_size})",
              flush=True)
    return questions


def uses_mu(args: Args) -> bool:
    """ARCO trains μ; outcome RL and the ground-truth arms (--credit projection | causal) have none."""
    return args.reward == "arco" and args.credit == "mu"


def mu_folder(args: Args) -> str:
    return mu_dir_name(asdict(args))


def build_models(args: Args, warmup_dir: Path):
    """π and μ from the warmup, each with a fresh LoRA on top of the merged SFT weights: the
    frozen references π_ref and μ_ref are the same modules with the adapter disabled."""
    load = dict(device=args.device, dtype=args.dtype, autocast=args.autocast, engine=args.engine)
    pi, _ = load_backbone_checkpoint(warmup_dir / "pi_sft", **load)
    if hasattr(pi.model, "peft_config"):
        merge_lora(pi)
    add_lora(pi, dropout=args.lora_dropout)
    if not uses_mu(args):
        return pi, None
    mu = RubricModel.load(warmup_dir / mu_folder(args), **load)
    if mu.rubric_mode != args.rubric or mu.k != args.k:
        sys.exit(f"error: the warmup μ in {warmup_dir / mu_folder(args)} has rubric_mode={mu.rubric_mode}, "
                 f"K={mu.k}, but this run asks for --rubric {args.rubric} --k {args.k}")
    if hasattr(mu.backbone.model, "peft_config"):
        merge_lora(mu.backbone)
    add_lora(mu.backbone, dropout=args.lora_dropout)
    return pi, mu


def make_optimizers(pi, mu, args: Args):
    """AdamW for π's LoRA and for μ (its LoRA and score head, with their own learning rates), with the
    release's weight decay; π's learning rate is set per epoch (sparse or dense)."""
    opt_pi = torch.optim.AdamW(trainable_parameters(pi.model), lr=args.pi_lr_sparse, weight_decay=args.weight_decay)
    opt_mu = torch.optim.AdamW(mu.parameter_groups(args.mu_lr, args.head_lr), weight_decay=args.weight_decay) \
        if mu is not None else None
    return opt_pi, opt_mu


def evaluate_policy(pi, examples, args: Args, retriever) -> tuple[dict, list]:
    """Greedy dev evaluation (env.evaluate): EM, F1, searches, invalid-step rate. Under torchrun each rank
    evaluates its share of the questions; the numbers are those of all of them."""
    act = policy_act(pi, 0.0, args.max_new_tokens_pi, args.gen_batch)
    with MEMORY.phase("dev evaluation"):
        trajs = dp.gather(env.rollout(examples[dp.share(len(examples))], act, retriever, args.max_searches,
                                      args.obs_chars, progress=True))
    return env.dev_metrics(trajs), trajs


def warmup_evaluation(warmup_dir: Path, args: Args) -> tuple[dict | None, list[dict]]:
    """The warmup's SFT-only dev evaluation, when it was made with this run's settings: epoch 0
    is then not evaluated again. (π at epoch 0 is π_sft plus a fresh LoRA whose B = 0, which
    adds exact zeros: greedy decoding gives the same trajectories; tests/test_arco.py checks it.)"""
    path = warmup_dir / "metrics.json"
    metrics = json.loads(path.read_text()) if path.is_file() else {}
    wanted = epoch0_settings(args)
    traces = warmup_dir / "eval_sft_only.jsonl"
    if args.max_searches is not None:
        return None, []
    if metrics.get("sft_only_settings") != wanted or not traces.is_file():
        cached = sft_only_cache(warmup_dir, wanted)          # another run's evaluation of the same π_sft
        if not (cached / "traces.jsonl").is_file():
            return None, []
        metrics, traces = json.loads((cached / "metrics.json").read_text()), cached / "traces.jsonl"
    rows = [{**r, "epoch": 0, "batch": -1} for r in env.read_jsonl(traces)]
    for r in rows:
        for st in r["steps"]:
            st["observation"] = st["observation"][:160]
    if dp.main:
        print(f"[arco] epoch 0 (SFT only): the warmup's evaluation, same settings ({traces})", flush=True)
    return metrics["sft_only"], rows


def open_run(args: Args) -> tuple[Path, Path | None]:
    """The run folder (args.json written), and with --resume the checkpoint to continue from."""
    run_dir = Path(args.out_dir) / args.dataset / args.name
    ckpt_dir = run_dir / "checkpoints"
    if run_dir.exists() and not args.resume and (run_dir / "metrics.jsonl").exists():
        sys.exit(f"error: {run_dir} already holds a run: pass --resume to continue it, or --name for a new one")
    last = latest_checkpoint(ckpt_dir) if args.resume else None
    if args.resume and last is None:
        if not (run_dir / "args.json").is_file():
            sys.exit(f"error: --resume: there is no run at {run_dir} to continue; check --name / --out-dir")
        if dp.main:                           # killed before its first checkpoint: the run starts again
            print(f"[arco] --resume: {ckpt_dir} holds no checkpoint yet: starting the run again from its "
                  f"beginning (the warmup keeps what it finished)", flush=True)
            rewrite_jsonl(run_dir / "metrics.jsonl", lambda r: False)
            shutil.rmtree(run_dir / "traces", ignore_errors=True)
    dp.barrier()                              # every rank has checked before rank 0 writes anything
    if dp.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        env.write_json(run_dir / "args.json", asdict(args))
    return run_dir, last


def sft_only_evaluation(run_dir: Path, warmup_dir: Path, pi, dev, args: Args, retriever) -> dict:
    """A new run starts with empty logs and epoch 0: the SFT-only policy on the dev questions (the
    warmup's own evaluation when it was made with this run's settings)."""
    if dp.main:
        (run_dir / "metrics.jsonl").write_text("")
        shutil.rmtree(run_dir / "traces", ignore_errors=True)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    ev, rows = warmup_evaluation(warmup_dir, args)
    if ev is None:
        ev, trajs = evaluate_policy(pi, dev, args, retriever)
        rows = trace_rows(trajs, 0, -1)
        if dp.main and args.max_searches is None:  # kept beside the warmup: the next run of its settings reuses it
            wanted = epoch0_settings(args)

            def write(tmp: Path) -> None:
                env.write_jsonl(tmp / "traces.jsonl", [{k: v for k, v in r.items() if k not in ("epoch", "batch")}
                                                       for r in rows])
                env.write_json(tmp / "metrics.json", {"sft_only": ev, "sft_only_settings": wanted})
            write_atomically(sft_only_cache(warmup_dir, wanted), write)
    return log_evaluation(run_dir, 0, ev, rows)


def epoch0_settings(args: Args) -> dict:
    """What decides the SFT-only dev evaluation (warmup.eval_settings): the same, the same trajectories."""
    return warmup.eval_settings(args.eval_size, args.seed, args.max_new_tokens_pi, args.obs_chars, args.gen_batch)


def sft_only_cache(warmup_dir: Path, wanted: dict) -> Path:
    """Where the SFT-only evaluations made by runs (not by the warmup) are kept, one folder per settings:
    the arms of a study that share a warmup and a seed evaluate epoch 0 once."""
    return warmup_dir / "sft_only_evaluations" / hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()[:16]


def log_evaluation(run_dir: Path, epoch: int, ev: dict, rows: list[dict], dense: bool | None = None) -> dict:
    """One dev evaluation into metrics.jsonl and traces/eval_epoch_<epoch>.jsonl; returns its history row."""
    if dp.main:
        env.write_jsonl(run_dir / "metrics.jsonl", [{"kind": "eval", "epoch": epoch, **ev}], append=True)
        env.write_jsonl(run_dir / "traces" / f"eval_epoch_{epoch}.jsonl", rows, append=True)
        print(f"[arco] epoch {epoch}{' (SFT only)' if epoch == 0 else ''}: dev EM {ev['em']:.1f} F1 {ev['f1']:.1f} "
              f"invalid {ev['invalid_rate']:.2f} (peak RSS so far {peak_rss_gib():.1f} GiB)", flush=True)
    return {"epoch": epoch, **ev} if dense is None else {"epoch": epoch, "dense": dense, **ev}


def update_line(row: dict, epoch: int, b: int) -> str:
    """The one-line log of an update (every number is also in metrics.jsonl)."""
    mu_part = (f" dec-MSE {row['decomposition_mse']:.4f} → {row['decomposition_mse_after']:.4f} KLμ {row['kl_mu']:.4f}"
               f" s̄ {row['mean_s']:+.3f}" if "rubric_loss" in row else "")
    if row.get("rubric_parse_rate") is not None:
        mu_part += f" K-criteria {100 * row['rubric_parse_rate']:.0f}% copied {100 * row['copied_rate']:.0f}%"
    if "sum_auc" in row:
        mu_part += f" AUC(Σs,R) {'—' if row['sum_auc'] is None else format(row['sum_auc'], '.2f')}"
    return (f"[arco] epoch {epoch} batch {b}: R {row['mean_R']:.2f} policy loss {row['policy_loss']:+.4f} "
            f"KLπ {row['kl_pi']:.4f}{mu_part} invalid {row['invalid_rate']:.2f}")


def resume_from(folder: Path, run_dir: Path, args: Args):
    """Rebuild π, μ and their optimizers as they were in a checkpoint, and drop from the logs what
    comes after it; returns them with the epoch and batch to continue from and the evaluations so far."""
    load = dict(device=args.device, dtype=args.dtype, autocast=args.autocast, engine=args.engine)
    pi, _ = load_backbone_checkpoint(folder / "pi", **load)
    mu = RubricModel.load(folder / "mu", **load) if (folder / "mu").is_dir() and uses_mu(args) else None
    state = torch.load(folder / "optim.pt", weights_only=True, map_location="cpu")
    opt_pi, opt_mu = make_optimizers(pi, mu, args)
    opt_pi.load_state_dict(state["opt_pi"])
    if mu is not None:
        opt_mu.load_state_dict(state["opt_mu"])
    saved = json.loads((folder / "state.json").read_text())
    epoch, batch = (saved["epoch"], saved["next_batch"]) if saved.get("next_batch") else (saved["epoch"] + 1, 0)
    if not dp.main:
        return pi, mu, opt_pi, opt_mu, epoch, batch, saved["history"]
    rewrite_jsonl(run_dir / "metrics.jsonl", lambda r: r.get("epoch", 0) < epoch or (
        r["epoch"] == epoch and r["kind"] in ("update", "curve") and r["batch"] < batch))
    for f in (run_dir / "traces").glob("*epoch_*.jsonl"):
        if int(f.stem.split("_")[-1]) >= epoch:
            rewrite_jsonl(f, lambda r: not f.name.startswith("eval") and r["batch"] < batch and r["epoch"] == epoch)
    print(f"[arco] resuming {run_dir} at epoch {epoch}, batch {batch}", flush=True)
    return pi, mu, opt_pi, opt_mu, epoch, batch, saved["history"]


def trace_rows(trajs, epoch: int, batch: int, rubrics=None, d=None, s=None, A=None, info=None) -> list[dict]:
    """One JSON row per trajectory: every step's action, observation head, criteria, d_t, s_t, G_t, A_t."""
    rows = []
    for i, (t, flat) in enumerate(zip(trajs, env.step_ranges(trajs))):
        row = t.to_dict()
        row.update(epoch=epoch, batch=batch)
        for j, (st, useful) in enumerate(zip(row["steps"], env.step_usefulness(t))):
            st["observation"] = st["observation"][:160]
            st["useful"] = useful                 # the ground-truth label (env.step_usefulness), for μ's AUC
            if rubrics is not None:
                st["criteria"] = rubrics[flat[j]].criteria
                st["rubric_parsed"] = rubrics[flat[j]].complete          # K criteria (Rubric.complete)
                if not rubrics[flat[j]].complete:
                    st["rubric_text"] = rubrics[flat[j]].text[:300]     # what μ wrote, kept when unparseable
                st["d"] = [round(x, 4) for x in d[flat[j]].tolist()]
            if s is not None:
                st["s"] = round(float(s[flat[j]]), 4)
            if info and "G" in info:
                st["G"] = round(info["G"][i][j], 4)
                st["bucket"] = info["buckets"][i][j]
            if A is not None:
                st["A"] = round(A[i][j], 4)
        rows.append(row)
    return rows


@contextlib.contextmanager
def timed(row: dict, key: str):
    """row["seconds_<key>"], and the phase's resident memory in the run's memory profile (evaluate.MEMORY)."""
    t0 = time.time()
    with MEMORY.phase(key):
        yield
    row[f"seconds_{key}"] = time.time() - t0


def peak_rss_gib() -> float:
    """The process's peak resident memory so far in GiB (Linux reports KiB), logged with every update."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def save_checkpoint(folder: Path, pi, mu, opt_pi, opt_mu, epoch: int, history: list[dict],
                    next_batch: int = 0) -> None:
    """π's and μ's adapters (+ μ's score head), optimizer states and the metrics so far, as they
    are after `epoch` (or, with next_batch > 0, after batch next_batch − 1 of `epoch`: Ctrl-C).
    Written to a temporary folder, then renamed: a kill never leaves a half checkpoint. Under torchrun
    every rank holds the same weights and optimizer states: rank 0 writes them."""
    if not dp.main:
        return
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_backbone(pi, tmp / "pi")
    if mu is not None:
        mu.save(tmp / "mu")
    torch.save({"opt_pi": opt_pi.state_dict(), "opt_mu": opt_mu.state_dict() if opt_mu else None}, tmp / "optim.pt")
    (tmp / "state.json").write_text(json.dumps({"epoch": epoch, "next_batch": next_batch, "history": history},
                                               indent=1))
    write_manifest(tmp)                       # what it holds, checked by --resume (latest_checkpoint)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    if not next_batch:                        # an epoch's checkpoint supersedes a Ctrl-C one taken before it
        shutil.rmtree(folder.with_name("interrupted"), ignore_errors=True)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The latest intact finished state: the last epoch checkpoint, or a Ctrl-C checkpoint taken later. A
    damaged one (a file cut short or changed since its manifest was written) is named and passed over for
    the one before it; when every one is damaged, the run stops naming the folder."""
    epochs = sorted(int(p.name.split("_")[1]) for p in ckpt_dir.glob("epoch_*") if not p.name.endswith(".tmp"))
    found = [ckpt_dir / f"epoch_{e}" for e in reversed(epochs)]
    stopped = ckpt_dir / "interrupted"
    if (stopped / "state.json").is_file():
        at = json.loads((stopped / "state.json").read_text())["epoch"]
        found.insert(sum(e >= at for e in epochs), stopped)     # after the epochs it follows, newest first
    for folder in found:
        problem = damaged(folder)
        if problem is None:
            return folder
        print(f"[arco] checkpoint {folder.name} is damaged ({problem}): passing over it", flush=True)
    if found:
        raise UsageError(f"--resume: every checkpoint in {ckpt_dir} is damaged (see above); start afresh under "
                         f"another --name")
    return None


def rewrite_jsonl(path: Path, keep) -> None:
    """Keep the rows of a JSONL file for which keep(row) is true (what --resume redoes goes)."""
    if path.exists():
        env.write_jsonl(path, [r for r in env.read_jsonl(path) if keep(r)])


class DataParallel:
    """torchrun's ranks (WORLD_SIZE, RANK, LOCAL_RANK in the environment): each rank rolls out, annotates and
    backpropagates its share of a batch; what the equations need of the whole batch is gathered. One
    process (a plain `python arco.py`): rank 0 of 1, and every method below returns its input."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        self.main = self.rank == 0
        self.device = torch.device("cpu")

    def start(self, args: Args) -> None:
        """Join the process group: NCCL on CUDA (each rank its GPU, cuda:LOCAL_RANK), gloo on CPU."""
        if self.world == 1:
            return
        if args.sampling != "trajectory":
            sys.exit("error: a torchrun run needs --sampling trajectory (each trajectory its own random stream, so "
                     "the rollouts do not depend on how the batch is split across ranks)")
        if args.device.startswith("cuda:"):
            sys.exit(f"error: under torchrun each rank takes its own GPU (cuda:LOCAL_RANK): pass --device cuda or "
                     f"auto, not {args.device} (CUDA_VISIBLE_DEVICES chooses which GPUs)")
        cuda = torch.cuda.is_available() and args.device in ("auto", "cuda")
        if cuda:
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(args.device)
            self.device = torch.device(args.device)
        # a long timeout: the other ranks wait at a barrier while rank 0 makes the warmup
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=12))

    def share(self, n: int) -> slice:
        """This rank's contiguous share of n items (the first n % world ranks take one more)."""
        q, r = divmod(n, self.world)
        start = self.rank * q + min(self.rank, r)
        return slice(start, start + q + (self.rank < r))

    def gather(self, items: list) -> list:
        """Every rank's `items`, concatenated in rank order: with share(), the batch's own order."""
        if self.world == 1:
            return items
        out: list = [None] * self.world
        dist.all_gather_object(out, items)
        return [x for part in out for x in part]

    def sum(self, *values: float) -> list[float]:
        """Each value summed over the ranks."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        return bool(self.sum(float(flag))[0]) if self.world > 1 else flag

    def sum_gradients(self, params) -> None:
        """Each gradient summed over the ranks (the losses already divide by the whole batch's |B|)."""
        if self.world == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])          # one all-reduce for all of them
        dist.all_reduce(flat)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p.grad))

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def end(self) -> None:
        """Leave the process group together (a rank that leaves alone can abort its peer's last call)."""
        if self.world > 1:
            dist.barrier()
            dist.destroy_process_group()


dp = DataParallel()


# What the algorithm functions call to reach the engines and the ranks: one call each.

def written_and_scored(mu, contexts: list, args: Args) -> tuple[list, torch.Tensor, torch.Tensor]:
    """μ.annotate over the steps, each torchrun rank on its share (in_shares): the rubrics, d and s."""
    mu.eval()

    def written(cs):
        if not cs:                                    # (a rank's share may be empty)
            return []
        rubrics, sc = mu.annotate(cs, args.rubric_temperature, args.max_new_tokens_mu, args.gen_batch)
        return list(zip(rubrics, sc.d.float().cpu(), sc.s.float().cpu()))
    out = in_shares(written, contexts)
    if not out:
        return [], torch.zeros(0, args.k), torch.zeros(0)
    rubrics, d, s = zip(*out)
    return list(rubrics), torch.stack(d), torch.stack(s)


def mu_at_work(mu, trajs, contexts, rubrics, s) -> dict:
    """What the log and the report show of μ at each update (README, "the default run"): the share of steps
    whose rubric gives K criteria (`rubric_parse_rate`), the share of the written criteria that are a piece of
    μ's own prompt copied verbatim (`copied_rate`, rubric_model.copied_from_prompt), and the AUC of μ's verdict
    Σ_t s_t against R(τ) over the update's trajectories (`sum_auc`; None when every R is the same)."""
    if mu is None or s is None:
        return {}
    out: dict = {"sum_auc": auc([float(s[r.start:r.stop].sum()) for r in env.step_ranges(trajs)],
                                [t.reward > 0.5 for t in trajs])}
    if mu.rubric_mode in ("static", "none"):
        return out
    written = [(c, ctx) for ctx, r in zip(contexts, rubrics) for c in r.criteria if c.strip()]
    out["rubric_parse_rate"] = sum(r.complete for r in rubrics) / max(1, len(rubrics))
    out["copied_rate"] = sum(copied_from_prompt(c, mu.prompt_text(ctx)) for c, ctx in written) / max(1, len(written))
    return out


def bucket_means(G, buckets, valid) -> dict:
    """For the log: the mean G_t of each bucket's valid steps (Eq. 4's Ḡ_{B,b})."""
    per_bucket: dict[str, list[float]] = {}
    for g_t, b_t, v_t in zip(G, buckets, valid):
        for g, b, ok in zip(g_t, b_t, v_t):
            if ok:
                per_bucket.setdefault(b, []).append(g)
    return {b: sum(v) / len(v) for b, v in per_bucket.items()}


def credit_stats(trajs, s, A, info) -> dict:
    """For the log of a dense or μ-scored update (issue 41): the mean s_t by step type and position
    (`search@1`, `finish@4`, …; valid steps), the correlation over the batch of Σ_t s_t − R(τ) with the number of
    searches (does the credit reward length?), and each bucket holding one valid step (Eq. 4's singleton, where
    --bucket-fallback puts the batch's mean G as its baseline) with the advantage that step got."""
    if s is None:
        return {}
    by: dict[str, list[float]] = {}
    excess, searches = [], []
    for t, r in zip(trajs, env.step_ranges(trajs)):
        scores = s[r.start:r.stop].tolist()
        for i, (st, x) in enumerate(zip(t.steps, scores), 1):
            if st.valid:
                by.setdefault(f"{st.action}@{i}", []).append(x)
        excess.append(sum(scores) - t.reward)
        searches.append(sum(st.valid and st.action == "search" for st in t.steps))
    sd = (float(torch.tensor(excess).std()), float(torch.tensor(searches, dtype=torch.float).std())) \
        if len(trajs) > 1 else (0.0, 0.0)
    # none where either does not vary; Σ_t s_t = R by construction (the oracles) leaves rounding error only
    corr = float(torch.corrcoef(torch.tensor([excess, searches], dtype=torch.float))[0, 1]) \
        if sd[0] > 1e-5 and sd[1] > 0 else None
    singletons = []
    if "buckets" in info:
        counts: dict = {}
        for t, b_t in zip(trajs, info["buckets"]):
            for st, b in zip(t.steps, b_t):
                if b is not None and st.valid:            # Eq. 4's I_b: valid steps, as bucketed_advantages
                    counts[b] = counts.get(b, 0) + 1
        singletons = [{"bucket": b, "action": st.action, "A": a} for t, b_t, a_t in zip(trajs, info["buckets"], A)
                      for st, b, a in zip(t.steps, b_t, a_t) if b is not None and st.valid and counts[b] == 1]
    return {"mean_s_by_step": {k: sum(v) / len(v) for k, v in sorted(by.items())},
            "corr_excess_searches": corr, "singleton_buckets": singletons}


def fork(run_dir: Path, checkpoint: Path, args: Args) -> Path:
    """--fork-from: a study's arm starts from another run's checkpoint (issue 41: the arms share Algorithm 1's
    sparse phase, then fork at the dense transition): that run's logs are copied in, and resume_from then loads
    π, μ, both optimizers and the history from the checkpoint and cuts the logs there."""
    parent = checkpoint.parent.parent
    if not (checkpoint / "state.json").is_file():
        sys.exit(f"error: --fork-from {checkpoint}: not a checkpoint folder (no state.json); give "
                 f"runs/<dataset>/<run>/checkpoints/epoch_K")
    if uses_mu(args) and not (checkpoint / "mu" / "config.json").is_file():
        sys.exit(f"error: --fork-from {checkpoint} holds no μ, and this run (ARCO) needs one: fork from an ARCO run")
    mu_config = (checkpoint / "mu" / "config.json")       # read, not loaded: resume_from loads μ itself
    if uses_mu(args) and json.loads(mu_config.read_text())["rubric_model"]["rubric_mode"] != args.rubric:
        sys.exit(f"error: the μ in {checkpoint} is not a --rubric {args.rubric} μ: fork from a run of that μ")
    if dp.main:
        shutil.copyfile(parent / "metrics.jsonl", run_dir / "metrics.jsonl")
        shutil.rmtree(run_dir / "traces", ignore_errors=True)
        shutil.copytree(parent / "traces", run_dir / "traces")
        print(f"[arco] forking {run_dir} from {checkpoint}", flush=True)
    dp.barrier()
    return checkpoint


def learning_curve_point(run_dir: Path, epoch: int, b: int, pi, dev, args: Args, retriever) -> None:
    """--eval-every: a greedy evaluation on the first --curve-size dev questions after update b, logged as a
    `curve` row of metrics.jsonl (its traces in traces/curve_epoch_<epoch>.jsonl)."""
    ev, trajs = evaluate_policy(pi, dev, args, retriever)
    if dp.main:
        env.write_jsonl(run_dir / "metrics.jsonl", [{"kind": "curve", "epoch": epoch, "batch": b, **ev}], append=True)
        env.write_jsonl(run_dir / "traces" / f"curve_epoch_{epoch}.jsonl", trace_rows(trajs, epoch, b), append=True)
        print(f"[arco] epoch {epoch} after batch {b}: dev EM {ev['em']:.1f} on {len(dev)} questions", flush=True)


def passes(bb, seqs, lens, args: Args, kl: bool = False, units=None):
    """The training passes of an update (rubric_model.training_passes, by the --engine the model was loaded
    with) within --pass-tokens; under torchrun, this rank's share of the units (gradient_step sums the gradients)."""
    return training_passes(bb, seqs, lens, kl, args.pass_tokens, units, dp.share)


def gradient_step(optimizer, what: str, *totals: float, step: bool = True) -> list[float]:
    """After an update's passes: its logged totals summed over the ranks, a NaN or inf loss (the first
    total) stopped before the weights, then one optimizer step on the ranks' summed gradients, clipped
    to norm 1 (the release). A parameter no pass reached gets a zero gradient, as if the skipped steps
    had been computed: AdamW's moments and weight decay then move exactly as they would have."""
    totals = dp.sum(*totals)
    if step:
        check_finite(what, totals[0])
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        dp.sum_gradients(params)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
    return totals


def in_shares(fn, items: list) -> list:
    """fn (a list → as many results) on this rank's share of `items`; every rank gets all the results, in
    order. One process: fn(items)."""
    return dp.gather(fn(items[dp.share(len(items))]))


def sample_trajectories(pi, group: list, epoch: int, b: int, args: Args, retriever) -> list:
    """π's rollouts of one batch (env.rollout, Alg. 1 lines 6–14), seeded per batch (a resumed run draws the
    same) or per trajectory (--sampling trajectory: the same whatever the rank layout); under torchrun each
    rank rolls out its share, then draws its own LoRA dropout masks."""
    seed = args.seed * 1_000_003 + epoch * 1009 + b
    torch.manual_seed(seed)
    act = policy_act(pi, args.rollout_temperature, args.max_new_tokens_pi, args.gen_batch)
    seeds = [(seed * 4096 + j) % 2 ** 56 for j in range(len(group))] if args.sampling == "trajectory" else None
    mine = dp.share(len(group))
    trajs = dp.gather(env.rollout(group[mine], act, retriever, args.max_searches, args.obs_chars,
                                  seeds=seeds[mine] if seeds else None))
    if dp.world > 1:
        torch.manual_seed(seed * 64 + dp.rank)
    return trajs


def log_iteration(run_dir: Path, row: dict, traces: list[dict]) -> None:
    if dp.main:
        env.write_jsonl(run_dir / "metrics.jsonl", [row], append=True)
        env.write_jsonl(run_dir / "traces" / f"epoch_{row['epoch']}.jsonl", traces, append=True)


def progress(items, desc: str):
    from tqdm import tqdm
    return tqdm(items, desc=desc, disable=not dp.main)


def show(line: str) -> None:
    if dp.main:
        from tqdm import tqdm
        tqdm.write(line)


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

    def agreed(self) -> bool:
        """Whether any rank was asked to stop (one process: this one); every rank then stops at the same batch."""
        return dp.any(self.requested)

    def stop(self, run_dir: Path, pi, mu, opt_pi, opt_mu, epoch: int, history: list[dict], next_batch: int = 0):
        """Exit at a Ctrl-C: mid-epoch after saving the `interrupted` checkpoint (continuing at
        next_batch), at an epoch's end with its epoch checkpoint already saved."""
        folder = run_dir / "checkpoints" / (f"epoch_{epoch}" if not next_batch else "interrupted")
        if next_batch:
            save_checkpoint(folder, pi, mu, opt_pi, opt_mu, epoch, history, next_batch)
        dp.barrier()                          # no rank exits (torchrun then ends the others) before rank 0 has saved
        sys.exit(f"interrupted: the state after epoch {epoch}" + (f", batch {next_batch - 1}," if next_batch else "")
                 + f" is saved in {folder}; rerun the same command with --resume to continue")

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)


def write_selection(run_dir: Path, history: list[dict], args: Args) -> dict:
    sel = select_checkpoint(history, args.sparse_epochs)
    if not dp.main:
        return sel
    env.write_json(run_dir / "selection.json", sel)
    return sel


def write_report(run_dir: Path, history: list[dict], args: Args) -> None:
    """report.md: the results per epoch, the selected checkpoint, and a few trajectories with rubrics."""
    if not dp.main:
        return
    env.write_json(run_dir / "memory.json", MEMORY.rows())      # the resident memory by phase (RESULTS)
    sel = select_checkpoint(history, args.sparse_epochs)
    lines = [f"# ARCO run `{run_dir.name}` on {args.dataset}", "",
             f"preset `{args.preset}`, reward `{args.reward}`, rubric `{args.rubric}`, K = {args.k}, "
             f"π = `{args.model}`, μ = `{args.mu_model}`; {args.train_size} train / {args.eval_size} dev questions, "
             f"{args.epochs} epochs, the first {args.sparse_epochs} sparse.", "",
             "| epoch | phase | dev EM | dev F1 | searches / question | invalid steps |", "|---|---|---|---|---|---|"]
    for h in history:
        phase = "SFT only" if h["epoch"] == 0 else ("dense" if h.get("dense") else "sparse")
        lines.append(f"| {h['epoch']} | {phase} | {h['em']:.1f} | {h['f1']:.1f} | {h['mean_searches']:.2f} | "
                     f"{100 * h['invalid_rate']:.0f}% |")
    lines += ["", f"Selected (best dev EM after the dense transition, the paper's rule): epoch "
                  f"{sel['selected_epoch']} — EM {sel['selected']['em']:.1f}, F1 {sel['selected']['f1']:.1f}. "
                  f"Best overall: epoch {sel['best_overall_epoch']} (EM {sel['best_overall']['em']:.1f}).", ""]
    lines += mu_report(run_dir)
    last = max((int(p.stem.split("_")[1]) for p in (run_dir / "traces").glob("epoch_*.jsonl")), default=None)
    if last is not None:
        lines += [f"## Sample training trajectories (epoch {last})", ""]
        for row in env.read_jsonl(run_dir / "traces" / f"epoch_{last}.jsonl")[:3]:
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


MU_COLUMNS = (("rubric_parse_rate", "K criteria"), ("copied_rate", "copied from μ's prompt"),
              ("sum_auc", "AUC of Σ_t s_t for R"), ("decomposition_mse", "decomposition error (Eq. 5)"))


def mu_report(run_dir: Path) -> list[str]:
    """report.md's "μ at work": per update, the share of steps whose rubric gives K criteria, the share of criteria
    copied from μ's prompt, the AUC of Σ_t s_t against R and the decomposition error before and after the update's
    Eq. 5 step (mu_at_work, rubric_update), and the same in a figure (mu.png)."""
    rows = [r for r in env.read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "update" and "mean_s" in r
            and r["mean_s"] is not None]
    if not rows:
        return []
    pct = lambda x: "—" if x is None else f"{100 * x:.0f}%"
    num = lambda x, f=".2f": "—" if x is None else format(x, f)
    lines = ["## μ at work", "",
             "Per update: the share of steps whose rubric gives K criteria, the share of criteria that copy a piece of "
             "μ's own prompt verbatim, the AUC of μ's verdict Σ_t s_t for R(τ) = 1 over the update's trajectories (0.5: "
             "chance; — where every R is the same), and Eq. 5's decomposition error mean_τ (Σ_t s_t − R(τ))² on the "
             "update's trajectories before and after μ's step.", "",
             "| update | phase | trajectories (R = 1) | K criteria | copied | AUC(Σs, R) | mean s_t | decomposition error, "
             "before → after |", "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        n = r["trajectories"]
        lines.append(f"| {i} (epoch {r['epoch']}, batch {r['batch']}) | {'dense' if r['dense'] else 'sparse'} | {n} "
                     f"({round(r['mean_R'] * n)}) | {pct(r.get('rubric_parse_rate'))} | {pct(r.get('copied_rate'))} | "
                     f"{num(r.get('sum_auc'))} | {r['mean_s']:+.3f} | {num(r.get('decomposition_mse'), '.3f')} → "
                     f"{num(r.get('decomposition_mse_after'), '.3f')} |")
    plot_mu(rows, run_dir / "mu.png")
    return lines + ["", "![μ at work](mu.png)", ""]


def plot_mu(rows: list[dict], path: Path) -> None:
    """mu.png: MU_COLUMNS over the updates, one small panel each."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(10, 2.4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    x = list(range(1, len(rows) + 1))
    for k, (key, title) in enumerate(MU_COLUMNS):
        ax = fig.add_subplot(1, len(MU_COLUMNS), k + 1)
        pts = [(i, r.get(key)) for i, r in zip(x, rows) if r.get(key) is not None]
        ax.plot([i for i, _ in pts], [y for _, y in pts], marker="o", label="before μ's step" if k == 3 else None)
        if key == "decomposition_mse":
            after = [(i, r.get("decomposition_mse_after")) for i, r in zip(x, rows)
                     if r.get("decomposition_mse_after") is not None]
            ax.plot([i for i, _ in after], [y for _, y in after], marker="x", linestyle="--", label="after")
            ax.legend(fontsize=7)
        else:
            ax.set_ylim(0, 1.02)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("update", fontsize=8)
        ax.set_xticks(x)
        ax.grid(alpha=0.3)
    fig.savefig(path, format="png")


def describe_plan(args: Args, n_train: int) -> str:
    """What --dry-run prints: the schedule, the updates per epoch and the loss scales."""
    plan = epoch_plan(args, n_train)
    lines = [f"preset {args.preset}, dataset {args.dataset}, reward {args.reward}: {n_train} training questions "
             f"(--train-size; fewer if the data holds fewer), {args.eval_size} dev questions, π = {args.model}, "
             f"μ = {args.mu_model if uses_mu(args) else '(none)'}"]
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
        f"  Eq. 3: −(1/|B|) Σ_τ Σ_t A_t log π(a_t|h_t) + λ_π (1/|B|) Σ_τ Σ_t {per_step}_i KL(π‖π_ref)_i",
        f"  Eq. 5: (1/|B|) Σ_τ w_τ (Σ_t s_t − R)²  [w: {'class-balanced' if args.class_balance else '1'}]"
        f" + β {args.kl_mu:g} · " + ("(1/|B|) Σ_τ Σ_t mean_i KL(μ‖μ_ref)_i" if args.token_reduction == "mean"
                                   else "mean_t Σ_i KL(μ‖μ_ref)_i"),
        "  Eq. 7: " + ("mean over tokens of −log p(r̃) + 10 · mean over steps × K of (d − ŝ)²"
                       if args.token_reduction == "mean" else "mean over steps of [Σ_i −log p(r̃_i) + 10 ‖d − ŝ‖²]"),
        f"  optimizer: AdamW, weight decay {args.weight_decay:g}; μ lr {args.mu_lr:g}, score head {args.head_lr:g}; "
        f"rubrics {'greedy' if not args.rubric_temperature else f'sampled at T {args.rubric_temperature:g}'}",
        f"warmup: {args.warmup_size} questions ({'among' if args.warmup_questions == 'within' else 'apart from'} "
        f"RL's) × {args.warmup_samples} teacher trajectories; π SFT {args.sft_epochs_pi} epochs (lr {args.sft_lr_pi:g}, "
        f"batch {args.sft_batch_pi}, best dev EM kept), μ SFT on "
        f"{f'the first {args.sft_questions_mu} questions' if args.sft_questions_mu else 'every question'}, "
        f"{args.sft_epochs_mu} epochs (lr {args.sft_lr_mu:g}, head {args.sft_head_lr:g}, batch {args.sft_batch_mu}, "
        f"last kept){f', then {args.sft_head_steps} steps on the score head alone' if args.sft_head_steps else ''}"]
    return "\n".join(lines)


# The memory estimate (--dry-run, benchmark.py loop): the peak on one device, from the models' shapes alone


GIB = 2 ** 30
RUNTIME_GIB = 1.0            # the process before any model: torch, transformers, the retriever, the data (CPU);
                             # the CUDA context and allocator slack on a GPU. Calibrated in RESULTS ("memory")


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


def memory_estimate(args: Args) -> dict:
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


def main(argv: Sequence[str] | None = None) -> None:
    args = resolve_args(parse_args(Args, argv, description=__doc__))
    if args.dry_run:
        print(describe_plan(args, args.train_size))
        print(memory_estimate(args)["text"])
        return
    for name in {args.model, args.mu_model}:        # before any folder: a model that cannot be had here
        check_model_available(name)
    dp.start(args)
    try:
        run_dir = run(args)
    except env.DataError as e:
        sys.exit(f"error: {e}")
    if dp.main:
        print(f"[arco] done: {run_dir / 'report.md'}")
    dp.end()


if __name__ == "__main__":
    main_guard(main, env.DataError, ModelLoadError)
