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
# release's own rates (1e-5, head 5e-4), which kept μ's credit through RL where the cpu preset's eroded it.
STUDY = dict(dataset="synthetic-long", train_size=32, batch_size=8, group_size=4, dense_samples=4, eval_size=500,
             warmup_size=100, sft_epochs_pi=1, sft_questions_mu=40, sft_eval_size=100, warmup_questions="before",
             sparse_epochs=2, epochs=3, pi_lr_sparse=2e-4, pi_lr_dense=6e-5, kl_pi_sparse=0.0, kl_pi_dense=0.05,
             alpha=0.5, mu_lr=1e-5, head_lr=5e-4, eval_every=4, curve_size=200)

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


def main(argv: Sequence[str] | None = None) -> None:
    pre = argparse.ArgumentParser(prog="study.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = pre.add_subparsers(dest="program", required=True)
    lad = sub.add_parser("ladder", help="the μ-quality ladder (no RL)")
    lad.add_argument("--rows", nargs="+", default=list(LADDER), choices=list(LADDER))
    fk = sub.add_parser("fork", help="sparse, then fork: the arms against outcome RL")
    fk.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    fk.add_argument("--arms", nargs="+", default=["outcome", "arco", "mixed", "causal-oracle"], choices=list(ARMS))
    fk.add_argument("--figures", default="", help="also write the learning curves here (the README's figures/)")
    own, rest = pre.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if own.program == "ladder":
        ladder(rest, own.rows)
    else:
        fork_study(rest, own.seeds, own.arms, own.figures)


if __name__ == "__main__":
    main_guard(main, env.DataError, rubric_model.ModelLoadError)
