"""The scripts import one way: each only the ones below it (evaluate ← env ← rubric_model ← warmup ← arco
← diagnostics), at the top of the file; checked on the source with `ast`."""
import ast
from pathlib import Path

ORDER = ["evaluate", "env", "rubric_model", "warmup", "arco", "diagnostics"]
ROOT = Path(__file__).resolve().parent.parent


def project_imports(module: str, nested: bool) -> set[str]:
    """The project modules `module` imports: at its top level (nested=False), or inside functions."""
    tree = ast.parse((ROOT / f"{module}.py").read_text(encoding="utf-8"))
    top = set(tree.body)
    names = set()
    for node in ast.walk(tree):
        if (node in top) == nested:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(ORDER)


def test_imports_flow_one_way_at_the_top():
    every = {(m, imp) for m in ORDER for nested in (False, True) for imp in project_imports(m, nested)}
    upward = {(m, imp) for m, imp in every if ORDER.index(imp) >= ORDER.index(m)}
    assert upward == set()
    inside = {(m, imp) for m in ORDER for imp in project_imports(m, nested=True)}
    assert inside == set()                              # no project import hides inside a function
    assert not any(imp == "diagnostics" for _, imp in every)    # nothing imports the diagnostics
