"""The gradient probe (issue 53): what one update's step credit does to π's gradient, measured directly.

    python probe.py [--at sft fork] [--probe-seed 0] [arco.py's flags, as study.py takes them]

Part of the credit study (its settings, warmup, sparse phases and oracles are study.py's; nothing imports this file). At a π — π_sft of the
study's warmup, or π at a seed's fork (its sparse phase run first where missing) — and with respect to the weights
RL trains (π's LoRA adapter): the true gradient g* of J = E[R] is estimated from a held-out pool of rollouts
(outcome REINFORCE with each question's leave-one-out mean as the baseline: unbiased), and every credit scheme's
batch gradient g_B = (1/|B|) Σ_τ Σ_t A_{τ,t} ∇ log π(a_t|h_t) (Eq. 3's, its KL term aside) is formed on 64 disjoint
batches of the study's budget, 8 trajectories, drawn from a second pool: 2 questions × 4 samples (the study's
composition) or 8 questions × 1 (the release's dense composition). One pool and one per-step gradient serve every
scheme (common random numbers). The per-step gradients are count-sketched to PROBE["dims"] numbers (a random linear
map that keeps inner products in expectation; sketch_check measures how closely on the first steps). Each stage is
kept under <out-dir>/synthetic-long/study/probe-<point>-s<seed>/ as it finishes (resumable), with its seconds.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import torch

import arco
import env
import rubric_model
import warmup
from config import main_guard
from study import fmt, ground_truth_scores, run_once, study_args

PROBE = dict(questions=128, samples=4, dims=8192, chunk=16)
COMPOSITIONS = {"2x4": (2, 4), "8x1": (8, 1)}


class Sketch:
    """A count sketch of a flat parameter vector: coordinate i goes to bucket h(i) with sign σ(i) (seeded), so
    ⟨S a, S b⟩ = ⟨a, b⟩ in expectation, with an error of order ‖a‖‖b‖/√dims."""

    def __init__(self, params: Sequence[torch.nn.Parameter], dims: int, seed: int = 0):
        n = sum(p.numel() for p in params)
        g = torch.Generator().manual_seed(seed)
        self.dims, self.index = dims, torch.randint(0, dims, (n,), generator=g)
        self.sign = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.dims).index_add_(0, self.index, self.sign * flat.float().cpu())


def flat_grad(params) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float().cpu()
                      for p in params])


def probe_questions(args: arco.Args, warm: Path, n: int) -> list:
    """2n training questions neither the warmup nor the study's RL runs (their --train-size) used, in the seeded
    order of arco.training_questions: the first n for the batch pool, the next n for g*."""
    taught = {r["id"] for path in warm.glob("records*.jsonl") for r in env.read_jsonl(path)}
    order = env.load_split(args.dataset, "train", args.data_dir or None, len(taught) + args.train_size + 2 * n, args.seed)
    return [q for q in order if q.id not in taught][args.train_size:args.train_size + 2 * n]


def traj_row(t) -> dict:
    return {"id": t.example.id, "answer": t.answer, "reward": t.reward, "finished": t.finished,
            "max_searches": t.max_searches, "steps": [dataclasses.asdict(st) for st in t.steps]}


def traj_from_row(row: dict, example) -> "env.Trajectory":
    return env.Trajectory(example, row["max_searches"], [env.Step(**st) for st in row["steps"]], row["answer"],
                          row["reward"], row["finished"])


def probe_rollouts(pi, questions: Sequence, samples: int, args: arco.Args, path: Path, seed: int) -> list:
    """`samples` rollouts of each question at the rollout temperature, one seeded random stream each (what a
    question's k-th sample is does not depend on the chunking); kept in `path` a chunk at a time (resumable)."""
    from tqdm import tqdm
    rows = env.read_jsonl(path) if path.is_file() else []
    retriever = env.shared_retriever(args.retriever or None, args.retriever_pooling)
    chunk = PROBE["chunk"]
    for start in tqdm(range(len(rows) // samples, len(questions), chunk), desc=f"rollouts ({path.stem})"):
        group = [(q, k) for q in questions[start:start + chunk] for k in range(samples)]
        seeds = [seed * 1_000_003 + (start + i // samples) * 64 + k for i, (_, k) in enumerate(group)]
        act = rubric_model.policy_act(pi, args.rollout_temperature, args.max_new_tokens_pi, args.gen_batch)
        trajs = env.rollout([q for q, _ in group], act, retriever, args.max_searches, args.obs_chars, seeds=seeds)
        env.write_jsonl(path, [traj_row(t) for t in trajs], append=True)
        rows += [traj_row(t) for t in trajs]
    by_id = {q.id: q for q in questions}
    return [traj_from_row(r, by_id[r["id"]]) for r in rows[:len(questions) * samples]]


def step_logprob(pi, st) -> torch.Tensor:
    """log π(a_t|h_t): the sum of the action's token log-probs, with its graph (one sequence)."""
    seqs, lens = rubric_model.policy_sequences(pi, [st])
    return rubric_model.sequence_logprobs(pi, [seqs[0][:-lens[0]]], [seqs[0][-lens[0]:]]).sums()[0]


def step_gradients(pi, trajs: Sequence, sketch: Sketch, path: Path, check_path: Path, check: int = 24) -> torch.Tensor:
    """∇ log π(a_t|h_t) of every step, sketched: [steps, dims] (zeros for invalid steps, outside V_τ); kept in
    `path` a chunk of trajectories at a time (resumable). The first chunk also writes `check_path`
    (sketch_check on its first `check` valid steps' full gradients)."""
    from tqdm import tqdm
    params = rubric_model.trainable_parameters(pi.model)
    done = torch.load(path, weights_only=True) if path.is_file() else {"trajectories": 0, "rows": []}
    rows, full = list(done["rows"]), []
    pi.model.eval()                                  # no LoRA dropout: the gradient of π itself
    chunk = PROBE["chunk"] * 2
    for start in tqdm(range(done["trajectories"], len(trajs), chunk), desc="per-step gradients"):
        for t in trajs[start:start + chunk]:
            for st in t.steps:
                if not st.valid:
                    rows.append(torch.zeros(sketch.dims))
                    continue
                for p in params:
                    p.grad = None
                step_logprob(pi, st).backward()
                g = flat_grad(params)
                if start == 0 and len(full) < check:
                    full.append(g)
                rows.append(sketch(g))
        if start == 0:
            env.write_json(check_path, sketch_check(sketch, full))
        torch.save({"trajectories": min(start + chunk, len(trajs)), "rows": rows}, path)
    return torch.stack(rows)


def sketch_check(sketch: Sketch, full: Sequence[torch.Tensor]) -> dict:
    """How well the sketch keeps cosines: the full gradients of some steps and 8 random Gaussian combinations of
    them (like batch gradients), every pair's cosine before and after the sketch."""
    g = torch.Generator().manual_seed(1)
    vecs = list(full) + [sum(float(torch.randn(1, generator=g)) * f for f in full) for _ in range(8)]
    small = [sketch(v) for v in vecs]
    diffs = [abs(float(F_cos(vecs[a], vecs[b])) - float(F_cos(small[a], small[b])))
             for a in range(len(vecs)) for b in range(a + 1, len(vecs))]
    return {"vectors": len(vecs), "dims_full": int(vecs[0].numel()), "dims": sketch.dims,
            "max_abs_cosine_difference": max(diffs), "mean_abs_cosine_difference": sum(diffs) / len(diffs)}


def F_cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a[None].double(), b[None].double())[0]


def loo_advantages(trajs: Sequence) -> list[float]:
    """R(τ) − the mean R of its question's other samples: an outcome baseline that does not depend on τ."""
    by_q: dict = defaultdict(list)
    for i, t in enumerate(trajs):
        by_q[t.example.id].append(i)
    out = [0.0] * len(trajs)
    for idx in by_q.values():
        for i in idx:
            others = [trajs[j].reward for j in idx if j != i]
            out[i] = trajs[i].reward - (sum(others) / len(others) if others else 0.0)
    return out


def true_gradient(pi, trajs: Sequence, sketch: Sketch, args: arco.Args, path: Path) -> dict:
    """g* = ∇J estimated on the held-out pool, sketched, as two halves (the first and second half of its
    questions: their agreement says how noisy g* is): (1/n) Σ_τ A_τ Σ_{t∈V_τ} ∇ log π(a_t|h_t) with the
    leave-one-out outcome advantage (trajectories with A = 0 contribute nothing and are skipped). Kept in `path`
    per chunk (resumable: sketched sums are additive)."""
    from tqdm import tqdm
    params = rubric_model.trainable_parameters(pi.model)
    A = loo_advantages(trajs)
    half = len(trajs) // 2
    done = torch.load(path, weights_only=True) if path.is_file() else {
        "trajectories": 0, "halves": torch.zeros(2, sketch.dims)}
    halves = done["halves"].clone()
    pi.model.eval()
    chunk = PROBE["chunk"] * 2
    for start in tqdm(range(done["trajectories"], len(trajs), chunk), desc="g* (held-out pool)"):
        for h in (0, 1):
            idx = [i for i in range(start, min(start + chunk, len(trajs))) if (i >= half) == h and A[i] != 0.0]
            if not idx:
                continue
            steps = [(st, A[i]) for i in idx for st in trajs[i].steps if st.valid]
            seqs, lens = rubric_model.policy_sequences(pi, [st for st, _ in steps])
            units, at = [], 0
            for i in idx:
                n = sum(st.valid for st in trajs[i].steps)
                units.append(list(range(at, at + n)))
                at += n
            for p in params:
                p.grad = None
            adv = torch.tensor([a for _, a in steps])
            for p in rubric_model.training_passes(pi, seqs, lens, budget=args.pass_tokens, units=units):
                (-(adv[p.index].to(p.logprobs.device) * (p.logprobs * p.mask).sum(-1)).sum() / half).backward()
            halves[h] -= sketch(flat_grad(params))          # the loss's gradient is −g
        torch.save({"trajectories": min(start + chunk, len(trajs)), "halves": halves}, path)
    return {"g": halves.mean(0), "halves": halves}


def probe_mu_scores(mu_dir: Path, trajs: Sequence, args: arco.Args, path: Path) -> torch.Tensor:
    """μ's s_t for every step of the pool (its own greedy rubric, as in annotate), kept in `path` (resumable)."""
    from tqdm import tqdm
    done = torch.load(path, weights_only=True) if path.is_file() else {"trajectories": 0, "s": torch.zeros(0)}
    s = [done["s"]]
    mu = None
    chunk = PROBE["chunk"] * 2
    for start in tqdm(range(done["trajectories"], len(trajs), chunk), desc=f"μ scores ({mu_dir.name})"):
        mu = mu or rubric_model.RubricModel.load(mu_dir, device=args.device, dtype=args.dtype, autocast=args.autocast,
                                                 engine=args.engine)
        contexts = [c for t in trajs[start:start + chunk] for c in rubric_model.contexts_from_trajectory(t)]
        _, scores = mu.annotate(contexts, args.rubric_temperature, args.max_new_tokens_mu, args.gen_batch)
        s.append(scores.s.float().cpu())
        torch.save({"trajectories": min(start + chunk, len(trajs)), "s": torch.cat(s)}, path)
    return torch.cat(s)


def position_buckets(actions: Sequence[str], valid: Sequence[bool]) -> list[str | None]:
    """A state-only baseline's groups: a valid step's position t (whatever its action), where Eq. 4's
    step_buckets puts a search with the searches of its rank and a Finish with every trajectory's last step."""
    return [f"t{t}" if ok else None for t, ok in enumerate(valid)]


def mc_values(trajs: Sequence) -> list[list[float]]:
    """V̂(h_t) for every step: the mean R of the pool's other samples of the same question whose first t actions
    are the trajectory's (they continue the same prefix: independent draws of π from h_t); where none shares
    h_t, those sharing the longest shorter prefix (still independent of a_t). Extra rollouts beyond the batch."""
    by_q: dict = defaultdict(list)
    for i, t in enumerate(trajs):
        by_q[t.example.id].append(i)
    out = []
    for i, t in enumerate(trajs):
        acts = [st.action_text() for st in t.steps]
        sib = [trajs[j] for j in by_q[t.example.id] if j != i]
        values = []
        for k in range(len(t.steps)):
            for m in range(k, -1, -1):
                same = [u.reward for u in sib if [st.action_text() for st in u.steps[:m]] == acts[:m]]
                if same:
                    values.append(sum(same) / len(same))
                    break
            else:
                values.append(0.0)
        out.append(values)
    return out


def scheme_advantages(name: str, batch: Sequence[int], trajs, scores: dict, values, composition: str,
                      alpha: float, fallback: bool) -> list[list[float]]:
    """Per-step advantages of one batch (trajectory indices) under a credit scheme: `outcome` (arco.
    outcome_advantages: the question's group mean at 2 × 4, the batch mean at 8 × 1), `value` (R − V̂(h_t),
    mc_values), or a dense one "<scores> <baseline>" — Eq. 3's G_t of the scores (`causal`: env's causal oracle,
    or a μ's) with Eq. 4's bucket means (`eq4`, as ARCO runs) or a state-only baseline (`state`), α-scaled — and
    `mixed <μ>`: the outcome advantage plus μ's Eq. 3–4 dense advantage (the mixed arm)."""
    ts = [trajs[i] for i in batch]
    valid = [[st.valid for st in t.steps] for t in ts]
    groups = [t.example.id for t in ts] if COMPOSITIONS[composition][1] > 1 else None
    outcome = arco.outcome_advantages([t.reward for t in ts], groups)
    if name == "outcome":
        return [[a if ok else 0.0 for ok in v] for a, v in zip(outcome, valid)]
    if name == "value":
        return [[t.reward - values[i][k] if ok else 0.0 for k, ok in enumerate(v)] for i, t, v in zip(batch, ts, valid)]
    kind, *rest = name.split()
    source = rest[0] if kind == "mixed" else kind
    G = [arco.reward_to_go(scores[source][i]) for i in batch]
    bucket = position_buckets if (kind != "mixed" and rest[0] == "state") else arco.step_buckets
    buckets = [bucket([st.action for st in t.steps], v) for t, v in zip(ts, valid)]
    A = arco.bucketed_advantages(G, buckets, valid, alpha, fallback)
    if kind == "mixed":
        A = [[a + o if ok else 0.0 for a, ok in zip(a_t, v)] for a_t, o, v in zip(A, outcome, valid)]
    return A


def probe_batches(n_questions: int, samples: int, composition: str) -> list[list[int]]:
    """Disjoint batches of the pool (trajectory i = question i // samples, sample i % samples): 2 × 4 takes two
    questions' four samples; 8 × 1 takes sample k of eight questions."""
    q_per, s_per = COMPOSITIONS[composition]
    out = []
    for q0 in range(0, n_questions - q_per + 1, q_per):
        for k0 in range(0, samples - s_per + 1, s_per):
            out.append([(q0 + a) * samples + k0 + b for a in range(q_per) for b in range(s_per)])
    return out


def probe_stats(grads: torch.Tensor, offsets: list[int], trajs, scores, values, gstar: dict, schemes: Sequence[str],
                n_questions: int, samples: int, alpha: float, fallback: bool, resamples: int = 2000) -> list[dict]:
    """Per (scheme, composition): the cosine of each batch gradient with g* (mean and 95% interval over the
    batches), the batch gradients' spread relative to their component along g* (tr Cov / ⟨ḡ, ĝ*⟩²: lower is a
    better-conditioned step; also relative to outcome RL at 2 × 4), and the bias seen in the mean gradient
    ḡ over all batches: its cosine with g*, and its component orthogonal to g*. The intervals of the noise ratio,
    of cos(ḡ, g*) and of its difference from outcome 2 × 4's come from one paired bootstrap over blocks of
    questions (block_bootstrap)."""
    g = gstar["g"].double()
    u = g / g.norm()
    rows, grams = [], []
    for composition in COMPOSITIONS:
        batches = probe_batches(n_questions, samples, composition)
        for name in schemes:
            gb = []
            for batch in batches:
                A = scheme_advantages(name, batch, trajs, scores, values, composition, alpha, fallback)
                coef = torch.zeros(grads.shape[0], dtype=torch.float64)
                for i, a_t in zip(batch, A):
                    coef[offsets[i]:offsets[i] + len(a_t)] = torch.tensor(a_t, dtype=torch.float64)
                gb.append((coef @ grads.double()) / len(batch))
            gb = torch.stack(gb)
            cos = torch.stack([F_cos(x, g) for x in gb]).double()
            mean = gb.mean(0)
            along = float(mean @ u)
            spread = float(((gb - mean) ** 2).sum(1).mean())
            rows.append({"scheme": name, "composition": composition, "batches": len(batches),
                         "cos_mean": float(cos.mean()), "cos_ci95": 1.96 * float(cos.std()) / len(cos) ** 0.5,
                         "along": along, "noise_to_signal": spread / along ** 2 if along else None,
                         "mean_cos": float(F_cos(mean, g)),
                         "orthogonal_share": float((mean - along * u).norm() / mean.norm()) if mean.norm() else None})
            grams.append((gb @ gb.T, gb @ u))
    base = next(i for i, r in enumerate(rows) if r["scheme"] == "outcome" and r["composition"] == "2x4")
    for r in rows:
        r["variance_vs_outcome_2x4"] = (r["noise_to_signal"] / rows[base]["noise_to_signal"]
                                        if r["noise_to_signal"] and rows[base]["noise_to_signal"] else None)
    boot = block_bootstrap(grams, samples, resamples)        # a block: 8 questions × `samples` = `samples` batches
    for r, b in zip(rows, boot):
        r["variance_vs_outcome_2x4_ci"] = percentile_interval(b["noise_to_signal"] / boot[base]["noise_to_signal"])
        r["mean_cos_ci"] = percentile_interval(b["mean_cos"])
        r["mean_cos_vs_outcome_2x4_ci"] = percentile_interval(b["mean_cos"] - boot[base]["mean_cos"])
    return rows


def block_bootstrap(grams: Sequence[tuple[torch.Tensor, torch.Tensor]], batches_per_block: int, resamples: int,
                    seed: int = 0) -> list[dict]:
    """Resampled statistics of each row's batch gradients g_1..g_B, from their Gram matrix K = [⟨g_a, g_b⟩] and
    projections p = [⟨g_b, û*⟩] alone: a resample weights batch b by w_b (Σ w = B), so ḡ = Σ w_b g_b / B,
    ⟨ḡ, û*⟩ = w·p / B, ‖ḡ‖² = wᵀKw / B², and the spread Σ w_b ‖g_b‖² / B − ‖ḡ‖² (probe_stats' tr Cov at w = 1).
    The weights come from resampling blocks of consecutive batches, the same draw for every row: a block of
    probe_batches' 2 × 4 batches and the block of 8 × 1 batches at the same index hold the same questions (8
    questions, all their samples, at the probe's sizes), so the resample is one over questions, paired across
    schemes and compositions (intervals of differences and ratios carry the common random numbers)."""
    B = len(grams[0][1])
    blocks = B // batches_per_block
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, blocks, (resamples, blocks), generator=g)
    counts = torch.nn.functional.one_hot(picks, blocks).sum(1).double()   # (resamples, blocks): times drawn
    W = counts.repeat_interleave(batches_per_block, dim=1)                 # (resamples, B)
    out = []
    for K, p in grams:
        along = W @ p / B
        msq = ((W @ K) * W).sum(1) / B ** 2
        spread = W @ torch.diagonal(K) / B - msq
        out.append({"noise_to_signal": spread / along ** 2, "mean_cos": along / msq.clamp_min(1e-300).sqrt()})
    return out


def percentile_interval(x: torch.Tensor) -> list[float]:
    return [float(torch.quantile(x, 0.025)), float(torch.quantile(x, 0.975))]


def favoured(rows: Sequence[dict], factor: float = 1.5) -> list[str]:
    """Issue 53's rule for an RL check: the schemes whose batch gradient at 8 × 1 has a noise-to-signal at least
    `factor` times below outcome RL's at 2 × 4 over its whole interval (upper end ≤ 1/factor) at equal bias —
    read as: the cosine of its mean gradient with g* not below outcome 2 × 4's beyond the paired interval (an
    unbiased scheme with less noise has a mean gradient at least as close to g*; a bias shows as a lower one)."""
    return [r["scheme"] for r in rows if r["composition"] == "8x1" and r["scheme"] != "outcome"
            and r["variance_vs_outcome_2x4_ci"][1] <= 1 / factor and r["mean_cos_vs_outcome_2x4_ci"][1] >= 0]


def probe(argv: Sequence[str], points: Sequence[str], seed: int) -> Path:
    """The gradient probe at each point ("sft": π_sft and the warmup μ; "fork": π and μ at seed `seed`'s fork,
    its sparse phase run first if missing), cached stage by stage under study/probe-<point>-s<seed>/."""
    base = study_args(argv, seed=seed)
    root = Path(base.out_dir) / base.dataset
    warm = root / "study-warmup"
    out = root / "study"
    warmup.run_from_arco(dataclasses.replace(base, warmup_dir=str(warm)), train_mu=False)   # π_sft (reused)
    questions = probe_questions(base, warm, PROBE["questions"])
    for point in points:
        folder = out / f"probe-{point}-s{seed}"
        folder.mkdir(parents=True, exist_ok=True)
        seconds = json.loads((folder / "seconds.json").read_text()) if (folder / "seconds.json").is_file() else {}
        load = dict(device=base.device, dtype=base.dtype, autocast=base.autocast, engine=base.engine)
        mus = {"warmup": warm / warmup.mu_dir_name(dataclasses.asdict(base))}
        if point == "sft":
            pi, _ = rubric_model.load_backbone_checkpoint(warm / "pi_sft", **load)
            torch.manual_seed(seed)                          # the RL adapter's initialization, as arco.run
            rubric_model.add_lora(pi, dropout=0.0)
        else:
            sparse = run_once(study_args(argv, epochs=base.sparse_epochs, warmup_dir=str(warm), seed=seed,
                                         name=f"sparse-s{seed}"))
            at = sparse / "checkpoints" / f"epoch_{base.sparse_epochs}"
            pi, _ = rubric_model.load_backbone_checkpoint(at / "pi", **load)
            mus = {"fork": at / "mu"}
        sketch = Sketch(rubric_model.trainable_parameters(pi.model), PROBE["dims"])

        def stage(name, fn):
            t0 = time.time()
            value = fn()
            seconds[name] = seconds.get(name, 0.0) + time.time() - t0
            env.write_json(folder / "seconds.json", seconds)
            return value
        n, k = PROBE["questions"], PROBE["samples"]
        pool = stage("rollouts (batch pool)", lambda: probe_rollouts(pi, questions[:n], k, base,
                                                                     folder / "pool.jsonl", seed))
        held = stage("rollouts (g* pool)", lambda: probe_rollouts(pi, questions[n:], k, base,
                                                                  folder / "held.jsonl", seed + 7919))
        gstar = stage("g*", lambda: true_gradient(pi, held, sketch, base, folder / "gstar.pt"))
        grads = stage("per-step gradients", lambda: step_gradients(pi, pool, sketch, folder / "grads.pt",
                                                                   folder / "sketch.json"))
        pi = None                                            # the μs below need the memory
        scores = {"causal": [ground_truth_scores(t, "causal") for t in pool]}
        for name, mu_dir in mus.items():
            if not (mu_dir / "config.json").is_file():
                raise env.DataError(f"no μ in {mu_dir} yet: the study's warmup makes it (python study.py fork ...)")
            s = stage(f"μ scores ({name})", lambda: probe_mu_scores(mu_dir, pool, base, folder / f"mu-{name}.pt"))
            scores[name] = [s[r.start:r.stop].tolist() for r in env.step_ranges(pool)]
        offsets = [r.start for r in env.step_ranges(pool)]
        schemes = ["outcome", "value", "causal eq4", "causal state"] + [
            x for name in mus for x in (f"{name} eq4", f"{name} state", f"mixed {name}")]
        rows = probe_stats(grads, offsets, pool, scores, mc_values(pool), gstar, schemes, n, k, base.alpha,
                           base.bucket_fallback)
        facts = {"point": point, "seed": seed, "pool": {"trajectories": len(pool), "questions": n,
                 "steps": int(grads.shape[0]), "mean_R": sum(t.reward for t in pool) / len(pool)},
                 "held": {"trajectories": len(held), "questions": n, "mean_R": sum(t.reward for t in held) / len(held),
                          "nonzero_advantage": sum(a != 0 for a in loo_advantages(held))},
                 "gstar_halves_cos": float(F_cos(gstar["halves"][0], gstar["halves"][1])),
                 "sketch": json.loads((folder / "sketch.json").read_text()), "seconds": seconds, "rows": rows,
                 "favoured": favoured(rows)}
        env.write_json(folder / "probe.json", facts)
        print(probe_markdown(facts))
    return out


def probe_markdown(facts: dict) -> str:
    lines = [f"probe at {facts['point']} (seed {facts['seed']}): batch pool {facts['pool']['trajectories']} "
             f"trajectories of {facts['pool']['questions']} questions (mean R {facts['pool']['mean_R']:.2f}); g* from "
             f"{facts['held']['trajectories']} ({facts['held']['nonzero_advantage']} with a non-zero advantage); "
             f"cos(g* halves) {facts['gstar_halves_cos']:.2f}", "",
             "| scheme | batch | cos(g_B, g*) | tr Cov / ⟨ḡ, ĝ*⟩² | vs outcome 2×4 | cos(ḡ, g*) | vs outcome 2×4 | ḡ ⟂ g* |",
             "|---|---|---|---|---|---|---|---|"]
    for r in facts["rows"]:
        nts = "–" if r["noise_to_signal"] is None else f"{r['noise_to_signal']:.0f}"
        rel = "–" if r["variance_vs_outcome_2x4"] is None else f"{r['variance_vs_outcome_2x4']:.2f}"
        lo, hi = r["variance_vs_outcome_2x4_ci"]
        dlo, dhi = r["mean_cos_vs_outcome_2x4_ci"]
        lines.append(f"| {r['scheme']} | {r['composition']} | {r['cos_mean']:.3f} ± {r['cos_ci95']:.3f} | {nts} | "
                     f"{rel} [{lo:.2f}, {hi:.2f}] | {r['mean_cos']:.2f} | [{dlo:+.2f}, {dhi:+.2f}] | "
                     f"{fmt(r['orthogonal_share'])} |")
    lines += ["", "favoured at 8 × 1 (≥ 1.5× less noise than outcome 2 × 4 at equal bias): "
              + (", ".join(facts["favoured"]) or "none")]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    pre = argparse.ArgumentParser(prog="probe.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    pre.add_argument("--at", nargs="+", default=["sft", "fork"], choices=["sft", "fork"],
                     help="sft: π_sft and the warmup μ; fork: π and μ at the seed's fork (its sparse phase run if missing)")
    pre.add_argument("--probe-seed", type=int, default=0, help="the study seed whose warmup, fork and questions are used")
    own, rest = pre.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    probe(rest, own.at, own.probe_seed)


if __name__ == "__main__":
    main_guard(main, env.DataError, rubric_model.ModelLoadError)
