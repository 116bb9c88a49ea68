"""The scripts import one way: each only the ones below it (evaluate ← env ← rubric_model ← warmup ← arco
← diagnostics / study / benchmark), at the top of the file; checked on the source with `ast`. Every shared
setting is declared once, with its presets' values beside it, and no script reaches for another's settings."""
import ast
import dataclasses
from pathlib import Path

ORDER = ["evaluate", "env", "rubric_model", "warmup", "arco", "diagnostics", "study", "benchmark"]
TOP = {"diagnostics", "study", "benchmark"}     # the top floor: nothing imports them, nor each other
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
    assert not any(imp in TOP for _, imp in every)      # nothing imports the diagnostics, the study or the benchmarks


# The names of the engines (rubric_model's fast machinery) and of data parallelism (torchrun's ranks).
MACHINERY = {"SharedPrefix", "pack", "packed_steps", "packed_hidden", "token_passes", "reference_logq", "backward_prefix",
             "checkpoint", "training_passes", "plain_passes", "fast_passes", "engine", "pass_tokens",
             "dp", "DataParallel", "share", "gather", "sum_gradients", "world", "rank", "mine", "barrier"}
ALGORITHM = ("iteration", "policy_update", "rubric_update", "run")


def arco_functions() -> dict:
    tree = ast.parse((ROOT / "arco.py").read_text(encoding="utf-8"))
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_the_algorithm_functions_name_no_engine_and_no_rank():
    """Issue 32: Algorithm 1's functions hold its lines and Eq. 3–5, nothing of the engines or of torchrun."""
    functions = arco_functions()
    for name in ALGORITHM:
        used = {n.id for n in ast.walk(functions[name]) if isinstance(n, ast.Name)} | \
               {n.attr for n in ast.walk(functions[name]) if isinstance(n, ast.Attribute)}
        assert used & MACHINERY == set(), name


def test_the_algorithm_reads_in_500_lines_and_each_update_in_40():
    """From the top of arco.py to the end of its algorithm part (knobs, schedule, equations, one iteration,
    the run, checkpoint selection: everything before the "Plumbing" banner), and each update."""
    lines = (ROOT / "arco.py").read_text(encoding="utf-8").splitlines()
    plumbing = next(i for i, line in enumerate(lines) if line.startswith("# Plumbing"))
    functions = arco_functions()
    assert functions["select_checkpoint"].end_lineno < plumbing and plumbing - 1 <= 500
    for name in ("policy_update", "rubric_update"):
        assert functions[name].end_lineno - functions[name].lineno + 1 <= 40, name


# --------------------------------------------------------------------------- settings: declared once, with their presets
def tree(module: str) -> ast.Module:
    return ast.parse((ROOT / f"{module}.py").read_text(encoding="utf-8"))


def test_every_preset_driven_setting_is_declared_once_with_both_presets_values():
    """from_preset(paper=..., cpu=...) at the declaration of every preset-driven field (arco.Args, warmup.Settings),
    no field declared again down a settings hierarchy, and arco.PRESETS read from the declarations."""
    import arco
    import warmup
    for module in ("warmup", "arco"):
        for node in ast.walk(tree(module)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "from_preset":
                assert {k.arg for k in node.keywords} >= {"paper", "cpu", "help"}, f"{module}.py:{node.lineno}"
    for cls in (warmup.Settings, warmup.Args, arco.Args):
        preset_driven = [f for f in dataclasses.fields(cls) if "presets" in f.metadata]
        assert all(f.default is None and set(f.metadata["presets"]) == {"paper", "cpu"} for f in preset_driven)
        for base in cls.__mro__[1:]:
            if dataclasses.is_dataclass(base):
                assert not set(cls.__annotations__) & {f.name for f in dataclasses.fields(base)}, (cls, base)
    assert arco.PRESETS == warmup.preset_table(arco.Args) and len(arco.PRESETS["paper"]) > 40
    assert not any(isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict)
                   and any(getattr(t, "id", "") == "PRESETS" for t in n.targets)
                   for module in ORDER for n in ast.walk(tree(module)))     # no table typed a second time
    for name in warmup.PRESET_NAMES:                                      # every one filled from its declaration
        filled = arco.resolve_args(arco.Args(preset=name))
        assert all(getattr(filled, f) == v for f, v in arco.PRESETS[name].items() if f not in ("warmup_size",))


SCRIPTS = ["rubric_model", "warmup", "arco", "diagnostics", "study", "benchmark"]


def own_fields(module: str) -> set[str]:
    """The fields of the settings `module` defines (its dataclasses named *Args or *Settings: the command line's),
    their bases' included: its own settings hierarchy."""
    mod = __import__(module)
    return {f.name for node in tree(module).body if isinstance(node, ast.ClassDef)
            and node.name.endswith(("Args", "Settings")) for f in dataclasses.fields(getattr(mod, node.name))}


def test_no_script_reads_another_scripts_settings_by_getattr():
    """getattr/hasattr of a setting's name (a field of any script's settings) names one of the module's own
    dataclasses' fields, and no getattr on a script's settings (args, a, settings) hedges with a default."""
    every = set().union(*(own_fields(m) for m in SCRIPTS))
    for module in ORDER:
        mine = own_fields(module) if module in SCRIPTS else set()
        for node in ast.walk(tree(module)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
                continue
            obj, key = node.args[0], node.args[1]
            if isinstance(key, ast.Constant) and key.value in every:
                assert key.value in mine, f"{module}.py:{node.lineno} reads {key.value!r}, not a setting of its own"
            if isinstance(obj, ast.Name) and obj.id in ("args", "a", "settings"):
                assert node.func.id == "getattr" and len(node.args) == 2, f"{module}.py:{node.lineno}"
