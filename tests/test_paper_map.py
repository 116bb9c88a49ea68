"""The paper → code table is what runs (issue 65). README's table names each equation once, in one of the five
scripts, and no public function of infra/ is named there or computes an equation; and every function the table
names for Eq. 2–7, Alg. 1 lines 28–31 and EM/F1 is what a tiny run computes with — warmup collection and both SFTs,
a sparse and a dense epoch with μ's annotation and both updates, the dev evaluation — on each engine.

How the second is shown: each named function is replaced, in every module that holds it (a `from x import f` copy
included) and in the seam's registries, by a spy that counts its calls and then runs it; one tiny run per engine must
call every one of them. A function some engine bypassed (its own pooling, its own KL, a copy) gets no call and fails
the test, as a patch that raises would, without one run per function."""
import ast
import importlib
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

import arco
from test_arco import tiny_args

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("arco", "env", "rubric_model", "warmup", "evaluate")


def paper_table() -> list[tuple[str, list[str]]]:
    """README's "Paper → code" table: (paper cell, the backticked dotted names of the code cell) per row."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Paper → code", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    return [(paper.strip(), re.findall(r"`([A-Za-z_][\w.]*)`", code)) for paper, code in rows[1:]]


EQUATION = re.compile(r"Eq\. \d|line[s]? (2[3-9]|3[01])\b|EM / F1")


def test_every_equation_is_named_once_in_the_five_scripts():
    rows = [(paper, names) for paper, names in paper_table() if EQUATION.search(paper)]
    assert len(rows) >= 10
    named = [n for _, names in rows for n in names]
    for name in named:
        assert name.split(".")[0] in SCRIPTS + ("RubricModel",), name
    dup = [n for n, k in Counter(named).items() if k > 1]
    assert dup == [], dup                                           # each equation's function named once
    for name in named:                                              # and each resolves
        module, *rest = name.split(".")
        obj = importlib.import_module("rubric_model").RubricModel if module == "RubricModel" else \
            importlib.import_module(module)
        for part in rest:
            obj = getattr(obj, part)


def public_functions(module: str) -> set[str]:
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8"))
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


# What a public function of infra/ may look like an equation by its name and is not (the reason beside it).
NOT_EQUATIONS = {"infra.passes.sequence_logprobs": "log p(response | prompt): the passes' reference definition",
                 "infra.runs.mu_at_work": "what an update logs of μ", "infra.runs.auc": "a statistic the log keeps",
                 "infra.passes.lm_logits": "the LM head's logits", "infra.passes.response_positions": "indexing"}
LOOKS_LIKE = re.compile(r"kl|pool|loss|advantage|bucket|reward|project|score|return|baseline")


def test_no_function_in_infra_is_a_paper_equation():
    """infra/'s public functions against the table's names: none is named there, and none whose name looks like an
    equation's (KL, pooling, losses, advantages, buckets, rewards, projections, scores) but the listed ones."""
    table = {n.split(".")[-1] for _, names in paper_table() if EQUATION.search(_) for n in names}
    infra = {f"infra.{p.stem}": public_functions(f"infra.{p.stem}") for p in (ROOT / "infra").glob("*.py")
             if p.stem != "__init__"}
    assert {(m, f) for m, fs in infra.items() for f in fs if f in table} == set()
    suspicious = {f"{m}.{f}" for m, fs in infra.items() for f in fs if LOOKS_LIKE.search(f)}
    assert suspicious <= set(NOT_EQUATIONS), sorted(suspicious - set(NOT_EQUATIONS))


def spied() -> list[str]:
    """Every function the table names in an equation row (Eq. 2–7, Alg. 1 lines 23–31, EM/F1), as module.name (a
    class's instances are called: its forward), and π_ref: what the tiny run must call."""
    out = []
    for paper, names in paper_table():
        if EQUATION.search(paper) or paper.startswith("Alg. 1 line 1:"):
            for n in names:
                if n.startswith("RubricModel."):
                    n = "rubric_model." + n
                if n in ("rubric_model.ScoreHead",):
                    n += ".forward"
                if n.split(".")[0] in SCRIPTS and n not in ("warmup.ensure", "arco.start_from"):
                    out.append(n)
    return out


def test_the_spied_functions_are_the_tables_equations():
    assert set(spied()) >= {"rubric_model.mean_pool", "rubric_model.ScoreHead.forward", "arco.reward_to_go",
                            "arco.step_buckets", "arco.bucketed_advantages", "arco.outcome_advantages",
                            "arco.token_kl", "arco.reduce_tokens", "arco.reference", "arco.policy_loss",
                            "arco.decomposition_loss", "arco.rubric_loss", "warmup.project_scores",
                            "warmup.rubric_sft_loss", "evaluate.exact_match", "evaluate.f1_score"}


def spy(monkeypatch, target: str, calls: Counter) -> None:
    """Replace the function `target` by a counting spy wherever it is held: its own module (or class), every project
    module that imported it by name, and the seam's registries."""
    module, *path = target.split(".")
    owner = importlib.import_module(module)
    for part in path[:-1]:
        owner = getattr(owner, part)
    real = getattr(owner, path[-1])

    def counted(*a, **k):
        calls[target] += 1
        return real(*a, **k)
    monkeypatch.setattr(owner, path[-1], counted)
    if len(path) == 1:
        for name, mod in list(sys.modules.items()):
            if name.split(".")[0] in SCRIPTS + ("infra", "lab") and mod is not owner:
                for attr, value in list(vars(mod).items()):
                    if value is real:
                        monkeypatch.setattr(mod, attr, counted)
        for table in (arco.SCORERS, arco.ESTIMATORS):
            for key, value in list(table.items()):
                if value is real:
                    monkeypatch.setitem(table, key, counted)


@pytest.mark.parametrize("engine", ["plain", "fast"])
def test_a_tiny_run_computes_with_every_function_the_table_names(tiny_dir, tmp_path, monkeypatch, engine):
    calls: Counter = Counter()
    for target in spied():
        spy(monkeypatch, target, calls)
    # π's actions scripted valid (a search, then a Finish), so that Eq. 3 meets valid steps: the tiny random π writes
    # none; the rest is the tiny run (its own warmup, --class-balance for the release's Eq. 5 weights)
    monkeypatch.setattr(arco, "policy_act", lambda *a, **k: lambda prompts, seeds=None: [
        "Finish[nobody]" if "Observation:" in p[-1]["content"] else "Search[alpha]" for p in prompts])
    arco.main(tiny_args(tiny_dir, tmp_path, engine=engine, class_balance=True))
    missing = [t for t in spied() if not calls[t]]
    assert missing == [], missing
