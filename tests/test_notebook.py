"""The walkthrough notebook (issue 61): it runs top to bottom on a fresh kernel (executed here on the embedded
models, with the small warmup it makes itself in a fresh folder), calls only public names the five scripts define
(no copy of the algorithm, nothing of infra/ or lab/, no private name), and the committed file holds the outputs
of one real execution with the command, machine and time that produced them."""
import ast
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from test_layout import ROOT, SCRIPTS, defined

NOTEBOOK = ROOT / "notebooks" / "walkthrough.ipynb"


def code_cells(nb) -> list[str]:
    return [c.source for c in nb.cells if c.cell_type == "code"]


def public_names(script: str) -> set[str]:
    """What a script defines at its top level (functions, classes, assignments), public ones only."""
    return {n for n in defined(script) if not n.startswith("_")}


def names_used(sources: list[str]) -> tuple[set[str], set[str]]:
    """(the modules the cells import, every `script.name` they reach)."""
    imported, reached = set(), set()
    for src in sources:
        tree = ast.parse(src)
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                imported |= {a.name for a in n.names}
            elif isinstance(n, ast.ImportFrom):
                imported.add(n.module or "")
                if n.module in SCRIPTS:
                    reached |= {f"{n.module}.{a.name}" for a in n.names}
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in SCRIPTS:
                reached.add(f"{n.value.id}.{n.attr}")
    return imported, reached


def test_the_notebook_calls_only_public_names_the_scripts_define():
    imported, reached = names_used(code_cells(nbformat.read(NOTEBOOK, as_version=4)))
    assert not {m for m in imported if m.split(".")[0] in ("infra", "lab")}, imported
    assert {"arco", "env", "warmup"} <= imported
    stray = {r for r in reached if r.split(".", 1)[1] not in public_names(r.split(".")[0])}
    assert stray == set()
    assert {"arco.sample_trajectories", "arco.annotate", "arco.advantages", "arco.policy_update",
            "arco.rubric_update", "warmup.ensure", "arco.start_from"} <= reached


def test_the_checker_catches_a_private_or_foreign_name():
    """The check above, on cells that reach a private name, a name a script only imports, and infra/."""
    imported, reached = names_used(["import arco\narco._private()\narco.fresh_adapter(x)", "from infra import models"])
    assert {r for r in reached if r.split(".", 1)[1] not in public_names("arco")} == {"arco._private",
                                                                                     "arco.fresh_adapter"}
    assert "infra" in imported


def test_the_committed_notebook_holds_one_real_execution():
    """Every code cell has outputs and none an error; the first cell says the command and the machine, the first code
    cell's output the date, the commit and the package versions, the last one the seconds; the figure it saved is in
    figures/; every section's output says what to notice."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.outputs and not [o for o in c.outputs if o.output_type == "error"], c.source[:80]
            assert c.execution_count is not None
    first = nb.cells[0].source
    assert "make notebook" in first and "CPU" in first
    outputs = [o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert " UTC, commit " in outputs[0] and "torch 2." in outputs[0] and "transformers " in outputs[0]
    assert "this notebook's run:" in outputs[-1] and outputs[-1].rstrip().endswith(" s")
    assert sum("What to notice" in text for text in outputs) >= 5
    assert (ROOT / "figures" / "walkthrough_scores.png").is_file()
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1


def test_the_notebook_runs_top_to_bottom_on_a_fresh_kernel(tmp_path, monkeypatch, data_dir):
    """Executed as a reader's fresh kernel would run it (from notebooks/), with no `make run` warmup: the first cell
    makes the small one in tmp_path; a cell that raises fails the test (nbclient's CellExecutionError)."""
    monkeypatch.setenv("ARCO_WALKTHROUGH_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("ARCO_DATA_DIR", str(Path(data_dir).resolve()))      # the kernel runs in notebooks/
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs = []
    NotebookClient(nb, timeout=1200, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    out = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "making a small one" in out and "s_t = mean_j d_t,j" in out and "decomposition error" in out
    assert (tmp_path / "runs" / "hotpotqa" / "walkthrough-warmup" / "mu_sft" / "config.json").is_file()
