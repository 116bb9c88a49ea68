"""Tests of evaluate.py: EM / F1 with the official HotpotQA semantics (§4.1; Alg. 1,
line 23 uses EM as R(τ)), score_predictions, the predictions reader and the CLI.

Every expected number below was worked out by hand, not by running the code.
"""
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infra import memory  # noqa: E402
from evaluate import exact_match, f1_score, normalize_answer, score_predictions  # noqa: E402
from infra.files import PredictionError, read_predictions  # noqa: E402
from infra.report import format_table  # noqa: E402

# (prediction, gold, EM, F1)
CASES = [
    # articles
    ("The Beatles", "beatles", 1.0, 1.0),
    ("an apple", "apple", 1.0, 1.0),
    ("The Who", "Who", 1.0, 1.0),                   # the band name loses its article too
    ("theater", "ater", 0.0, 0.0),                  # 'the' inside a word stays: 'theater' vs 'ater'
    ("the theater", "Theater", 1.0, 1.0),
    ("the", "a", 1.0, 0.0),                         # both normalize to '': EM 1, no token → F1 0
    # punctuation (ASCII only, deleted without inserting a space)
    ("U.S.A.", "USA", 1.0, 1.0),
    ("Lennon's", "Lennons", 1.0, 1.0),
    ("Lennon’s", "Lennons", 0.0, 0.0),              # curly apostrophe is not ASCII punctuation
    ("rock-and-roll", "rock and roll", 0.0, 0.0),   # 'rockandroll' vs 3 tokens: nothing shared
    ("snake_case", "snakecase", 1.0, 1.0),          # '_' is in string.punctuation
    # numbers
    ("1,755", "1755", 1.0, 1.0),
    ("1.5", "15", 1.0, 1.0),                        # the decimal point is punctuation too
    ("in 1755", "1755", 0.0, 2 / 3),                # P 1/2, R 1/1 → 2·(1/2)/(3/2) = 2/3
    # case and whitespace
    ("  New \t York\n", "new york", 1.0, 1.0),
    ("NEW YORK city", "New York", 0.0, 0.8),        # P 2/3, R 2/2 → 2·(2/3)/(5/3) = 4/5
    # yes / no / noanswer rule
    ("yes", "no", 0.0, 0.0),
    ("yes", "yes it is", 0.0, 0.0),                 # would be P 1, R 1/3 → 0.5 without the rule
    ("the answer is no", "no", 0.0, 0.0),           # gold side special; would be 0.5 without it
    ("no", "no", 1.0, 1.0),
    ("No.", "no", 1.0, 1.0),
    ("YES", "yes", 1.0, 1.0),
    ("noanswer", "no answer", 0.0, 0.0),
    # aliases: max over the list
    ("Barack Obama", ["President Obama", "Barack Hussein Obama", "Obama"], 0.0, 0.8),
    # ^ per alias: P 1/2 R 1/2 → 0.5; P 2/2 R 2/3 → 0.8; P 1/2 R 1/1 → 2/3; max 0.8
    ("JFK", ["John F. Kennedy", "JFK"], 1.0, 1.0),
    ("yes", ["no", "yes"], 1.0, 1.0),
    # unicode: no folding
    ("Café", "cafe", 0.0, 0.0),
    ("naïve", "naïve", 1.0, 1.0),
    ("na\u00efve", "nai\u0308ve", 0.0, 0.0),        # composed ï vs i + combining diaeresis
    ("1990–1995", "1990-1995", 0.0, 0.0),           # en dash kept, hyphen deleted: '1990–1995' vs '19901995'
    ("1990–1995", "1990–1995", 1.0, 1.0),
    # empty
    ("", "Paris", 0.0, 0.0),
    ("", "", 1.0, 0.0),                             # official: EM 1 but F1 0 (no common token)
    ("A.", "", 1.0, 0.0),                           # 'a.' → 'a' → '' (article)
    # partial overlap, repeated tokens counted as a multiset
    ("Paris France", "Paris, Texas", 0.0, 0.5),     # P 1/2, R 1/2 → 1/2
    ("Ella Fitzgerald", "Ella Jane Smith", 0.0, 0.4),  # P 1/2, R 1/3 → 2·(1/6)/(5/6) = 0.4
    ("paris paris paris", "paris", 0.0, 0.5),       # common min(3,1)=1: P 1/3, R 1 → 2·(1/3)/(4/3) = 1/2
    ("new york new york", "New York", 0.0, 2 / 3),  # common 2: P 2/4, R 2/2 → 2·(1/2)/(3/2) = 2/3
    ("x y x y z", "x y y w", 0.0, 2 / 3),           # common x1+y2=3: P 3/5, R 3/4 → 2·(9/20)/(27/20) = 2/3
    ("red red blue", "red blue blue", 0.0, 2 / 3),  # common 2: P 2/3, R 2/3 → 2/3
]


@pytest.mark.parametrize("prediction,gold,em,f1", CASES, ids=[f"{i}:{c[0]!r}" for i, c in enumerate(CASES)])
def test_em_f1_cases(prediction, gold, em, f1):
    assert exact_match(prediction, gold) == pytest.approx(em)
    assert f1_score(prediction, gold) == pytest.approx(f1)
    assert isinstance(exact_match(prediction, gold), float) and isinstance(f1_score(prediction, gold), float)


def test_normalize_answer_order_and_examples():
    assert normalize_answer("The  U.S.A.'s theater,\tAN apple!") == "usas theater apple"
    assert normalize_answer("a-the") == "athe"           # punctuation first, so no article is left
    assert normalize_answer("Café – Crème") == "café – crème"
    assert normalize_answer("") == ""


def test_aliases_accept_any_sequence_and_reject_empty():
    assert exact_match("Obama", ("Barack Obama", "Obama")) == 1.0
    for metric in (exact_match, f1_score):
        with pytest.raises(ValueError):
            metric("Paris", [])


# --------------------------------------------------------------------------- score_predictions
@dataclass
class Ex:
    id: str
    answers: list
    type: str


EXAMPLES = [
    Ex("e1", ["Paris"], "bridge"),
    Ex("e2", ["New York City", "NYC"], "bridge"),
    Ex("e3", ["yes"], "comparison"),
    Ex("e4", ["1755"], "comparison"),
    Ex("e5", ["Lyon"], "bridge"),
]
PREDICTIONS = {"e1": "paris", "e2": "New York", "e3": "no", "e4": "in 1755"}  # e5 missing
# e1: EM 1, F1 1. e2: EM 0, F1 vs 'new york city' P 2/2 R 2/3 → 0.8 (vs 'nyc' 0).
# e3: EM 0, F1 0 (yes/no). e4: EM 0, F1 P 1/2 R 1 → 2/3.


def test_score_predictions_means_and_types():
    r = score_predictions(PREDICTIONS, EXAMPLES)
    assert r["n"] == 4 and r["missing"] == 1
    assert r["coverage"] == "4 of 5 examples predicted"
    assert r["em"] == pytest.approx(25.0)                             # 1/4
    assert r["f1"] == pytest.approx(100 * (1 + 0.8 + 0 + 2 / 3) / 4)  # 61.666...
    assert r["by_type"]["bridge"] == pytest.approx({"n": 2, "em": 50.0, "f1": 90.0})
    assert r["by_type"]["comparison"] == pytest.approx({"n": 2, "em": 0.0, "f1": 100 / 3})
    assert list(r["by_type"]) == ["bridge", "comparison"]
    json.dumps(r)  # the CLI prints it


def test_score_predictions_empty_and_unknown():
    r = score_predictions({}, EXAMPLES)
    assert (r["n"], r["missing"], r["em"], r["f1"], r["by_type"]) == (0, 5, 0.0, 0.0, {})
    with pytest.raises(ValueError, match="zz"):
        score_predictions({"e1": "Paris", "zz": "x"}, EXAMPLES)


def test_format_table():
    table = format_table([{"type": "all", "n": 3, "em": 33.3333, "f1": 50.0}, {"type": "a|b", "n": 1}],
                         ["type", "n", "em", "f1"])
    assert table.splitlines() == ["| type | n | em | f1 |", "|---|---|---|---|",
                                  "| all | 3 | 33.33 | 50.00 |", "| a\\|b | 1 |  |  |"]


# --------------------------------------------------------------------------- read_predictions
def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD = '{"id": "a", "answer": "Paris"}'
BAD_LINES = [  # (bad line, words the message must contain); the bad line is line 3
    ("{not json", "not valid JSON"),
    ('["a", "Paris"]', "expected a JSON object"),
    ('"just a string"', "expected a JSON object"),
    ('{"answer": "x"}', "missing field 'id'"),
    ('{"id": "b"}', "missing field 'answer'"),
    ('{"id": "b", "answer": 5}', "field 'answer' must be a string"),
    ('{"id": "b", "answer": null}', "field 'answer' must be a string"),
    ('{"id": 7, "answer": "x"}', "field 'id' must be a string"),
    ('{"id": "a", "answer": "Lyon"}', "duplicate id 'a' (first on line 1)"),
]


@pytest.mark.parametrize("bad,words", BAD_LINES)
def test_read_predictions_errors_name_file_and_line(tmp_path, bad, words):
    path = write(tmp_path / "preds.jsonl", [GOOD, "", bad, GOOD])  # blank line 2 is skipped
    with pytest.raises(PredictionError) as err:
        read_predictions(str(path))
    assert str(err.value).startswith(f"{path}:3: ")
    assert words in str(err.value)


def test_read_predictions_unknown_id(tmp_path):
    path = write(tmp_path / "preds.jsonl", [GOOD, '{"id": "abc", "answer": "x"}'])
    with pytest.raises(PredictionError) as err:
        read_predictions(str(path), known_ids={"a"}, source="hotpotqa/dev")
    assert str(err.value) == f"{path}:2: unknown id 'abc' (not in hotpotqa/dev)"


def test_read_predictions_bad_bytes_and_missing_file(tmp_path):
    path = tmp_path / "preds.jsonl"
    path.write_bytes(GOOD.encode() + b'\n{"id": "b", "answer": "\xff"}\n')
    with pytest.raises(PredictionError, match=r"preds\.jsonl:2: not UTF-8"):
        read_predictions(str(path))
    with pytest.raises(PredictionError, match=r"nope\.jsonl: cannot read"):
        read_predictions(str(tmp_path / "nope.jsonl"))
    assert issubclass(PredictionError, ValueError)


def test_read_predictions_ok(tmp_path):
    path = write(tmp_path / "preds.jsonl", [GOOD, "  ", '{"id": "b", "answer": "", "extra": 1}'])
    assert read_predictions(str(path), known_ids={"a", "b"}) == {"a": "Paris", "b": ""}


# --------------------------------------------------------------------------- python evaluate.py PREDICTIONS GOLD
def hotpot_record(qid, question, answer, qtype):
    return json.dumps({"_id": qid, "question": question, "answer": answer,
                       "supporting_facts": [["Page " + qid, 0]],
                       "context": [["Page " + qid, [f"{answer} is the answer to {qid}.", " Second sentence."]],
                                   ["Other " + qid, ["Unrelated text."]]],
                       "type": qtype, "level": "hard"})


def run_cli(tmp_path, pred_lines, *gold_args, data=None):
    data = data or tmp_path / "data"
    (data / "hotpotqa").mkdir(parents=True, exist_ok=True)
    write(data / "hotpotqa" / "dev.jsonl", [
        hotpot_record("q1", "Where is the Louvre?", "Paris", "bridge"),
        hotpot_record("q2", "Which city is bigger?", "New York City", "comparison"),
        hotpot_record("q3", "Are both rivers in Europe?", "yes", "comparison"),
    ])
    preds = write(tmp_path / "preds.jsonl", pred_lines)
    env = {k: v for k, v in os.environ.items() if k != "ARCO_DATA_DIR"}
    args = gold_args or ("--dataset", "hotpotqa", "--split", "dev", "--data-dir", str(data))
    return subprocess.run([sys.executable, "evaluate.py", str(preds), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300), preds


def test_cli_scores_a_predictions_file_overall_and_per_type(tmp_path):
    """`python evaluate.py PREDICTIONS --dataset hotpotqa` and with the gold file named: the table, then the JSON."""
    lines = ['{"id": "q1", "answer": "The Paris"}', '{"id": "q2", "answer": "New York"}', '{"id": "q3", "answer": "no"}']
    for gold in ((), (str(tmp_path / "data" / "hotpotqa" / "dev.jsonl"),)):
        proc, _ = run_cli(tmp_path, lines, *gold)
        assert proc.returncode == 0, proc.stderr
        table, _, js = proc.stdout.partition("\n\n")
        assert table.splitlines()[:3] == ["| type | n | em | f1 |", "|---|---|---|---|", "| all | 3 | 33.33 | 60.00 |"]
        result = json.loads(js)
        # q1: EM 1, F1 1; q2: EM 0, F1 P 2/2 R 2/3 → 0.8; q3: EM 0, F1 0 (yes/no)
        assert (result["n"], result["missing"]) == (3, 0)
        assert result["em"] == pytest.approx(100 / 3) and result["f1"] == pytest.approx(60.0)
        assert result["by_type"]["bridge"] == pytest.approx({"n": 1, "em": 100.0, "f1": 100.0})
        assert result["by_type"]["comparison"] == pytest.approx({"n": 2, "em": 0.0, "f1": 40.0})
    proc, _ = run_cli(tmp_path, lines[:1])
    assert proc.returncode == 0 and "2 of 3 questions" in proc.stderr and json.loads(
        proc.stdout.partition("\n\n")[2])["missing"] == 2


def test_cli_errors_are_one_line_with_exit_status_2(tmp_path):
    proc, preds = run_cli(tmp_path, ['{"id": "q1", "answer": "Paris"}', "", '{"id": "abc", "answer": "x"}'])
    gold = tmp_path / "data" / "hotpotqa" / "dev.jsonl"
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"error: {preds}:3: unknown id 'abc' (not in {gold})\n"
    proc, _ = run_cli(tmp_path, ['{"id": "q1", "answer": "Paris"}'], str(tmp_path / "nope.jsonl"))
    assert proc.returncode == 2 and "nope.jsonl" in proc.stderr


# The official HotpotQA script (hotpot_evaluate_v1.py of the public repository hotpotqa/hotpot), run once outside this
# project on the 200 pairs below — the first 200 questions of ../shared/data/hotpotqa/dev.jsonl, each with the
# prediction `official_pairs` makes — printed these means (its code is not part of this project).
OFFICIAL_200 = {"em": 0.35, "f1": 0.5281888666888669}


def official_pairs(gold: list[tuple[str, str]]) -> dict[str, str]:
    """A prediction for each (id, gold answer): the answer itself, upper-cased, with an article and a full stop,
    with another question's answer after it, its first word, another question's answer, yes or no, doubled,
    hyphenated, or empty — in turn."""
    out = {}
    for i, (qid, ans) in enumerate(gold):
        other = gold[(i + 7) % len(gold)][1]
        words = ans.split()
        out[qid] = [ans, ans.upper(), f"The {ans}.", f"{ans} ({other})", words[0] if words else "", other,
                    "yes" if ans.lower() != "yes" else "no", f"{ans} {ans}", ans.replace(" ", "-"), ""][i % 10]
    return out


def test_cli_gives_the_official_scripts_em_and_f1_on_200_real_pairs(tmp_path, data_dir):
    """`python evaluate.py` on 200 real HotpotQA dev questions and predictions of every kind the metrics treat apart
    (articles, punctuation, case, partial and wrong answers, yes/no, empty) gives the official script's EM and F1."""
    rows = [json.loads(line) for line in (Path(data_dir) / "hotpotqa" / "dev.jsonl").read_text().splitlines()
            if line.strip()][:200]
    gold = write(tmp_path / "gold.jsonl", [json.dumps(r) for r in rows])
    preds = write(tmp_path / "preds.jsonl", [json.dumps({"id": k, "answer": v})
                                             for k, v in official_pairs([(r["_id"], r["answer"]) for r in rows]).items()])
    proc = subprocess.run([sys.executable, "evaluate.py", str(preds), str(gold)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.partition("\n\n")[2])
    assert result["n"] == 200 and result["missing"] == 0
    assert result["em"] == pytest.approx(100 * OFFICIAL_200["em"], abs=1e-9)
    assert result["f1"] == pytest.approx(100 * OFFICIAL_200["f1"], abs=1e-9)


def test_a_phase_hands_what_it_freed_back_to_the_os(monkeypatch):
    """RESULTS' memory profile: glibc keeps freed tensors' blocks in its heap unless trimmed, so every phase
    ends with memory.release_memory. 3,000 tensors of 64 KiB (below any mmap threshold: heap blocks), all
    freed but the last, which pins the heap's top: after the phase the resident memory is back where it
    started; with the release switched off it stays ~190 MiB higher (the same code checks itself)."""
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("resident memory is read from /proc (Linux)")
    import torch

    def grow_and_free(phases):
        memory.release_memory()          # what earlier tests freed would otherwise absorb the growth
        before = phases.rss_gib()
        with phases.phase("allocate"):
            xs = [torch.ones(16 * 1024) for _ in range(3000)]
            kept = xs[-1]
            del xs
        return before, phases.rss_gib(), phases.stats["allocate"], kept

    before, after, stats, _ = grow_and_free(memory.PhaseMemory())
    assert stats["peak_gib"] - before > 0.15 and stats["runs"] == 1 and stats["seconds"] > 0
    assert after - before < 0.05, (before, after)
    monkeypatch.setattr(memory, "release_memory", lambda: None)
    before, after, _, _ = grow_and_free(memory.PhaseMemory())
    assert after - before > 0.15, "without the release the heap keeps the freed blocks (the test's premise)"


ONEDNN_PROBE = """
import sys
sys.path.insert(0, {root!r})
import torch
from infra import memory
if {capped}:
    memory.steady_heap()
torch.set_num_threads(1)
w, x = torch.randn(1536, 576), torch.randn(400, 576)
before = memory.MEMORY.rss_gib()
with torch.autocast("cpu", dtype=torch.bfloat16):
    for rows in range(20, 420):                    # 400 token counts: 400 matrix shapes
        torch.nn.functional.linear(x[:rows], w)
memory.release_memory()
print(memory.MEMORY.rss_gib() - before)
"""


def test_the_bf16_kernels_oneDNN_keeps_are_capped(monkeypatch):
    """infra.memory.steady_heap caps oneDNN's cache of compiled bf16 matmul kernels (one per matrix shape, about
    0.8 MiB each, 1024 kept by default; every new token count makes new ones): the autocast path held
    0.8 GiB of them (issue 43). A fresh process runs 400 shapes with and without the cap, and the user's
    own ONEDNN_PRIMITIVE_CACHE_CAPACITY is left alone."""
    def growth(capped: bool) -> float:
        env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
        proc = subprocess.run([sys.executable, "-c", ONEDNN_PROBE.format(root=str(ROOT), capped=capped)],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return float(proc.stdout.split()[-1])
    uncapped = growth(False)
    if uncapped < 0.1:
        pytest.skip(f"this CPU's bf16 matmuls keep no kernels per shape ({uncapped:.3f} GiB without the cap)")
    assert growth(True) < uncapped - 0.1, uncapped
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    memory.steady_heap()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"
