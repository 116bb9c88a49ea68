"""Answer metrics for multi-hop QA, with the official HotpotQA semantics, and the scoring of a file of predictions
(paper §4.1). Run comparisons and the diagnostics of μ are the lab's (lab/diagnostics.py).

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

    python evaluate.py preds.jsonl ../shared/data/hotpotqa/dev.jsonl     # EM/F1 of a file of {"id", "answer"} lines
    python evaluate.py preds.jsonl --dataset hotpotqa [--split dev]      # the same, the gold file found as arco.py finds it

Reading the two files is the package's (infra/files.py, infra/data.py); the lab's diagnostics go further.
"""
import argparse
import json
import re
import string
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

from infra.data import GENERATED, DataError, find_data_file, gold_answers
from infra.files import PredictionError, read_predictions
from infra.report import format_table
from infra.settings import DATASETS, main_guard


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


def main(argv: Sequence[str] | None = None) -> None:
    """`python evaluate.py PREDICTIONS GOLD` (or `--dataset NAME [--split dev]` for GOLD): EM and F1 of a predictions
    file against a gold file, over the gold questions that have a prediction (the others counted as missing),
    overall and per question type: a markdown table, then the JSON."""
    parser = argparse.ArgumentParser(prog="python evaluate.py", description=main.__doc__)
    parser.add_argument("predictions", help='a JSONL file of {"id": ..., "answer": ...} lines')
    parser.add_argument("gold", nargs="?", help="the gold questions: a data file in its official layout (HotpotQA, "
                                                "2WikiMultiHopQA, MuSiQue; JSON or JSONL)")
    parser.add_argument("--dataset", choices=[d for d in DATASETS if d not in GENERATED], help="instead of GOLD: the dataset's file, looked for in "
                                                            "--data-dir, then $ARCO_DATA_DIR")
    parser.add_argument("--split", default="dev", choices=["train", "dev"], help="with --dataset (default dev)")
    parser.add_argument("--data-dir", default="", help="with --dataset: the folder holding <dataset>/<split>.jsonl")
    args = parser.parse_args(argv)
    if (args.gold is None) == (args.dataset is None):
        parser.error("give a GOLD file or --dataset, one of the two")
    path = Path(args.gold) if args.gold else find_data_file(args.dataset, args.split, args.data_dir or None)
    gold = gold_answers(path)
    result = score_predictions(read_predictions(args.predictions, {g.id for g in gold}, str(path)), gold)
    if result["missing"]:
        print(f"warning: {result['missing']} of {len(gold)} questions in {path} have no prediction; the scores are "
              f"over the {result['n']} predicted", file=sys.stderr)
    rows = [{"type": "all", **result}] + [{"type": t, **r} for t, r in result["by_type"].items()]
    print(format_table(rows, ["type", "n", "em", "f1"]))
    print()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main_guard(main, DataError, PredictionError)
