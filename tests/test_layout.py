"""The scripts import one way: each only the ones below it (evaluate ← env ← rubric_model ← warmup ← arco
← diagnostics), checked on the source with `ast`, imports inside functions included."""
import ast
from pathlib import Path

ORDER = ["evaluate", "env", "rubric_model", "warmup", "arco", "diagnostics"]
ROOT = Path(__file__).resolve().parent.parent
KNOWN_EXCEPTIONS = {("evaluate", "env")}   # the predictions CLI's data loader, inside evaluate.main


def project_imports(module: str) -> set[str]:
    tree = ast.parse((ROOT / f"{module}.py").read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(ORDER)


def test_imports_flow_one_way():
    upward = {(m, imp) for m in ORDER for imp in project_imports(m) if ORDER.index(imp) >= ORDER.index(m)}
    assert upward == KNOWN_EXCEPTIONS
    assert not any("diagnostics" in project_imports(m) for m in ORDER)    # nothing imports the diagnostics
