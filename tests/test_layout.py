"""The scripts import one way: each only the ones below it (evaluate ← env ← rubric_model ← fast ← warmup ← arco ←
diagnostics / study / benchmark), at the top of the file; checked on the source with `ast`. The fast engine
(fast.py) sits behind rubric_model's interface: warmup.py imports it only to register it, and nothing above names
it. Every shared setting is declared once, with its presets' values beside it, and no script reaches for another's
settings. The reading path stays short."""
import ast
import dataclasses
from pathlib import Path

ORDER = ["evaluate", "env", "rubric_model", "fast", "warmup", "arco", "diagnostics", "study", "benchmark"]
TOP = {"diagnostics", "study", "benchmark"}     # the top floor: nothing imports them, nor each other
ROOT = Path(__file__).resolve().parent.parent


def tree(module: str) -> ast.Module:
    return ast.parse((ROOT / f"{module}.py").read_text(encoding="utf-8"))


def project_imports(module: str, nested: bool) -> set[str]:
    """The project modules `module` imports: at its top level (nested=False), or inside functions."""
    t = tree(module)
    top = set(t.body)
    names = set()
    for node in ast.walk(t):
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


# --------------------------------------------------------------------------- the fast engine behind the interface
# What fast.py holds (issue 42): every packing, shared-prefix, memo and decoder function.
FAST = {"common_prefix_length", "_cache", "_growing_layer_class", "SharedPrefix", "Packed", "pack", "packed_hidden",
        "StepPass", "packed_steps", "_next_token_logits", "reference_logq", "token_passes", "fast_passes",
        "PREFILL_TOKENS", "PromptMemo", "_rows_packed", "_rows_from_memo", "_prefill", "decode", "check_supported"}


def top_level_names(module: str) -> set[str]:
    names = set()
    for node in tree(module).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def test_the_fast_engine_lives_in_fast_py_and_only_warmup_imports_it_to_register_it():
    assert FAST <= top_level_names("fast") and not FAST & top_level_names("rubric_model")
    # arco.py, study.py, diagnostics.py and benchmark.py do not import fast.py (benchmark.py times the engines
    # through rubric_model's interface, the backbone's --engine choosing; arco.py's imports register "fast")
    assert not any("fast" in project_imports(m, nested) for m in ("arco", "study", "diagnostics", "benchmark")
                   for nested in (False, True))
    warm = tree("warmup")
    assert any(isinstance(n, ast.Import) and [a.name for a in n.names] == ["fast"] for n in warm.body)
    assert not any(isinstance(n, ast.ImportFrom) and n.module == "fast" for n in ast.walk(warm))
    assert not any(isinstance(n, ast.Name) and n.id == "fast" for n in ast.walk(warm))       # names nothing in it


def test_rubric_model_is_the_two_head_model_in_1320_lines():
    """No packing, prefix, memo, decoder or benchmark code left in it: those are fast.py's and benchmark.py's.
    (1300 until issue 43 added Backbone.autocast's bf16 weight copies, which both engines use.)"""
    lines = (ROOT / "rubric_model.py").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 1320
    assert not {"benchmark", "best_times", "parse_rate", "memory_estimate"} & top_level_names("rubric_model")


# --------------------------------------------------------------------------- the algorithm names no machinery
# The names of the engines (fast.py's machinery) and of data parallelism (torchrun's ranks).
MACHINERY = {"SharedPrefix", "pack", "packed_steps", "packed_hidden", "token_passes", "reference_logq", "backward_prefix",
             "checkpoint", "training_passes", "plain_passes", "fast_passes", "engine", "pass_tokens", "decode",
             "plain_decode", "PromptMemo", "fast",
             "dp", "DataParallel", "share", "gather", "sum_gradients", "world", "rank", "mine", "barrier"}
ALGORITHM = ("iteration", "policy_update", "rubric_update", "run")


def arco_functions() -> dict:
    return {n.name: n for n in tree("arco").body if isinstance(n, ast.FunctionDef)}


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


# --------------------------------------------------------------------------- the reading path (README)
# What the README's "Reading path" lists, in its order: from `python arco.py` to Eq. 7 with --engine plain.
# "arco" is arco.py from its top to the "Plumbing" banner; the others are functions and classes (Class.method).
READING_PATH = [
    ("arco", None),
    ("rubric_model", "generate"), ("rubric_model", "policy_act"), ("rubric_model", "plain_decode"),
    ("rubric_model", "end_of_reply"), ("rubric_model", "engine_of"),
    ("rubric_model", "training_passes"), ("rubric_model", "Pass"), ("rubric_model", "plain_passes"),
    ("rubric_model", "last_hidden_states"), ("rubric_model", "lm_logits"), ("rubric_model", "token_kl"),
    ("rubric_model", "reference"), ("rubric_model", "reduce_tokens"),
    ("rubric_model", "RubricModel.step_scores"), ("rubric_model", "ScoreHead"),
    ("rubric_model", "RubricModel.annotate"),
    ("warmup", "project_scores"), ("warmup", "rubric_sft_loss"), ("warmup", "rubric_sft_passes"),
    ("warmup", "rubric_sft_backward"), ("warmup", "policy_sft_backward"),
]


def reading_path_lines() -> dict:
    """Each entry of READING_PATH → its number of lines (from the source, with ast)."""
    out = {}
    for module, name in READING_PATH:
        if name is None:
            lines = (ROOT / f"{module}.py").read_text(encoding="utf-8").splitlines()
            out[(module, name)] = next(i for i, line in enumerate(lines) if line.startswith("# Plumbing"))
            continue
        scope = tree(module).body
        for part in name.split("."):
            node = next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
            scope = node.body
        out[(module, name)] = node.end_lineno - node.lineno + 1
    return out


def test_the_reading_path_is_at_most_1200_lines_and_never_enters_fast_py():
    counts = reading_path_lines()
    assert sum(counts.values()) <= 1200, counts
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Reading path"):readme.index("## Paper → code")]
    named = {name.split(".")[-1] for _, name in READING_PATH if name}
    assert {n for n in named if f"`{n}`" not in section and f".{n}`" not in section} == set()   # the README's list
    assert not {name for module, name in READING_PATH if module == "fast"}
    assert not {name for _, name in READING_PATH} & FAST                    # nor a name of its machinery


# --------------------------------------------------------------------------- settings: declared once, read by their own
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
