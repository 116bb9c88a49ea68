"""What runs a run of Algorithm 1 (arco.py), beneath it: the plumbing a reader of the algorithm can take on trust.

The run's folder (args.json, metrics.jsonl, traces/, checkpoints/, --resume, --init-from), the warmup it needs
and the models and optimizers it starts from, the dev evaluations, the engines' and torchrun's ranks' one call
each, the log and the traces, Ctrl-C, the report (report.md, mu.png, memory.json) and --dry-run's memory
estimate. Nothing here changes a number of the algorithm: the equations, the updates, gradient clipping and the
seeds are in arco.py, which imports this file; this file imports nothing from arco.py.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

import env
import warmup
from config import MEMORY, UsageError
from evaluate import auc
from rubric_model import (ENGINES, HUB_SHAPES, RubricModel, add_lora, check_intact, copied_from_prompt, damaged,
                          load_backbone_checkpoint, merge_lora, model_shape, policy_act, resolve_autocast,
                          resolve_device, resolve_dtype, save_backbone, trainable_parameters, training_passes,
                          write_atomically, write_manifest)


# ----------------------------------------------------------------------------------------
# The run's folder: args, logs, checkpoints, --resume, --init-from
# ----------------------------------------------------------------------------------------

def open_run(args) -> tuple[Path, Path | None]:
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


def rewrite_jsonl(path: Path, keep) -> None:
    """Keep the rows of a JSONL file for which keep(row) is true (what --resume redoes goes)."""
    if path.exists():
        env.write_jsonl(path, [r for r in env.read_jsonl(path) if keep(r)])


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


def resume_from(folder: Path, run_dir: Path, args, with_mu: bool):
    """Rebuild π, μ and their optimizers as they were in a checkpoint, and drop from the logs what
    comes after it; returns them with the epoch and batch to continue from and the evaluations so far."""
    load = dict(device=args.device, dtype=args.dtype, autocast=args.autocast, engine=args.engine)
    pi, _ = load_backbone_checkpoint(folder / "pi", **load)
    mu = RubricModel.load(folder / "mu", **load) if (folder / "mu").is_dir() and with_mu else None
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


def init_from(run_dir: Path, checkpoint: Path, args, with_mu: bool) -> Path:
    """--init-from: a new run starts from another run's checkpoint (say, its last sparse epoch, to try another
    dense phase; the study's arms share one sparse phase this way): that run's logs are copied in, and
    resume_from then loads π, μ, both optimizers and the history from the checkpoint and cuts the logs there."""
    parent = checkpoint.parent.parent
    if not (checkpoint / "state.json").is_file():
        sys.exit(f"error: --init-from {checkpoint}: not a checkpoint folder (no state.json); give "
                 f"runs/<dataset>/<run>/checkpoints/epoch_K")
    if with_mu and not (checkpoint / "mu" / "config.json").is_file():
        sys.exit(f"error: --init-from {checkpoint} holds no μ, and this run (ARCO) needs one: start from an ARCO "
                 f"run's checkpoint")
    mu_config = (checkpoint / "mu" / "config.json")       # read, not loaded: resume_from loads μ itself
    if with_mu and json.loads(mu_config.read_text())["rubric_model"]["rubric_mode"] != args.rubric:
        sys.exit(f"error: the μ in {checkpoint} is not a --rubric {args.rubric} μ: start from a run of that μ")
    if dp.main:
        shutil.copyfile(parent / "metrics.jsonl", run_dir / "metrics.jsonl")
        shutil.rmtree(run_dir / "traces", ignore_errors=True)
        shutil.copytree(parent / "traces", run_dir / "traces")
        print(f"[arco] starting {run_dir} from {checkpoint}", flush=True)
    dp.barrier()
    return checkpoint


# ----------------------------------------------------------------------------------------
# The warmup and the models (Alg. 1, line 1)
# ----------------------------------------------------------------------------------------

def ensure_warmup(args, with_mu: bool) -> Path:
    """π_sft/ and the μ this run needs (warmup.mu_dir_name) of the warmup (§3.2, App. B): the
    offline oracle warmup runs for whatever is missing. Runs that differ only in μ (the ablations,
    K, --mu-model) share one collection and one π SFT."""
    folder = warmup.warmup_folder(args)
    need = ["pi_sft"] + ([mu_folder(args)] if with_mu else [])
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
        warmup.run_from_arco(args, train_mu=with_mu)
    dp.barrier()                              # under torchrun the other ranks wait for rank 0's warmup
    return folder


def training_questions(args, warmup_dir: Path) -> list:
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


def mu_folder(args) -> str:
    return warmup.mu_dir_name(asdict(args))


def build_models(args, warmup_dir: Path, with_mu: bool):
    """π and μ from the warmup, each with a fresh LoRA on top of the merged SFT weights: the
    frozen references π_ref and μ_ref are the same modules with the adapter disabled."""
    load = dict(device=args.device, dtype=args.dtype, autocast=args.autocast, engine=args.engine)
    pi, _ = load_backbone_checkpoint(warmup_dir / "pi_sft", **load)
    if hasattr(pi.model, "peft_config"):
        merge_lora(pi)
    add_lora(pi, dropout=args.lora_dropout)
    if not with_mu:
        return pi, None
    mu = RubricModel.load(warmup_dir / mu_folder(args), **load)
    if mu.rubric_mode != args.rubric or mu.k != args.k:
        sys.exit(f"error: the warmup μ in {warmup_dir / mu_folder(args)} has rubric_mode={mu.rubric_mode}, "
                 f"K={mu.k}, but this run asks for --rubric {args.rubric} --k {args.k}")
    if hasattr(mu.backbone.model, "peft_config"):
        merge_lora(mu.backbone)
    add_lora(mu.backbone, dropout=args.lora_dropout)
    return pi, mu


def make_optimizers(pi, mu, args):
    """AdamW for π's LoRA and for μ (its LoRA and score head, with their own learning rates), with the
    release's weight decay; π's learning rate is set per epoch (sparse or dense)."""
    opt_pi = torch.optim.AdamW(trainable_parameters(pi.model), lr=args.pi_lr_sparse, weight_decay=args.weight_decay)
    opt_mu = torch.optim.AdamW(mu.parameter_groups(args.mu_lr, args.head_lr), weight_decay=args.weight_decay) \
        if mu is not None else None
    return opt_pi, opt_mu


# ----------------------------------------------------------------------------------------
# Dev evaluations (epoch 0 from the warmup's when it can)
# ----------------------------------------------------------------------------------------

def evaluate_policy(pi, examples, args, retriever) -> tuple[dict, list]:
    """Greedy dev evaluation (env.evaluate): EM, F1, searches, invalid-step rate. Under torchrun each rank
    evaluates its share of the questions; the numbers are those of all of them."""
    act = policy_act(pi, 0.0, args.max_new_tokens_pi, args.gen_batch)
    with MEMORY.phase("dev evaluation"):
        trajs = dp.gather(env.rollout(examples[dp.share(len(examples))], act, retriever, args.max_searches,
                                      args.obs_chars, progress=True))
    return env.dev_metrics(trajs), trajs


def warmup_evaluation(warmup_dir: Path, args) -> tuple[dict | None, list[dict]]:
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


def sft_only_evaluation(run_dir: Path, warmup_dir: Path, pi, dev, args, retriever) -> dict:
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


def epoch0_settings(args) -> dict:
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


# ----------------------------------------------------------------------------------------
# The engines and torchrun's ranks: one call each
# ----------------------------------------------------------------------------------------

class DataParallel:
    """torchrun's ranks (WORLD_SIZE, RANK, LOCAL_RANK in the environment): each rank rolls out, annotates and
    backpropagates its share of a batch; what the equations need of the whole batch is gathered. One
    process (a plain `python arco.py`): rank 0 of 1, and every method below returns its input."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        self.main = self.rank == 0
        self.device = torch.device("cpu")

    def start(self, args) -> None:
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


def written_and_scored(mu, contexts: list, args) -> tuple[list, torch.Tensor, torch.Tensor]:
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


def passes(bb, seqs, lens, args, kl: bool = False, units=None):
    """The training passes of an update (rubric_model.training_passes, by the --engine the model was loaded
    with) within --pass-tokens; under torchrun, this rank's share of the units (gradient_step sums the gradients)."""
    return training_passes(bb, seqs, lens, kl, args.pass_tokens, units, dp.share)


def in_shares(fn, items: list) -> list:
    """fn (a list → as many results) on this rank's share of `items`; every rank gets all the results, in
    order. One process: fn(items)."""
    return dp.gather(fn(items[dp.share(len(items))]))


def chunks(items: Sequence, size: int) -> list:
    return [items[i:i + size] for i in range(0, len(items), max(1, size))]


class NonFiniteLoss(FloatingPointError):
    pass


def check_finite(name: str, value: float) -> None:
    """Stop before a NaN or inf loss reaches the weights (the run keeps its last good checkpoint)."""
    if not math.isfinite(value):
        raise NonFiniteLoss(f"the {name} loss is {value}")


# ----------------------------------------------------------------------------------------
# The log: one line per update, metrics.jsonl, traces
# ----------------------------------------------------------------------------------------

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


def log_iteration(run_dir: Path, row: dict, traces: list[dict]) -> None:
    if dp.main:
        env.write_jsonl(run_dir / "metrics.jsonl", [row], append=True)
        env.write_jsonl(run_dir / "traces" / f"epoch_{row['epoch']}.jsonl", traces, append=True)


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


def mu_at_work(mu, trajs, contexts, rubrics, s) -> dict:
    """μ at each update (README, "the default run"): the share of steps whose rubric gives K criteria, of criteria
    copied from μ's prompt (rubric_model.copied_from_prompt), and the AUC of Σ_t s_t for R (None: all R equal)."""
    if mu is None or s is None:
        return {}
    out: dict = {"sum_auc": auc([float(s[r.start:r.stop].sum()) for r in env.step_ranges(trajs)],
                                [t.reward > 0.5 for t in trajs])}
    if mu.rubric_mode in ("static", "none"):
        return out
    written = [(c, p) for p, r in zip(map(mu.prompt_text, contexts), rubrics) for c in r.criteria if c.strip()]
    out["rubric_parse_rate"] = sum(r.complete for r in rubrics) / max(1, len(rubrics))
    out["copied_rate"] = sum(copied_from_prompt(c, p) for c, p in written) / max(1, len(written))
    return out


def bucket_means(G, buckets, valid) -> dict:
    """For the log: the mean G_t of each bucket's valid steps (Eq. 4's Ḡ_{B,b})."""
    per_bucket: dict[str, list[float]] = {}
    for g_t, b_t, v_t in zip(G, buckets, valid):
        for g, b, ok in zip(g_t, b_t, v_t):
            if ok:
                per_bucket.setdefault(b, []).append(g)
    return {b: sum(v) / len(v) for b, v in per_bucket.items()}


@contextlib.contextmanager
def timed(row: dict, key: str):
    """row["seconds_<key>"], and the phase's resident memory in the run's memory profile (config.MEMORY)."""
    t0 = time.time()
    with MEMORY.phase(key):
        yield
    row[f"seconds_{key}"] = time.time() - t0


def peak_rss_gib() -> float:
    """The process's peak resident memory so far in GiB (Linux reports KiB), logged with every update."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def progress(items, desc: str):
    from tqdm import tqdm
    return tqdm(items, desc=desc, disable=not dp.main)


def show(line: str) -> None:
    if dp.main:
        from tqdm import tqdm
        tqdm.write(line)


# ----------------------------------------------------------------------------------------
# Ctrl-C
# ----------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------

def write_selection(run_dir: Path, sel: dict) -> None:
    if dp.main:
        env.write_json(run_dir / "selection.json", sel)


def write_report(run_dir: Path, history: list[dict], sel: dict, args) -> None:
    """report.md: the results per epoch, the selected checkpoint, and a few trajectories with rubrics."""
    if not dp.main:
        return
    env.write_json(run_dir / "memory.json", MEMORY.rows())      # the resident memory by phase (RESULTS)
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
              ("sum_auc", "AUC of Σ_t s_t for R"), ("decomposition_mse", "Eq. 5 error: before ●, after ×"))


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
    lines = ["## μ at work", "", "Per update: steps whose rubric gives K criteria; criteria copying a piece of μ's prompt; "
             "the AUC of μ's verdict Σ_t s_t for R(τ) = 1 (0.5: chance; —: every R the same); Eq. 5's decomposition "
             "error mean_τ (Σ_t s_t − R(τ))² on the update's trajectories, before and after μ's step.", "",
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
        for field, style in ((key, "o-"), ("decomposition_mse_after", "x--")) if k == 3 else ((key, "o-"),):
            pts = [(i, r[field]) for i, r in zip(x, rows) if r.get(field) is not None]
            ax.plot([i for i, _ in pts], [y for _, y in pts], style, label="after μ's step" if "after" in field else None)
        ax.set(title=title, xlabel="update", xticks=x, **({} if k == 3 else {"ylim": (0, 1.02)}))
        ax.grid(alpha=0.3)
    fig.savefig(path, format="png")


# ----------------------------------------------------------------------------------------
# The memory estimate (--dry-run)
# ----------------------------------------------------------------------------------------

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
