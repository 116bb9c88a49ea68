"""Finished runs of arco.py compared (`python -m lab.diagnostics --run A --run B`): each run's checkpoint scored on
one split (reusing the evaluation the run made, or one stored by an earlier call), the warmup's rows first, EM / F1
overall and per question type, paired differences and the methods over their seeds: comparison.md and .json."""
import functools
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import env
from evaluate import exact_match, f1_score
from infra.report import format_table
from infra import models
from infra.engines import ENGINES
from infra.files import read_jsonl, write_json, write_jsonl
from infra.passes import policy_act
from infra.runs import trace_rows
from infra.warmups import mu_dir_name
from lab.stats import mean_ci

# --------------------------------------------------------------------------- runs: comparison and diagnostics (issue 6)
# `python -m lab.diagnostics --run DIR [--run DIR ...] [--diagnose]`. Reads what arco.py leaves in a run folder
# (args.json, metrics.jsonl, traces/, checkpoints/, selection.json) and its warmup folder; loads models
# only where an evaluation or a μ diagnostic needs them.

_METRICS = ("n", "em", "f1", "mean_searches", "invalid_rate", "finished_rate")


class RunError(ValueError):
    """A run folder, checkpoint or option that cannot be used; the message names it."""


def question_type(t: str | None) -> str:
    """The key of the per-type breakdown: the trace row's `type`, except that MuSiQue's id prefixes
    '3hop1' / '3hop2' become the hop count '3hop'; an empty type is 'unknown'."""
    m = re.fullmatch(r"(\d+hop)\d*", t or "")
    return m.group(1) if m else (t or "unknown")


def trajectory_scores(rows: Sequence[dict]) -> dict:
    """EM and F1 (%), valid searches per question, invalid-step rate and finished rate of trace
    rows (Trajectory.to_dict()), overall and by `question_type`, computed as
    env.evaluate computes them: an unfinished trajectory scores 0."""
    def summary(rs: Sequence[dict]) -> dict:
        n = len(rs)
        steps = [st for r in rs for st in r["steps"]]
        hit = [(exact_match(r["answer"], r["gold"]), f1_score(r["answer"], r["gold"])) if r.get("finished")
               else (0.0, 0.0) for r in rs]
        return {"n": n, "em": 100 * sum(h[0] for h in hit) / max(n, 1), "f1": 100 * sum(h[1] for h in hit) / max(n, 1),
                "mean_searches": sum(st["action"] == "search" and st["valid"] for st in steps) / max(n, 1),
                "invalid_rate": sum(not st["valid"] for st in steps) / max(len(steps), 1),
                "finished_rate": sum(bool(r.get("finished")) for r in rs) / max(n, 1)}
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[question_type(r.get("type"))].append(r)
    return {**summary(rows), "by_type": {t: summary(groups[t]) for t in sorted(groups)}}


@dataclass
class Run:
    """One run folder of arco.py and the checkpoint of it being compared."""
    dir: Path
    name: str
    args: dict              # args.json: the resolved settings the run used
    checkpoint: str         # epoch_K, interrupted (a Ctrl-C checkpoint), or epoch_0 = the warmup's π SFT
    epoch: int              # the epoch that checkpoint ends (its training traces: traces/epoch_K.jsonl)
    selected: bool          # the checkpoint is selection.json's
    warmup_dir: Path

    def policy_dir(self) -> Path:
        if self.checkpoint == "epoch_0":
            return self.warmup_dir / "pi_sft"
        return self.dir / "checkpoints" / self.checkpoint / "pi"

    def warmup_mu_dir(self) -> Path:
        return self.warmup_dir / mu_dir_name(self.args)

    def mu_dirs(self) -> list[tuple[int, Path]]:
        """(epoch, folder) of μ after each finished RL epoch, in order."""
        found = []
        for p in (self.dir / "checkpoints").glob("epoch_*"):
            tail = p.name.split("_", 1)[1]
            if tail.isdigit() and (p / "mu" / "config.json").is_file():
                found.append((int(tail), p / "mu"))
        return sorted(found)

    def metrics(self) -> list[dict]:
        return read_jsonl(self.dir / "metrics.jsonl")

    def training_traces(self, epoch: int) -> list[dict]:
        return read_jsonl(self.dir / "traces" / f"epoch_{epoch}.jsonl")

    def trace_epochs(self) -> list[int]:
        return sorted(int(p.stem.split("_")[1]) for p in (self.dir / "traces").glob("epoch_*.jsonl")
                      if p.stem.split("_")[1].isdigit())

    @property
    def has_mu(self) -> bool:
        return self.args.get("reward") != "outcome" and bool(self.mu_dirs())


def open_run(folder: str | Path, checkpoint: str | None = None) -> Run:
    """A run folder and its checkpoint: `checkpoint`, else selection.json's selected epoch, else
    (an unfinished run) the last epoch checkpoint, with a warning."""
    folder = Path(folder)
    if not (folder / "args.json").is_file():
        raise RunError(f"{folder}: not a run folder (no args.json); give a folder arco.py wrote, "
                       f"runs/<dataset>/<name>")
    args = json.loads((folder / "args.json").read_text())
    if (folder / "lab.json").is_file():          # a study's run: its own options (credit, mixed, ...) beside them
        args.update(json.loads((folder / "lab.json").read_text()))
    warm = Path(args["warmup_dir"]) if args.get("warmup_dir") else folder.parent / "warmup"
    ckpts = folder / "checkpoints"
    have = sorted((p.name for p in ckpts.glob("*") if (p / "pi" / "config.json").is_file()),
                  key=lambda n: (len(n), n)) if ckpts.is_dir() else []   # epoch_2 before epoch_10
    selected = False
    if checkpoint is None:
        if (folder / "selection.json").is_file():
            checkpoint = f"epoch_{json.loads((folder / 'selection.json').read_text())['selected_epoch']}"
            selected = True
        else:
            epochs = sorted(int(c.split("_")[1]) for c in have if c.split("_")[-1].isdigit())
            if not epochs:
                raise RunError(f"{folder}: no selection.json and no finished epoch in {ckpts}")
            checkpoint = f"epoch_{epochs[-1]}"
            print(f"warning: {folder} has no selection.json (an unfinished run?): using its last checkpoint, "
                  f"{checkpoint}", file=sys.stderr)
    if checkpoint == "epoch_0":
        epoch = 0
        if not (warm / "pi_sft" / "config.json").is_file():
            raise RunError(f"{folder}: checkpoint epoch_0 is the warmup's π SFT, but {warm / 'pi_sft'} is missing")
    elif checkpoint == "interrupted" and checkpoint in have:
        epoch = json.loads((ckpts / checkpoint / "state.json").read_text())["epoch"]
    elif re.fullmatch(r"epoch_\d+", checkpoint):
        epoch = int(checkpoint.split("_")[1])
        if checkpoint not in have and not selected:   # a selected one may be gone: its evaluation is kept
            raise RunError(f"{folder}: no checkpoint {checkpoint} (it has: {', '.join(have) or 'none'})")
    else:
        raise RunError(f"{folder}: no checkpoint {checkpoint!r}; give epoch_K (it has: {', '.join(have) or 'none'})")
    return Run(folder, folder.name, args, checkpoint, epoch, selected, warm)


@functools.cache
def shared_retriever():
    """The retriever (MiniLM and its index cache), built once per command and only if needed."""
    return env.Retriever()


def evaluation(run: Run, split: str, data_dir: str | None, device: str, reevaluate: bool, dtype: str = "auto") -> dict:
    """Greedy scores of the run's checkpoint on `split` (the _METRICS, by_type, source), reusing an
    evaluation already made unless `reevaluate`: on dev, the run's own (metrics.jsonl's eval row
    of that epoch; the breakdown from traces/eval_epoch_K.jsonl); else one stored by an earlier
    call in <run>/evals/. Otherwise π is loaded and evaluated (env.evaluate, the run's
    settings and question sample) and the result stored in <run>/evals/<split>_<checkpoint>.json
    with the trajectories beside it (.jsonl)."""
    stored = run.dir / "evals" / f"{split}_{run.checkpoint}.json"
    if not reevaluate:
        if split == "dev" and run.checkpoint.startswith("epoch_"):
            row = next((r for r in reversed(run.metrics()) if r.get("kind") == "eval" and r["epoch"] == run.epoch),
                       None)
            if row is not None:
                traces = run.dir / "traces" / f"eval_epoch_{run.epoch}.jsonl"
                by_type = trajectory_scores(read_jsonl(traces))["by_type"] if traces.is_file() else {}
                return {**{k: row[k] for k in _METRICS if k in row}, "by_type": by_type,
                        "source": f"the run's own evaluation (metrics.jsonl, epoch {run.epoch})"}
        if stored.is_file():
            return {**json.loads(stored.read_text()), "source": f"stored: {stored}"}
    a = run.args
    examples = env.load_split(a["dataset"], split, data_dir or a.get("data_dir") or None, a.get("eval_size"),
                              a.get("seed", 0))
    print(f"[evaluate] {run.name}: evaluating {run.checkpoint} greedily on {len(examples)} {split} questions",
          flush=True)
    pi, _ = models.load_backbone_checkpoint(run.policy_dir(), device=device, dtype=dtype, engine=ENGINES["fast"])
    act = policy_act(pi, 0.0, a["max_new_tokens_pi"], a.get("gen_batch") or 16)        # greedy
    scores, trajs = env.evaluate(examples, act, shared_retriever(), a.get("max_searches"), a["obs_chars"])
    del pi
    rows = [{**row, "checkpoint": run.checkpoint} for row in trace_rows(trajs, run.epoch, -1)]
    result = {**{k: scores[k] for k in _METRICS if k in scores}, "by_type": trajectory_scores(rows)["by_type"],
              "checkpoint": run.checkpoint, "split": split}
    write_jsonl(stored.with_suffix(".jsonl"), rows)
    write_json(stored, result)
    return {**result, "source": f"evaluated now, stored: {stored}"}


def warmup_rows(runs: Sequence[Run]) -> list[dict]:
    """The paper's Base and SFT-only rows from each distinct warmup folder's metrics.json (dev)."""
    rows, seen = [], set()
    for run in runs:
        path = run.warmup_dir / "metrics.json"
        if path.resolve() in seen or not path.is_file():
            continue
        seen.add(path.resolve())
        m = json.loads(path.read_text())
        suffix = "" if len({r.warmup_dir.resolve() for r in runs}) == 1 else f" ({run.warmup_dir})"
        for key, label, ckpt in (("base", "base", run.args.get("model", "")), ("sft_only", "SFT only", "pi_sft")):
            if key in m:
                rows.append({"system": label + suffix, "checkpoint": ckpt,
                             **{k: m[key][k] for k in _METRICS if k in m[key]}, "by_type": {},
                             "source": f"warmup: {path}"})
    return rows


def question_em(run: Run, epoch: int) -> dict[str, float]:
    """{question id: EM in %} of the run's own greedy dev evaluation at `epoch` (traces/eval_epoch_K.jsonl;
    R(τ) is EM, Alg. 1 line 23); {} when the run kept no such traces."""
    return {r["id"]: 100.0 * r["reward"] for r in read_jsonl(run.dir / "traces" / f"eval_epoch_{epoch}.jsonl")}


def paired_difference(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """EM after − EM before over the questions both evaluated, with the 95% interval of the mean of
    the per-question differences (paired: the same questions, so question difficulty cancels)."""
    ids = sorted(before.keys() & after.keys())
    if not ids:
        return None
    mean, half = mean_ci([after[i] - before[i] for i in ids])
    return {"n": len(ids), "delta_em": mean, "half_width": half}


def method_of(row: dict) -> str:
    """The method a run row belongs to, whatever its seed: outcome RL, ARCO, ARCO w/o Rubric, …"""
    if row.get("reward") == "outcome":
        return "outcome RL"
    if row.get("credit") in ("oracle", "projection"):          # "oracle": its name before issue 41
        return "projection oracle"
    if row.get("credit") == "causal":
        return "causal oracle"
    if row.get("mixed"):
        return "mixed (outcome + μ's dense advantage)"
    variant = {"adaptive": "", "none": " w/o Rubric", "static": " w/o Adaptive", "prefix-free": " w/o Prefix"}
    data = {"policy": " (μ SFT on π's rollouts)", "both": " (μ SFT on π's rollouts and the teacher's)"}
    rubric = variant.get(row.get("rubric"), f" {row.get('rubric')}")
    k = "" if row.get("k") in (3, None) else f" K={row['k']}"
    return "ARCO" + rubric + k + data.get(row.get("mu_data"), "")     # --mu-data teacher (the paper's) adds nothing


# Run arguments that tell seeds of one method apart (or only say where and how it ran), not its settings.
NOT_SETTINGS = {"seed", "name", "out_dir", "resume", "dry_run", "benchmark", "device", "dtype", "autocast", "data_dir",
                "warmup_dir", "fork_from", "init_from",   # a study's arms start from their seed's own sparse run
                "eval_every", "curve_size"}                # the study's learning-curve points
# What outcome RL never reads (no μ, no dense epoch): differences in these do not split its runs.
UNUSED_BY_OUTCOME = {"sparse_epochs", "pi_lr_dense", "kl_pi_dense", "rubric", "k", "mu_model", "mu_lr", "head_lr",
                     "kl_mu", "alpha", "bucket_fallback", "class_balance", "rubric_temperature", "max_new_tokens_mu",
                     "mu_examples", "sft_epochs_mu", "sft_lr_mu", "sft_head_lr", "sft_batch_mu", "sft_questions_mu",
                     "warmup_probe"}


def split_by_settings(groups: dict[str, list[dict]], by_run: dict[str, Run]) -> dict[str, list[dict]]:
    """Runs of one method whose settings differ (say --group-size) are not seeds of each other: each
    setting gets its own group, labelled with the flags that tell the groups apart."""
    out: dict[str, list[dict]] = {}
    for method, members in groups.items():
        ignore = NOT_SETTINGS | (UNUSED_BY_OUTCOME if all(m.get("reward") == "outcome" for m in members) else set())
        settings = [{k: v for k, v in by_run[m["run"]].args.items() if k not in ignore} for m in members]
        differ = sorted({k for s in settings for k in s if any(t.get(k) != s[k] for t in settings)})
        for member, s in zip(members, settings):
            flags = ", ".join(f"--{k.replace('_', '-')} {s.get(k)}" for k in differ)
            out.setdefault(f"{method} ({flags})" if differ else method, []).append(member)
    return out


def outcome_baseline(groups: dict[str, list[dict]], by_run: dict[str, Run]) -> str | None:
    """The group every other one is paired against ("Δ EM vs outcome RL"): outcome RL. When outcome RL ran at
    several settings (the fork study's control at ARCO's dense π rate and λ_π beside it), the one whose
    settings the other methods' runs share most (outcome RL as a user would run it instead of them): counted
    over the settings that tell the outcome groups apart; ties (no other method given, say) go to the label
    that sorts first, whatever the order of the runs."""
    labels = sorted(m for m in groups if m.startswith("outcome RL"))
    if len(labels) < 2:
        return labels[0] if labels else None
    first = {m: by_run[groups[m][0]["run"]].args for m in labels}
    split = {k for a in first.values() for k in a if any(b.get(k) != a[k] for b in first.values())} \
        - NOT_SETTINGS - UNUSED_BY_OUTCOME
    others = [by_run[r["run"]].args for m, rs in groups.items() if m not in labels for r in rs]
    return max(labels, key=lambda m: sum(o.get(k) == first[m].get(k) for o in others for k in split))


def method_rows(rows: Sequence[dict], runs: Sequence[Run]) -> list[dict]:
    """One row per method over its runs (seeds): EM and F1 as mean ± half the range over the runs, the
    SFT-only EM of the same runs' dev questions (each run's epoch 0), and the paired difference to it
    pooled over every run's questions with its 95% interval: beyond noise when the interval excludes 0; and the
    paired difference to outcome RL of the same seed (`outcome_baseline`), pooled the same way."""
    by_run = {str(r.dir): r for r in runs}
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row.get("run"):
            groups[method_of(row)].append(row)
    groups = split_by_settings(groups, by_run)
    final = {row["run"]: question_em(by_run[row["run"]], by_run[row["run"]].epoch) for rs in groups.values()
             for row in rs}
    same_seed = lambda members: {(by_run[row["run"]].args.get("seed"), q): v for row in members   # noqa: E731
                                 for q, v in final[row["run"]].items()}
    base = outcome_baseline(groups, by_run)
    outcome = {m: same_seed(rs) for m, rs in groups.items() if m.startswith("outcome RL")}   # keyed (seed, question)
    out = []
    for method, members in groups.items():
        before, after, sft = {}, {}, []
        for row in members:
            run = by_run[row["run"]]
            b, a = question_em(run, 0), question_em(run, run.epoch)
            before.update({(run.name, q): v for q, v in b.items()})
            after.update({(run.name, q): v for q, v in a.items()})
            if b:
                sft.append(sum(b.values()) / len(b))
        spread = lambda v: (sum(v) / len(v), (max(v) - min(v)) / 2) if v else (None, None)   # noqa: E731
        em, f1 = spread([m["em"] for m in members]), spread([m["f1"] for m in members])
        by_seed = same_seed(members)
        out.append({"method": method, "runs": len(members), "em": em[0], "em_spread": em[1], "f1": f1[0],
                    "f1_spread": f1[1], "sft_only_em": sum(sft) / len(sft) if sft else None,
                    "vs_sft_only": paired_difference(before, after),
                    "vs_outcome": None if method == base or base is None else
                    paired_difference(outcome[base], by_seed),
                    "vs_other_outcome": {m: paired_difference(em_, by_seed) for m, em_ in outcome.items()
                                         if m not in (base, method)}})
    return out


def compare_runs(runs: Sequence[Run], split: str, data_dir: str | None, device: str, reevaluate: bool,
                 dtype: str = "auto") -> dict:
    """The side-by-side comparison: warmup rows (dev only), then one row per run (on dev with its paired
    difference to its own epoch 0), then one row per method over its runs (seeds)."""
    rows = warmup_rows(runs) if split == "dev" else []
    for run in runs:
        scores = evaluation(run, split, data_dir, device, reevaluate, dtype)
        scores = {k: v for k, v in scores.items() if k not in ("checkpoint", "split")}   # the row says them
        mu = run.args.get("reward") != "outcome" and run.args.get("credit", "mu") == "mu"
        rows.append({"system": run.name, "checkpoint": run.checkpoint + (" (selected)" if run.selected else ""),
                     "run": str(run.dir), "reward": run.args.get("reward"), "credit": run.args.get("credit"), "mixed": run.args.get("mixed"),
                     "rubric": run.args.get("rubric") if mu else None, "k": run.args.get("k") if mu else None,
                     "mu_data": run.args.get("mu_data") if mu else None,
                     **scores,
                     "vs_sft_only": paired_difference(question_em(run, 0), question_em(run, run.epoch))
                     if split == "dev" else None})
    types_ = sorted({t for r in rows for t in r["by_type"]})
    return {"dataset": runs[0].args["dataset"], "split": split, "types": types_, "rows": rows,
            "methods": method_rows(rows, runs) if split == "dev" else []}


def comparison_markdown(comp: dict) -> str:
    """The comparison as one markdown table, then where each row comes from."""
    pct = lambda x: "" if x is None else f"{x:.1f}"                                  # noqa: E731
    delta = lambda d: "" if not d else f"{d['delta_em']:+.1f} ± {d['half_width']:.1f} (n {d['n']})"  # noqa: E731
    cols = ["system", "checkpoint", "n", "EM", "F1", "Δ EM vs SFT only ± 95%", "searches / q", "invalid steps %"] + \
        [f"{t} EM / F1" for t in comp["types"]]
    table = []
    for r in comp["rows"]:
        cells = {"system": r["system"], "checkpoint": r["checkpoint"], "n": r.get("n"), "EM": pct(r.get("em")),
                 "F1": pct(r.get("f1")), "Δ EM vs SFT only ± 95%": delta(r.get("vs_sft_only")),
                 "searches / q": "" if r.get("mean_searches") is None else f"{r['mean_searches']:.2f}",
                 "invalid steps %": "" if r.get("invalid_rate") is None else f"{100 * r['invalid_rate']:.1f}"}
        for t in comp["types"]:
            b = r["by_type"].get(t)
            cells[f"{t} EM / F1"] = f"{b['em']:.1f} / {b['f1']:.1f} (n {b['n']})" if b else ""
        table.append(cells)
    lines = [f"# Comparison on {comp['dataset']} / {comp['split']}", "", format_table(table, cols), "",
             "Greedy decoding; EM and F1 in %, an unfinished trajectory scores 0. The warmup rows have no "
             "per-type breakdown (its metrics.json keeps none). Δ EM: the checkpoint's EM minus the same run's "
             "epoch 0 (SFT only) on the same questions, mean of the per-question differences ± its 95% interval "
             "(beyond noise when the interval excludes 0).", ""]
    if comp.get("methods"):
        mrows = [{"method": m["method"], "runs": m["runs"],
                  "EM (mean ± half range)": f"{m['em']:.1f} ± {m['em_spread']:.1f}",
                  "F1": f"{m['f1']:.1f} ± {m['f1_spread']:.1f}",
                  "SFT-only EM, same questions": pct(m["sft_only_em"]),
                  "Δ EM vs SFT only ± 95% (pooled)": delta(m["vs_sft_only"]),
                  "Δ EM vs outcome RL, same seed ± 95%": delta(m.get("vs_outcome"))} for m in comp["methods"]]
        lines += ["By method, over its runs (seeds):", "", format_table(mrows, list(mrows[0])), ""]
        others = dict.fromkeys(o for m in comp["methods"] for o in m.get("vs_other_outcome") or {})
        if others:                       # outcome RL at several settings: the column's baseline, then the rest
            base = next(m["method"] for m in comp["methods"] if m["method"].startswith("outcome RL")
                        and m["vs_outcome"] is None)
            lines += [f"Outcome RL ran at several settings: the column pairs with {base}."]
            lines += [f"Paired with {other} instead (same seed ± 95%): " + "; ".join(
                f"{m['method']} {delta(m['vs_other_outcome'][other])}" for m in comp["methods"]
                if other in m["vs_other_outcome"]) for other in others] + [""]
    lines += ["Sources:", ""]
    lines += [f"- {r['system']}: {r['source']}" for r in comp["rows"]]
    return "\n".join(lines) + "\n"
