"""A run's folder (plumbing beneath arco.py): runs/<dataset>/<name>/ with args.json, metrics.jsonl (a row per update
and per evaluation), traces/*.jsonl (every step's action, observation, criteria, d_t, s_t, G_t, A_t) and
checkpoints/ (π's and μ's adapters, μ's score head, both optimizers, the history); --resume from the last intact
checkpoint (or from the next batch after a Ctrl-C), --init-from another run's checkpoint; the one-line log of an
update and what it logs of μ (mu_at_work, auc); Ctrl-C. Nothing here changes a number of the algorithm; only the first worker writes (infra/parallel.py).
"""
from __future__ import annotations

import json
import math
import shutil
import signal
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch

from infra.files import damaged, read_jsonl, write_json, write_jsonl, write_manifest
from infra.memory import peak_rss_gib
from infra.models import save_backbone
from infra.report import write_report
from infra.settings import UsageError


SCHEME = {"scorer": "mu", "estimator": "arco", "plugin": []}     # ARCO's: arco.py's --scorer, --estimator, --plugin


def keep_scheme(args) -> None:
    """Where a run's credit comes from (arco.py's --scorer, --estimator, --plugin): a flag left unset takes what the
    run ran with (--resume: its args.json) or its parent (--init-from: the parent run's args.json), else ARCO's; a
    run folder asked to continue under another scheme is refused (one line), as a scorer run's checkpoint has no μ
    and a run's numbers follow one estimator."""
    here = Path(args.out_dir) / args.dataset / args.name / "args.json"
    parent = Path(args.init_from).parent.parent / "args.json" if args.init_from else None
    source = here if args.resume and here.is_file() else parent if parent and parent.is_file() else None
    recorded = json.loads(source.read_text()) if source else {}
    for key, default in SCHEME.items():
        had = recorded.get(key) if recorded.get(key) is not None else default    # a run from before the flags: ARCO
        want = getattr(args, key)
        if want is None:
            setattr(args, key, had)
        elif source == here and want != had:
            show = lambda v: " ".join(v) if isinstance(v, list) else v            # noqa: E731
            sys.exit(f"error: {here.parent} ran with --{key} {show(had) or '(none)'}, this command asks for --{key} "
                     f"{show(want) or '(none)'}: resume it as it ran (leave the flag out), or start a new run (--name)")


class RunFolder:
    """runs/<dataset>/<name>/: opened new (refused when a run is there and --resume is not given) or, with
    --resume, at its latest intact checkpoint (`last`)."""

    def __init__(self, args, workers):
        self.path, self.workers, self.main = Path(args.out_dir) / args.dataset / args.name, workers, workers.main
        ckpt = self.path / "checkpoints"
        if self.path.exists() and not args.resume and (self.path / "metrics.jsonl").exists():
            sys.exit(f"error: {self.path} already holds a run: pass --resume to continue it, or --name for a new one")
        self.last = latest_checkpoint(ckpt) if args.resume else None
        if args.resume and self.last is None:
            if not (self.path / "args.json").is_file():
                sys.exit(f"error: --resume: there is no run at {self.path} to continue; check --name / --out-dir")
            if self.main:                         # killed before its first checkpoint: the run starts again
                print(f"[arco] --resume: {ckpt} holds no checkpoint yet: starting the run again from its "
                      f"beginning (the warmup keeps what it finished)", flush=True)
                rewrite_jsonl(self.path / "metrics.jsonl", lambda r: False)
                shutil.rmtree(self.path / "traces", ignore_errors=True)
        workers.barrier()                         # every worker has checked before the first writes anything
        if self.main:
            self.path.mkdir(parents=True, exist_ok=True)
            write_json(self.path / "args.json", asdict(args))

    # -- starting: afresh, from another run's checkpoint, or where this one stopped ------------------------------
    def start_afresh(self) -> None:
        """A new run: empty logs (epoch 0's evaluation is its first row)."""
        if self.main:
            (self.path / "metrics.jsonl").write_text("")
            shutil.rmtree(self.path / "traces", ignore_errors=True)
            shutil.rmtree(self.path / "checkpoints", ignore_errors=True)

    def init_from(self, checkpoint: Path, with_mu: bool, rubric: str) -> Path:
        """--init-from: a new run starts from another run's checkpoint (say, its last sparse epoch, to try another
        dense phase; the study's arms share one sparse phase this way): that run's logs are copied in, and `resume`
        then cuts them at the checkpoint."""
        parent = checkpoint.parent.parent
        if not (checkpoint / "state.json").is_file():
            sys.exit(f"error: --init-from {checkpoint}: not a checkpoint folder (no state.json); give "
                     f"runs/<dataset>/<run>/checkpoints/epoch_K")
        if with_mu and not (checkpoint / "mu" / "config.json").is_file():
            sys.exit(f"error: --init-from {checkpoint} holds no μ, and this run (ARCO) needs one: start from an ARCO "
                     f"run's checkpoint")
        mu_config = checkpoint / "mu" / "config.json"          # read, not loaded: the run loads μ itself
        if with_mu and json.loads(mu_config.read_text())["rubric_model"]["rubric_mode"] != rubric:
            sys.exit(f"error: the μ in {checkpoint} is not a --rubric {rubric} μ: start from a run of that μ")
        if self.main:
            shutil.copyfile(parent / "metrics.jsonl", self.path / "metrics.jsonl")
            shutil.rmtree(self.path / "traces", ignore_errors=True)
            shutil.copytree(parent / "traces", self.path / "traces")
            print(f"[arco] starting {self.path} from {checkpoint}", flush=True)
        self.workers.barrier()
        return checkpoint

    def resume(self, checkpoint: Path, opt_pi, opt_mu) -> tuple[list[dict], int, int]:
        """The optimizers' states of a checkpoint loaded (π and μ the caller loads), and the logs cut where it was
        taken; returns the evaluations so far and the epoch and batch to continue from."""
        state = torch.load(checkpoint / "optim.pt", weights_only=True, map_location="cpu")
        opt_pi.load_state_dict(state["opt_pi"])
        if opt_mu is not None:
            opt_mu.load_state_dict(state["opt_mu"])
        saved = json.loads((checkpoint / "state.json").read_text())
        epoch, batch = (saved["epoch"], saved["next_batch"]) if saved.get("next_batch") else (saved["epoch"] + 1, 0)
        if self.main:
            rewrite_jsonl(self.path / "metrics.jsonl", lambda r: r.get("epoch", 0) < epoch or (
                r["epoch"] == epoch and r["kind"] in ("update", "curve") and r["batch"] < batch))
            for f in (self.path / "traces").glob("*epoch_*.jsonl"):
                if int(f.stem.split("_")[-1]) >= epoch:
                    rewrite_jsonl(f, lambda r: not f.name.startswith("eval") and r["batch"] < batch and r["epoch"] == epoch)
            print(f"[arco] resuming {self.path} at epoch {epoch}, batch {batch}", flush=True)
        return saved["history"], epoch, batch

    # -- writing ---------------------------------------------------------------------------------------------------
    def save(self, epoch: int, pi, mu, opt_pi, opt_mu, history: list[dict], next_batch: int = 0) -> Path:
        """checkpoints/epoch_<epoch> (or, with next_batch > 0, checkpoints/interrupted: after batch next_batch − 1)."""
        folder = self.path / "checkpoints" / (f"epoch_{epoch}" if not next_batch else "interrupted")
        if self.main:
            save_checkpoint(folder, pi, mu, opt_pi, opt_mu, epoch, history, next_batch)
        return folder

    def log_update(self, row: dict, traces: list[dict]) -> None:
        if self.main:
            write_jsonl(self.path / "metrics.jsonl", [row], append=True)
            write_jsonl(self.path / "traces" / f"epoch_{row['epoch']}.jsonl", traces, append=True)

    def log_evaluation(self, epoch: int, ev: dict, rows: list[dict], dense: bool | None = None) -> dict:
        """One dev evaluation into metrics.jsonl and traces/eval_epoch_<epoch>.jsonl; returns its history row."""
        if self.main:
            write_jsonl(self.path / "metrics.jsonl", [{"kind": "eval", "epoch": epoch, **ev}], append=True)
            write_jsonl(self.path / "traces" / f"eval_epoch_{epoch}.jsonl", rows, append=True)
            print(f"[arco] epoch {epoch}{' (SFT only)' if epoch == 0 else ''}: dev EM {ev['em']:.1f} F1 {ev['f1']:.1f} "
                  f"invalid {ev['invalid_rate']:.2f} (peak RSS so far {peak_rss_gib():.1f} GiB)", flush=True)
        return {"epoch": epoch, **ev} if dense is None else {"epoch": epoch, "dense": dense, **ev}

    def write(self, name: str, obj) -> None:
        if self.main:
            write_json(self.path / name, obj)

    def report(self, history: list[dict], sel: dict, args) -> None:
        """selection.json, report.md (and mu.png), memory.json."""
        if self.main:
            write_json(self.path / "selection.json", sel)
            write_report(self.path, history, sel, args)

    def progress(self, items, desc: str):
        from tqdm import tqdm
        return tqdm(items, desc=desc, disable=not self.main)

    def show(self, line: str) -> None:
        if self.main:
            from tqdm import tqdm
            tqdm.write(line)


def rewrite_jsonl(path: Path, keep) -> None:
    """Keep the rows of a JSONL file for which keep(row) is true (what --resume redoes goes)."""
    if path.exists():
        write_jsonl(path, [r for r in read_jsonl(path) if keep(r)])


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
    every worker holds the same weights and optimizer states: the first writes them."""
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


# ----------------------------------------------------------------------------------------
# The log: one line per update, trace rows
# ----------------------------------------------------------------------------------------

def update_line(row: dict, epoch: int, b: int) -> str:
    """The one-line log of an update (every number is also in metrics.jsonl)."""
    after = f" → {row['decomposition_mse_after']:.4f}" if "decomposition_mse_after" in row else ""
    mu_part = (f" dec-MSE {row['decomposition_mse']:.4f}{after} KLμ {row['kl_mu']:.4f} s̄ {row['mean_s']:+.3f}"
               if "rubric_loss" in row else "")
    if row.get("rubric_parse_rate") is not None:
        mu_part += f" K-criteria {100 * row['rubric_parse_rate']:.0f}% copied {100 * row['copied_rate']:.0f}%"
    if "sum_auc" in row:
        mu_part += f" AUC(Σs,R) {'—' if row['sum_auc'] is None else format(row['sum_auc'], '.2f')}"
    return (f"[arco] epoch {epoch} batch {b}: R {row['mean_R']:.2f} policy loss {row['policy_loss']:+.4f} "
            f"KLπ {row['kl_pi']:.4f}{mu_part} invalid {row['invalid_rate']:.2f}")


def trace_rows(trajs, epoch: int, batch: int, rubrics=None, d=None, s=None, adv=None) -> list[dict]:
    """One JSON row per trajectory: every step's action, observation head, criteria, d_t, s_t, G_t, A_t (the flat
    per-step lists — rubrics, d, s — in trajectory order; `adv`, an estimator's arco.Advantages)."""
    rows, at = [], 0
    for i, t in enumerate(trajs):
        row = t.to_dict()
        row.update(epoch=epoch, batch=batch)
        for j, st in enumerate(row["steps"]):
            k = at + j
            st["observation"] = st["observation"][:160]
            if rubrics is not None:
                st["criteria"] = rubrics[k].criteria
                st["rubric_parsed"] = rubrics[k].complete          # K criteria (Rubric.complete)
                if not rubrics[k].complete:
                    st["rubric_text"] = rubrics[k].text[:300]     # what μ wrote, kept when unparseable
                st["d"] = [round(x, 4) for x in d[k].tolist()]
            if s is not None:
                st["s"] = round(float(s[k]), 4)
            if adv is not None and adv.G is not None:
                st["G"] = round(adv.G[i][j], 4)
                st["bucket"] = adv.buckets[i][j]
            if adv is not None:
                st["A"] = round(adv.A[i][j], 4)
        at += len(t.steps)
        rows.append(row)
    return rows


def average_ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of `values`; tied values share the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1  # positions i..j hold ranks i+1..j+1
        i = j + 1
    return ranks


def auc(scores: Sequence[float], labels: Sequence[bool | int]) -> float | None:
    """ROC AUC: the probability that a random positive scores above a random negative, a tie
    counting 1/2 (the Mann–Whitney U / (n_pos · n_neg), from average ranks). None when either
    class is empty. Issue 6: μ's s_t separating useful from useless steps."""
    if len(scores) != len(labels):
        raise ValueError(f"auc: {len(scores)} scores but {len(labels)} labels")
    pos = [bool(y) for y in labels]
    n_pos, n_neg = sum(pos), len(pos) - sum(pos)
    if n_pos == 0 or n_neg == 0:
        return None
    rank_sum = sum(r for r, p in zip(average_ranks(scores), pos) if p)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def copied_from_prompt(criterion: str, prompt: str) -> bool:
    """Is a criterion a piece of μ's own prompt copied verbatim (a line such as "Searches left: 1", an entity
    name of the question, the first words of an observation)? Compared case- and space-insensitively, trailing
    punctuation aside; an empty criterion is no copy (it counts against K criteria instead)."""
    c = " ".join(criterion.split()).lower().rstrip(" .,;:")
    return bool(c) and c in " ".join(prompt.split()).lower()


def mu_at_work(mu, trajs, contexts, rubrics, s) -> dict:
    """What an update logs of μ (README, "the default run"): the share of steps whose rubric gives K criteria, of
    criteria copied from μ's prompt (copied_from_prompt), and the AUC of μ's verdict Σ_t s_t for R (None: all R
    equal). {} without μ."""
    if mu is None or s is None:
        return {}
    sums, at = [], 0
    for t in trajs:
        sums.append(float(s[at:at + len(t.steps)].sum()))
        at += len(t.steps)
    out: dict = {"sum_auc": auc(sums, [t.reward > 0.5 for t in trajs])}
    if mu.rubric_mode in ("static", "none"):
        return out
    written = [(c, p) for p, r in zip(map(mu.prompt_text, contexts), rubrics) for c in r.criteria if c.strip()]
    out["rubric_parse_rate"] = sum(r.complete for r in rubrics) / max(1, len(rubrics))
    out["copied_rate"] = sum(copied_from_prompt(c, p) for c, p in written) / max(1, len(written))
    return out


class NonFiniteLoss(FloatingPointError):
    pass


def check_finite(name: str, value: float) -> None:
    """Stop before a NaN or inf loss reaches the weights (the run keeps its last good checkpoint)."""
    if not math.isfinite(value):
        raise NonFiniteLoss(f"the {name} loss is {value}")


# ----------------------------------------------------------------------------------------
# Ctrl-C
# ----------------------------------------------------------------------------------------

class CtrlC:
    """Ctrl-C during RL: the current batch finishes, a checkpoint is saved, the run exits
    (--resume continues from the next batch). A second Ctrl-C stops at once."""

    def __init__(self, folder: RunFolder):
        self.folder, self.requested = folder, False

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
        """Whether any worker was asked to stop (one process: this one); every worker then stops at the same batch."""
        return self.folder.workers.any(self.requested)

    def stop(self, pi, mu, opt_pi, opt_mu, epoch: int, history: list[dict], next_batch: int = 0):
        """Exit at a Ctrl-C: mid-epoch after saving the `interrupted` checkpoint (continuing at
        next_batch), at an epoch's end with its epoch checkpoint already saved."""
        folder = self.folder.path / "checkpoints" / (f"epoch_{epoch}" if not next_batch else "interrupted")
        if next_batch:
            self.folder.save(epoch, pi, mu, opt_pi, opt_mu, history, next_batch)
        self.folder.workers.barrier()     # no worker exits (torchrun then ends the others) before the first has saved
        sys.exit(f"interrupted: the state after epoch {epoch}" + (f", batch {next_batch - 1}," if next_batch else "")
                 + f" is saved in {folder}; rerun the same command with --resume to continue")

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)
