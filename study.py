"""The credit study (issues 33 and 41): does μ's step credit help π beyond outcome RL, and what limits μ? On the
long-horizon worlds (`synthetic-long`: 3-4-hop chains, look-alike distractors, 5 searches), from one deliberately
partial π_sft. Not part of the paper; nothing imports this file. Two programs, each resumable (what is finished
is kept; an unfinished run resumes), each taking arco.py's flags after its own:

  python study.py ladder [--rows ROW ...]          the μ-quality ladder, before any RL: one μ per row (a μ SFT
                                                   variant of the study's warmup), each μ's AUC by step type on
                                                   π_sft's seeded rollouts of 100 held-out dev questions, μ reading
                                                   its OWN greedy rubric, beside the position-only baseline on the
                                                   same steps. Written to <out-dir>/synthetic-long/study/ladder.md
  python study.py fork [--seeds 0 1 2] [--arms ARM ...] [--figures figures]
                                                   Algorithm 1 as it runs: a sparse phase once per seed (π on outcome
                                                   advantages, μ co-evolving by Eq. 5 every update; `sparse-sN`),
                                                   then the arms forked from its last checkpoint at the dense
                                                   transition (same weights, μ, optimizer states, same first dense
                                                   batch): outcome RL continuing, ARCO, the mixed arm, the causal and
                                                   projection oracles, ARCO w/o Rubric (its own sparse phase with a
                                                   rubric-free μ: π's sparse updates do not read μ), outcome RL at
                                                   the dense phase's π rate and λ_π. The table (Δ EM
                                                   vs outcome RL of the same seed, paired 95% intervals), μ's AUC
                                                   through the sparse phase and at the fork, per-update credit
                                                   statistics, the learning curves: <out-dir>/synthetic-long/study/
                                                   over every finished arm of the given seeds, whichever process
                                                   ran it (seeds run as separate processes each write it for
                                                   their own seeds: the command with every seed rebuilds it,
                                                   running nothing again). A run another process is running is
                                                   refused, so once a seed has forked its arms may run as
                                                   parallel processes, each with its own --arms

The settings every run of the study shares are STUDY below; the dense phase takes the release's ratios to
the sparse one (CHOICES.md, "the credit study").
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

import torch

import env
import warmup
import arco
import rubric_model
from env import step_usefulness
from evaluate import auc_by_step_type, main_guard, parse_args

# Shared by every run and every μ of the study (arco.py's flag names). 32 RL questions the warmup did not use,
# 8 trajectories an update (2 questions × 4 samples, in sparse and dense epochs alike): 16 updates an epoch.
# π_sft: one SFT epoch on 100 warmup questions (29 EM on 100 held-out questions: room for credit), μ SFT on
# the first 40's. The release's dense/sparse ratios: π's rate × 0.3 (1e-5 → 3e-6), λ_π 0 → 0.05, α 0.5; μ at the
# release's own rates (1e-5, head 5e-4), which kept μ's credit through RL where the cpu preset's eroded it. μ writes
# the release's JSON list; μ SFT and evaluation as the `cpu` preset had them when the study ran (issue 52 changed
# the preset's since).
STUDY = dict(dataset="synthetic-long", train_size=32, batch_size=8, group_size=4, dense_samples=4, eval_size=500,
             warmup_size=100, sft_epochs_pi=1, sft_questions_mu=40, sft_eval_size=100, warmup_questions="before",
             sparse_epochs=2, epochs=3, pi_lr_sparse=2e-4, pi_lr_dense=6e-5, kl_pi_sparse=0.0, kl_pi_dense=0.05,
             alpha=0.5, mu_lr=1e-5, head_lr=5e-4, eval_every=4, curve_size=200, rubric_format="json",
             eval_every_epoch=True, sft_epochs_mu=2, sft_batch_mu=8, sft_head_steps=500, max_new_tokens_mu=96,
             class_balance=True)

# The μ-quality ladder: each row a μ SFT variant of the study's warmup (warmup.py's flag names).
LADDER = {
    "teacher": dict(mu_data="teacher"),                                      # the oracle's own trajectories (App. B)
    "teacher-check": dict(mu_data="teacher", criteria="check"),
    "policy": dict(mu_data="policy"),                                        # π_sft's rollouts, oracle-annotated
    "policy-ownhead": dict(mu_data="policy", head_fit="own"),
    "policy-check": dict(mu_data="policy", criteria="check"),
    "policy-check-ownhead": dict(mu_data="policy", criteria="check", head_fit="own"),
    "policy-bal": dict(mu_data="policy", balance_finishes=True),            # right/wrong finishes weigh alike
    "policy-check-ownhead-bal": dict(mu_data="policy", criteria="check", head_fit="own", balance_finishes=True),
    "policy-q100": dict(mu_data="policy", sft_questions_mu=100),           # every warmup question's rollouts
    "policy-q100-n4": dict(mu_data="policy", sft_questions_mu=100, policy_samples=4),
    "policy-q100-check-ownhead": dict(mu_data="policy", sft_questions_mu=100, criteria="check", head_fit="own"),
    "policy-q100-n4-check-ownhead": dict(mu_data="policy", sft_questions_mu=100, policy_samples=4, criteria="check",
                                         head_fit="own"),
    "policy-norubric": dict(mu_data="policy", rubric="none"),
}

# The fork's arms: the sparse run each forks from, and its own settings (arco.py's flag names).
ARMS = {"outcome": ("sparse", dict(reward="outcome")),                       # R(τ) − the group's mean, continuing
        "arco": ("sparse", dict()),                                          # dense, μ's s_t (Algorithm 1)
        "mixed": ("sparse", dict(mixed=True)),                               # outcome + μ's dense advantage
        "causal-oracle": ("sparse", dict(credit="causal")),                  # G_t = R − Φ(h_t)
        "projection-oracle": ("sparse", dict(credit="projection")),          # the issue-33 ceiling (sees the future)
        "arco-norubric": ("sparse-norubric", dict(rubric="none")),         # its own μ, its own sparse phase
        # A control beyond the issue: outcome RL at the dense phase's π rate and λ_π (ARCO's), so that ARCO's
        # difference to it is μ's credit alone, not the cooler update (the report pairs each arm with it too).
        # Its settings follow the command line's dense ones: a function of the study's arguments.
        "outcome-dense": ("sparse", lambda base: dict(reward="outcome", pi_lr_sparse=base.pi_lr_dense,
                                                      kl_pi_sparse=base.kl_pi_dense))}
SPARSE = {"sparse": dict(), "sparse-norubric": dict(rubric="none")}
ARGS_FIELDS = {f.name for f in dataclasses.fields(arco.Args)}


def study_args(argv: Sequence[str], **overrides) -> arco.Args:
    """arco.Args for one run of the study: arco.py's defaults, then STUDY, then the command line's flags, then
    `overrides` (the arm's or the row's), the preset filling the rest."""
    given = parse_args(arco.Args, list(argv))
    defaults = arco.Args()
    explicit = {f.name: getattr(given, f.name) for f in dataclasses.fields(arco.Args)
                if getattr(given, f.name) != getattr(defaults, f.name)}
    return arco.resolve_args(dataclasses.replace(defaults, **{**STUDY, **explicit, **overrides}))


# --- the μ-quality ladder (no RL) ------------------------------------------------------------------------------

def position_auc(trajs) -> dict:
    """The position-only baseline: a step's score is minus its index (earlier = useful), by step type."""
    steps = [(t, st, u) for tr in trajs for t, (st, u) in enumerate(zip(tr.steps, step_usefulness(tr)))]
    return auc_by_step_type([-t for t, _, _ in steps], [u for _, _, u in steps],
                            [st.action if st.valid else None for _, st, _ in steps])


def ladder(argv: Sequence[str], rows: Sequence[str]) -> Path:
    """Train each row's μ (warmup.run: the collection, π SFT and μ SFTs already made are reused), then score it
    on π_sft's seeded held-out rollouts (warmup.policy_dev_rollouts), kept in study/ladder.json."""
    base = study_args(argv)
    root = Path(base.out_dir) / base.dataset
    folder, out = root / "study-warmup", root / "study"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "ladder.json"
    done = json.loads(path.read_text()) if path.is_file() else {}
    trajs = None
    for row in rows:
        args = study_args(argv, **LADDER[row])
        name = warmup.mu_dir_name(dataclasses.asdict(args))
        if done.get(row, {}).get("mu") == name:
            continue
        print(f"[study] ladder row {row}: μ {folder / name}", flush=True)
        warmup.run_from_arco(args, folder)                     # trains the μ this row needs, reuses the rest
        if trajs is None:
            retriever = env.shared_retriever(base.retriever or None, base.retriever_pooling)
            trajs = warmup.policy_dev_rollouts(base, folder, retriever)
        mu = rubric_model.RubricModel.load(folder / name, device=base.device, dtype=base.dtype, autocast=base.autocast,
                                           engine=base.engine)
        done[row] = {"mu": name, "settings": LADDER[row], "command": ladder_command(row),
                     **warmup.policy_dev_auc(mu, trajs, base.gen_batch, base.max_new_tokens_mu),
                     "position": position_auc(trajs), "sft": mu_sft_facts(folder, name)}
        done = keep_row(path, row, done[row])
    (out / "ladder.md").write_text(ladder_markdown(done), encoding="utf-8")
    print(ladder_markdown(done))
    return out


def keep_row(path: Path, key: str, row: dict) -> dict:
    """Add `row` under `key` to the JSON file at `path`, read again first: another of the study's processes
    may have added its own rows since this one read it. Returns the file's rows."""
    done = {**(json.loads(path.read_text()) if path.is_file() else {}), key: row}
    env.write_json(path, done)
    return done


def ladder_command(row: str) -> str:
    flags = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in LADDER[row].items())
    return f"python warmup.py {flags} (with the study's settings; or: python study.py ladder --rows {row})"


def mu_sft_facts(folder: Path, name: str) -> dict:
    """What the row's μ SFT saw and did (the warmup's metrics.json)."""
    m = json.loads((folder / "metrics.json").read_text()).get("mu", {}).get(name, {})
    return {k: m.get(k) for k in ("mu_sft_loss_per_epoch", "mu_head_fit_error", "sft_items", "sft_finishes",
                                  "sft_right_finishes")}


def fmt(v) -> str:
    return "–" if v is None else f"{v:.2f}"


def auc_table(heads: Sequence[str], rows: Iterable[tuple[Sequence[str], dict]]) -> str:
    """μ's step AUC beside the position-only baseline (policy_dev_auc and position_auc rows), one line each,
    after the row's own cells (`heads` names them)."""
    lines = [f"| {' | '.join(cells)} | **{fmt(d['search'])}** / {fmt(d['position']['search'])} | "
             f"**{fmt(d['finish'])}** / {fmt(d['position']['finish'])} | {fmt(d['all'])} | {d['steps']} |"
             for cells, d in rows]
    return (f"| {' | '.join(heads)} | search: μ / position | finish: μ / position | all | steps |\n"
            f"|{'---|' * (len(heads) + 4)}\n" + "\n".join(lines) + "\n")


def ladder_markdown(done: dict) -> str:
    return auc_table(["row", "μ folder"], (([row, f"`{d['mu']}`"], d) for row, d in done.items()))


# --- sparse, then fork ---------------------------------------------------------------------------------------------

def run_once(args: arco.Args) -> Path:
    """One run of the study: skipped when finished, resumed when started; refused while another process runs
    it (so the arms of one seed can run in parallel processes, each with its own --arms, once its fork exists)."""
    run_dir = Path(args.out_dir) / args.dataset / args.name
    if (run_dir / "selection.json").is_file():
        return run_dir
    with held(run_dir):
        args.resume = (run_dir / "args.json").is_file()
        print(f"[study] {args.name}: {'resuming' if args.resume else 'starting'}", flush=True)
        return arco.run(args)


@contextlib.contextmanager
def held(run_dir: Path):
    """Plumbing: an exclusive lock on <run_dir>/running.lock (holding the owner's process id) while the run runs;
    the system drops it when its process ends, however it ends. The file stays (removing a lock file races)."""
    import fcntl
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "running.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            sys.exit(f"error: {run_dir} is being run by process {f.read().strip() or '?'}: give each study.py process "
                     "its own --seeds or --arms (a seed's arms in parallel only once its sparse phase is done)")
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        yield


def fork_study(argv: Sequence[str], seeds: Sequence[int], arms: Sequence[str], figures: str = "") -> Path:
    base = study_args(argv)
    root = Path(base.out_dir) / base.dataset
    warm = str(root / "study-warmup")
    for seed in seeds:                       # a seed's sparse phase, then its arms: results come in whole
        for arm in arms:
            parent, own = ARMS[arm]
            own = own(base) if callable(own) else own
            sparse = run_once(study_args(argv, **SPARSE[parent], epochs=base.sparse_epochs, warmup_dir=warm,
                                         seed=seed, name=f"{parent}-s{seed}"))
            fork_at = sparse / "checkpoints" / f"epoch_{base.sparse_epochs}"
            run_once(study_args(argv, **own, warmup_dir=warm, seed=seed, name=f"{arm}-s{seed}", fork_from=str(fork_at)))
    # The report: every finished arm of these seeds, whichever process ran it (the one-seed arms included).
    dirs = {arm: [d for d in (root / f"{arm}-s{seed}" for seed in seeds) if (d / "selection.json").is_file()]
            for arm in ARMS}
    return fork_report(base, root, {arm: ds for arm, ds in dirs.items() if ds}, figures)


def update_aucs(run_dir: Path) -> list[dict]:
    """Per update of a run with μ, the AUC of s_t for useful vs useless steps of its own training batch, each
    batch scored by the μ that scored it (no pooling across μ states), by step type, with the update's
    decomposition error (Eq. 5's first term)."""
    mse = {(r["epoch"], r["batch"]): r.get("decomposition_mse") for r in env.read_jsonl(run_dir / "metrics.jsonl")
           if r["kind"] == "update"}
    out = []
    for path in sorted((run_dir / "traces").glob("epoch_*.jsonl"), key=lambda f: int(f.stem.split("_")[1])):
        batches: dict = defaultdict(list)
        for row in env.read_jsonl(path):
            batches[row["batch"]] += [st for st in row["steps"] if "s" in st and "useful" in st]
        epoch = int(path.stem.split("_")[1])
        for b, steps in sorted(batches.items()):
            out.append({"epoch": epoch, "batch": b, "decomposition_mse": mse.get((epoch, b)), **auc_by_step_type(
                [st["s"] for st in steps], [st["useful"] for st in steps],
                [st.get("action") if st.get("valid") else None for st in steps])})
    return out


def fork_mu_auc(base: arco.Args, warm: Path, forks: Iterable[Path], path: Path) -> dict:
    """μ's step AUC at the fork, held out: per seed, the μ of the sparse run's checkpoint at the fork (co-evolved
    by Eq. 5 on π's rollouts) and the warmup μ it started from, each reading its own greedy rubric, on the
    ladder's 100 dev questions played by π_sft (the ladder's probe: μ before RL) and by π at the fork (the same
    questions and sampling seeds), with the position-only baseline on the same steps. Kept in `path` by
    "<μ> on <player>"; a pair already there is not measured again (the seeds' processes share the file)."""
    done = json.loads(path.read_text()) if path.is_file() else {}
    trajs: dict = {}
    for fork in forks:
        run = fork.parent.parent
        start = warm / warmup.mu_dir_name(json.loads((run / "args.json").read_text()))
        label = f"{run.name}/{fork.name}"
        for mu_dir, mu_name in ((start, start.name), (fork / "mu", label)):
            for policy, player in ((None, "pi_sft"), (fork / "pi", label)):
                key = f"{mu_name} on {player}"
                if key in done:
                    continue
                if player not in trajs:
                    retriever = env.shared_retriever(base.retriever or None, base.retriever_pooling)
                    trajs[player] = warmup.policy_dev_rollouts(base, warm, retriever, policy)
                print(f"[study] μ's AUC at the fork: {key}", flush=True)
                mu = rubric_model.RubricModel.load(mu_dir, device=base.device, dtype=base.dtype,
                                                   autocast=base.autocast, engine=base.engine)
                row = {"mu": mu_name, "player": player, "position": position_auc(trajs[player]),
                       **warmup.policy_dev_auc(mu, trajs[player], base.gen_batch, base.max_new_tokens_mu)}
                del mu
                done = keep_row(path, key, row)
    return done


def fork_mu_markdown(done: dict) -> str:
    return auc_table(["μ", "rollouts of"], (([d["mu"], d["player"]], d) for d in done.values()))


def credit_summary(updates: Sequence[dict]) -> dict:
    """Over a run's dense updates (metrics rows with μ's statistics): μ's mean s_t by step type and position, the
    mean correlation of Σ_t s_t − R with the trajectory's number of searches (does μ pay for length?), and the
    singleton fallback (Eq. 3–4: a bucket of one step is advantaged against its batch, not its bucket): such
    buckets per update, how many were terminal (a Finish's), and the mean advantage those Finishes got."""
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None
    by_step = defaultdict(list)
    for u in updates:
        for k, v in (u.get("mean_s_by_step") or {}).items():
            by_step[k].append(v)
    singles = [b for u in updates for b in u.get("singleton_buckets") or []]
    finishes = [b["A"] for b in singles if b.get("action") == "finish"]
    return {"updates": len(updates), "mean_s_by_step": {k: mean(v) for k, v in sorted(by_step.items())},
            "corr_excess_searches": mean([u.get("corr_excess_searches") for u in updates]),
            "singletons_per_update": len(singles) / len(updates) if updates else None,
            "finish_singletons_per_update": len(finishes) / len(updates) if updates else None,
            "finish_singleton_A": mean(finishes)}


def credit_room(rows: Iterable[dict]) -> dict:
    """How much room step credit has in a policy's trajectories (trace rows): the share of failed ones (R = 0)
    holding a useful step followed later by a useless one — where outcome credit blames the useful step
    with the rest and step credit need not."""
    failed = [r for r in rows if not r["reward"]]
    room = 0
    for r in failed:
        useful = step_usefulness(r)
        room += any(u and not v for i, u in enumerate(useful) for v in useful[i + 1:])
    return {"failed": len(failed), "useful_then_useless": room, "share": room / len(failed) if failed else None}


def dev_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(updates made before it, dev EM) of every evaluation of a run, all on the curve's slice (the first
    --curve-size dev questions): the --eval-every points, and each epoch-end evaluation's EM on those same
    questions (its traces; the evaluation's own EM covers --eval-size questions, shown in the table)."""
    rows = env.read_jsonl(run_dir / "metrics.jsonl")
    size = json.loads((run_dir / "args.json").read_text()).get("curve_size")
    done = lambda e, b: sum(r["kind"] == "update" and (r["epoch"], r["batch"]) <= (e, b) for r in rows)  # noqa: E731

    def on_slice(r: dict) -> float:
        traces = run_dir / "traces" / f"eval_epoch_{r['epoch']}.jsonl"
        if r["kind"] == "curve" or not size or not traces.is_file():
            return r["em"]
        first = env.read_jsonl(traces)[:size]               # an evaluation's traces keep the dev order
        return 100.0 * sum(t["reward"] for t in first) / len(first)
    return [(done(r["epoch"], r["batch"] if r["kind"] == "curve" else 10 ** 9), on_slice(r))
            for r in rows if r["kind"] in ("eval", "curve")]


def train_reward(run_dir: Path, window: int = 4) -> list[tuple[int, float]]:
    """(update, mean R(τ) of the training rollouts over the last `window` updates): one update's 8 rollouts are
    too few to read (the per-update values are in metrics.jsonl)."""
    rs = [r["mean_R"] for r in env.read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "update"]
    last = [rs[max(0, i - window):i] for i in range(1, len(rs) + 1)]
    return [(i, sum(xs) / len(xs)) for i, xs in enumerate(last, 1)]


def study_curves(dirs: dict[str, list[Path]], sparse_of: dict[Path, Path], curve) -> dict[str, list]:
    """`curve` of each sparse phase once ("sparse phase", its seeds), then of each arm from its fork on
    (`sparse_of`: the sparse run each arm's run forked from)."""
    shared = {p: curve(p) for p in dict.fromkeys(sparse_of[d] for ds in dirs.values() for d in ds)}   # arms' order
    out: dict[str, list] = defaultdict(list)
    for p, points in shared.items():
        out["sparse phase" + (", rubric-free μ" if p.name.startswith("sparse-norubric") else "")].append(points)
    for arm, ds in dirs.items():
        out[arm] = [[(x, y) for x, y in curve(d) if x >= shared[sparse_of[d]][-1][0]] for d in ds]
    return dict(out)


def plot_curves(curves: dict[str, list[list[tuple[int, float]]]], path: Path, title: str, ylabel: str) -> None:
    """Per arm: each seed a thin line, the mean over seeds a thick one (points where every seed has one); the
    sparse phases in grey."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(7, 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    arms = [arm for arm in curves if not arm.startswith("sparse")]
    for arm, series in curves.items():
        color = f"C{arms.index(arm)}" if arm in arms else ("0.35" if arm == "sparse phase" else "0.65")
        for s in series:
            ax.plot([x for x, _ in s], [y for _, y in s], color=color, linewidth=0.7, alpha=0.45)
        xs = sorted(set.intersection(*[{x for x, _ in s} for s in series])) if series else []
        mean = [sum(dict(s)[x] for s in series) / len(series) for x in xs]
        ax.plot(xs, mean, color=color, linewidth=2.2, marker="o", markersize=3,
                label=f"{arm} ({len(series)} seed{'s' if len(series) > 1 else ''})")
    ax.set(title=title, xlabel="update", ylabel=ylabel)
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


def fork_report(base: arco.Args, root: Path, dirs: dict[str, list[Path]], figures: str) -> Path:
    """The fork study's table, μ's AUC through the sparse phase and after the fork, the per-update credit
    statistics and the curves, into <root>/study/fork.md, fork.json and the two images."""
    out = root / "study"
    runs = [d for ds in dirs.values() for d in ds]
    # The comparison table (paired intervals against outcome RL of the same seed) is diagnostics.py's, run as
    # the command a reader would type; it writes comparison.md/.json into the first run's folder.
    subprocess.run([sys.executable, str(Path(__file__).with_name("diagnostics.py")), "--run", *map(str, runs),
                    "--device", base.device, "--dtype", base.dtype] + (["--data-dir", base.data_dir] if base.data_dir
                                                                        else []), check=True)
    comp = json.loads((runs[0] / "comparison.json").read_text())
    md = "# The fork study (issue 41)\n\n" + (runs[0] / "comparison.md").read_text()
    saved = {d: json.loads((d / "args.json").read_text()) for d in runs}         # each run's own arguments
    forks = sorted({Path(a["fork_from"]) for a in saved.values()})
    sparse_of = {d: Path(a["fork_from"]).parent.parent for d, a in saved.items()}
    aucs = {p.name: update_aucs(p) for p in sorted(set(sparse_of.values())) if (p / "checkpoints").is_dir()}
    aucs.update({d.name: update_aucs(d) for d in runs if (d / "traces").is_dir() and arco.uses_mu(
        arco.Args(**{k: v for k, v in saved[d].items() if k in ARGS_FIELDS}))})
    fork_mu = fork_mu_auc(base, root / "study-warmup", forks, out / "fork_mu.json")
    md += ("\nμ's step AUC at the fork, held out: the warmup μ and each seed's μ at the fork, each writing its own "
           f"rubric, on {warmup.POLICY_PROBE_QUESTIONS} dev questions played once by π_sft and by π at the fork "
           "(the same questions and sampling seeds):\n\n" + fork_mu_markdown(fork_mu))
    md += "\nμ through the sparse phase and after the fork, per update (decomposition error; step AUC search / finish):\n\n"
    for name, rows in aucs.items():
        md += f"- {name}: " + "; ".join(f"{fmt(r['decomposition_mse'])} {fmt(r['search'])}/{fmt(r['finish'])}"
                                        for r in rows) + "\n"
    # The oracles' Σ_t s_t = R by construction: logs written before arco.credit_stats knew it correlate rounding
    # error with length, so their correlation is dropped here.
    exact = {d.name for d in runs if saved[d].get("credit", "mu") != "mu"}
    stats = {d.name: [{k: None if k == "corr_excess_searches" and d.name in exact else r.get(k)
                       for k in ("epoch", "batch", "dense", "mean_s_by_step", "corr_excess_searches", "singleton_buckets")}
                      for r in env.read_jsonl(d / "metrics.jsonl") if r["kind"] == "update" and "mean_s_by_step" in r]
             for d in runs}
    summary = {name: credit_summary([r for r in rows if r["dense"]]) for name, rows in stats.items()
               if any(r["dense"] for r in rows)}
    md += ("\nμ's credit over each arm's dense updates: corr(Σ s − R, searches), mean over updates (> 0: μ pays for "
           "length); singleton buckets per update (terminal ones, and the mean advantage of their Finish); μ's mean "
           "s_t by step and position:\n\n")
    for name, c in summary.items():
        md += (f"- {name} ({c['updates']} updates): corr {fmt(c['corr_excess_searches'])}; singletons "
               f"{fmt(c['singletons_per_update'])} (terminal {fmt(c['finish_singletons_per_update'])}, A "
               f"{fmt(c['finish_singleton_A'])}); s̄ " + ", ".join(f"{k} {v:+.2f}" for k, v in
                                                                 c["mean_s_by_step"].items()) + "\n")
    curves, rewards = (study_curves(dirs, sparse_of, curve) for curve in (dev_curve, train_reward))
    for folder in [out] + ([Path(figures)] if figures else []):
        plot_curves(curves, folder / "study_dev_em.png", f"dev EM on {base.curve_size} questions "
                    "(thin: seeds; thick: mean)", "EM (%)")
        plot_curves(rewards, folder / "study_train_reward.png", "mean R(τ) of the training rollouts, last 4 "
                    "updates (thin: seeds; thick: mean)", "mean R")
    out.mkdir(parents=True, exist_ok=True)
    (out / "fork.md").write_text(md, encoding="utf-8")
    env.write_json(out / "fork.json", {"comparison": comp, "fork_mu": fork_mu, "update_aucs": aucs,
                                       "credit_stats": stats, "credit_summary": summary, "curves": curves})
    print(md)
    return out


# --- the gradient probe (issue 53) -----------------------------------------------------------------------------
#
# What one update's credit does to π's gradient, measured directly instead of through the EM that 16 noisy updates
# reach. At a π (π_sft of the study's warmup, or π at a seed's fork), with respect to the weights RL trains (π's
# LoRA adapter): the true gradient g* of J = E[R] is estimated from a held-out pool of rollouts (outcome REINFORCE
# with each question's leave-one-out mean as the baseline: unbiased), and every credit scheme's batch gradient
# g_B = (1/|B|) Σ_τ Σ_t A_{τ,t} ∇ log π(a_t|h_t) (Eq. 3's, its KL term aside) is formed on 64 disjoint batches of
# the study's budget, 8 trajectories, drawn from a second pool: 2 questions × 4 samples (the study's composition)
# or 8 questions × 1 (the release's dense composition). One pool and one per-step gradient serve every scheme
# (common random numbers). The per-step gradients are count-sketched to PROBE["dims"] numbers (a random linear
# map that keeps inner products in expectation; sketch_check measures how closely on the first steps).

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
                n_questions: int, samples: int, alpha: float, fallback: bool) -> list[dict]:
    """Per (scheme, composition): the cosine of each batch gradient with g* (mean and 95% interval over the
    batches), the batch gradients' spread relative to their component along g* (tr Cov / ⟨ḡ, ĝ*⟩²: lower is a
    better-conditioned step; also relative to outcome RL at 2 × 4), and the bias seen in the mean gradient
    ḡ over all batches: its cosine with g*, and its component orthogonal to g*."""
    g = gstar["g"].double()
    u = g / g.norm()
    rows = []
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
    base = next(r for r in rows if r["scheme"] == "outcome" and r["composition"] == "2x4")["noise_to_signal"]
    for r in rows:
        r["variance_vs_outcome_2x4"] = r["noise_to_signal"] / base if r["noise_to_signal"] and base else None
    return rows


def probe(argv: Sequence[str], points: Sequence[str], seed: int) -> Path:
    """The gradient probe at each point ("sft": π_sft and the warmup μ; "fork": π and μ at seed `seed`'s fork,
    its sparse phase run first if missing), cached stage by stage under study/probe-<point>-s<seed>/."""
    import time
    base = study_args(argv, seed=seed)
    root = Path(base.out_dir) / base.dataset
    warm = root / "study-warmup"
    out = root / "study"
    warmup.run_from_arco(base, warm)                         # the study's warmup (reused when there)
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
        del pi
        scores = {"causal": [env.ground_truth_scores(t, "causal") for t in pool]}
        for name, mu_dir in mus.items():
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
                 "sketch": json.loads((folder / "sketch.json").read_text()), "seconds": seconds, "rows": rows}
        env.write_json(folder / "probe.json", facts)
        print(probe_markdown(facts))
    return out


def probe_markdown(facts: dict) -> str:
    lines = [f"probe at {facts['point']} (seed {facts['seed']}): batch pool {facts['pool']['trajectories']} "
             f"trajectories of {facts['pool']['questions']} questions (mean R {facts['pool']['mean_R']:.2f}); g* from "
             f"{facts['held']['trajectories']} ({facts['held']['nonzero_advantage']} with a non-zero advantage); "
             f"cos(g* halves) {facts['gstar_halves_cos']:.2f}", "",
             "| scheme | batch | cos(g_B, g*) | tr Cov / ⟨ḡ, ĝ*⟩² | vs outcome 2×4 | cos(ḡ, g*) | ḡ ⟂ g* |",
             "|---|---|---|---|---|---|---|"]
    for r in facts["rows"]:
        nts = "–" if r["noise_to_signal"] is None else f"{r['noise_to_signal']:.0f}"
        rel = "–" if r["variance_vs_outcome_2x4"] is None else f"{r['variance_vs_outcome_2x4']:.2f}"
        lines.append(f"| {r['scheme']} | {r['composition']} | {r['cos_mean']:.3f} ± {r['cos_ci95']:.3f} | {nts} | "
                     f"{rel} | {r['mean_cos']:.2f} | {fmt(r['orthogonal_share'])} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    pre = argparse.ArgumentParser(prog="study.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = pre.add_subparsers(dest="program", required=True)
    lad = sub.add_parser("ladder", help="the μ-quality ladder (no RL)")
    lad.add_argument("--rows", nargs="+", default=list(LADDER), choices=list(LADDER))
    fk = sub.add_parser("fork", help="sparse, then fork: the arms against outcome RL")
    fk.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    fk.add_argument("--arms", nargs="+", default=["outcome", "arco", "mixed", "causal-oracle"], choices=list(ARMS))
    fk.add_argument("--figures", default="", help="also write the learning curves here (the README's figures/)")
    pr = sub.add_parser("probe", help="the gradient probe: each credit scheme's batch gradient against the true one")
    pr.add_argument("--at", nargs="+", default=["sft", "fork"], choices=["sft", "fork"],
                    help="sft: π_sft and the warmup μ; fork: π and μ at the seed's fork (its sparse phase run if missing)")
    pr.add_argument("--probe-seed", type=int, default=0, help="the study seed whose warmup, fork and questions are used")
    own, rest = pre.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if own.program == "ladder":
        ladder(rest, own.rows)
    elif own.program == "probe":
        probe(rest, own.at, own.probe_seed)
    else:
        fork_study(rest, own.seeds, own.arms, own.figures)


if __name__ == "__main__":
    main_guard(main, env.DataError, rubric_model.ModelLoadError)
