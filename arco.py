"""ARCO, Algorithm 1: co-evolution of the policy π and the rubric model μ, in one command.

Paper: §3.2 (Eq. 3–5) and Appendix A (Algorithm 1).

    python arco.py --dataset hotpotqa                  # CPU preset: warmup (if needed), RL, evaluation, report
    python arco.py --dataset hotpotqa --preset paper   # Qwen3-4B-Instruct-2507 and the authors' release recipe
    python arco.py --dataset hotpotqa --preset paper --dry-run   # its schedule, loss scales and memory estimate, no model
    python arco.py --dataset synthetic --reward outcome        # the binary-EM REINFORCE baseline (no μ)
    python arco.py --dataset hotpotqa --rubric none            # Table 2's "w/o Rubric" (also: static, prefix-free)

The schedule (Alg. 1, lines 3–5; `epoch_plan`): `--sparse-epochs` epochs train π on R(τ) alone, the
rest on μ's dense rewards. An update takes `--batch-size` trajectories: batch_size / G questions × G
samples in a sparse epoch, batch_size questions × 1 in a dense one (the release's composition).

One iteration (Alg. 1, lines 5–38) over a batch B:

    rollout (π samples, env retrieves)       lines 6–14    sample_trajectories → env.rollout
    rubrics r_t and scores d_t, s_t (μ)      lines 15–19   annotate → RubricModel.annotate
    R(τ) = EM(answer, gold)                  line 23       env.rollout
    advantages: sparse R − mean R, or        lines 26–32   outcome_advantages / reward_to_go,
      dense α(G_t − Ḡ_{B,b}) by bucket                      step_buckets, bucketed_advantages
    π update: Eq. 3 with KL(π‖π_ref)         lines 33–35   policy_update → policy_loss
    μ update: Eq. 5                          lines 36–38   rubric_update → rubric_loss

The equations are small named functions (reward_to_go, step_buckets, bucketed_advantages, outcome_advantages,
token_kl, reduce_tokens, policy_loss, class_weights, decomposition_loss, rubric_loss), tested against hand-worked
numbers that also live in `tests/vectors.json`, so a port to another framework can check itself; `reference` is
π_ref and μ_ref. Every engine's passes compute with them.

Read top to bottom: the knobs (Args, each with its presets' values; those it shares with warmup.py are declared in
the script of their section: warmup.Settings, env.EnvSettings, rubric_model.MuSettings), the schedule, the equations, the one seam (step scorers and advantage estimators registered
by name), one iteration, the run (Algorithm 1's outer loop), main. What runs a run — its folder, logs,
checkpoints, --resume, Ctrl-C, the report — is in the package beneath (infra/), and so are the model passes and
the split of a batch among torchrun's processes (`workers`, infra/parallel.py: in one process it hands back what it
is given). `--engine plain`: one forward per sequence, a plain sampling loop (the code to read).
"""
from __future__ import annotations

import importlib
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

import env
import warmup
from infra.data import DataError
from infra.engines import loading
from infra.estimate import describe_plan, memory_estimate
from infra.memory import MEMORY, peak_rss_gib, timed
from infra.models import ModelLoadError, check_model_available, fresh_adapter, load_backbone_checkpoint, trainable_parameters
from infra.parallel import ALONE, Workers
from infra.passes import policy_act, policy_sequences, training_passes
from infra.runs import (CtrlC, NonFiniteLoss, RunFolder, check_finite, keep_scheme, latest_checkpoint, mu_at_work,
                        trace_rows, update_line)
from infra.settings import fill_from_preset, from_preset, main_guard, parse_args, preset_table
from infra.warmups import eval_settings, sft_only
from rubric_model import RubricModel, contexts_from_trajectory, mean_pool


@dataclass
class Args(warmup.Settings):
    """arco.py's knobs: those it shares with warmup.py (warmup.Settings: the data, device and engines, π's rollout
    in env.py, μ's form in rubric_model.py, the warmup's), then Algorithm 1's own."""
    name: str = field(default="", metadata={"help": "run name under runs/<dataset>/ (default: from --reward/--rubric/--k)"})
    resume: bool = field(default=False, metadata={"help": "continue a killed run from its last finished epoch"})
    dry_run: bool = field(default=False, metadata={"help": "print the training schedule, the loss scales and the memory estimate, "
                                                            "then exit (no data, no model)"})
    mu_error_after: bool = field(default=True, metadata={
        "help": "log μ's decomposition error on each batch after its step too (one more forward of μ, for the log and "
                "the report only: about a fifth of a μ update at the cpu preset)"})
    reward: str = field(default="arco", metadata={"help": "arco (μ's dense rewards after the sparse epochs) or "
                                                           "outcome (binary-EM REINFORCE throughout, no μ: Search-R1-style)",
                                                  "choices": ["arco", "outcome"]})
    scorer: str | None = field(default=None, metadata={
        "help": "the dense epochs' s_t: mu (μ, Alg. 1 lines 15–19: ARCO) or a step scorer a --plugin registers "
                "(arco.register_scorer; then no μ is built). Unset: mu, or what the run (--resume) or its parent "
                "(--init-from) ran with"})
    estimator: str | None = field(default=None, metadata={
        "help": "the advantages of Alg. 1 lines 26–32: arco (`advantages`) or an estimator a --plugin registers "
                "(arco.register_estimator). Unset: arco, or as the run or its parent ran"})
    plugin: list[str] | None = field(default=None, metadata={
        "help": "modules imported first, which register scorers and estimators (e.g. lab.study: the mixed estimator, "
                "the synthetic worlds' oracles). Unset: none, or as the run or its parent ran"})
    init_from: str = field(default="", metadata={"path": "dir", "help": "start from another run's checkpoint folder "
                                                                         "(its π, μ, optimizers and logs), e.g. "
                                                                         "runs/<dataset>/<run>/checkpoints/epoch_1"})
    gpu_memory: float = field(default=80.0, metadata={"above": 0, "help": "GiB of the one device --dry-run's memory estimate "
                                                              "checks the run against (our default: one 80 GB GPU; the paper names no device)"})
    sampling: str = field(default="batch", metadata={
        "help": "π's random stream when sampling rollouts: batch (one draw over the generation batch, as "
                "transformers' generate) or trajectory (one seeded stream per trajectory: the same rollouts "
                "whatever the rank layout; a torchrun run needs it)", "choices": ["batch", "trajectory"]})
    # from_preset(paper=..., cpu=...): the --preset's value unless given (why each value: CHOICES.md's flag table)
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
    class_balance: bool | None = from_preset(paper=True, cpu=False, help="weight Eq. 5's decomposition term so that "
                                             "successes and failures weigh alike (release; not in the paper)")
    pi_lr_sparse: float | None = from_preset(paper=1e-5, cpu=2e-4, help="π LoRA learning rate, sparse epochs (1e-5)")
    pi_lr_dense: float | None = from_preset(paper=3e-6, cpu=1e-4, help="π LoRA learning rate, dense epochs (3e-6)")
    mu_lr: float | None = from_preset(paper=1e-5, cpu=1e-5, help="μ LoRA learning rate (1e-5)")
    head_lr: float | None = from_preset(paper=5e-4, cpu=5e-5, help="μ score-head learning rate (5e-4)")
    kl_pi_sparse: float | None = from_preset(paper=0.0, cpu=0.0, help="λ_π in sparse epochs (Eq. 3; release 0, Alg. 1 "
                                             "line 35 has the KL in every epoch)")
    kl_pi_dense: float | None = from_preset(paper=0.05, cpu=0.05, help="λ_π in dense epochs (Eq. 3; release 0.05)")
    kl_mu: float | None = from_preset(paper=0.05, cpu=0.05, help="β, rubric-token KL(μ‖μ_ref) weight (Eq. 5; 0.05)")
    alpha: float | None = from_preset(paper=0.5, cpu=0.5, help="α, dense reward scale (Eq. 3; 0.5)")
    logprob_temperature: str | None = from_preset(
        paper="1", cpu="1", choices=["1", "rollout"],
        help="the temperature of Eq. 3's log π(a_t|h_t) and of its KL: 1 (release: the logits as they are, though π "
             "samples at --rollout-temperature) or rollout (logits / --rollout-temperature, the distribution π "
             "sampled from, as verl and TRL: then a constant advantage moves π by zero in expectation)")
    lora_dropout: float | None = from_preset(paper=0.05, cpu=0.05, below=1,
                                             help="dropout of π's and μ's RL LoRA adapters (release 0.05); 0 makes a "
                                                  "torchrun run's updates those of the single-process run")
    warmup_questions: str | None = from_preset(paper="within", cpu="within", choices=["within", "before"],
                                               help="within: RL's training questions and the warmup's are the first "
                                                    "of one seeded order, so the fewer lie among the others (release: "
                                                    "its 1,000 warmup questions among its 2,000); before: RL's "
                                                    "training questions leave out every question of the warmup's "
                                                    "records (π was not fine-tuned on them)")


# --- The schedule (Alg. 1, lines 3–5) ----------------------------------------------------------------------------------


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
    size = max(1, epoch_plan(args, len(train))[epoch - 1]["questions_per_batch"])
    return [[train[i] for i in order[k:k + size]] for k in range(0, len(order), size)]


# --- The equations (Eq. 3–5, Alg. 1 line 31) ---------------------------------------------------------------------------


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
    buckets, k = [], 0                       # k: how many valid searches so far
    for t, (a, ok) in enumerate(zip(actions, valid)):
        if t == len(actions) - 1:
            buckets.append(TERMINAL)
        elif ok and a == "search":
            k += 1
            buckets.append(f"search_{k}")
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
    sums, counts = bucket_sums(G, buckets, valid)
    batch_mean = sum(sums.values()) / max(1, sum(counts.values()))

    def baseline(b: str) -> float:
        return batch_mean if singleton_fallback and counts[b] == 1 else sums[b] / counts[b]
    return [[alpha * (g - baseline(b)) if ok else 0.0 for g, b, ok in zip(g_tau, b_tau, v_tau)]
            for g_tau, b_tau, v_tau in zip(G, buckets, valid)]


def bucket_sums(G: Sequence[Sequence[float]], buckets: Sequence[Sequence[str | None]],
                valid: Sequence[Sequence[bool]]) -> tuple[dict[str, float], dict[str, int]]:
    """Eq. 4's I_b over a batch: the sum of G over the valid steps in bucket b, and their count |I_b| (so
    Ḡ_{B,b} = sum / count; the log keeps these means)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for g_tau, b_tau, v_tau in zip(G, buckets, valid):
        for g, b, ok in zip(g_tau, b_tau, v_tau):
            if ok:
                sums[b] = sums.get(b, 0.0) + g
                counts[b] = counts.get(b, 0) + 1
    return sums, counts


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


def token_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """The token-level KL of Eq. 3 (π to π_ref) and Eq. 5 (μ to μ_ref) at each position: KL(p_θ ‖ p_ref) =
    Σ_v p_θ(v) (log p_θ(v) − log p_ref(v)), exact over the vocabulary, from the two log-softmaxes [..., V] → [...].
    The direction the paper writes (the release computes KL(p_ref ‖ p_θ)); every engine's passes call this
    function (training_passes' `kl`)."""
    return (logp.exp() * (logp - ref_logp)).sum(-1)


def reduce_tokens(per_token: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """One number per step from a per-token quantity [B, R] (zero at padding): the sum over the step's tokens (the
    paper's Σ_i in Eq. 3 and 5) or their mean (the release; --token-reduction). → [B]."""
    total = (per_token * mask).sum(-1)
    return total if how == "sum" else total / mask.sum(-1).clamp_min(1)


def reference(bb):
    """π_ref and μ_ref (§3.2; Eq. 3's and Eq. 5's KL): the frozen SFT model each starts RL from. start_from merged
    the SFT adapter into the weights and trains a fresh LoRA on top, so the reference is the same module with that
    adapter disabled — no copy of a weight. The passes compute p_ref inside this context (training_passes'
    `reference`)."""
    return bb.model.disable_adapter()


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


# --- The one seam: step scorers and advantage estimators, registered by name (verl's pattern) ----------------------
# ARCO is --scorer mu --estimator arco (μ's step scores, the estimator `advantages` below). An analysis beyond the
# paper (the lab's oracles and its mixed arm) registers its own function under a name, in a module --plugin imports,
# and runs Algorithm 1 with it: python arco.py --plugin lab.study --estimator mixed. The run's args.json keeps the
# three, and --resume keeps them (infra.runs.keep_scheme).

@dataclass
class CreditBatch:
    """What an advantage estimator receives (Alg. 1, lines 26–32)."""
    trajs: list                         # the batch B (env.Trajectory: its steps, their validity, R(τ))
    s: torch.Tensor | None              # s_t of every step, flat in trajectory order (μ's or a scorer's); None: neither
    dense: bool                         # epoch ≥ η (Alg. 1, line 4)
    args: "Args"                        # the run's settings (α, --sparse-baseline, --bucket-fallback, ...)


@dataclass
class Advantages:
    """What an advantage estimator returns: A_{τ,t} for every step (0 outside V_τ), and for the log of a dense update
    Eq. 3–4's intermediates (each step's G_t and bucket in the traces, Ḡ_{B,b} in the update's row)."""
    A: list[list[float]]
    G: list[list[float]] | None = None
    buckets: list[list[str | None]] | None = None
    mean_G_per_bucket: dict[str, float] | None = None


StepScorer = Callable[[list], torch.Tensor]
"""(the batch's trajectories) → s_t of every step, flat in trajectory order, in place of μ's (lines 15–19)."""
Estimator = Callable[[CreditBatch], Advantages]
"""A CreditBatch → its Advantages: lines 26–32."""
SCORERS: dict[str, StepScorer] = {}
ESTIMATORS: dict[str, Estimator] = {}


def register(table: dict, kind: str, name: str) -> Callable:
    def add(fn):
        if name in table or (table is SCORERS and name == "mu"):
            raise ValueError(f"{kind} {name!r} is registered already ({getattr(table.get(name), '__qualname__', 'μ')}): "
                             f"choose another name")
        table[name] = fn
        return fn
    return add


def register_scorer(name: str) -> Callable[[StepScorer], StepScorer]:
    """@register_scorer("name"): a StepScorer that --scorer name uses instead of μ (no μ is built); a taken name is
    refused."""
    return register(SCORERS, "a step scorer named", name)


def register_estimator(name: str) -> Callable[[Estimator], Estimator]:
    """@register_estimator("name"): an Estimator that --estimator name uses for lines 26–32; a taken name is refused."""
    return register(ESTIMATORS, "an advantage estimator named", name)


def check_scheme(args: Args) -> None:
    """The run's --plugin modules imported (they register their names), then --scorer and --estimator looked up."""
    for module in args.plugin:
        importlib.import_module(module)
    if args.scorer != "mu" and args.scorer not in SCORERS:
        raise DataError(f"no step scorer named {args.scorer!r} (registered: mu, {', '.join(SCORERS) or 'none'}; "
                        f"a --plugin module registers others)")
    if args.estimator not in ESTIMATORS:
        raise DataError(f"no advantage estimator named {args.estimator!r} (registered: {', '.join(ESTIMATORS)}; a "
                        f"--plugin module registers others)")


@dataclass
class Update:
    """What a logging hook (run's `hooks`) sees after an update, before its row is logged (it may add to the row):
    the update's place, its trajectories, μ's rubrics, d_t and s_t (or a scorer's s_t), the advantages, and π after
    the update (the lab evaluates it for its learning curves)."""
    row: dict
    epoch: int
    batch: int
    batches: int
    trajs: list
    rubrics: list | None
    d: torch.Tensor | None
    s: torch.Tensor | None
    adv: Advantages
    pi: object


Hook = Callable[[Update], None]


# --- One iteration of Algorithm 1 (lines 5–38) ------------------------------------------------------------------


def sample_trajectories(pi, group: list, epoch: int, b: int, args: Args, retriever, workers: Workers = ALONE) -> list:
    """π's rollouts of one batch (env.rollout, Alg. 1 lines 6–14), seeded per batch (a resumed run draws the
    same) or per trajectory (--sampling trajectory: the same whatever the split among processes); each worker
    rolls out its part, then draws its own LoRA dropout masks."""
    seed = args.seed * 1_000_003 + epoch * 1009 + b
    torch.manual_seed(seed)
    act = policy_act(pi, args.rollout_temperature, args.max_new_tokens_pi, args.gen_batch)
    seeds = [(seed * 4096 + j) % 2 ** 56 for j in range(len(group))] if args.sampling == "trajectory" else None
    trajs = workers.map(lambda idx: env.rollout([group[i] for i in idx], act, retriever, args.max_searches,
                                                args.obs_chars, seeds=[seeds[i] for i in idx] if seeds else None),
                        range(len(group)))
    workers.own_stream(seed)
    return trajs


def annotate(mu: RubricModel, trajs, args: Args, workers: Workers = ALONE) -> tuple[list, list, torch.Tensor, torch.Tensor]:
    """Alg. 1, lines 15–19: μ writes r_t for every step and scores it: d_t, s_t (Eq. 2).

    Returns the step contexts, the rubrics, d [N, K] and s [N] (no gradient), steps in trajectory order.
    """
    contexts = [c for t in trajs for c in contexts_from_trajectory(t)]
    mu.eval()

    def written_and_scored(part):
        rubrics, sc = mu.annotate(part, args.rubric_temperature, args.max_new_tokens_mu, args.gen_batch)
        return list(zip(rubrics, sc.d.float().cpu(), sc.s.float().cpu()))
    out = workers.map(written_and_scored, contexts)
    if not out:
        return contexts, [], torch.zeros(0, args.k), torch.zeros(0)
    rubrics, d, s = zip(*out)
    return contexts, list(rubrics), torch.stack(d), torch.stack(s)


@register_estimator("arco")
def advantages(batch: CreditBatch) -> Advantages:
    """Alg. 1, lines 26–32: per-step advantages; 0 on invalid steps (outside V_τ)."""
    trajs, args = batch.trajs, batch.args
    valid = [[st.valid for st in t.steps] for t in trajs]
    groups = [(t.example.dataset, t.example.id) for t in trajs] if args.sparse_baseline == "group" else None
    A_tau = outcome_advantages([t.reward for t in trajs], groups)                                  # line 31
    if not batch.dense:
        return Advantages([[a if ok else 0.0 for ok in v] for a, v in zip(A_tau, valid)])
    G = [reward_to_go(batch.s[r.start:r.stop].tolist()) for r in env.step_ranges(trajs)]  # line 28, Eq. 3
    buckets = [step_buckets([st.action for st in t.steps], v) for t, v in zip(trajs, valid)]
    A = bucketed_advantages(G, buckets, valid, args.alpha, args.bucket_fallback)   # line 29, Eq. 4
    sums, counts = bucket_sums(G, buckets, valid)
    return Advantages(A, G, buckets, {b: sums[b] / counts[b] for b in sums})


GRAD_CLIP = 1.0      # the largest gradient norm of an RL optimizer step (the release's)


def gradient_step(optimizer, what: str, workers: Workers, *totals: float, step: bool = True) -> list[float]:
    """After an update's passes: its logged totals summed over the workers, a NaN or inf loss (the first
    total) stopped before the weights, then one optimizer step on the workers' summed gradients, clipped
    to norm GRAD_CLIP (the release). A parameter no pass reached gets a zero gradient, as if the skipped steps
    had been computed: AdamW's moments and weight decay then move exactly as they would have."""
    totals = workers.total(*totals)
    if step:
        check_finite(what, totals[0])
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        workers.total_gradients(params)
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        optimizer.step()
    return totals


def log_pi_temperature(args: Args) -> float:
    """The T of log π(a_t|h_t) = log softmax(logits / T) in Eq. 3 (--logprob-temperature): the rollout's, or 1.
    Only at the rollout's is E_a[∇ log π(a|h)] = 0 under the sampling distribution, so that a baseline (any
    advantage offset that does not depend on a_t) leaves the expected update unchanged; at 1 it moves it by
    −b · E[Σ_t ∇ log π] (tests/test_arco.py checks both by enumeration)."""
    return args.rollout_temperature if args.logprob_temperature == "rollout" else 1.0


@torch.no_grad()
def log_pi(pi, steps, args: Args) -> torch.Tensor:
    """log π(a_t|h_t) of each step as Eq. 3 reads it (the action's token log-probs summed, at log_pi_temperature),
    without gradients: what π's update moves (the walkthrough shows it before and after a step)."""
    seqs, lens = policy_sequences(pi, steps)
    out = torch.zeros(len(steps))
    for p in training_passes(pi, seqs, lens, args.pass_tokens, temperature=log_pi_temperature(args)):
        out[p.index] = p.logprobs.sum(-1).float().cpu()
    return out


def policy_update(pi, optimizer, trajs, A: list[list[float]], args: Args, kl_pi: float, workers: Workers = ALONE) -> dict:
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
    passes = training_passes(pi, seqs, lens, args.pass_tokens, workers.own([[i] for i in range(len(seqs))]),
                             temperature=log_pi_temperature(args),        # log π(a_t|h_t) at T, and the KL
                             kl=token_kl if kl_pi else None, reference=reference if kl_pi else None)
    for p in passes:
        kl = reduce_tokens(p.kl, p.mask, args.token_reduction) if kl_pi else None     # KL_t(π ‖ π_ref)
        loss = policy_loss(p.logprobs.sum(-1), adv[p.index].to(p.logprobs.device), len(trajs), kl, kl_pi)  # Eq. 3
        loss.backward()
        loss_sum += float(loss.detach())
        kl_sum += float(p.kl.detach().sum()) if kl_pi else 0.0
    passes.backward_shared()                     # the fast engine: the shared prompt's gradients, through it once
    loss_sum, kl_sum = gradient_step(optimizer, "policy (Eq. 3)", workers, loss_sum, kl_sum, step=n_valid > 0)
    pi.model.eval()
    return {"policy_loss": loss_sum, "kl_pi": kl_sum / max(sum(lens), 1), "policy_steps": n_valid}


def rubric_update(mu: RubricModel, optimizer, trajs, contexts, rubrics, args: Args, workers: Workers = ALONE) -> dict:
    """Alg. 1, lines 36–38: one gradient step on Eq. 5. Its decomposition term couples the steps of a
    trajectory, so each pass holds whole trajectories."""
    R = torch.tensor([float(t.reward) for t in trajs])
    w = torch.tensor(class_weights(R.tolist()) if args.class_balance else [1.0] * len(trajs))
    kl_divisor = len(trajs) if args.token_reduction == "mean" else len(contexts)       # see rubric_loss
    use_kl = bool(args.kl_mu) and mu.rubric_mode not in ("static", "none")     # no generated r_t to regularize
    seqs = mu.scoring_ids(contexts, rubrics)                                      # (q, h_t, a_t, r_t)
    lens = [len(r.token_ids) if use_kl else 0 for r in rubrics]
    of = torch.tensor([k for k, t in enumerate(trajs) for _ in t.steps])          # each step's trajectory
    units = workers.own(env.step_ranges(trajs))                                   # whole trajectories
    mu.train()
    optimizer.zero_grad(set_to_none=True)
    loss_sum = mse = kl_sum = 0.0
    passes = training_passes(mu.backbone, seqs, lens, args.pass_tokens, units, kl=token_kl if use_kl else None,
                             reference=reference if use_kl else None, hidden=True)
    for p in passes:
        s = mu.step_scores(mean_pool(p.hidden, p.hidden_mask)).s.float().cpu()                      # Eq. 2
        kl = reduce_tokens(p.kl, p.mask, args.token_reduction).float().cpu() if use_kl else None   # KL_t(μ ‖ μ_ref)
        loss = rubric_loss(s, of[p.index], R, kl, args.kl_mu, kl_divisor, len(trajs), w)             # Eq. 5
        loss.backward()
        loss_sum += float(loss.detach())
        mse += float(decomposition_loss(s.detach(), of[p.index], R, len(trajs)))
        kl_sum += float(p.kl.detach().sum()) if use_kl else 0.0
    passes.backward_shared()                     # the fast engine: the shared prompt's gradients, through it once
    loss_sum, mse, kl_sum = gradient_step(optimizer, "rubric-model (Eq. 5)", workers, loss_sum, mse, kl_sum)
    mu.eval()
    row = {"rubric_loss": loss_sum, "decomposition_mse": mse, "kl_mu": kl_sum / max(sum(lens), 1)}
    if args.mu_error_after:     # for the log only (--no-mu-error-after: off): the batch's error after the step
        t0 = time.time()
        with torch.no_grad():
            after = sum(float(decomposition_loss(mu.step_scores(mean_pool(p.hidden, p.hidden_mask)).s.float().cpu(),
                                                 of[p.index], R, len(trajs)))              # (no LM head)
                        for p in training_passes(mu.backbone, seqs, [0] * len(seqs), args.pass_tokens, units,
                                                 hidden=True))
        row |= {"decomposition_mse_after": workers.total(after)[0], "seconds_mu_after": time.time() - t0}
    return row


def iteration(pi, mu, opt_pi, opt_mu, batch, epoch: int, b: int, batches: int, phase: dict, args: Args, retriever,
              workers: Workers = ALONE) -> Update:
    """One iteration of Algorithm 1 (lines 5–38) on batch b of an epoch's `batches`, in the epoch's `phase` (an
    epoch_plan entry: sparse or dense, λ_π); its log row is Update.row."""
    row: dict = {"kind": "update", "epoch": epoch, "batch": b, "dense": phase["dense"]}
    group = [ex for ex in batch for _ in range(phase["samples"])]           # B: G samples per question if sparse
    with timed(row, "rollout"):                  # plumbing: row["seconds_rollout"], the phase's memory
        trajs = sample_trajectories(pi, group, epoch, b, args, retriever, workers)           # lines 6–14
    contexts = rubrics = d = s = None
    if mu is not None:
        with timed(row, "mu_annotate"):
            contexts, rubrics, d, s = annotate(mu, trajs, args, workers)                         # lines 15–19
    elif args.scorer != "mu":
        s = SCORERS[args.scorer](trajs)          # a registered scorer's step scores in place of μ's (no μ)
    adv = ESTIMATORS[args.estimator](CreditBatch(trajs, s, phase["dense"], args))                  # lines 26–32
    with timed(row, "pi_update"):
        row.update(policy_update(pi, opt_pi, trajs, adv.A, args, phase["kl_pi"], workers))        # lines 33–35
    if mu is not None:
        with timed(row, "mu_update"):
            row.update(rubric_update(mu, opt_mu, trajs, contexts, rubrics, args, workers))         # lines 36–38
    steps = [st for t in trajs for st in t.steps]
    row.update(trajectories=len(trajs), questions=len(batch), mean_R=sum(t.reward for t in trajs) / len(trajs),
               invalid_rate=sum(not st.valid for st in steps) / len(steps),
               mean_s=float(s.mean()) if s is not None else None,
               mean_G_per_bucket=adv.mean_G_per_bucket, peak_rss_gib=peak_rss_gib(),
               **mu_at_work(mu, trajs, contexts, rubrics, s))
    return Update(row, epoch, b, batches, trajs, rubrics, d, s, adv, pi)


# --- The run: Algorithm 1 from the warmup to the selected checkpoint (line 1, the evaluations, the outer loop) ----


def dev_evaluation(pi, dev, args: Args, retriever, workers: Workers = ALONE) -> tuple[dict, list]:
    """Greedy dev evaluation (§4.1): EM, F1, searches, invalid-step rate, each worker on its part of the
    questions, the numbers those of all of them."""
    act = policy_act(pi, 0.0, args.max_new_tokens_pi, args.gen_batch)
    with MEMORY.phase("dev evaluation"):
        trajs = workers.map(lambda part: env.rollout(part, act, retriever, args.max_searches, args.obs_chars,
                                                     progress=True), dev)
    return env.dev_metrics(trajs), trajs


def start_from(warm: warmup.Warmup, args: Args, with_mu: bool) -> tuple:
    """Alg. 1, line 1: π ← π_sft and μ ← μ_sft (None without μ), each with a fresh LoRA on its merged SFT weights:
    the frozen π_ref and μ_ref are the same modules with that adapter disabled."""
    load = loading(args)
    pi = fresh_adapter(load_backbone_checkpoint(warm.pi, **load)[0], args.lora_dropout)
    mu = RubricModel.load(warm.mu, **load).fresh_adapter(args.lora_dropout) if with_mu else None
    return pi, mu


def sft_only_evaluation(pi, dev, args: Args, retriever, warm_folder: Path, workers: Workers = ALONE) -> tuple:
    """Epoch 0: the SFT-only policy's dev evaluation and its trace rows — the warmup's own when it was made with
    these settings (infra.warmups.sft_only: greedy decoding, the same numbers), else evaluated now."""
    def now() -> tuple[dict, list]:
        ev, trajs = dev_evaluation(pi, dev, args, retriever, workers)
        return ev, trace_rows(trajs, 0, -1)
    key = eval_settings(dev, args.seed, args.max_new_tokens_pi, args.obs_chars, args.gen_batch) \
        if args.max_searches is None else None         # --max-searches is not part of the key: evaluate then
    return sft_only(warm_folder, key, now, workers.main)


def make_optimizers(pi, mu: RubricModel | None, args: Args):
    """AdamW for π's LoRA and for μ (its LoRA and score head, with their own learning rates), with the
    release's weight decay; π's learning rate is set per epoch (sparse or dense)."""
    opt_pi = torch.optim.AdamW(trainable_parameters(pi.model), lr=args.pi_lr_sparse, weight_decay=args.weight_decay)
    opt_mu = torch.optim.AdamW(mu.parameter_groups(args.mu_lr, args.head_lr), weight_decay=args.weight_decay) \
        if mu is not None else None
    return opt_pi, opt_mu


def resume_at(checkpoint: Path, folder: RunFolder, args: Args, with_mu: bool) -> tuple:
    """--resume, --init-from: π, μ and both optimizers as a checkpoint holds them, the evaluations so far and the
    epoch and batch to continue from (the run's logs cut there)."""
    load = loading(args)
    pi = load_backbone_checkpoint(checkpoint / "pi", **load)[0]
    mu = RubricModel.load(checkpoint / "mu", **load) if with_mu and (checkpoint / "mu").is_dir() else None
    opt_pi, opt_mu = make_optimizers(pi, mu, args)
    history, epoch, batch = folder.resume(checkpoint, opt_pi, opt_mu)
    if opt_mu is not None:          # the moments are the checkpoint's, the rates this command's (π's: set per epoch)
        for group, lr in zip(opt_mu.param_groups, (args.mu_lr, args.head_lr)):
            group["lr"] = lr
    return pi, mu, opt_pi, opt_mu, history, epoch, batch


def run(args: Args, hooks: Sequence[Hook] = (), workers: Workers | None = None) -> Path:
    """Algorithm 1 end to end, the warmup first where it is missing; returns the run folder. Where the step scores and
    advantages come from is args' --scorer and --estimator (ARCO's own by default); `hooks`: what an analysis logs
    after each update (Update); `workers`: torchrun's processes (one by default)."""
    workers = workers or Workers()
    keep_scheme(args)                    # plumbing: --resume (--init-from) keeps its run's (parent's) scorer, estimator
    check_scheme(args)
    with_mu = args.reward == "arco" and args.scorer == "mu"          # outcome RL and a registered scorer: no μ
    if args.scorer != "mu" and workers.main:
        print(f"[arco] step scores from {args.scorer!r} (a registered scorer): no μ is built", flush=True)
    folder = RunFolder(args, workers)                                # plumbing: a new folder, or --resume's
    warm = workers.first(lambda: warmup.ensure(args, with_mu))       # §3.2, App. B: π_sft and μ_sft
    train = env.training_questions(args.dataset, args.data_dir or None, args.train_size, args.seed,   # D
                                   warm.taught if args.warmup_questions == "before" else frozenset())
    dev = env.load_split(args.dataset, "dev", args.data_dir or None, args.eval_size, args.seed)
    retriever = env.shared_retriever(args.retriever or None, args.retriever_pooling)       # R
    torch.manual_seed(args.seed)                 # the fresh LoRA adapters' initialization
    pi, mu = start_from(warm, args, with_mu)                         # line 1: π ← π_sft, μ ← μ_sft
    opt_pi, opt_mu = make_optimizers(pi, mu, args)
    last = folder.last or (folder.init_from(Path(args.init_from), with_mu, args.rubric) if args.init_from else None)
    if last is None:                             # epoch 0: the SFT-only policy's dev evaluation
        folder.start_afresh()
        ev, rows = sft_only_evaluation(pi, dev, args, retriever, warm.folder, workers)
        history, start_epoch, start_batch = [folder.log_evaluation(0, ev, rows)], 1, 0
    else:                                        # π, μ and both optimizers as they were at that checkpoint
        pi, mu, opt_pi, opt_mu, history, start_epoch, start_batch = resume_at(last, folder, args, with_mu)

    try:
        with CtrlC(folder) as ctrl_c:
            for epoch in range(start_epoch, args.epochs + 1):                                # Alg. 1, line 3
                phase = epoch_plan(args, len(train))[epoch - 1]             # line 4: sparse or dense, λ_π, lr
                for g in opt_pi.param_groups:
                    g["lr"] = phase["pi_lr"]
                batches = epoch_batches(train, epoch, args)
                first = start_batch if epoch == start_epoch else 0
                desc = f"epoch {epoch} ({'dense' if phase['dense'] else 'sparse'})"
                for b in folder.progress(range(first, len(batches)), desc):
                    u = iteration(pi, mu, opt_pi, opt_mu, batches[b], epoch, b, len(batches), phase, args, retriever,
                                  workers)                                                     # lines 5–38
                    for hook in hooks:                   # an analysis's own log (the lab's statistics, curves)
                        hook(u)
                    folder.log_update(u.row, trace_rows(u.trajs, epoch, b, u.rubrics, u.d, u.s, u.adv))
                    folder.show(update_line(u.row, epoch, b))
                    if ctrl_c.agreed() and b + 1 < len(batches):
                        ctrl_c.stop(pi, mu, opt_pi, opt_mu, epoch, history, b + 1)
                if args.eval_all or phase["selectable"] or epoch == args.epochs:   # the dev evaluation
                    ev, trajs = dev_evaluation(pi, dev, args, retriever, workers)
                    history.append(folder.log_evaluation(epoch, ev, trace_rows(trajs, epoch, -1), phase["dense"]))
                folder.save(epoch, pi, mu, opt_pi, opt_mu, history)
                if ctrl_c.agreed() and epoch < args.epochs:
                    ctrl_c.stop(pi, mu, opt_pi, opt_mu, epoch, history)
    except NonFiniteLoss as e:
        kept = latest_checkpoint(folder.path / "checkpoints")
        sys.exit(f"error: {e} at epoch {epoch}, batch {b}; nothing of this batch was saved. The last good "
                 f"checkpoint is {kept or 'none (no epoch finished yet)'}: lower the learning rates and rerun "
                 f"with --resume.")
    sel = select_checkpoint(history, args.sparse_epochs)                 # §4.1
    folder.report(history, sel, args)
    return folder.path


def select_checkpoint(history: list[dict], sparse_epochs: int) -> dict:
    """The paper's rule (§4.1): the best dev-EM epoch after the dense transition, i.e. after the
    `sparse_epochs` sparse ones (EM ties: warmup.dev_rank, then the earlier); the best overall, epoch 0
    included, is recorded beside it. (The release has no selection code: its per-epoch evaluations are
    read by hand.)"""
    trained = [h for h in history if h["epoch"] >= 1]
    post = [h for h in trained if h["epoch"] > sparse_epochs] or trained or history
    best_post = max(post, key=lambda h: (*warmup.dev_rank(h), -h["epoch"]))
    best_all = max(history, key=lambda h: (*warmup.dev_rank(h), -h["epoch"]))
    return {"selected_epoch": best_post["epoch"], "selected": best_post,
            "best_overall_epoch": best_all["epoch"], "best_overall": best_all}


# --- main: the settings checked, then the run --------------------------------------------------------------------------


PRESETS = preset_table(Args)        # {preset: {setting: value}}, read from the declarations of Args (and Settings)


def resolve_args(args: Args) -> Args:
    """Fill every preset-driven field the command line left unset, then check the combination."""
    if args.warmup_size is None and args.train_size is not None:     # a smaller --train-size shrinks the warmup too
        args.warmup_size = min(PRESETS[args.preset]["warmup_size"], args.train_size)
    fill_from_preset(args)
    if args.mu_model is None:
        args.mu_model = args.model
    if not args.name:
        args.name = "outcome" if args.reward == "outcome" else \
            "arco" + ("" if args.rubric == "adaptive" else f"-{args.rubric}") + ("" if args.k == 3 else f"-k{args.k}")
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
    if args.rubric_format == "slots" and args.rubric in ("adaptive", "prefix-free") and args.max_new_tokens_mu < 4 * args.k:
        problems.append(f"--rubric-format slots writes {args.k} numbered criteria of at least one word each: "
                        f"--max-new-tokens-mu must be at least {4 * args.k}, got {args.max_new_tokens_mu}")
    if problems:
        sys.exit("error: " + "; ".join(problems))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = resolve_args(parse_args(Args, argv, description=__doc__))
    if args.dry_run:
        print(describe_plan(args, epoch_plan(args, args.train_size)))
        print(memory_estimate(args)["text"])
        return
    for name in {args.model, args.mu_model}:        # before any folder: a model that cannot be had here
        check_model_available(name)
    workers = Workers()                             # torchrun's processes, or this one
    workers.start(args)
    try:
        run_dir = run(args, workers=workers)
    except DataError as e:
        sys.exit(f"error: {e}")
    if workers.main:
        print(f"[arco] done: {run_dir / 'report.md'}")
    workers.end()


if __name__ == "__main__":
    main_guard(main, DataError, ModelLoadError)
