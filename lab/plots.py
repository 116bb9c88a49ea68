"""The PNG plots of the diagnostics (matplotlib, Agg canvas, no pyplot state) and the series they draw from a run's
metrics.jsonl and traces. Each returns its Figure so callers can check the data."""
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

import arco

# PNG plots (matplotlib, Agg canvas, no pyplot state). Each returns its Figure so callers can check the data.
_Series = Sequence[tuple[float, float | None]]


def plot_lines(series: dict[str, _Series], path: str | Path, title: str, ylabel: str, chance: float | None = None,
               ylim: tuple[float, float] | None = None, size: tuple[float, float] = (6.4, 4.0), dpi: int = 100,
               xlabel: str = "epoch"):
    """One line per named series of (epoch, value) points (sorted; None values skipped), a dashed
    `chance` line if given, saved as PNG. The report's three: dev EM per epoch of each run (§4.2
    selects the checkpoint by peak dev EM), mean s_t per position bucket (Eq. 3–4), credit AUC."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
    fig = Figure(figsize=size, dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, points in series.items():
        pts = sorted((x, y) for x, y in points if y is not None)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=str(name))
    if chance is not None:
        ax.axhline(chance, linestyle="--", color="grey", label="chance")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return fig


def dev_em_series(metrics: Iterable[dict]) -> list[tuple[int, float]]:
    """(epoch, dev EM) pairs of a run's metrics.jsonl rows (the `kind: eval` ones)."""
    return [(r["epoch"], r["em"]) for r in metrics if r.get("kind") == "eval"]


def train_reward_series(metrics: Iterable[dict]) -> list[tuple[int, float]]:
    """(update number from 1, mean R(τ) of the update's rollouts) of a run's metrics.jsonl rows."""
    return [(i, r["mean_R"]) for i, r in enumerate((r for r in metrics if r.get("kind") == "update"), 1)]


def bucket_mean_scores(rows: Iterable[dict]) -> dict[str, list[tuple[int, float]]]:
    """{bucket: [(epoch, mean s_t)]} over the scored valid steps of trace rows (Eq. 2–4)."""
    sums: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        steps = row.get("steps", [])
        for st, b in zip(steps, arco.step_buckets([x.get("action") for x in steps], [x.get("valid") for x in steps])):
            b = st.get("bucket") or b
            if b is not None and st.get("valid") and isinstance(st.get("s"), (int, float)):
                sums[b][row.get("epoch", 0)].append(st["s"])
    rank = lambda b: (b == "terminal", int(b.rsplit("_", 1)[-1]) if b.rsplit("_", 1)[-1].isdigit() else 0, b)
    order = sorted(sums, key=rank)  # search_1, search_2, …, search_10, terminal
    return {b: [(ep, sum(v) / len(v)) for ep, v in sorted(sums[b].items())] for b in order}
