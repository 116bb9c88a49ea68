"""Answer metrics for multi-hop QA, with the official HotpotQA semantics, the scoring of a file of
predictions (paper §4.1), and the AUC the run's log and the studies report. Run comparisons and the
diagnostics of μ are the lab's (lab/diagnostics.py).

Paper: §4.1 reports Exact Match (EM) and token-level F1 on every dataset; Algorithm 1,
line 23 uses EM as the trajectory reward R(τ) ∈ {0, 1}. Both metrics are computed here
exactly as the official HotpotQA evaluation script defines them (the SQuAD answer
normalization plus HotpotQA's yes/no rule for F1), so numbers are comparable with the
paper's tables:

  normalize: lowercase → drop ASCII punctuation (`string.punctuation`) → drop the words
             a / an / the → fold runs of whitespace to one space.
  EM:        1 if the normalized strings are equal, else 0.
  F1:        harmonic mean of token precision and recall over the normalized tokens,
             counting repeated tokens (multiset intersection); 0 when the two sides
             share no token, and 0 when either side normalizes to 'yes', 'no' or
             'noanswer' and the two differ.

Where a question has several gold answers (aliases, e.g. MuSiQue's `answer_aliases`),
each metric is the maximum over them.

`python -m lab.diagnostics --predictions preds.jsonl --dataset hotpotqa [--split dev]` scores a file of {"id",
"answer"} lines (report_predictions: a table overall and per question type, then the JSON). Imports nothing of the
project.
"""
import json
import re
import string
import sys
import typing
from collections import Counter, defaultdict
from typing import Any, Iterable, Sequence


# --------------------------------------------------------------------------- metrics
_PUNCTUATION = set(string.punctuation)  # ASCII only: en dash, curly quotes, ¿ ... are kept
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_SPECIAL = ("yes", "no", "noanswer")  # HotpotQA: F1 gives no partial credit on these


def normalize_answer(s: str) -> str:
    """Official HotpotQA / SQuAD normalization: lower → drop punctuation → drop articles
    → fold whitespace.

    There is no unicode folding: 'Café' stays 'café' (≠ 'cafe'), a composed 'ï' differs
    from 'i' + combining diaeresis, and non-ASCII marks such as the en dash '–' or the
    curly apostrophe '’' are not punctuation. Punctuation is deleted, not replaced by a
    space, so 'U.S.A.' → 'usa', '1,755' → '1755' but 'rock-and-roll' → 'rockandroll'.
    """
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _aliases(gold: str | Sequence[str]) -> list[str]:
    aliases = [gold] if isinstance(gold, str) else list(gold)
    if not aliases:
        raise ValueError("empty list of gold answers")
    return aliases


def exact_match(prediction: str, gold: str | Sequence[str]) -> float:
    """1.0 if the normalized prediction equals a normalized gold answer, else 0.0.

    `gold` is one answer or a list of aliases (max over them). Alg. 1, line 23: this is
    the reward R(τ). Note EM('', '') = 1: two answers that normalize to nothing agree.
    """
    pred = normalize_answer(prediction)
    return max(float(pred == normalize_answer(g)) for g in _aliases(gold))


def _f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if (pred in _SPECIAL or ref in _SPECIAL) and pred != ref:
        return 0.0
    pred_tokens, ref_tokens = pred.split(), ref.split()
    common = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, gold: str | Sequence[str]) -> float:
    """Token-level F1 between the normalized prediction and gold answer (max over aliases).

    Tokens are counted with multiplicity. As in the official script, F1 is 0 when no
    token is shared -- so F1('', '') = 0 although EM('', '') = 1 -- and 0 when either
    side normalizes to 'yes', 'no' or 'noanswer' and the two differ (F1('yes',
    'yes it is') = 0).
    """
    return max(_f1(prediction, g) for g in _aliases(gold))


def score_predictions(predictions: dict[str, str], examples: Iterable[Any]) -> dict:
    """Mean EM and F1 (in %) of `predictions` {id: answer} over `examples`.

    Each example has `.id`, `.answers` (gold first, then aliases) and `.type`. Only
    examples with a prediction are scored; the others are counted in `missing` (and in
    `coverage`), never silently scored as 0. A prediction for an id not among the
    examples is an error (ValueError). With nothing to score, em and f1 are 0.0 and n 0.
    """
    examples = list(examples)
    known = {ex.id for ex in examples}
    unknown = [i for i in predictions if i not in known]
    if unknown:
        raise ValueError(f"{len(unknown)} predicted id(s) not among the examples, e.g. {unknown[0]!r}")
    scores = defaultdict(list)  # type -> [(em, f1), ...]
    for ex in examples:
        if ex.id in predictions:
            pred = predictions[ex.id]
            scores[ex.type].append((exact_match(pred, ex.answers), f1_score(pred, ex.answers)))

    def summary(pairs: list[tuple[float, float]]) -> dict:
        n = len(pairs)
        return {"n": n, "em": 100 * sum(p[0] for p in pairs) / max(n, 1),
                "f1": 100 * sum(p[1] for p in pairs) / max(n, 1)}

    result = summary([p for pairs in scores.values() for p in pairs])
    result["missing"] = len(examples) - result["n"]
    result["coverage"] = f"{result['n']} of {len(examples)} examples predicted"
    result["by_type"] = {t: summary(scores[t]) for t in sorted(scores, key=str)}
    return result


def format_table(rows: list[dict], columns: Sequence[str]) -> str:
    """A markdown table of `rows`, one column per key in `columns`; floats get 2 decimals."""
    def cell(v: Any) -> str:
        text = f"{v:.2f}" if isinstance(v, float) else ("" if v is None else str(v))
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- predictions file
class PredictionError(ValueError):
    """A predictions file that cannot be scored; the message names the file and line."""


def _parse_line(raw: bytes) -> tuple[str, str] | None:
    """(id, answer) of one predictions line, None for a blank one; ValueError if bad."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f'expected a JSON object {{"id": ..., "answer": ...}}, got {type(record).__name__}')
    for key in ("id", "answer"):
        if key not in record:
            raise ValueError(f"missing field {key!r}")
        if not isinstance(record[key], str):
            raise ValueError(f"field {key!r} must be a string, got {json.dumps(record[key])}")
    return record["id"], record["answer"]


def read_predictions(path: str, known_ids: typing.Container[str] | None = None,
                     source: str = "the dataset") -> dict[str, str]:
    """Read a JSONL file of {"id": ..., "answer": ...} objects into {id: answer}.

    Blank lines are skipped; other fields are ignored. Raises PredictionError, with a
    message 'FILE:LINE: what is wrong', on the first line that is not valid UTF-8 JSON,
    not an object, lacks "id" or "answer", has a non-string id or answer, repeats an
    earlier id, or (when `known_ids` is given) names an id not in `source`.
    """
    try:
        with open(path, "rb") as f:
            raw_lines = f.read().split(b"\n")
    except OSError as e:
        raise PredictionError(f"{path}: cannot read predictions ({e.strerror})") from None
    predictions: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(raw_lines, 1):
        try:
            parsed = _parse_line(raw)
            if parsed is None:
                continue
            pid, answer = parsed
            if pid in first_line:
                raise ValueError(f"duplicate id {pid!r} (first on line {first_line[pid]})")
            if known_ids is not None and pid not in known_ids:
                raise ValueError(f"unknown id {pid!r} (not in {source})")
        except ValueError as e:
            raise PredictionError(f"{path}:{lineno}: {e}") from None
        first_line[pid] = lineno
        predictions[pid] = answer
    return predictions


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


def report_predictions(path: str, examples: Sequence, source: str) -> int:
    """`python -m lab.diagnostics --predictions FILE --dataset NAME`: score a predictions file against `examples` (the
    split env.py loaded), print the markdown table (overall, then per question type) and the JSON; returns
    the exit status (2 with the file's first error on stderr)."""
    try:
        predictions = read_predictions(path, {ex.id for ex in examples}, source)
    except PredictionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = score_predictions(predictions, examples)
    if result["missing"]:
        print(f"warning: {result['missing']} of {len(examples)} examples in {source} have no "
              f"prediction; scores are over the {result['n']} predicted", file=sys.stderr)
    rows = [{"type": "all", **result}] + [{"type": t, **s} for t, s in result["by_type"].items()]
    print(format_table(rows, ["type", "n", "em", "f1"]))
    print()
    print(json.dumps(result, indent=2))
    return 0
