"""The gradient probe (issue 53): what one update's step credit does to π's gradient, measured directly.

    python -m lab.probe [--at sft fork] [--probe-seed 0] [arco.py's flags, as lab.study takes them]

Part of the credit study (its settings, warmup and sparse phases are lab/study.py's, its oracles lab/truth.py's). At
a π — π_sft of the study's warmup, or π at a seed's fork (its sparse phase run first where missing) — and with
respect to the weights RL trains (π's LoRA adapter): the expected update g* is estimated from a held-out pool of
rollouts (outcome REINFORCE with each question's leave-one-out mean as the baseline), and every credit scheme's
batch gradient g_B = (1/|B|) Σ_τ Σ_t A_{τ,t} ∇ log π(a_t|h_t) (Eq. 3's, its KL term aside) is formed on 64 disjoint
batches of the study's budget, 8 trajectories, drawn from a second pool: 2 questions × 4 samples (the study's
composition) or 8 questions × 1 (the release's dense composition). One pool and one per-step gradient serve every
scheme (common random numbers). The per-step gradients are count-sketched to PROBE["dims"] numbers (a random linear
map that keeps inner products in expectation; sketch_check measures how closely on some steps). Each stage is
kept under <out-dir>/synthetic-long/study/probe-<point>-s<seed>/ as it finishes (resumable), with its seconds, and
carries the fingerprint of the pool and π it was computed on (a stage of another pool is refused).

The ceiling of step credit (issue 60): from every prefix h_t of the first BRANCH["questions"] questions' trajectories
π is run on BRANCH["continuations"] more times (branch_rollouts), so that V̂(h_t) and Q̂(h_t, a_t) = V̂(h_{t+1}) are
Monte-Carlo estimates from the same continuations; R − V̂(h_t) is the best any exactly-decomposing, prefix-only μ
can hand π (Eq. 3's G_t = R − Σ_{k<t} s_k with Σ_{k<t} s_k = V^π(h_t); at t = 0 the sum is empty, so through ARCO's
estimator, with Eq. 4's buckets, it is `branch eq4`), Q̂ − V̂ the best any step critic can.

Issue 67: every statistic twice, with log π at temperature 1 (the update as the release implements it: π samples at
the rollout temperature, so a baseline is not neutral; score_drift sizes that) and at the rollout temperature (arco.py's
--logprob-temperature rollout: neutral baselines, g* = ∇J up to the dropped invalid steps); and where outcome RL's step
is zero — the 2 × 4 groups whose samples all fail — whether μ's credit moves π the way the critic's Q̂ − V̂ does
(allfail_stats), binned by the question's success rate p̂ from its continuations, with the AUC of μ's s_t for the
sign of Q̂ − V̂ there, corrected for V̂'s noise (noisy_label_auc).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import torch

import arco
import env
import warmup
from infra.runs import auc
from infra import models, passes
from infra.data import DataError
from infra.engines import loading
from infra.files import read_jsonl, write_json, write_jsonl
from infra.settings import main_guard
from infra.warmups import mu_dir_name
from lab.study import fmt, run_once, study_args  # (lab.study registers the "mixed" estimator)
from lab.truth import ground_truth_scores
from rubric_model import RubricModel, contexts_from_trajectory

PROBE = dict(questions=256, samples=4, dims=8192, chunk=16)
# The branched rollouts: the first `questions` of the batch pool, `continuations` from every prefix h_t (t ≥ 1) of
# their trajectories, `root` from each question's own h_0 (shared by its samples); prefixes per chunk (resumable).
BRANCH = dict(questions=256, continuations=4, root=16, chunk=32)
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
    order of env.training_questions: the first n for the batch pool, the next n for g*."""
    taught = {r["id"] for path in warm.glob("records*.jsonl") for r in read_jsonl(path)}
    order = env.load_split(args.dataset, "train", args.data_dir or None, len(taught) + args.train_size + 2 * n, args.seed)
    return [q for q in order if q.id not in taught][args.train_size:args.train_size + 2 * n]


# --- what each cached stage was computed on ------------------------------------------------------------------------

def checkpoint_id(folder: Path) -> str:
    """π's fingerprint: the SHA-256 of its checkpoint's manifest (every file's size and SHA-256), 16 hex digits."""
    manifest = Path(folder) / "manifest.json"
    return hashlib.sha256(manifest.read_bytes() if manifest.is_file() else str(folder).encode()).hexdigest()[:16]


def pool_id(rows: Sequence[dict]) -> str:
    """A pool's fingerprint: its questions, every step's output and action, the rewards and the π that played them
    (16 hex digits). Every stage computed from the pool keeps it, and is refused beside another pool."""
    key = [[r["id"], r["reward"], r.get("pi", ""), [[st["output"], st["action"], st["argument"]] for st in r["steps"]]]
           for r in rows]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def same_pool(path: Path, have: str | None, want: str) -> None:
    """Refuse a cached stage computed on another pool (a stage written before fingerprints, None, passes)."""
    if have is not None and have != want:
        raise DataError(f"{path} was computed on another pool or π (fingerprint {have}; this pool's is {want}): "
                            f"delete it to compute it again")


def traj_row(t, pi: str = "") -> dict:
    return {"id": t.example.id, "answer": t.answer, "reward": t.reward, "finished": t.finished,
            "max_searches": t.max_searches, "steps": [dataclasses.asdict(st) for st in t.steps], "pi": pi}


def traj_from_row(row: dict, example) -> "env.Trajectory":
    return env.Trajectory(example, row["max_searches"], [env.Step(**st) for st in row["steps"]], row["answer"],
                          row["reward"], row["finished"])


def probe_rollouts(pi, questions: Sequence, samples: int, args: arco.Args, path: Path, seed: int,
                   pi_id: str = "") -> tuple[list, str]:
    """`samples` rollouts of each question at the rollout temperature, one seeded random stream each (what a
    question's k-th sample is does not depend on the chunking); kept in `path` a chunk at a time (resumable; rows
    of another π, `pi_id`, are refused). Returns the trajectories and the pool's fingerprint (pool_id)."""
    from tqdm import tqdm
    rows = read_jsonl(path) if path.is_file() else []
    other = {r.get("pi") for r in rows} - {pi_id, None, ""}
    if other:
        raise DataError(f"{path} holds rollouts of another π ({', '.join(sorted(other))}; this π is {pi_id}): "
                            f"delete the folder to probe this π")
    retriever = env.shared_retriever(args.retriever or None, args.retriever_pooling)
    chunk = PROBE["chunk"]
    for start in tqdm(range(len(rows) // samples, len(questions), chunk), desc=f"rollouts ({path.stem})"):
        group = [(q, k) for q in questions[start:start + chunk] for k in range(samples)]
        seeds = [seed * 1_000_003 + (start + i // samples) * 64 + k for i, (_, k) in enumerate(group)]
        act = passes.policy_act(pi, args.rollout_temperature, args.max_new_tokens_pi, args.gen_batch)
        trajs = env.rollout([q for q, _ in group], act, retriever, args.max_searches, args.obs_chars, seeds=seeds)
        write_jsonl(path, [traj_row(t, pi_id) for t in trajs], append=True)
        rows += [traj_row(t, pi_id) for t in trajs]
    by_id = {q.id: q for q in questions}
    rows = rows[:len(questions) * samples]
    return [traj_from_row(r, by_id[r["id"]]) for r in rows], pool_id(rows)


# --- per-step gradients and g* -------------------------------------------------------------------------------------

def temperatures(args: arco.Args) -> dict[str, float]:
    """The temperatures log π is taken at (issue 67): "1", the update as the release implements it (π samples at
    the rollout temperature, its loss reads log softmax(z)), and "rollout", the neutral one (log softmax(z / T) at
    the sampling temperature T, arco.py's --logprob-temperature rollout: then E_a[∇ log π(a|h)] = 0 and a baseline
    leaves the expected update unchanged)."""
    return {"1": 1.0, "rollout": args.rollout_temperature}


def step_logprobs(pi, st, temps: Sequence[float]) -> list[torch.Tensor]:
    """log π(a_t|h_t) at each temperature T: the sum of the action's token log-probs under softmax(logits / T),
    one forward shared, each with its graph (one sequence)."""
    seqs, lens = passes.policy_sequences(pi, [st])
    ids = torch.tensor([seqs[0]], device=pi.device)
    hidden = passes.last_hidden_states(pi, ids, torch.ones_like(ids))[0]
    n, r = len(seqs[0]), lens[0]
    logits = passes.lm_logits(pi, hidden[n - r - 1:n - 1])                       # [r, V]: the positions before them
    return [torch.log_softmax(logits / T, -1).gather(-1, ids[0, n - r:, None]).sum() for T in temps]


def step_gradients(pi, trajs: Sequence, sketch: Sketch, path: Path, check_path: Path, check: int = 24,
                   fingerprint: str | None = None, temps: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """∇ log π(a_t|h_t) of every step at each temperature of `temps` ({label: T}; default {"1": 1}), sketched:
    {label: [steps, dims]} (zeros for invalid steps, outside V_τ); one forward per step, one backward per T. Kept
    in `path` a chunk of trajectories at a time (resumable, with the pool's fingerprint). The first chunk also
    writes `check_path` (sketch_check on the full gradients, at the first T, of its first `check` valid steps)."""
    from tqdm import tqdm
    temps = temps or {"1": 1.0}
    params = models.trainable_parameters(pi.model)
    done = torch.load(path, weights_only=True) if path.is_file() else {"trajectories": 0, "rows": {k: [] for k in temps}}
    same_pool(path, done.get("fingerprint"), fingerprint)
    if set(done["rows"]) != set(temps):
        raise DataError(f"{path} holds gradients at temperatures {', '.join(done['rows'])}, not "
                        f"{', '.join(temps)}: delete it to compute it again")
    rows, full = {k: list(v) for k, v in done["rows"].items()}, []
    pi.model.eval()                                  # no LoRA dropout: the gradient of π itself
    chunk = PROBE["chunk"] * 2
    for start in tqdm(range(done["trajectories"], len(trajs), chunk), desc="per-step gradients"):
        for t in trajs[start:start + chunk]:
            for st in t.steps:
                if not st.valid:
                    for k in temps:
                        rows[k].append(torch.zeros(sketch.dims))
                    continue
                logps = step_logprobs(pi, st, list(temps.values()))
                for j, (k, logp) in enumerate(zip(temps, logps)):
                    for p in params:
                        p.grad = None
                    logp.backward(retain_graph=j + 1 < len(logps))
                    g = flat_grad(params)
                    if j == 0 and start == 0 and len(full) < check:
                        full.append(g)
                    rows[k].append(sketch(g))
        if start == 0:
            write_json(check_path, sketch_check(sketch, full))
        torch.save({"trajectories": min(start + chunk, len(trajs)), "rows": rows, "fingerprint": fingerprint}, path)
    steps = sum(len(t.steps) for t in trajs)
    if any(len(v) != steps for v in rows.values()):
        raise DataError(f"{path} holds {len(next(iter(rows.values())))} step gradients, the pool {steps} steps: "
                        f"delete it to compute it again")
    return {k: torch.stack(v) for k, v in rows.items()}


def sketch_check(sketch: Sketch, full: Sequence[torch.Tensor]) -> dict:
    """How well the sketch keeps cosines: the full gradients of some valid steps (step_gradients: the first 24 of the
    pool's first chunk) and 8 random Gaussian combinations of them (like batch gradients), every pair's cosine
    before and after the sketch."""
    g = torch.Generator().manual_seed(1)
    vecs = list(full) + [sum(float(torch.randn(1, generator=g)) * f for f in full) for _ in range(8)]
    small = [sketch(v) for v in vecs]
    diffs = [abs(float(F_cos(vecs[a], vecs[b])) - float(F_cos(small[a], small[b])))
             for a in range(len(vecs)) for b in range(a + 1, len(vecs))]
    return {"vectors": len(vecs), "steps": len(full), "dims_full": int(vecs[0].numel()), "dims": sketch.dims,
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


def true_gradient(pi, trajs: Sequence, sketch: Sketch, args: arco.Args, path: Path,
                  fingerprint: str | None = None, temperature: float = 1.0) -> dict:
    """g* estimated on the held-out pool, sketched, as two halves (the first and second half of its questions:
    their agreement says how noisy g* is): (1/n) Σ_τ A_τ Σ_{t∈V_τ} ∇ log π(a_t|h_t) with the leave-one-out outcome
    advantage (trajectories with A = 0 contribute nothing and are skipped), log π at `temperature`. At 1 this is
    the update as the release implements it — rollouts sampled at the rollout temperature, log π at temperature
    1, invalid steps dropped — not exactly ∇J (score_drift measures the difference's source); at the rollout
    temperature it is ∇J of the sampling policy up to the dropped invalid steps. Kept in `path` per chunk
    (resumable: sketched sums are additive), with the held-out pool's fingerprint."""
    from tqdm import tqdm
    params = models.trainable_parameters(pi.model)
    A = loo_advantages(trajs)
    half = len(trajs) // 2
    done = torch.load(path, weights_only=True) if path.is_file() else {
        "trajectories": 0, "halves": torch.zeros(2, sketch.dims)}
    same_pool(path, done.get("fingerprint"), fingerprint)
    halves = done["halves"].clone()
    pi.model.eval()
    chunk = PROBE["chunk"] * 2
    for start in tqdm(range(done["trajectories"], len(trajs), chunk), desc="g* (held-out pool)"):
        for h in (0, 1):
            idx = [i for i in range(start, min(start + chunk, len(trajs))) if (i >= half) == h and A[i] != 0.0]
            if not idx:
                continue
            steps = [(st, A[i]) for i in idx for st in trajs[i].steps if st.valid]
            seqs, lens = passes.policy_sequences(pi, [st for st, _ in steps])
            units, at = [], 0
            for i in idx:
                n = sum(st.valid for st in trajs[i].steps)
                units.append(list(range(at, at + n)))
                at += n
            for p in params:
                p.grad = None
            adv = torch.tensor([a for _, a in steps])
            tp = passes.training_passes(pi, seqs, lens, budget=args.pass_tokens, units=units, temperature=temperature)
            for p in tp:
                (-(adv[p.index].to(p.logprobs.device) * (p.logprobs * p.mask).sum(-1)).sum() / half).backward()
            tp.backward_shared()
            halves[h] -= sketch(flat_grad(params))          # the loss's gradient is −g
        torch.save({"trajectories": min(start + chunk, len(trajs)), "halves": halves, "fingerprint": fingerprint},
                   path)
    return {"g": halves.mean(0), "halves": halves}


def probe_mu_scores(mu_dir: Path, trajs: Sequence, args: arco.Args, path: Path,
                    fingerprint: str | None = None) -> torch.Tensor:
    """μ's s_t for every step of the pool (its own greedy rubric, as in annotate), kept in `path` (resumable, with
    the pool's fingerprint); one score per step of the pool, or an error."""
    from tqdm import tqdm
    done = torch.load(path, weights_only=True) if path.is_file() else {"trajectories": 0, "s": torch.zeros(0)}
    same_pool(path, done.get("fingerprint"), fingerprint)
    s = [done["s"]]
    mu = None
    chunk = PROBE["chunk"] * 2
    for start in tqdm(range(done["trajectories"], len(trajs), chunk), desc=f"μ scores ({mu_dir.name})"):
        mu = mu or RubricModel.load(mu_dir, **loading(args))
        contexts = [c for t in trajs[start:start + chunk] for c in contexts_from_trajectory(t)]
        _, scores = mu.annotate(contexts, args.rubric_temperature, args.max_new_tokens_mu, args.gen_batch)
        s.append(scores.s.float().cpu())
        torch.save({"trajectories": min(start + chunk, len(trajs)), "s": torch.cat(s), "fingerprint": fingerprint},
                   path)
    s = torch.cat(s)
    steps = sum(len(t.steps) for t in trajs)
    if len(s) != steps:
        raise DataError(f"{path} holds {len(s)} step scores, the pool {steps} steps: delete it to score again")
    return s


# --- the branched rollouts: V̂(h_t) and Q̂(h_t, a_t) of π (issue 60) ----------------------------------------------

def branch_prefixes(trajs: Sequence, n_questions: int, samples: int) -> list[tuple[int, int]]:
    """The prefixes to continue, (trajectory, t) = the state h_t before step t of that trajectory: each question's
    h_0 once, as (its first trajectory, 0) — its samples share it — and t = 1 … T−1 of every trajectory of the first
    n_questions (h_T follows the last step: the trajectory ended there)."""
    return [(q * samples, 0) for q in range(n_questions)] + \
        [(i, t) for i in range(n_questions * samples) for t in range(1, len(trajs[i].steps))]


def branch_seed(seed: int, trajectory: int, t: int, j: int) -> int:
    """The random stream of continuation j from (trajectory, t): apart from every pool's (probe_rollouts)."""
    return (seed + 1) * 10 ** 12 + (trajectory * 16 + t) * 64 + j


def branch_rollouts(pi, trajs: Sequence, args: arco.Args, path: Path, seed: int,
                    fingerprint: str | None = None) -> dict[tuple[int, int], list[float]]:
    """π continued from every prefix of branch_prefixes at the rollout temperature: BRANCH["root"] times from each
    h_0, BRANCH["continuations"] times from each later h_t, each continuation its own seeded random stream; the
    rewards are exact given the answer. {(trajectory, t): the continuations' R}. Kept in `path` a chunk of
    prefixes at a time (resumable), each row with the pool's fingerprint and the steps its continuations took."""
    from tqdm import tqdm
    rows = read_jsonl(path) if path.is_file() else []
    for r in rows:
        same_pool(path, r.get("pool"), fingerprint)
    done = {(r["trajectory"], r["t"]): r["rewards"] for r in rows}
    todo = [p for p in branch_prefixes(trajs, BRANCH["questions"], PROBE["samples"]) if p not in done]
    retriever = env.shared_retriever(args.retriever or None, args.retriever_pooling)
    for start in tqdm(range(0, len(todo), BRANCH["chunk"]), desc="branched rollouts"):
        starts, seeds, keys = [], [], []
        for i, t in todo[start:start + BRANCH["chunk"]]:
            for j in range(BRANCH["root"] if t == 0 else BRANCH["continuations"]):
                starts.append(env.Trajectory(trajs[i].example, trajs[i].max_searches, list(trajs[i].steps[:t])))
                seeds.append(branch_seed(seed, i, t, j))
                keys.append((i, t))
        act = passes.policy_act(pi, args.rollout_temperature, args.max_new_tokens_pi, args.gen_batch)
        ends = env.play(starts, act, retriever, args.obs_chars, seeds=seeds)
        new: dict = {}
        for (i, t), e in zip(keys, ends):
            row = new.setdefault((i, t), {"trajectory": i, "t": t, "rewards": [], "steps": 0, "pool": fingerprint})
            row["rewards"].append(e.reward)
            row["steps"] += len(e.steps) - t
        write_jsonl(path, list(new.values()), append=True)
        done.update({k: r["rewards"] for k, r in new.items()})
    return done


def branch_values(trajs: Sequence, done: dict, n_questions: int, samples: int) -> dict[str, list]:
    """Per trajectory of the first n_questions, per step t: V̂(h_t), the mean R of the continuations from h_t (h_0's:
    its question's), and Q̂(h_t, a_t) = V̂(h_{t+1}) — the same continuations, since the observation after a_t is
    fixed by a_t (top-1 retrieval) — and R itself at the last step, where the trajectory ends. "full" from all the
    continuations, "a" and "b" from their first and second halves: two independent estimates whose difference
    measures V̂'s own sampling noise (probe_stats removes it). None for the trajectories not branched."""
    out: dict[str, list] = {h: [None] * len(trajs) for h in ("full", "a", "b")}
    for i in range(n_questions * samples):
        rewards = [done[(i // samples * samples, 0)]] + [done[(i, t)] for t in range(1, len(trajs[i].steps))]
        if any(len(r) % 2 for r in rewards):            # the halves' noise formula (probe_stats) needs equal halves
            raise ValueError(f"trajectory {i}: an odd number of continuations cannot be split into equal halves")
        for h in out:
            parts = [r if h == "full" else (r[:len(r) // 2] if h == "a" else r[len(r) // 2:]) for r in rewards]
            V = [sum(p) / len(p) for p in parts]
            out[h][i] = {"V": V, "Q": V[1:] + [float(trajs[i].reward)]}
    return out


# --- the credit schemes ----------------------------------------------------------------------------------------------

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


# The probe's own estimators, registered as any run's would be (arco's seam): each scheme below is a pair (the s_t
# it hands an estimator, the estimator's name), so the probe measures what `arco.py --estimator NAME` would compute.

@arco.register_estimator("probe-return")
def return_advantages(batch: arco.CreditBatch) -> arco.Advantages:
    """A_t = G_t, Eq. 3's reward-to-go of the s_t with no baseline and no α, on valid steps: given s_t whose
    reward-to-go is a per-step advantage (`telescoped`), that advantage."""
    G = [arco.reward_to_go(batch.s[r.start:r.stop].tolist()) for r in env.step_ranges(batch.trajs)]
    return arco.Advantages([[g if st.valid else 0.0 for g, st in zip(g_t, t.steps)] for g_t, t in zip(G, batch.trajs)])


@arco.register_estimator("probe-state")
def state_advantages(batch: arco.CreditBatch) -> arco.Advantages:
    """Eq. 3's G_t of the s_t with a state-only baseline: the mean G of the batch's valid steps at the same position t
    (position_buckets; Eq. 4 puts a search with the searches of its rank, a Finish with every last step), α-scaled."""
    valid = [[st.valid for st in t.steps] for t in batch.trajs]
    G = [arco.reward_to_go(batch.s[r.start:r.stop].tolist()) for r in env.step_ranges(batch.trajs)]
    buckets = [position_buckets([st.action for st in t.steps], v) for t, v in zip(batch.trajs, valid)]
    return arco.Advantages(arco.bucketed_advantages(G, buckets, valid, batch.args.alpha, batch.args.bucket_fallback))


@arco.register_estimator("probe-verdict")
def verdict_advantages(batch: arco.CreditBatch) -> arco.Advantages:
    """μ's verdict on the whole trajectory at every valid step: α (R̂ − the group's or batch's mean R̂), R̂ = Σ_t s_t."""
    groups = [(t.example.dataset, t.example.id) for t in batch.trajs] if batch.args.sparse_baseline == "group" else None
    verdict = arco.outcome_advantages([float(batch.s[r.start:r.stop].sum()) for r in env.step_ranges(batch.trajs)],
                                      groups)
    return arco.Advantages([[batch.args.alpha * a if st.valid else 0.0 for st in t.steps]
                            for a, t in zip(verdict, batch.trajs)])


def telescoped(A: Sequence[float]) -> list[float]:
    """Per-step s_t whose reward-to-go is A_t: s_t = A_t − A_{t+1}, the last A_T (Σ_{k≥t} s_k = A_t)."""
    return [a - b for a, b in zip(A, list(A[1:]) + [0.0])]


def scheme_credit(name: str, i: int, t, scores: dict, values, branch: list | None) -> tuple[list[float] | None, str, bool]:
    """A scheme as the seam runs it, for trajectory i: (its s_t, the registered estimator's name, dense?). `outcome`
    (ARCO's estimator, sparse: R − the group's mean at 2 × 4, the batch's at 8 × 1); `value` (R − V̂(h_t),
    mc_values), `branch value` (R − V̂(h_t) of the branched rollouts, V̂(h_0) at t = 0 included: a state-value
    baseline, optimistic for a decomposing μ) and `branch critic` (Q̂(h_t, a_t) − V̂(h_t): the best step critic;
    `branch` is one of branch_values' estimates), each a per-step advantage handed to "probe-return"; `branch eq4`
    (the best exactly-decomposing μ as ARCO's estimator runs it: s_t whose G_0 = R, since Σ_{k<0} s_k is empty
    whatever μ, and G_t = R − V̂(h_t) after, through Eq. 4's buckets and α); `verdict <μ>` ("probe-verdict"); a dense
    "<scores> <baseline>" — Eq. 3's G_t of the scores (`causal`: the causal oracle's, or a μ's) through ARCO's
    estimator (`eq4`, Eq. 4's buckets) or "probe-state" (`state`); and `mixed <μ>`, the lab's mixed estimator."""
    n = len(t.steps)
    if name == "outcome":
        return None, "arco", False
    if name in ("value", "branch value", "branch critic", "branch eq4"):
        V = values[i] if name == "value" else branch[i]["V"]
        A = [b["Q"][k] - b["V"][k] for b in [branch[i]] for k in range(n)] if name == "branch critic" else \
            [t.reward - (V[k] if k or name != "branch eq4" else 0.0) for k in range(n)]
        return telescoped(A), ("arco" if name == "branch eq4" else "probe-return"), True
    kind, *rest = name.split()
    if kind == "verdict":
        return scores[rest[0]][i], "probe-verdict", True
    if kind == "mixed":
        return scores[rest[0]][i], "mixed", True
    return scores[kind][i], {"eq4": "arco", "state": "probe-state"}[rest[0]], True


def scheme_advantages(name: str, batch: Sequence[int], trajs, scores: dict, values, composition: str,
                      alpha: float, fallback: bool, branch: list | None = None) -> list[list[float]]:
    """Per-step advantages of one batch (trajectory indices) under a credit scheme (scheme_credit), computed by its
    registered estimator (arco.ESTIMATORS) on the batch, as a run computes them; at 2 × 4 the group baselines are
    each question's samples, at 8 × 1 (one sample a question) the batch's."""
    ts = [trajs[i] for i in batch]
    credit = [scheme_credit(name, i, trajs[i], scores, values, branch) for i in batch]
    s, estimator, dense = [c[0] for c in credit], credit[0][1], credit[0][2]
    args = arco.Args(alpha=alpha, bucket_fallback=fallback,
                     sparse_baseline="group" if COMPOSITIONS[composition][1] > 1 else "batch")
    flat = torch.tensor([x for row in s for x in row], dtype=torch.float64) if s[0] is not None else None
    return arco.ESTIMATORS[estimator](arco.CreditBatch(ts, flat, dense, args)).A


def probe_batches(n_questions: int, samples: int, composition: str) -> list[list[int]]:
    """Disjoint batches of the pool (trajectory i = question i // samples, sample i % samples): 2 × 4 takes two
    questions' four samples; 8 × 1 takes sample k of eight questions. Every `samples` consecutive batches hold the
    same 8 questions (a block; at 8 × 1 its batches share questions, so they are not independent: the intervals and
    the de-noising below treat the blocks, not the batches, as the independent draws)."""
    q_per, s_per = COMPOSITIONS[composition]
    out = []
    for q0 in range(0, n_questions - q_per + 1, q_per):
        for k0 in range(0, samples - s_per + 1, s_per):
            out.append([(q0 + a) * samples + k0 + b for a in range(q_per) for b in range(s_per)])
    return out


def batch_gradients(name: str, batches: Sequence[Sequence[int]], grads: torch.Tensor, offsets: Sequence[int],
                    composition: str, trajs, scores, values, alpha: float, fallback: bool, branch=None,
                    keep: set[int] | None = None) -> torch.Tensor:
    """g_B = (1/|B|) Σ_τ Σ_t A_{τ,t} ∇ log π(a_t|h_t) of each batch under a scheme: [batches, dims], float64. With
    `keep` (trajectory indices), only those trajectories' terms — the advantages still computed on the whole
    batch, as the update computes them: the part of g_B that a subset of the pool contributes (the parts of
    disjoint subsets add up to g_B)."""
    out = []
    for batch in batches:
        A = scheme_advantages(name, batch, trajs, scores, values, composition, alpha, fallback, branch)
        coef = torch.zeros(grads.shape[0], dtype=torch.float64)
        for i, a_t in zip(batch, A):
            if keep is None or i in keep:
                coef[offsets[i]:offsets[i] + len(a_t)] = torch.tensor(a_t, dtype=torch.float64)
        out.append((coef @ grads.double()) / len(batch))
    return torch.stack(out)


# --- the statistics ----------------------------------------------------------------------------------------------------

def denoised_inner(K: torch.Tensor, W: torch.Tensor, per_block: int, centered: bool = False) -> tuple:
    """From a (cross-)Gram matrix K = [⟨g^X_a, g^Y_b⟩] of B batch gradients, per row of weights W [R, B]:
    ⟨ḡ^X, ḡ^Y⟩ with ḡ = Σ w_b g_b / B, and its de-noised expectation ⟨E g^X, E g^Y⟩: ⟨ḡ^X, ḡ^Y⟩ minus the spread of
    the block means (per_block consecutive batches, disjoint questions: independent where an 8 × 1 block's batches
    are not) over (blocks − 1); NaN with a single block, nothing to de-noise with.
    `centered`, for a bootstrap's draws: each draw's de-noised value shifted by the estimate's de-noising (the
    de-noised minus the plain value at unit weights). A draw's truth is the data's own ḡ, so its de-noised value
    scatters around ⟨ḡ^X, ḡ^Y⟩, not around the estimate; shifted, the draws scatter around the estimate with the
    estimate's spread (the percentile interval of an uncentered draw sat a whole de-noising below the estimate,
    which it could exclude)."""
    B = K.shape[0]
    blocks = B // per_block
    plain = ((W @ K) * W).sum(1) / B ** 2
    if blocks < 2:
        return plain, torch.full_like(plain, float("nan"))
    M = torch.zeros(B, blocks, dtype=K.dtype)
    M[torch.arange(blocks * per_block), torch.arange(blocks * per_block) // per_block] = 1.0 / per_block
    counts = W[:, ::per_block][:, :blocks]
    block_spread = counts @ torch.diagonal(M.T @ K @ M) / blocks - plain
    expected = plain - block_spread / (blocks - 1)
    if centered:
        one_plain, one_expected = denoised_inner(K, torch.ones(1, B, dtype=K.dtype), per_block)
        expected = expected + (one_expected - one_plain)
    return plain, expected


def gram_stats(K: torch.Tensor, p: torch.Tensor, noise: torch.Tensor, W: torch.Tensor, per_block: int,
               centered: bool = False) -> dict:
    """A row's statistics from its batch gradients' Gram matrix K = [⟨g_a, g_b⟩], their projections p = [⟨g_b, û*⟩]
    and a per-batch noise energy to remove (`noise`: the part of ‖g_b − E g_b‖² that V̂'s own sampling adds, or 0),
    for each row of weights W [R, B] (1 everywhere: the estimate; a bootstrap's resampled counts: its draws, then
    `centered`, see denoised_inner): ḡ = Σ w_b g_b / B, along = ⟨ḡ, û*⟩, msq = ‖ḡ‖², the de-noised ‖E g_B‖²
    (expected_sq, denoised_inner) and with it the spread tr Cov = Σ w_b ‖g_b‖² / B − ‖E g_B‖² (unbiased whether or
    not a block's batches share questions; Σ w_b ‖g_b‖² / B − ‖ḡ‖² would fall short by tr Cov / B and, at 8 × 1, by
    the shared part's covariances too), noise_to_signal = spread / along², the same with `noise` removed
    (noise_to_signal_clean), cos(ḡ, g*), and cos(E g_B, g*) = along / ‖E g_B‖ (‖E g_B‖ floored at |along|, which it
    cannot be below: a cosine in [−1, 1]). With a single block, nothing to de-noise with: the spread is the batches'
    own, × B / (B − 1), and ‖E g_B‖² NaN."""
    B = K.shape[0]
    along = W @ p / B
    msq, expected = denoised_inner(K, W, per_block, centered)
    mean_sq = W @ torch.diagonal(K) / B                                            # mean ‖g_b‖² = tr Cov + ‖E g_B‖²
    spread = mean_sq - expected if B // per_block > 1 else (mean_sq - msq) * B / (B - 1)
    clean = spread - W @ noise / B
    return {"along": along, "msq": msq, "spread": spread, "noise_to_signal": spread / along ** 2,
            "noise_to_signal_clean": clean / along ** 2, "mean_cos": along / msq.clamp_min(1e-300).sqrt(),
            "expected_sq": expected,
            "mean_cos_denoised": along / torch.maximum(expected, along ** 2).clamp_min(1e-300).sqrt()}


def expected_cos(gx: torch.Tensor, gy: torch.Tensor, W: torch.Tensor, per_block: int,
                 centered: bool = False) -> torch.Tensor:
    """cos(E g^X, E g^Y) of two schemes on the same batches, each expectation's square and their inner product
    de-noised (denoised_inner; `centered` for a bootstrap's draws), per row of weights; clipped to [−1, 1], NaN where
    either de-noised square is not positive (no signal to compare). 1: the two credit schemes step π the same way
    on average (a baseline's difference changes only the noise)."""
    xy, xx, yy = (denoised_inner(a @ b.T, W, per_block, centered)[1] for a, b in ((gx, gy), (gx, gx), (gy, gy)))
    cos = (xy / (xx.clamp_min(1e-300) * yy.clamp_min(1e-300)).sqrt()).clamp(-1.0, 1.0)
    return torch.where((xx > 0) & (yy > 0), cos, torch.full_like(cos, float("nan")))   # no signal: undefined


def bootstrap_weights(batches: int, per_block: int, resamples: int, seed: int = 0) -> torch.Tensor:
    """[resamples, batches] weights of a block bootstrap: blocks of per_block consecutive batches drawn with
    replacement, the same draw for every row (paired). A 2 × 4 block and the 8 × 1 block at the same index hold the
    same questions (8 questions, all their samples, at the probe's sizes), so the resample is one over questions,
    paired across schemes and compositions (intervals of differences and ratios carry the common random numbers)."""
    blocks = batches // per_block
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, blocks, (resamples, blocks), generator=g)
    counts = torch.nn.functional.one_hot(picks, blocks).sum(1).double()   # (resamples, blocks): times drawn
    return counts.repeat_interleave(per_block, dim=1)


def block_bootstrap(grams: Sequence[tuple], batches_per_block: int, resamples: int, seed: int = 0) -> list[dict]:
    """gram_stats of each row (K, p[, noise]) under bootstrap_weights' resamples, each draw's ‖E g_B‖² centered on
    the estimate's (denoised_inner)."""
    W = bootstrap_weights(len(grams[0][1]), batches_per_block, resamples, seed)
    return [gram_stats(K, p, rest[0] if rest else torch.zeros_like(p), W, batches_per_block, centered=True)
            for K, p, *rest in grams]


def percentile_interval(x: torch.Tensor) -> list[float]:
    x = x[~torch.isnan(x)]
    return [float(torch.quantile(x, 0.025)), float(torch.quantile(x, 0.975))] if len(x) else [math.nan, math.nan]


def probe_stats(grads: torch.Tensor, offsets: list[int], trajs, scores, values, gstar: dict, schemes: Sequence[str],
                n_questions: int, samples: int, alpha: float, fallback: bool, resamples: int = 2000,
                branch: dict | None = None, pairs: Sequence[tuple[str, str]] = ()) -> list[dict]:
    """Per (scheme, composition) on the batches of the first n_questions: the cosine of each batch gradient with g*
    (mean; 95% interval from the block means), the batch gradients' spread relative to their component along g*
    (tr Cov / ⟨ḡ, ĝ*⟩²: lower is a better-conditioned step; also relative to outcome RL at 2 × 4), for the branch
    schemes also with V̂'s own sampling noise removed (its energy per batch is ‖g_B^a − g_B^b‖²/4, g^a and g^b
    built from the two halves of the continuations: V̂'s noise at n continuations is half of one half's), and the
    mean gradient ḡ over all batches: its cosine with g*, the same de-noised (cos(E g_B, g*), gram_stats), and its
    component orthogonal to g*. Intervals of the ratios, of the cosines and of their differences from outcome 2 × 4's
    come from one paired bootstrap over blocks of questions. `pairs` (scheme X, scheme Y): cos(E g^X, E g^Y) per
    composition with its interval, in the X row (expected_cos)."""
    g = gstar["g"].double()
    u = g / g.norm()
    rows, grams, kept = [], [], {}
    W = bootstrap_weights(len(probe_batches(n_questions, samples, "2x4")), samples, resamples)
    for composition in COMPOSITIONS:
        batches = probe_batches(n_questions, samples, composition)
        for name in schemes:
            common = (grads, offsets, composition, trajs, scores, values, alpha, fallback)
            gb = batch_gradients(name, batches, *common, branch=branch["full"] if branch else None)
            noise = torch.zeros(len(batches), dtype=torch.float64)
            if name.startswith("branch"):
                ga, gb2 = (batch_gradients(name, batches, *common, branch=branch[h]) for h in "ab")
                noise = ((ga - gb2) ** 2).sum(1) / 4
            K, p = gb @ gb.T, gb @ u
            one = {k: float(v[0]) for k, v in gram_stats(K, p, noise, torch.ones(1, len(batches), dtype=torch.float64),
                                                        samples).items()}
            cos = torch.stack([F_cos(x, g) for x in gb]).double()
            blocks = cos[:len(cos) // samples * samples].view(-1, samples).mean(1)
            mean = gb.mean(0)
            rows.append({"scheme": name, "composition": composition, "batches": len(batches),
                         "cos_mean": float(cos.mean()), "cos_ci95": 1.96 * float(blocks.std()) / len(blocks) ** 0.5,
                         "along": one["along"], "noise_to_signal": one["noise_to_signal"] if one["along"] else None,
                         "noise_to_signal_clean": one["noise_to_signal_clean"] if name.startswith("branch") else None,
                         "mean_cos": one["mean_cos"], "mean_cos_denoised": one["mean_cos_denoised"],
                         "orthogonal_share": float((mean - one["along"] * u).norm() / mean.norm()) if mean.norm() else None})
            grams.append((K, p, noise))
            kept[(name, composition)] = gb
    base = next(i for i, r in enumerate(rows) if r["scheme"] == "outcome" and r["composition"] == "2x4")
    for r in rows:
        r["variance_vs_outcome_2x4"] = (r["noise_to_signal"] / rows[base]["noise_to_signal"]
                                        if r["noise_to_signal"] and rows[base]["noise_to_signal"] else None)
        if r["noise_to_signal_clean"] is not None and rows[base]["noise_to_signal"]:
            r["clean_vs_outcome_2x4"] = r["noise_to_signal_clean"] / rows[base]["noise_to_signal"]
    boot = block_bootstrap(grams, samples, resamples)                   # the same draws as W
    for r, b in zip(rows, boot):
        r["variance_vs_outcome_2x4_ci"] = percentile_interval(b["noise_to_signal"] / boot[base]["noise_to_signal"])
        if r["noise_to_signal_clean"] is not None:
            r["clean_vs_outcome_2x4_ci"] = percentile_interval(b["noise_to_signal_clean"] / boot[base]["noise_to_signal"])
        r["mean_cos_ci"] = percentile_interval(b["mean_cos"])
        r["mean_cos_vs_outcome_2x4_ci"] = percentile_interval(b["mean_cos"] - boot[base]["mean_cos"])
        r["mean_cos_vs_outcome_ci"] = percentile_interval(
            b["mean_cos"] - boot[next(i for i, o in enumerate(rows) if o["scheme"] == "outcome"
                                      and o["composition"] == r["composition"])]["mean_cos"])
        r["mean_cos_denoised_ci"] = percentile_interval(b["mean_cos_denoised"])
    at = {(r["scheme"], r["composition"]): i for i, r in enumerate(rows)}
    for i, (r, b) in enumerate(zip(rows, boot)):             # against outcome at the row's own composition
        o = at[("outcome", r["composition"])]
        if r["noise_to_signal"] and rows[o]["noise_to_signal"]:
            r["variance_vs_outcome"] = r["noise_to_signal"] / rows[o]["noise_to_signal"]
            r["variance_vs_outcome_ci"] = percentile_interval(b["noise_to_signal"] / boot[o]["noise_to_signal"])
        if r["noise_to_signal_clean"] is not None and rows[o]["noise_to_signal"]:
            r["clean_vs_outcome"] = r["noise_to_signal_clean"] / rows[o]["noise_to_signal"]
            r["clean_vs_outcome_ci"] = percentile_interval(b["noise_to_signal_clean"] / boot[o]["noise_to_signal"])
        v = at.get(("branch value", r["composition"]))      # the critic ÷ the value: the same expected gradient,
        if r["scheme"] == "branch critic" and v is not None:   # so a pure comparison of their noise (V̂'s removed)
            r["clean_vs_value"] = r["noise_to_signal_clean"] / rows[v]["noise_to_signal_clean"]
            r["clean_vs_value_ci"] = percentile_interval(b["noise_to_signal_clean"] / boot[v]["noise_to_signal_clean"])
    ones = torch.ones(1, W.shape[1], dtype=torch.float64)
    for x, y in pairs:
        for composition in COMPOSITIONS:
            if (x, composition) in kept and (y, composition) in kept:
                gx, gy = kept[(x, composition)], kept[(y, composition)]
                row = next(r for r in rows if r["scheme"] == x and r["composition"] == composition)
                row.setdefault("expected_cos", {})[y] = [float(expected_cos(gx, gy, ones, samples)[0]),
                                                         percentile_interval(expected_cos(gx, gy, W, samples, centered=True))]
    return rows


def gstar_attenuation(gstar: dict) -> dict:
    """How noisy g* is, from its two halves h₁, h₂ (independent estimates of the same expectation g):
    ⟨h₁, h₂⟩ estimates ‖g‖² without their noise, so cos(g*, g) ≈ √⟨h₁, h₂⟩ / ‖g*‖ and every cosine with g* is that
    factor times the cosine with g (for vectors independent of g*'s noise)."""
    h1, h2 = gstar["halves"].double()
    g = gstar["g"].double()
    inner = float(h1 @ h2)
    return {"halves_cos": float(F_cos(h1, h2)), "norm": float(g.norm()),
            "signal_norm": math.sqrt(max(inner, 0.0)), "attenuation": math.sqrt(max(inner, 0.0)) / float(g.norm())}


def score_drift(grads: torch.Tensor, offsets: Sequence[int], trajs: Sequence, samples: int, gstar: dict) -> dict:
    """The size of the temperature mismatch: m = E_τ[Σ_{t∈V_τ} ∇ log π(a_t|h_t)] is 0 when π samples at the
    temperature its log-probs are taken at and every step counts; here π samples at the rollout temperature (0.7),
    log π is taken at 1 and invalid steps are dropped, so it is not. Its norm, de-noised over the question means
    (their spread over (questions − 1) subtracted; the questions are independent), against g*'s de-noised norm
    (gstar_attenuation's √⟨h₁, h₂⟩); a constant baseline b moves the expected batch gradient by −b·m, so `bias_at_mean_R`
    is that shift at b = the pool's mean R, relative to ‖g‖."""
    sums = torch.stack([grads[offsets[i]:offsets[i] + len(t.steps)].double().sum(0) for i, t in enumerate(trajs)])
    q = sums[:len(sums) // samples * samples].view(-1, samples, sums.shape[1]).mean(1)
    mean = q.mean(0)
    m2 = float(mean @ mean) - float(((q - mean) ** 2).sum(1).mean()) / (len(q) - 1)
    signal = gstar_attenuation(gstar)["signal_norm"]
    mean_R = sum(t.reward for t in trajs) / len(trajs)
    drift = math.sqrt(max(m2, 0.0))
    return {"drift_norm": drift, "drift_sq": m2, "gradJ_norm": signal, "ratio": drift / signal if signal else None,
            "mean_R": mean_R, "bias_at_mean_R": mean_R * drift / signal if signal else None}


def favoured(rows: Sequence[dict], factor: float = 1.5) -> list[str]:
    """Issue 53's rule for an RL check: the schemes whose batch gradient at 8 × 1 has a noise-to-signal at least
    `factor` times below outcome RL's at 2 × 4 over its whole interval (upper end ≤ 1/factor) at equal bias —
    read as: the cosine of its mean gradient with g* not below outcome 2 × 4's beyond the paired interval (an
    unbiased scheme with less noise has a mean gradient at least as close to g*; a bias shows as a lower one)."""
    return [r["scheme"] for r in rows if r["composition"] == "8x1" and r["scheme"] != "outcome"
            and r["variance_vs_outcome_2x4_ci"][1] <= 1 / factor and r["mean_cos_vs_outcome_2x4_ci"][1] >= 0]


# --- where outcome RL's step is zero: the groups that all fail (issue 67) ---------------------------------------------

P_BINS = [("p̂ = 0", 0.0, 0.0), ("0 < p̂ ≤ ¼", 0.0, 0.25), ("¼ < p̂ ≤ ½", 0.25, 0.5), ("p̂ > ½", 0.5, 1.0)]


def p_bin(p: float) -> str:
    """The bin of a question's success rate p̂ (P_BINS: lower end exclusive, but p̂ = 0 its own bin)."""
    return next(name for name, lo, hi in P_BINS if (p == 0.0 if hi == 0.0 else lo < p <= hi))


def question_sets(trajs, branch_full: Sequence, n_questions: int, samples: int) -> dict[str, list[int]]:
    """The pool's questions (question q: trajectories q·samples … q·samples + samples − 1, its group at 2 × 4) by how
    their group ended — "all fail" (every R = 0: the group-mean outcome advantage is 0 on every step), "mixed",
    "all succeed" (also 0) — and the all-fail and mixed ones again by p̂ = V̂(h_0), the question's success rate
    from its branched root continuations (P_BINS): "all fail, p̂ = 0", ... {set: [question indices]}."""
    out: dict[str, list[int]] = {"all fail": [], "mixed": [], "all succeed": []}
    for q in range(n_questions):
        R = [trajs[q * samples + k].reward for k in range(samples)]
        kind = "all fail" if not any(R) else "all succeed" if all(r >= 1 for r in R) else "mixed"
        out[kind].append(q)
    for kind in ("all fail", "mixed"):
        for name, *_ in P_BINS:
            out[f"{kind}, {name}"] = [q for q in out[kind] if p_bin(branch_full[q * samples]["V"][0]) == name]
    return out


ALLFAIL_SCHEMES = ["outcome", "branch value", "branch eq4", "{mu} eq4", "verdict {mu}"]     # each against the critic


def allfail_stats(grads: torch.Tensor, offsets: list[int], trajs, scores: dict, values, branch: dict, mu: str,
                  n_questions: int, samples: int, alpha: float, fallback: bool, resamples: int = 2000) -> dict:
    """Does a scheme push π where the true step advantages point, where outcome RL's step is zero? On the 2 × 4
    batches of the first n_questions, each set of question_sets contributes a part of every batch gradient
    (batch_gradients' `keep`: the advantages computed on the whole batch, as the update does). Per set and scheme X
    (ALLFAIL_SCHEMES, `{mu}` the μ's name), against the branch critic C (Q̂ − V̂: each step's estimated true
    advantage, unbiased under V̂'s noise, so E g^C is ∇J's part from the set): the de-noised ⟨E g^X, E g^C⟩
    (denoised_inner), cos(E g^X, E g^C) (expected_cos), `along` = ⟨E g^X, E g^C⟩ / ‖E g^C‖ (how far X's mean step
    goes the critic's way), and `along_vs_outcome_mixed`: that ÷ outcome RL's own `along` on the mixed groups
    (what X adds where outcome RL gives nothing, against what outcome RL moves where it moves), each with its
    interval from one paired block bootstrap (the sets share the batches' blocks, centered as block_bootstrap's).
    Counts: questions, trajectories and valid steps of each set."""
    batches = probe_batches(n_questions, samples, "2x4")
    W = bootstrap_weights(len(batches), samples, resamples)
    ones = torch.ones(1, len(batches), dtype=torch.float64)
    sets = question_sets(trajs, branch["full"], n_questions, samples)
    common = (grads, offsets, "2x4", trajs, scores, values, alpha, fallback)
    counts, rows, draws = {}, [], {}
    for name, qs in sets.items():
        keep = {q * samples + k for q in qs for k in range(samples)}
        counts[name] = {"questions": len(qs), "trajectories": len(keep),
                        "valid_steps": sum(st.valid for i in keep for st in trajs[i].steps)}
        if not qs:
            continue
        crit = batch_gradients("branch critic", batches, *common, branch=branch["full"], keep=keep)
        cc = [denoised_inner(crit @ crit.T, w, samples, centered=c)[1] for w, c in ((ones, False), (W, True))]
        for scheme in ALLFAIL_SCHEMES:
            x = scheme.format(mu=mu)
            gx = batch_gradients(x, batches, *common, branch=branch["full"], keep=keep)
            xc = [denoised_inner(gx @ crit.T, w, samples, centered=c)[1] for w, c in ((ones, False), (W, True))]
            along = [a / c.clamp_min(1e-300).sqrt() for a, c in zip(xc, cc)]
            draws[(name, x)] = along[1]
            cos = float(expected_cos(gx, crit, ones, samples)[0])
            rows.append({"set": name, "scheme": x, "inner": float(xc[0][0]), "inner_ci": percentile_interval(xc[1]),
                         "cos": None if math.isnan(cos) else cos,
                         "cos_ci": percentile_interval(expected_cos(gx, crit, W, samples, centered=True)),
                         "along": float(along[0][0]), "along_ci": percentile_interval(along[1]),
                         "critic_sq": float(cc[0][0])})
    base = next((r for r in rows if r["set"] == "mixed" and r["scheme"] == "outcome"), None)
    for r in rows:
        if base and base["along"] != 0:
            r["along_vs_outcome_mixed"] = r["along"] / base["along"]
            r["along_vs_outcome_mixed_ci"] = percentile_interval(draws[(r["set"], r["scheme"])] /
                                                                 draws[("mixed", "outcome")])
    return {"sets": counts, "rows": rows, "auc": allfail_auc(trajs, scores[mu], branch, sets["all fail"], samples)}


def noisy_label_auc(scores: Sequence[float], a: Sequence[float], b: Sequence[float]) -> dict:
    """The AUC of `scores` for the sign of a quantity known only through two independent noisy estimates `a`, `b`
    of it (the halves of the continuations), corrected for the labels' noise. Model: an estimate's sign is the
    true sign flipped with probability ε, independently of the score and of the other half. Then the two halves
    agree in sign with probability (1 − ε)² + ε², which gives ε; the AUC measured against one half's signs (zero
    estimates left out) is 0.5 + κ (AUC − 0.5), κ = (purity of its positives) + (purity of its negatives) − 1,
    both from ε and the observed share of positives; so AUC = 0.5 + (measured − 0.5) / κ (None when κ < 0.1:
    labels too noisy to say). Also the AUC against the halves' mean (`raw`) and the counts."""
    def measured(est):
        keep = [i for i, e in enumerate(est) if e != 0]
        return auc([scores[i] for i in keep], [est[i] > 0 for i in keep]), \
            sum(est[i] > 0 for i in keep) / max(1, len(keep)), len(keep)
    full = [(x + y) / 2 for x, y in zip(a, b)]
    raw, _, n_raw = measured(full)
    (auc_a, pos_a, _), (auc_b, pos_b, _) = measured(a), measured(b)
    both = [i for i in range(len(a)) if a[i] != 0 and b[i] != 0]
    out = {"steps": len(a), "steps_signed": n_raw, "steps_both_halves_signed": len(both), "raw": raw,
           "halves": None, "agreement": None, "flip": None, "kappa": None, "corrected": None}
    if auc_a is None or auc_b is None or not both:
        return out
    agree = sum((a[i] > 0) == (b[i] > 0) for i in both) / len(both)
    eps = (1 - math.sqrt(max(2 * agree - 1, 0.0))) / 2
    measured_auc, share = (auc_a + auc_b) / 2, (pos_a + pos_b) / 2
    pi = min(1.0, max(0.0, (share - eps) / (1 - 2 * eps))) if eps < 0.5 else share
    kappa = (pi * (1 - eps) / share if share else 0.0) + ((1 - pi) * (1 - eps) / (1 - share) if share < 1 else 0.0) - 1
    out.update(halves=measured_auc, agreement=agree, flip=eps, kappa=kappa,
               corrected=min(1.0, max(0.0, 0.5 + (measured_auc - 0.5) / kappa)) if kappa >= 0.1 else None)
    return out


def allfail_auc(trajs, mu_scores: Sequence[Sequence[float]], branch: dict, questions: Sequence[int], samples: int,
                resamples: int = 1000, seed: int = 0) -> dict:
    """noisy_label_auc of μ's s_t for the sign of Q̂ − V̂ on the valid steps of the given questions' trajectories
    (the all-fail groups), the halves' Q̂ − V̂ as the two estimates; its interval from a bootstrap over the
    questions."""
    per_q = []
    for q in questions:
        rows = []
        for i in range(q * samples, (q + 1) * samples):
            for k, st in enumerate(trajs[i].steps):
                if st.valid:
                    rows.append((mu_scores[i][k], *(branch[h][i]["Q"][k] - branch[h][i]["V"][k] for h in "ab")))
        per_q.append(rows)

    def of(qs):
        rows = [r for q in qs for r in per_q[q]]
        return noisy_label_auc([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
    out = of(range(len(per_q)))
    g = torch.Generator().manual_seed(seed)
    boot = [of(torch.randint(0, len(per_q), (len(per_q),), generator=g).tolist())["corrected"]
            for _ in range(resamples if per_q else 0)]
    boot = torch.tensor([x for x in boot if x is not None], dtype=torch.float64)
    out["corrected_ci"] = percentile_interval(boot) if len(boot) else [math.nan, math.nan]
    out["questions"] = len(per_q)
    return out


def allfail_signal(allfail: dict, mu: str) -> list[str]:
    """Issue 67's rule for an RL check: μ's schemes (its Eq. 3–4 credit, its verdict) whose mean step on the
    all-fail groups goes the critic's way beyond noise (the lower end of ⟨E g^X, E g^C⟩'s interval above 0)."""
    return [r["scheme"] for r in allfail["rows"] if r["set"] == "all fail" and r["scheme"] in (f"{mu} eq4", f"verdict {mu}")
            and r["inner_ci"][0] > 0]


# --- the probe, stage by stage ---------------------------------------------------------------------------------------

SCHEMES = ["outcome", "value", "causal eq4", "causal state"]                     # then each μ's (probe)
CEILING = ["outcome", "value", "causal state", "branch value", "branch eq4", "branch critic"]   # the branched questions


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
        load = loading(base)
        mus = {"warmup": warm / mu_dir_name(dataclasses.asdict(base))}
        if point == "sft":
            pi_dir = warm / "pi_sft"
            pi, _ = models.load_backbone_checkpoint(pi_dir, **load)
            torch.manual_seed(seed)                          # the RL adapter's initialization, as arco.run
            models.add_lora(pi, dropout=0.0)
        else:
            sparse = run_once(study_args(argv, epochs=base.sparse_epochs, warmup_dir=str(warm), seed=seed,
                                         name=f"sparse-s{seed}"))
            at = sparse / "checkpoints" / f"epoch_{base.sparse_epochs}"
            pi_dir = at / "pi"
            pi, _ = models.load_backbone_checkpoint(pi_dir, **load)
            mus = {"fork": at / "mu"}
        sketch = Sketch(models.trainable_parameters(pi.model), PROBE["dims"])

        def stage(name, fn):
            t0 = time.time()
            value = fn()
            seconds[name] = seconds.get(name, 0.0) + time.time() - t0
            write_json(folder / "seconds.json", seconds)
            return value
        n, k, pi_id = PROBE["questions"], PROBE["samples"], checkpoint_id(pi_dir)
        pool, pool_fp = stage("rollouts (batch pool)", lambda: probe_rollouts(
            pi, questions[:n], k, base, folder / "pool.jsonl", seed, pi_id))
        held, held_fp = stage("rollouts (g* pool)", lambda: probe_rollouts(
            pi, questions[n:], k, base, folder / "held.jsonl", seed + 7919, pi_id))
        temps = temperatures(base)
        gstars = {label: stage(f"g* (log π at T {label})", lambda: true_gradient(
            pi, held, sketch, base, folder / ("gstar.pt" if label == "1" else f"gstar-{label}.pt"), held_fp, T))
            for label, T in temps.items()}
        grads = stage("per-step gradients", lambda: step_gradients(pi, pool, sketch, folder / "grads.pt",
                                                                   folder / "sketch.json", fingerprint=pool_fp,
                                                                   temps=temps))
        done = stage("branched rollouts", lambda: branch_rollouts(pi, pool, base, folder / "branches.jsonl", seed,
                                                                  pool_fp))
        pi = None                                            # the μs below need the memory
        scores = {"causal": [ground_truth_scores(t, "causal") for t in pool]}
        for name, mu_dir in mus.items():
            if not (mu_dir / "config.json").is_file():
                raise DataError(f"no μ in {mu_dir} yet: the study's warmup makes it (python -m lab.study fork ...)")
            s = stage(f"μ scores ({name})", lambda: probe_mu_scores(mu_dir, pool, base, folder / f"mu-{name}.pt",
                                                                    pool_fp))
            scores[name] = [s[r.start:r.stop].tolist() for r in env.step_ranges(pool)]
        offsets = [r.start for r in env.step_ranges(pool)]
        mu_rows = [x for name in mus for x in (f"{name} eq4", f"{name} state", f"mixed {name}", f"verdict {name}")]
        pairs = [(f"{name} {b}", f"verdict {name}") for name in mus for b in ("eq4", "state")] + \
            [(x, "outcome") for x in ("value", "causal state", "causal eq4", "branch value", "branch critic")]
        values = mc_values(pool)
        branch = branch_values(pool, done, BRANCH["questions"], k)
        mu = next(iter(mus))
        at = {}
        for label, T in temps.items():                       # the same statistics with log π at each temperature
            g, gs = grads[label], gstars[label]
            rows = probe_stats(g, offsets, pool, scores, values, gs, SCHEMES + mu_rows, n, k, base.alpha,
                               base.bucket_fallback, pairs=pairs)
            ceiling = probe_stats(g, offsets, pool, scores, values, gs, CEILING + [f"{m} state" for m in mus],
                                  BRANCH["questions"], k, base.alpha, base.bucket_fallback, branch=branch, pairs=pairs)
            allfail = allfail_stats(g, offsets, pool, scores, values, branch, mu, BRANCH["questions"], k, base.alpha,
                                    base.bucket_fallback)
            at[label] = {"T": T, "gstar": gstar_attenuation(gs), "gstar_halves_cos": float(F_cos(*gs["halves"])),
                         "drift": score_drift(g, offsets, pool, k, gs), "rows": rows, "ceiling": ceiling,
                         "favoured": favoured(rows), "allfail": allfail, "allfail_signal": allfail_signal(allfail, mu)}
        brows = read_jsonl(folder / "branches.jsonl")
        facts = {"point": point, "seed": seed, "pool": {"trajectories": len(pool), "questions": n,
                 "steps": int(grads["1"].shape[0]), "mean_R": sum(t.reward for t in pool) / len(pool),
                 "fingerprint": pool_fp, "pi": pi_id},
                 "held": {"trajectories": len(held), "questions": n, "mean_R": sum(t.reward for t in held) / len(held),
                          "nonzero_advantage": sum(a != 0 for a in loo_advantages(held)), "fingerprint": held_fp},
                 "branch": {"questions": BRANCH["questions"], "trajectories": BRANCH["questions"] * k,
                            "root_continuations": BRANCH["root"], "continuations": BRANCH["continuations"],
                            "prefixes": len(brows), "rollouts": sum(len(r["rewards"]) for r in brows),
                            "continued_steps": sum(r.get("steps", 0) for r in brows),
                            "valid_steps": sum(st.valid for t in pool[:BRANCH["questions"] * k] for st in t.steps)},
                 "sketch": json.loads((folder / "sketch.json").read_text()), "seconds": seconds, "at": at}
        write_json(folder / "probe.json", facts)
        print(probe_markdown(facts))
    return out


def _ci(lo_hi, f=".2f", sign=False) -> str:
    lo, hi = lo_hi
    fm = ("+" if sign else "") + f
    return f"[{lo:{fm}}, {hi:{fm}}]"


def table(rows: Sequence[dict], attenuation: float | None, clean: bool = False) -> list[str]:
    """probe_markdown's table: one line per (scheme, composition); every "vs outcome" against outcome RL at the same
    composition, on the same batches (paired intervals)."""
    head = ("| scheme | batch | cos(g_B, g*) | noise-to-signal | vs outcome | "
            + ("V̂'s noise removed | " if clean else "")
            + "cos(ḡ, g*) | vs outcome | de-noised cos(E g_B, g*) | ÷ g*'s attenuation | ḡ ⟂ g* |")
    lines = [head, "|" + "---|" * head.count(" | ")]
    for r in rows:
        nts = "–" if r["noise_to_signal"] is None else f"{r['noise_to_signal']:.0f}"
        rel = "–" if r.get("variance_vs_outcome") is None else \
            f"{r['variance_vs_outcome']:.2f} {_ci(r['variance_vs_outcome_ci'])}"
        extra = ""
        if clean:
            extra = (f"{r['clean_vs_outcome']:.2f} {_ci(r['clean_vs_outcome_ci'])}" if r.get("clean_vs_outcome") is not None
                     else "–") + (f"; ÷ value {r['clean_vs_value']:.2f} {_ci(r['clean_vs_value_ci'])}"
                                  if r.get("clean_vs_value") is not None else "") + " | "
        den = r["mean_cos_denoised"]
        lines.append(f"| {r['scheme']} | {r['composition']} | {r['cos_mean']:.3f} ± {r['cos_ci95']:.3f} | {nts} | "
                     f"{rel} | {extra}{r['mean_cos']:.2f} | {_ci(r['mean_cos_vs_outcome_ci'], sign=True)} | "
                     f"{den:.2f} {_ci(r['mean_cos_denoised_ci'])} | "
                     f"{fmt(min(1.0, den / attenuation) if attenuation else None)} | {fmt(r['orthogonal_share'])} |")
    return lines


def allfail_table(allfail: dict) -> list[str]:
    """probe_markdown's all-fail table: per set (with its counts) and scheme, the mean step against the critic's."""
    lines = ["| questions | (questions, steps) | scheme | ⟨E g, E g^C⟩ × 10⁶ | cos(E g, E g^C) | along E g^C ÷ outcome's "
             "on the mixed groups |", "|---|---|---|---|---|---|"]
    for r in allfail["rows"]:
        c = allfail["sets"][r["set"]]
        rel = f"{r['along_vs_outcome_mixed']:.2f} {_ci(r['along_vs_outcome_mixed_ci'])}" \
            if r.get("along_vs_outcome_mixed") is not None else "–"
        lines.append(f"| {r['set']} | {c['questions']}, {c['valid_steps']} | {r['scheme']} | "
                     f"{r['inner'] * 1e6:+.2f} {_ci([x * 1e6 for x in r['inner_ci']], sign=True)} | {fmt(r['cos'])} "
                     f"{_ci(r['cos_ci'])} | {rel} |")
    a = allfail["auc"]
    lines += ["", f"μ's s_t for the sign of Q̂ − V̂ on the all-fail groups' valid steps ({a['questions']} questions, "
                  f"{a['steps']} steps, {a['steps_signed']} with Q̂ ≠ V̂): AUC {fmt(a['raw'])} against the full "
                  f"estimate's sign, {fmt(a['halves'])} against a half's; halves agree in sign on "
                  f"{fmt(a['agreement'])} of {a['steps_both_halves_signed']} steps (flip rate {fmt(a['flip'])}, "
                  f"κ {fmt(a['kappa'])}): corrected AUC {fmt(a['corrected'])} {_ci(a['corrected_ci'])}"]
    return lines


def probe_markdown(facts: dict) -> str:
    """The probe's tables, once per temperature of log π (facts["at"])."""
    b = facts["branch"]
    lines = [f"probe at {facts['point']} (seed {facts['seed']}): batch pool {facts['pool']['trajectories']} "
             f"trajectories of {facts['pool']['questions']} questions (mean R {facts['pool']['mean_R']:.2f}); g* from "
             f"{facts['held']['trajectories']} ({facts['held']['nonzero_advantage']} with a non-zero advantage)"]
    for label, at in facts["at"].items():
        att = at["gstar"].get("attenuation")
        lines += ["", f"## log π at T = {at['T']:g} ({label})", "",
                  f"cos(g* halves) {at['gstar_halves_cos']:.2f}"
                  + (f", so cos(g*, E g*) ≈ {att:.2f} (g*'s attenuation)" if att is not None else ""), ""]
        lines += table(at["rows"], att)
        lines += ["", "de-noised cos 1.00: the de-noised ‖E g_B‖² came out at or below the squared component along g* "
                  "(no bias seen beyond noise); ÷ g*'s attenuation is capped at 1",
                  "", "favoured at 8 × 1 (≥ 1.5× less noise than outcome 2 × 4 at equal bias): "
                  + (", ".join(at["favoured"]) or "none")]
        lines += ["", f"the ceiling of step credit, on the first {b['questions']} questions ({b['trajectories']} "
                      f"trajectories): V̂(h_0) from {b['root_continuations']} continuations, V̂(h_t) and Q̂(h_t, a_t) "
                      f"= V̂(h_{{t+1}}) from {b['continuations']} (Q̂ exact at the last step); {b['rollouts']} "
                      f"continuations from {b['prefixes']} prefixes. `branch value` subtracts V̂(h_0) at t = 0, which no "
                      f"decomposing μ can (its G_0 = R): `branch eq4` is what ARCO's estimator hands π from a perfect "
                      f"decomposing μ (G_0 = R, then R − V̂(h_t), Eq. 4's buckets)", ""]
        lines += table(at["ceiling"], att, clean=True)
        pairs = [(r["scheme"], r["composition"], y, v) for r in at["rows"] + at["ceiling"]
                 for y, v in (r.get("expected_cos") or {}).items()]
        if pairs:
            lines += ["", "same expected step? de-noised cos(E g^X, E g^Y):"]
            lines += [f"- {x} vs {y} ({c}): {fmt(None if math.isnan(v[0]) else v[0])} {_ci(v[1])}"
                      for x, c, y, v in pairs]
        d = at["drift"]
        lines += ["", f"‖E Σ_t ∇ log π‖ = {fmt(d['ratio'])} × ‖g‖ (a constant baseline at the mean R {d['mean_R']:.2f} "
                      f"shifts the expected step by {fmt(d['bias_at_mean_R'])} × ‖g‖)"]
        lines += ["", "where outcome RL's step is zero (2 × 4 groups; C: the branch critic Q̂ − V̂):", ""]
        lines += allfail_table(at["allfail"])
        lines += ["", "an RL check (μ's mean step on the all-fail groups the critic's way beyond noise): "
                  + (", ".join(at["allfail_signal"]) or "none")]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    pre = argparse.ArgumentParser(prog="python -m lab.probe", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    pre.add_argument("--at", nargs="+", default=["sft", "fork"], choices=["sft", "fork"],
                     help="sft: π_sft and the warmup μ; fork: π and μ at the seed's fork (its sparse phase run if missing)")
    pre.add_argument("--probe-seed", type=int, default=0, help="the study seed whose warmup, fork and questions are used")
    own, rest = pre.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    probe(rest, own.at, own.probe_seed)


if __name__ == "__main__":
    main_guard(main, DataError, models.ModelLoadError)
