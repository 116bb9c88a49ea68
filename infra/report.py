"""A run's report (plumbing), and the markdown tables every report prints (format_table): report.md — the dev results per epoch, the selected checkpoint, μ at work per update
(with mu.png), a few training trajectories with their rubrics — and memory.json, the resident memory by phase."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from infra.files import read_jsonl, write_json
from infra.memory import MEMORY

def format_table(rows: list[dict], columns: Sequence[str]) -> str:
    """A markdown table of `rows`, one column per key in `columns`; floats get 2 decimals."""
    def cell(v: Any) -> str:
        text = f"{v:.2f}" if isinstance(v, float) else ("" if v is None else str(v))
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_report(run_dir: Path, history: list[dict], sel: dict, args) -> None:
    """report.md: the results per epoch, the selected checkpoint, and a few trajectories with rubrics."""
    write_json(run_dir / "memory.json", MEMORY.rows())      # the resident memory by phase (RESULTS)
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
        for row in read_jsonl(run_dir / "traces" / f"epoch_{last}.jsonl")[:3]:
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
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "update" and "mean_s" in r
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
