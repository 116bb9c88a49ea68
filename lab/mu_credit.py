"""μ diagnosed (`python -m lab.diagnostics --run DIR --diagnose`): its step credit on a held-out set with known step
labels (untrained, warmup and each RL epoch's μ), μ as a reward-free judge of R(τ), RQ3's Bind and Spec and RQ4's
redundancy on the training traces, the plots and the trajectory page: diagnostics.md and .json."""
import json
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

import env
import rubric_model
from evaluate import f1_score
from infra.report import format_table
from infra.runs import auc
from infra import models
from infra.engines import ENGINES
from infra.files import write_json
from infra.oracle import OracleTeacher
from lab.truth import step_usefulness
from lab.compare import Run, shared_retriever
from lab.judges import OpenAIJudge, embedding_bind
from lab.page import trajectories_html
from lab.plots import bucket_mean_scores, dev_em_series, plot_lines, train_reward_series
from lab.stats import best_threshold, binding_item, judge_stats, mean_ci, proportion_ci, redundancy, redundancy_summary, spearman

# --- μ diagnostics ---------------------------------------------------------------------------------

class _CachedEncoder:
    """`encode(texts)` -> numpy (n, dim), each distinct text encoded once (batched by `warm`)."""

    def __init__(self, encode):
        self.encode, self.vectors = encode, {}

    def warm(self, texts: Iterable[str]) -> None:
        todo = list(dict.fromkeys(t for t in texts if t not in self.vectors))
        if todo:
            for t, v in zip(todo, np.asarray(self.encode(todo), dtype=np.float64)):
                self.vectors[t] = v

    def __call__(self, texts: Sequence[str]):
        self.warm(texts)
        return np.stack([self.vectors[t] for t in texts])


def step_action_text(st: dict) -> str:
    """a_t of a trace row's step as env.Step.action_text writes it (the canonical action, or the
    raw output of an invalid step): the candidates of a Bind item."""
    return env.action_text(bool(st.get("valid")), st.get("action"), st.get("argument"), str(st.get("output", "")))


class TraceStep:
    """A trace row's step as env.format_history reads a step: its action text and observation."""

    def __init__(self, st: dict):
        self.st, self.observation = st, st.get("observation", "")

    def action_text(self) -> str:
        return step_action_text(self.st)


def _criteria(st: dict) -> list[str]:
    return [str(c) for c in (st.get("criteria") or []) if str(c).strip()]


def _proportion(correct: int, n: int, chance: Sequence[float] = ()) -> dict:
    out: dict[str, Any] = {"n": n, "correct": correct, "bind": 100 * correct / n if n else None}
    if n:
        low, high = proportion_ci(correct, n)
        out.update(ci95=[100 * low, 100 * high], half_width=100 * (high - low) / 2)
    if chance:
        out["chance"] = 100 * sum(chance) / len(chance)
    return out


def trace_binding(rows: Sequence[dict], encode, seed: int = 0, judge: Any = None, judge_items: int = 200) -> dict:
    """RQ3 (§4.4) on trace rows: one Bind item per step whose rubric has criteria (binding_item:
    the gold action among up to three other actions of its trajectory), judged by the embedding
    judge (`encode`) and, when `judge` (an OpenAIJudge) is given, by it on `judge_items` items
    drawn with `seed` (Bind, and Spec of the rubric for its own action). Split by the gold action's kind.
    Bind is in %, with the Wilson 95% interval and the chance level (mean 1 / candidates); Spec
    is a mean with its normal 95% half-width; unscored judge items count in `unscored` only."""
    rng = random.Random(seed)
    counts = Counter()
    items = []
    for row in rows:
        actions = [step_action_text(st) for st in row["steps"]]
        for t, st in enumerate(row["steps"]):
            counts["steps"] += 1
            criteria = _criteria(st)
            if not criteria:
                counts["without_criteria"] += 1
                continue
            item = binding_item(actions, t, rng)
            if item is None:
                counts["without_distractor"] += 1
                continue
            items.append({"kind": st.get("action", "invalid"), "criteria": criteria, "candidates": item[0],
                          "gold": item[1], "question": row["question"], "prefix": env.format_history([TraceStep(x) for x in row["steps"][:t]]),
                          "action": actions[t]})
    if isinstance(encode, _CachedEncoder):
        encode.warm([" ".join(i["criteria"]) for i in items] + [c for i in items for c in i["candidates"]])
    picks = [embedding_bind(encode, i["criteria"], i["candidates"]) for i in items]
    kinds = ["all"] + sorted({i["kind"] for i in items})
    group = lambda k: [j for j, i in enumerate(items) if k == "all" or i["kind"] == k]   # noqa: E731
    out: dict[str, Any] = {**counts, "items": len(items), "embedding": {
        k: _proportion(sum(picks[j] == items[j]["gold"] for j in group(k)), len(group(k)),
                       [1 / len(items[j]["candidates"]) for j in group(k)]) for k in kinds}}
    if judge is not None:
        asked = sorted(random.Random(seed).sample(range(len(items)), min(judge_items, len(items))))
        with ThreadPoolExecutor(8) as pool:
            bind = dict(zip(asked, pool.map(lambda j: judge.bind(items[j]["criteria"], items[j]["candidates"]), asked)))
            spec = dict(zip(asked, pool.map(lambda j: judge.spec(items[j]["question"], items[j]["prefix"],
                                                                 items[j]["action"], items[j]["criteria"]), asked)))
        res: dict[str, Any] = {"model": judge.model, "items": len(asked), "bind": {}, "spec": {}}
        for k in kinds:
            idx = [j for j in group(k) if j in bind]
            scored = [j for j in idx if bind[j] is not None]
            res["bind"][k] = {**_proportion(sum(bind[j] == items[j]["gold"] for j in scored), len(scored),
                                            [1 / len(items[j]["candidates"]) for j in scored]),
                              "unscored": len(idx) - len(scored)}
            ratings = [spec[j] for j in idx if spec[j] is not None]
            mean, half = mean_ci(ratings) if ratings else (None, None)
            res["spec"][k] = {"n": len(ratings), "spec": mean, "half_width": half, "unscored": len(idx) - len(ratings)}
        res["counters"] = dict(judge.counters)
        if judge.last_error:
            res["last_error"] = judge.last_error
        out["openai"] = res
    return out


def trace_redundancy(rows: Sequence[dict], encode, threshold: float = 0.8) -> dict:
    """RQ4 (§4.5) on trace rows: `redundancy` of every step's criteria (their embeddings from
    `encode`, their scores d_t), then `redundancy_summary`. Only the criteria μ wrote count: empty
    slots (a rubric with fewer than K criteria, or none parsed) are left out with their d."""
    per_step, without = [], 0
    steps = [st for row in rows for st in row["steps"]]
    pairs = [[(str(c), float(x)) for c, x in zip(st.get("criteria") or [], st.get("d") or []) if str(c).strip()]
             for st in steps]
    if isinstance(encode, _CachedEncoder):
        encode.warm([c for p in pairs for c, _ in p])
    for p in pairs:
        if not p:
            without += 1
            continue
        texts = [c for c, _ in p]
        per_step.append(redundancy(texts, encode(texts), [x for _, x in p], threshold))
    return {**redundancy_summary(per_step), "steps_without_criteria": without}


def heldout_set(run: Run, n_questions: int, samples: int, seed: int, data_dir: str | None):
    """The fixed held-out trajectories with known step labels: the oracle teacher's gold (sample 0)
    and imperfect trajectories (samples 1.. rotate through redundant / wrong-entity / premature /
    wrong-answer) on the first `n_questions` of a seeded dev sample, played in the real
    environment. Returns (trajectories, oracle metas, step labels)."""
    a = run.args
    examples = env.load_split(a["dataset"], "dev", data_dir or a.get("data_dir") or None, n_questions, seed)
    teacher = OracleTeacher(env, seed=seed, obs_chars=a.get("obs_chars") or 400)
    trajs, metas = teacher.rollout([(ex, s) for ex in examples for s in range(samples)], shared_retriever())
    return trajs, metas, [step_usefulness(t) for t in trajs]


def untrained_mu(warm_mu: Path, device: str, seed: int, dtype: str = "auto"):
    """μ before any training: the warmup μ's base backbone and settings, a fresh score head seeded
    by `seed` (ScoreHead's own initialization)."""
    config = json.loads((warm_mu / "config.json").read_text())
    m = config["rubric_model"]
    backbone = models.load_backbone(config["base_model"], device=device, dtype=dtype, engine=ENGINES["fast"])
    torch.manual_seed(seed)
    return rubric_model.RubricModel(backbone, m["k"], m["rubric_mode"], m["head_hidden"], m["static_criteria"],
                                    m.get("examples", 2))


def heldout_scores(mu, trajs, max_new_tokens: int, batch_size: int) -> tuple[list[list[float]], float]:
    """μ's s_t for every step of `trajs` (greedy rubrics, then the score head: Eq. 2), one list per
    trajectory, and the share of rubrics that parsed."""
    contexts = [c for t in trajs for c in rubric_model.contexts_from_trajectory(t)]
    mu.eval()
    with torch.no_grad():
        rubrics = mu.generate_rubrics(contexts, temperature=0.0, max_new_tokens=max_new_tokens, batch_size=batch_size)
        s = mu.score(contexts, rubrics, batch_size=batch_size).s.float().cpu().tolist()
    return [s[r.start:r.stop] for r in env.step_ranges(trajs)], sum(r.parsed for r in rubrics) / max(len(rubrics), 1)


def _finite(x: float) -> float | str:
    """A threshold for JSON: ±inf as the strings '+inf' / '-inf'."""
    return x if x not in (float("inf"), float("-inf")) else ("+inf" if x > 0 else "-inf")


def credit_stage(s: Sequence[Sequence[float]], labels: Sequence[Sequence[bool]], kinds: Sequence[Sequence[str]],
                 rewards: Sequence[float], f1s: Sequence[float], threshold: float = 0.5) -> dict:
    """Credit assignment and the judge lens of one μ on the held-out set: AUC of s_t for useful vs
    useless steps (all, Search steps, Finish steps), mean s_t of each class; Σ_t s_t as a judge of
    R(τ) (pass iff Σ_t s_t > threshold): judge_stats, its AUC for R, Spearman's ρ with F1."""
    flat = [(x, y, k) for st, lt, kt in zip(s, labels, kinds) for x, y, k in zip(st, lt, kt)]
    pick = lambda kind: [(x, y) for x, y, k in flat if kind is None or k == kind]   # noqa: E731
    mean = lambda v: sum(v) / len(v) if v else None                                # noqa: E731
    sums = [sum(st) for st in s]
    truth = [r >= 0.5 for r in rewards]
    out = {f"auc_{name}": auc([x for x, _ in pick(kind)], [y for _, y in pick(kind)])
           for name, kind in (("steps", None), ("search", "search"), ("finish", "finish"))}
    out.update(steps=len(flat), useful=sum(y for _, y, _ in flat),
               mean_s_useful=mean([x for x, y, _ in flat if y]), mean_s_useless=mean([x for x, y, _ in flat if not y]),
               judge={"threshold": threshold, **judge_stats([x > threshold for x in sums], truth)},
               auc_sum_vs_R=auc(sums, truth), spearman_sum_vs_f1=spearman(sums, list(f1s)))
    return out


def training_traces_auc(run: Run) -> list[dict]:
    """Per epoch: the AUC of the s_t recorded in the run's training traces (μ scoring the policy's
    own rollouts) for useful vs useless steps (step_usefulness from the rows' supporting indices)."""
    out = []
    for epoch in run.trace_epochs():
        s, y = [], []
        for row in run.training_traces(epoch):
            if row.get("supporting") is None or not all("s" in st for st in row["steps"]):
                continue
            s += [st["s"] for st in row["steps"]]
            y += step_usefulness(row)
        if s:
            out.append({"epoch": epoch, "steps": len(s), "useful": sum(y), "auc": auc(s, y)})
    return out


def step_count_reference(trajs: Sequence[Any], labels: Sequence[Sequence[bool]]) -> dict:
    """What a scorer that knows only where a step stands reaches (the reference for μ's AUC): the AUC
    of −(steps in the step's trajectory) and of −(the step's position t), each in its better direction
    (max of AUC and 1 − AUC, fitted on the same steps, so a generous reference)."""
    y = [v for lt in labels for v in lt]
    better = lambda a: None if a is None else max(a, 1 - a)                        # noqa: E731
    return {"auc_step_count": better(auc([-len(t.steps) for t in trajs for _ in t.steps], y)),
            "auc_step_position": better(auc([-i for t in trajs for i in range(len(t.steps))], y))}


def crossfit_judge(sums: Sequence[float], truth: Sequence[bool], folds: Sequence[int]) -> dict:
    """μ as a judge with a fitted threshold, out of sample: the trajectories of the held-out set in two
    folds (by question); each fold is judged with best_threshold fitted on the other, and the verdicts
    of both are pooled into one judge_stats. Works for every stage alike (the warmup μ too, which has no
    training traces of its own)."""
    verdicts, thresholds = [False] * len(sums), []
    for f in (0, 1):
        train = [i for i, g in enumerate(folds) if g != f]
        thr = best_threshold([sums[i] for i in train], [truth[i] for i in train]) if train else float("inf")
        thresholds.append(_finite(thr))
        for i, g in enumerate(folds):
            if g == f:
                verdicts[i] = sums[i] > thr
    return {"threshold": thresholds, **judge_stats(verdicts, truth)}


def fitted_threshold(rows: Sequence[dict]) -> dict | None:
    """best_threshold of Σ_t s_t against R(τ) over trace rows that recorded s_t (training data)."""
    scored = [r for r in rows if r["steps"] and all("s" in st for st in r["steps"])]
    if not scored:
        return None
    thr = best_threshold([sum(st["s"] for st in r["steps"]) for r in scored], [r["reward"] >= 0.5 for r in scored])
    return {"threshold": thr, "trajectories": len(scored)}


def diagnose_mu(run: Run, args) -> dict:
    """Credit assignment and the judge lens (see the module docstring) for the untrained μ, the
    warmup μ and μ after each RL epoch of `run`, on the held-out set."""
    trajs, metas, labels = heldout_set(run, args.heldout_questions, args.heldout_samples, args.seed,
                                       args.data_dir or None)
    kinds = [[st.action for st in t.steps] for t in trajs]
    order = {qid: i for i, qid in enumerate(dict.fromkeys(t.example.id for t in trajs))}
    folds = [order[t.example.id] % 2 for t in trajs]              # crossfit_judge's two folds, by question
    rewards = [t.reward for t in trajs]
    f1s = [f1_score(t.answer, t.example.answers) if t.finished else 0.0 for t in trajs]
    heldout = {"dataset": run.args["dataset"], "split": "dev", "questions": args.heldout_questions,
               "samples": args.heldout_samples, "seed": args.seed, "trajectories": len(trajs),
               "steps": sum(len(t.steps) for t in trajs), "useful_steps": sum(map(sum, labels)),
               "reward_1": sum(r >= 0.5 for r in rewards), "variants": dict(Counter(m["variant"] for m in metas)),
               # A reference for "AUC Σs vs R": Σ_t s_t of a μ that gives every step the same small score is
               # the trajectory's length times that score, so its AUC is this one (or 1 minus it).
               "auc_length_vs_R": auc([len(t.steps) for t in trajs], [r >= 0.5 for r in rewards]),
               **step_count_reference(trajs, labels)}
    a = run.args
    stages = [("untrained", -1, None), ("warmup", 0, run.warmup_mu_dir())] + \
        [(f"epoch_{e}", e, p) for e, p in run.mu_dirs()]
    selected_stage = "warmup" if run.checkpoint == "epoch_0" else run.checkpoint
    fit = fitted_threshold(run.training_traces(run.epoch)) if run.epoch > 0 else None
    results = []
    for name, x, folder in stages:
        print(f"[evaluate] credit assignment: scoring {heldout['steps']} held-out steps with the {name} μ",
              flush=True)
        mu = untrained_mu(run.warmup_mu_dir(), args.device, args.seed, args.dtype) if folder is None \
            else rubric_model.RubricModel.load(folder, device=args.device, dtype=args.dtype, engine=ENGINES["fast"])
        s, parse_rate = heldout_scores(mu, trajs, a.get("max_new_tokens_mu") or 128, a.get("gen_batch") or 16)
        del mu
        row = {"stage": name, "x": x,
               "model": str(folder) if folder else f"base backbone, fresh head (seed {args.seed})",
               "rubric_parse_rate": parse_rate, **credit_stage(s, labels, kinds, rewards, f1s),
               "judge_crossfit": crossfit_judge([sum(st) for st in s], [r >= 0.5 for r in rewards], folds)}
        if name == selected_stage and fit is not None:
            row["judge_fitted"] = {"threshold": _finite(fit["threshold"]),
                                   "fitted_on_trajectories": fit["trajectories"],
                                   "fitted_on": f"traces/epoch_{run.epoch}.jsonl",
                                   **judge_stats([sum(st) > fit["threshold"] for st in s], [r >= 0.5 for r in rewards])}
        results.append(row)
    return {"heldout": heldout, "stages": results, "selected_stage": selected_stage,
            "training_traces_auc": training_traces_auc(run)}


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        text = f"{x:.{digits}f}"
        return text[1:] if text.startswith("-") and float(text) == 0 else text   # no "-0.000"
    return str(x)


def diagnostics_markdown(d: dict) -> str:
    """diagnostics.md: every diagnostics table, in the order of the module docstring."""
    lines = [f"# Diagnostics of μ: run `{d['run']}` ({d['dataset']}, checkpoint {d['checkpoint']})", ""]
    if "credit" in d:
        h = d["credit"]["heldout"]
        lines += ["## Credit assignment (held-out oracle trajectories, known step labels)", "",
                  f"{h['trajectories']} trajectories ({h['questions']} dev questions × {h['samples']} samples, seed "
                  f"{h['seed']}; variants {h['variants']}), {h['steps']} steps of which {h['useful_steps']} useful; "
                  f"R = 1 for {h['reward_1']}. AUC of s_t for useful vs useless steps (0.5 = chance); the judge "
                  f"passes a trajectory iff Σ_t s_t > threshold and is compared with R(τ). Reference: the number "
                  f"of steps alone has AUC {_fmt(h.get('auc_length_vs_R'))} for R, so a μ that scores every step "
                  f"alike reaches that AUC (or 1 minus it) with Σ_t s_t. For the step AUC, a scorer that knows only "
                  f"how many steps the trajectory has reaches {_fmt(h.get('auc_step_count'))}, one that knows only the "
                  f"step's position {_fmt(h.get('auc_step_position'))} (each in its better direction).", ""]
        rows = []
        for r in d["credit"]["stages"]:
            rows.append({"μ": r["stage"], "AUC steps": _fmt(r["auc_steps"]), "AUC search": _fmt(r["auc_search"]),
                         "AUC finish": _fmt(r["auc_finish"]), "mean s useful / useless":
                         f"{_fmt(r['mean_s_useful'])} / {_fmt(r['mean_s_useless'])}",
                         "rubrics parsed": _fmt(r["rubric_parse_rate"], 2)})
        lines += [format_table(rows, list(rows[0])), "", "### μ as a reward-free judge of R(τ)", ""]
        rows = []
        for r in d["credit"]["stages"]:
            for key, label in (("judge", ""), ("judge_crossfit", "cross-fitted: "), ("judge_fitted", "fitted: ")):
                if key not in r:
                    continue
                j = r[key]
                thr = j["threshold"]
                thr = " / ".join(map(_fmt, thr)) if isinstance(thr, list) else _fmt(thr)
                rows.append({"μ": r["stage"], "threshold": label + thr,
                             "agreement": _fmt(j["agreement"]), "κ": _fmt(j["kappa"]),
                             "false pass": _fmt(j["false_pass_rate"]), "false fail": _fmt(j["false_fail_rate"]),
                             "AUC Σs vs R": _fmt(r["auc_sum_vs_R"]),
                             "Spearman Σs, F1": _fmt(r["spearman_sum_vs_f1"])})
        lines += [format_table(rows, list(rows[0])), "",
                  "The fitted threshold is best_threshold of Σ_t s_t against R on the checkpoint epoch's training "
                  "traces, applied to that epoch's μ. The cross-fitted one is fitted on the held-out trajectories of "
                  "half the questions and applied to the other half, both ways (the two thresholds shown), for every "
                  "μ alike.", ""]
        tr = d["credit"]["training_traces_auc"]
        if tr:
            lines += ["### AUC of the s_t recorded on the policy's own training rollouts", "",
                      format_table([{"epoch": r["epoch"], "steps": r["steps"], "useful": r["useful"],
                                     "AUC": _fmt(r["auc"])} for r in tr], ["epoch", "steps", "useful", "AUC"]), ""]
    lines += ["## RQ3: step binding (Bind, Spec) on the checkpoint epoch's training traces", "",
              "Bind in % with the Wilson 95% interval; chance = mean of 1 / candidates (a trajectory with few distinct "
              "actions gives fewer than four).", ""]
    rows = []
    for name, r in d["runs"].items():
        b = r.get("binding")
        if not b:
            continue
        for judge in ("embedding", "openai"):
            res = b.get(judge)
            if not res:
                continue
            bind = res if judge == "embedding" else res["bind"]
            for kind, x in bind.items():
                sp = res["spec"].get(kind, {}) if judge == "openai" else {}
                rows.append({"run": name, "epoch": r["epoch"],
                             "judge": "embedding" if judge == "embedding" else res["model"],
                             "steps": kind, "n": x["n"], "Bind %": _fmt(x["bind"], 1),
                             "± 95%": _fmt(x.get("half_width"), 1), "chance %": _fmt(x.get("chance"), 1),
                             "Spec (1–5)": f"{_fmt(sp.get('spec'), 2)} ± {_fmt(sp.get('half_width'), 2)}"
                             if sp else "",
                             "unscored": x.get("unscored", "")})
    lines += [format_table(rows, list(rows[0])) if rows else "No run's traces hold criteria.", ""]
    lines += ["## RQ4: rubric redundancy on the same traces", "",
              "Themes: greedy clusters of a step's criteria by embedding cosine ≥ 0.8; means over steps.", ""]
    rows = [{"run": name, "epoch": r["epoch"], "K": r["k"], "rubric": r["rubric"], "steps": x["steps"],
             "themes": _fmt(x["themes"], 2), "theme ratio": _fmt(x["theme_ratio"], 2),
             "exact dup.": _fmt(x["exact_duplicate_rate"], 3),
             "paraphrase dup.": _fmt(x["paraphrase_duplicate_rate"], 3),
             "score range in a theme": _fmt(x["score_range"], 3)}
            for name, r in d["runs"].items() if (x := r.get("redundancy")) and x["steps"]]
    lines += [format_table(rows, list(rows[0])) if rows else "No run's traces hold criteria.", ""]
    lines += ["## Files", ""] + [f"- `{f}`: {what}" for f, what in d["files"].items()]
    return "\n".join(lines) + "\n"


def diagnose(runs: Sequence[Run], args) -> dict[str, Path]:
    """--diagnose: the μ diagnostics of runs[0], RQ3 / RQ4 of every run with criteria, the plots and
    the page, all written into runs[0]'s folder. Returns {what: path}."""
    run = runs[0]
    out = run.dir
    d: dict[str, Any] = {"run": run.name, "dataset": run.args["dataset"], "checkpoint": run.checkpoint, "runs": {}}
    if args.judge_model:
        OpenAIJudge(args.judge_model)                 # fails here, before any model work, without a key
    d["credit"] = diagnose_mu(run, args)
    encode = _CachedEncoder(shared_retriever().encode)
    for r in runs:
        rows = r.training_traces(r.epoch)
        entry = {"epoch": r.epoch, "k": r.args.get("k"), "rubric": r.args.get("rubric"),
                 "reward": r.args.get("reward"), "trajectories": len(rows)}
        if any(_criteria(st) for row in rows for st in row["steps"]):
            print(f"[evaluate] RQ3 / RQ4 on {r.name}'s traces/epoch_{r.epoch}.jsonl", flush=True)
            judge = OpenAIJudge(args.judge_model) if args.judge_model else None   # counters of this run only
            entry["binding"] = trace_binding(rows, encode, args.seed, judge, args.judge_items)
            entry["redundancy"] = trace_redundancy(rows, encode)
        d["runs"][r.name] = entry
    files = {}
    series = {r.name: dev_em_series(r.metrics()) for r in runs}
    plot_lines(series, out / "dev_em.png", "Dev EM per epoch", "dev EM (%)")
    files["dev_em.png"] = "dev EM per epoch, every --run"
    rewards = {r.name: train_reward_series(r.metrics()) for r in runs}
    plot_lines(rewards, out / "train_reward.png", "Mean R of the training rollouts", "mean R(τ)", ylim=(-0.05, 1.05),
               xlabel="update")
    files["train_reward.png"] = "mean R(τ) of each update's rollouts, every --run"
    traces = {e: run.training_traces(e) for e in run.trace_epochs()}     # read once: the buckets and the page
    buckets = bucket_mean_scores([row for rows in traces.values() for row in rows])
    plot_lines(buckets, out / "bucket_scores.png", "Mean step score per bucket", "mean s_t", ylim=(-1.05, 1.05))
    files["bucket_scores.png"] = f"mean s_t per position bucket and epoch, {run.name}'s training traces"
    stages = d["credit"]["stages"]
    auc_series = {"held-out steps": [(r["x"], r["auc_steps"]) for r in stages],
                  "held-out searches": [(r["x"], r["auc_search"]) for r in stages],
                  "held-out Σs vs R": [(r["x"], r["auc_sum_vs_R"]) for r in stages],
                  "own rollouts (traces)": [(r["epoch"], r["auc"]) for r in d["credit"]["training_traces_auc"]]}
    auc_series = {k: v for k, v in auc_series.items() if any(y is not None for _, y in v)}  # no empty legend
    plot_lines(auc_series, out / "credit_auc.png", "Credit-assignment AUC", "AUC", chance=0.5, ylim=(0.0, 1.0))
    files["credit_auc.png"] = "credit-assignment AUC over training (x = -1 untrained μ, 0 warmup μ, K epoch K)"
    last = max(traces, default=None)
    shown = traces[last][:args.html_trajectories] if traces else []
    title = f"ARCO run {run.name}: training trajectories of epoch {'—' if last is None else last}"
    (out / "trajectories.html").write_text(trajectories_html(shown, title), encoding="utf-8")
    files["trajectories.html"] = f"{len(shown)} training trajectories of the last epoch with rubrics and scores"
    d["figures"] = {"dev_em.png": series, "train_reward.png": rewards, "bucket_scores.png": buckets,
                    "credit_auc.png": auc_series}
    files["diagnostics.json"] = "every number above, and the data of each figure"
    files["diagnostics.md"] = "these tables"
    d["files"] = files
    write_json(out / "diagnostics.json", d)
    (out / "diagnostics.md").write_text(diagnostics_markdown(d), encoding="utf-8")
    return {f: out / f for f in ("diagnostics.md", "diagnostics.json", "dev_em.png", "train_reward.png",
                                 "bucket_scores.png", "credit_auc.png", "trajectories.html")}
