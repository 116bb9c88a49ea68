"""Answer metrics for multi-hop QA, with the official HotpotQA semantics, the scoring of a file of
predictions (paper §4.1), and the command-line helper every script uses (parse_args). Run comparisons
and the diagnostics of μ are in diagnostics.py.

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

A file of predictions, one {"id": "<example id>", "answer": "<text>"} object per line, is scored
by `python env.py --predictions preds.jsonl --dataset hotpotqa [--split dev]` (env.py loads the
split; report_predictions prints a markdown table, overall and per question type, then the JSON).
This file imports nothing of the project.
"""
import argparse
import dataclasses
import json
import math
import os
import re
import string
import sys
import types
import typing
from collections import Counter, defaultdict
from typing import Any, Iterable, Sequence


# --------------------------------------------------------------------------- CLI helper
class UsageError(SystemExit):
    """Something the user can fix — a flag, a path, data, a model that cannot be had offline, a damaged run
    folder. A SystemExit whose code is the message, so that `sys.exit("error: ...")` and this are one kind;
    main_guard prints either as one `error:` line with exit status 2 (argparse's convention)."""

    def __init__(self, message: str):
        super().__init__("error: " + message)


class _Parser(argparse.ArgumentParser):
    def error(self, message):                  # argparse's own errors: one line, no usage block
        raise UsageError(f"{message} (--help lists the flags)")


def check_args(cls: type, args) -> None:
    """Every flag's valid range, declared next to it in `metadata`: numbers are finite and ≥ 0 unless it says
    "min" (None: any), "max", "above" (exclusive minimum) or "below" (exclusive maximum); "path": "dir" or
    "file" must exist when given (a list: each of its values). Raises UsageError naming every bad flag."""
    hints = typing.get_type_hints(cls)
    problems = []
    for f in dataclasses.fields(cls):
        value, meta, flag = getattr(args, f.name), f.metadata, "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if value is None or kind is bool:
            continue
        if kind in (int, float):
            lo, hi = meta.get("min", 0), meta.get("max")
            if not math.isfinite(value):
                problems.append(f"{flag} {value}: must be a finite number")
            elif lo is not None and value < lo:
                problems.append(f"{flag} {value}: must be ≥ {lo}")
            elif hi is not None and value > hi:
                problems.append(f"{flag} {value}: must be ≤ {hi}")
            elif "above" in meta and value <= meta["above"]:
                problems.append(f"{flag} {value}: must be > {meta['above']}")
            elif "below" in meta and value >= meta["below"]:
                problems.append(f"{flag} {value}: must be < {meta['below']}")
        elif meta.get("path"):
            for v in (value if isinstance(value, list) else [value]):
                want = os.path.isdir if meta["path"] == "dir" else os.path.isfile
                if v and not want(os.path.expanduser(v)):
                    problems.append(f"{flag} {v}: no such {'folder' if meta['path'] == 'dir' else 'file'}")
    if problems:
        raise UsageError("; ".join(problems))


def main_guard(main, *errors: type) -> None:
    """Run a script's main(). What the user can fix — a UsageError, a sys.exit("error: ..."), or one of the
    script's `errors` (a data error, a model that cannot be loaded) — is printed as one `error:` line with
    exit status 2; a Ctrl-C that no part of the script catches (one before RL's first batch, say) as one
    `interrupted` line with status 130; any other exception keeps its traceback (a bug). ARCO_TRACEBACK=1 keeps
    it for all."""
    steady_heap()
    try:
        try:
            main()
        except errors as e:
            raise UsageError(str(e)) from e
        except KeyboardInterrupt:
            if os.environ.get("ARCO_TRACEBACK") == "1":
                raise
            print("interrupted: nothing of this step was saved; rerun the same command (a run with --resume) to "
                  "continue from its last checkpoint", file=sys.stderr)
            sys.exit(130)
    except SystemExit as e:
        if not (isinstance(e.code, str) and e.code.startswith("error:")):
            raise
        if os.environ.get("ARCO_TRACEBACK") == "1":
            import traceback
            traceback.print_exc()
        print(" ".join(e.code.split()), file=sys.stderr)
        sys.exit(2)


def build_parser(cls: type, description: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one `--field-name` option per field of dataclass `cls`.

    A field without a default is a required option; `metadata={"help": ...}` is its
    help text, `metadata={"choices": [...]}` its allowed values. Types: str, int, float,
    bool (`--flag` / `--no-flag`), `X | None`, `list[X]` (one or more values; the option
    may be repeated, its values add up).
    """
    hints = typing.get_type_hints(cls)
    parser = _Parser(description=description,  # a docstring keeps its layout
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # `X | None` -> X
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        kw: dict[str, Any] = {"dest": f.name}
        if f.default is not dataclasses.MISSING:
            kw["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            kw["default"] = f.default_factory()
        else:
            kw["required"] = True
        shown = "" if kw.get("default") in (None, "") else f" (default: {kw['default']})"
        kw["help"] = (f.metadata.get("help", "") + shown).replace("%", "%%")
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is list:  # `--x a b` and `--x a --x b` both give [a, b]
            kw["action"], kw["nargs"], kw["type"] = "extend", "+", typing.get_args(kind)[0]
        else:
            kw["type"] = kind
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        parser.add_argument("--" + f.name.replace("_", "-"), **kw)
    return parser


def parse_args(cls: type, argv: Sequence[str] | None = None, description: str | None = None):
    """Parse the command line (or `argv`) into an instance of dataclass `cls`, every value in its range
    (check_args) before any work starts."""
    args = cls(**vars(build_parser(cls, description).parse_args(argv)))
    check_args(cls, args)
    return args


# --------------------------------------------------------------------------- memory by phase (plumbing)
class PhaseMemory:
    """Resident memory by phase (RESULTS' memory profile): a daemon thread reads /proc/self/statm every 20 ms
    and charges each reading to the innermost open phase (`with MEMORY.phase("π SFT"):`). `rows()`: per phase
    name, its peak resident GiB, the resident GiB when it last ended, its seconds and how often it ran.
    Linux only; elsewhere it records nothing."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.stack, self.stats, self.thread = interval, ["between phases"], {}, None
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def rss_gib(self) -> float:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self.page / 2 ** 30
        except OSError:
            return 0.0

    def _charge(self) -> None:
        rss = self.rss_gib()
        st = self._stats(self.stack[-1])
        st["peak_gib"] = max(st["peak_gib"], rss)

    def _stats(self, name: str) -> dict:
        return self.stats.setdefault(name, {"peak_gib": 0.0, "end_gib": 0.0, "seconds": 0.0, "runs": 0})

    def _sample(self) -> None:
        import time
        while True:
            self._charge()
            time.sleep(self.interval)

    def phase(self, name: str):
        import contextlib
        import threading
        import time
        if self.thread is None and os.path.exists("/proc/self/statm"):
            self.thread = threading.Thread(target=self._sample, daemon=True, name="phase-memory")
            self.thread.start()

        @contextlib.contextmanager
        def opened():
            self._charge()
            self.stack.append(name)
            t0 = time.time()
            try:
                yield
            finally:
                self._charge()
                release_memory()         # what the phase freed goes back to the OS before the next one starts
                st = self._stats(name)
                st["end_gib"], st["seconds"], st["runs"] = self.rss_gib(), st["seconds"] + time.time() - t0, st["runs"] + 1
                self.stack.pop()
        return opened()

    def rows(self) -> list[dict]:
        return [{"phase": k, **{m: round(v, 3) for m, v in st.items()}} for k, st in self.stats.items()]


MEMORY = PhaseMemory()


MMAP_THRESHOLD = 4 * 2 ** 20
ONEDNN_KERNELS = 32


def steady_heap() -> None:
    """Blocks of 4 MiB or more (KV caches, a pass's activations) straight from the OS, handed back when freed:
    glibc's default raises this threshold after every freed block up to 32 MiB, so decoding's caches came
    from its heap, and the heap stayed at every round's high-water mark (RESULTS, "memory": a 100-question
    evaluation 5.6 → 4.7 GiB; π SFT and decoding take the same time, within 5%, measured alternately).
    Every script's main sets it (main_guard); a no-op where glibc's mallopt is not there.

    And oneDNN, which runs bf16 matmuls on CPU, keeps the last 1024 kernels it compiled, one per matrix shape
    and about 0.8 MiB each: every new token count compiles new ones, so the autocast path held about 0.8 GiB
    of them (issue 43). ONEDNN_KERNELS keep a decoding step's and a pass's shapes, at the same speed
    (measured); set before the first bf16 matmul, and a user's ONEDNN_PRIMITIVE_CACHE_CAPACITY wins."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_KERNELS))
    import ctypes
    try:
        ctypes.CDLL(None).mallopt(-3, MMAP_THRESHOLD)          # M_MMAP_THRESHOLD (malloc.h)
    except (OSError, AttributeError):
        pass


def release_memory() -> None:
    """Hand freed memory back to the OS. glibc keeps the blocks of freed tensors in its heap, so without this
    a process stays at its biggest phase's footprint and adds the next phase's on top (RESULTS, "memory"):
    the garbage collector first, then glibc's malloc_trim (a no-op where there is none)."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


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


def _average_ranks(values: Sequence[float]) -> list[float]:
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
    rank_sum = sum(r for r, p in zip(_average_ranks(scores), pos) if p)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def auc_by_step_type(scores: Sequence[float], labels: Sequence[bool], kinds: Sequence[str | None]) -> dict:
    """auc of step scores against step labels for the search steps, the finish steps (`kinds`: each step's
    valid action, None for an invalid one) and all of them."""
    return {kind: auc([s for s, k in zip(scores, kinds) if kind in ("all", k)],
                      [y for y, k in zip(labels, kinds) if kind in ("all", k)]) for kind in ("search", "finish", "all")}


def report_predictions(path: str, examples: Sequence, source: str) -> int:
    """`python env.py --predictions FILE --dataset NAME`: score a predictions file against `examples` (the
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
