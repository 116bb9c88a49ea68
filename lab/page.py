"""Sample trajectories as one self-contained HTML page (inline CSS, no script, no external asset): each step's action,
observation, criteria and scores."""
import html
from typing import Any, Sequence

# Sample trajectories as one self-contained HTML page: inline CSS, no script, no external asset.
_PAGE_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
section.traj { border: 1px solid #ccc; border-radius: 6px; padding: .6em 1em; margin: 1em 0; }
.meta { color: #666; font-size: 12px; }
ol.steps > li { margin: .5em 0; padding: .3em .6em; background: #f7f7f7; border-radius: 4px; }
li.invalid { background: #fff4e5; }
code { background: #eee; padding: 0 .25em; border-radius: 3px; }
.obs { color: #555; font-size: 12px; white-space: pre-wrap; margin: .2em 0; }
ul.criteria { margin: .2em 0; padding-left: 1.2em; }
.score { font-family: monospace; font-weight: bold; padding: 0 .3em; border-radius: 3px; }
.pos { color: #0a6b1f; background: #e3f6e7; }
.neg { color: #a4161a; background: #fde4e4; }
.zero { color: #555; background: #eee; }
"""


def _score(x: Any, label: str = "") -> str:
    """A number as a span coloured by its sign (green > 0, red < 0, grey 0); '' when absent."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return ""
    sign = "pos" if x > 0 else "neg" if x < 0 else "zero"
    return f'<span class="score {sign}">{html.escape(label)}{x:+.3f}</span>'


def _step_html(st: dict) -> str:
    e = html.escape
    action = f"{st.get('action', '').capitalize()}[{st.get('argument', '')}]" if st.get("valid", True) \
        else f"invalid ({st.get('reason', '')}): {str(st.get('output', ''))[:200]}"
    head = [f"<code>{e(action)}</code>"]
    if st.get("bucket"):
        head.append(f'<span class="meta">{e(str(st["bucket"]))}</span>')
    head += [_score(st.get(k), f"{k}_t ") for k in ("s", "G", "A")]
    criteria, d = list(st.get("criteria") or []), list(st.get("d") or [])
    items = [f"<li>{_score(d[j] if j < len(d) else None, 'd ')} {e(str(criteria[j])) if j < len(criteria) else ''}"
             f"</li>" for j in range(max(len(criteria), len(d)))]
    parts = [" ".join(h for h in head if h), f'<div class="obs">{e(str(st.get("observation", ""))[:300])}</div>']
    if items:
        parts.append('<ul class="criteria">' + "".join(items) + "</ul>")
    if st.get("rubric_text"):
        parts.append(f'<div class="obs">unparsed rubric: {e(str(st["rubric_text"]))}</div>')
    return f'<li class="step{"" if st.get("valid", True) else " invalid"}">' + "".join(parts) + "</li>"


def trajectories_html(rows: Sequence[dict], title: str = "ARCO sample trajectories") -> str:
    """One HTML page of trace rows (infra.runs.trace_rows): question, gold, answer and R, then each step's
    action, observation head, criteria with d_{t,j}, and s_t, G_t, A_t (Eq. 2–4) coloured by sign.
    Every value is HTML-escaped; the page needs no server, no network and no JavaScript."""
    e = html.escape
    body = []
    for i, row in enumerate(rows, 1):
        gold = row.get("gold", "")
        gold = " | ".join(map(str, gold)) if isinstance(gold, (list, tuple)) else str(gold)
        R = row.get("reward")
        r_cls = "pos" if isinstance(R, (int, float)) and R > 0 else "neg"  # R ∈ {0, 1}: a miss shows red
        where = " · ".join(f"{k} {row[k]}" for k in ("id", "epoch", "batch") if k in row)
        body.append(
            f'<section class="traj"><h2>Trajectory {i} <span class="meta">{e(where)}</span></h2>'
            f"<p><b>Question:</b> {e(str(row.get('question', '')))}</p>"
            f"<p><b>Gold:</b> {e(gold)} &nbsp; <b>Answer:</b> {e(str(row.get('answer', '')))} &nbsp; "
            f'<b>R:</b> <span class="score {r_cls}">{e(str(R))}</span></p>'
            f'<ol class="steps">{"".join(_step_html(st) for st in row.get("steps", []))}</ol></section>')
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
            f"<style>{_PAGE_CSS}</style></head><body><h1>{e(title)}</h1>"
            f'<p class="meta">{len(rows)} trajectories. d: criterion scores; s_t: their mean (Eq. 2); G_t: '
            f"reward-to-go; A_t: advantage (Eq. 3–4). Green &gt; 0, red &lt; 0.</p>"
            + "\n".join(body) + "</body></html>\n")
