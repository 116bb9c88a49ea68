"""The documentation names only what exists (issue 59): every backticked dotted name in README.md, PORTING.md and
CHOICES.md — `arco.run`, `infra.parallel.Workers`, `RubricModel.annotate` — resolves against the code (a module,
then attributes; a leading class name is looked up among the project's modules); file names (`report.md`,
`arco.py`) and paths are not dotted names. The README stays under 300 lines, and its layout table lists the
real places and files, each importing only what is listed above it."""
import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "PORTING.md", "CHOICES.md"]
FILE_ENDINGS = (".py", ".md", ".json", ".jsonl", ".png", ".txt", ".html", ".pt", ".yaml", ".safetensors", ".gguf",
                ".lock", ".ipynb", ".sh", ".cfg", ".toml", ".zip")
DOTTED = re.compile(r"`([A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)+)`")
MODULES = ["arco", "env", "rubric_model", "warmup", "evaluate"] + \
    [f"infra.{p.stem}" for p in (ROOT / "infra").glob("*.py") if p.stem != "__init__"] + \
    [f"lab.{p.stem}" for p in (ROOT / "lab").glob("*.py") if p.stem != "__init__"]


def resolve(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):                       # the longest importable module first
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for p in parts[cut:]:
                obj = getattr(obj, p)
            return True
        except AttributeError:
            return dataclass_field(obj, parts[cut:])
    owners = [importlib.import_module(m) for m in MODULES]     # a class (or function) named without its module
    for mod in owners:
        if hasattr(mod, parts[0]) and getattr(getattr(mod, parts[0]), "__module__", None) == mod.__name__:
            obj = getattr(mod, parts[0])
            try:
                for p in parts[1:]:
                    obj = getattr(obj, p)
                return True
            except AttributeError:
                return dataclass_field(getattr(mod, parts[0]), parts[1:])
    return False


def dataclass_field(obj, rest) -> bool:
    """A dataclass's field (`Backbone.engine`, `CreditBatch.trajs`) is named in its annotations, not as an attribute."""
    return len(rest) == 1 and rest[0] in getattr(obj, "__annotations__", {})


# PORTING.md's verl table names verl's own configuration keys (`data.train_batch_size`, `trainer.test_freq`):
# another project's, not ours to resolve.
VERL_CONFIG = ("actor_rollout_ref.", "custom_reward_function.", "data.", "rollout.", "trainer.", "actor.")


def dotted_names(text: str) -> set[str]:
    return {m for m in DOTTED.findall(text) if not m.endswith(FILE_ENDINGS) and not m.startswith(("e.g", "i.e"))
            and not m.startswith(VERL_CONFIG)}


@pytest.mark.parametrize("doc", DOCS)
def test_every_backticked_dotted_name_resolves(doc):
    names = dotted_names((ROOT / doc).read_text(encoding="utf-8"))
    assert names, doc
    assert {n for n in sorted(names) if not resolve(n)} == set()


def test_the_resolver_tells_a_real_name_from_a_stale_one():
    assert resolve("arco.run") and resolve("infra.parallel.Workers.map") and resolve("RubricModel.annotate")
    assert resolve("CreditBatch.trajs") and resolve("lab.study.ARMS") and resolve("torch.autocast")
    assert not resolve("plumbing.build_models") and not resolve("arco.Credit.after_update")
    assert not resolve("rubric_model.load_backbone") and not resolve("RubricModel.no_such_method")


def test_the_readme_is_short_and_its_layout_table_is_the_import_order():
    """The README's layout table lists the five scripts and every module of infra/ and lab/ (by its file), in an
    order where each file imports only files above it (the import test's order, as a reader meets it)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    section = readme[readme.index("## Layout"):readme.index("\n## ", readme.index("## Layout") + 5)]
    listed = re.findall(r"^\| `([\w/]+\.py)` \|", section, flags=re.M)
    files = sorted(["arco.py", "env.py", "rubric_model.py", "warmup.py", "evaluate.py"] +
                   [f"infra/{p.name}" for p in (ROOT / "infra").glob("*.py") if p.stem != "__init__"] +
                   [f"lab/{p.name}" for p in (ROOT / "lab").glob("*.py") if p.stem != "__init__"])
    assert sorted(listed) == files
    module = lambda f: f[:-3].replace("/", ".")                                        # noqa: E731
    for i, f in enumerate(listed):
        t = ast.parse((ROOT / f).read_text(encoding="utf-8"))
        used = set()
        for n in ast.walk(t):
            if isinstance(n, ast.Import):
                used |= {a.name for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module:
                used |= {f"{n.module}.{a.name}" for a in n.names} if n.module in ("infra", "lab") else {n.module}
        assert used & {module(g) for g in listed[i + 1:]} == set(), f


# In the code's own words — docstrings, comments — and the walkthrough's markdown: a dotted name of the project
# (`module.name`, backticked or not) must exist too (issue 66: stale names such as arco's former
# `training_questions` survived the moves that README's own names were checked through).
PROJECT_NAME = re.compile(r"(?<![\w.`/])((?:arco|env|rubric_model|warmup|evaluate|infra|lab)(?:\.[A-Za-z_]\w*)+)")


def names_in(text: str) -> set[str]:
    return dotted_names(text) | {m for m in PROJECT_NAME.findall(text) if not m.endswith(FILE_ENDINGS)}


def code_words(path: Path):
    """The docstrings (module, classes, functions) and the comments of a source file, with their line numbers."""
    import io
    import tokenize
    source = path.read_text(encoding="utf-8")
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(n, clean=False):
            yield getattr(n, "lineno", 1), ast.get_docstring(n, clean=False)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def stale_names(path: Path) -> set[str]:
    if path.suffix == ".ipynb":
        import json
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        texts = [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "markdown"]
    else:
        texts = list(code_words(path))
    return {f"{path.name}:{where}: {n}" for where, text in texts for n in names_in(text) if not resolve(n)}


@pytest.mark.parametrize("path", [ROOT / f"{m.replace('.', '/')}.py" for m in MODULES] +
                         [ROOT / "notebooks" / "walkthrough.ipynb"], ids=lambda p: p.name)
def test_every_name_the_code_and_the_notebook_write_resolves(path):
    assert stale_names(path) == set()


def test_a_stale_name_in_a_docstring_or_the_notebook_is_caught(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('"""Uses arco.reward_to_go and `infra.runs.no_such_name`."""\n# and env.gone_now\nx = 1\n')
    assert {s.split(": ")[1] for s in stale_names(source)} == {"infra.runs.no_such_name", "env.gone_now"}
    notebook = tmp_path / "n.ipynb"
    notebook.write_text('{"cells": [{"cell_type": "markdown", "source": ["calls `arco.no_such_step`"]}]}')
    assert {s.split(": ")[1] for s in stale_names(notebook)} == {"arco.no_such_step"}
