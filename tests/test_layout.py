"""The layout: a core of flat scripts and a lab on the floor above it (README, "What each file does").

The core imports one way, each file only the ones below it (config ← evaluate ← env ← rubric_model ← fast ← teachers
← warmup ← plumbing ← arco), at the top of the file; the lab (study, probe, diagnostics, benchmark) imports the core
and nothing imports the lab. No core file names what only a study uses, and every core name the lab reaches for is
one the core uses itself or a reader is pointed to. The fast engine sits behind rubric_model's interface; the
algorithm names no machinery; every setting is declared once, with its presets' values beside it. Checked on the
source with `ast`."""
import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

CORE = ["config", "evaluate", "env", "rubric_model", "fast", "teachers", "warmup", "plumbing", "arco"]
LAB = ["study", "probe", "diagnostics", "benchmark"]
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
    return names & set(CORE + LAB)


def test_the_core_imports_one_way_and_never_the_lab():
    every = {(m, imp) for m in CORE + LAB for nested in (False, True) for imp in project_imports(m, nested)}
    assert {(m, imp) for m, imp in every if m in CORE and (imp in LAB or CORE.index(imp) >= CORE.index(m))} == set()
    assert {(m, imp) for m in CORE + LAB for imp in project_imports(m, nested=True)} == set()  # none inside a function
    # the lab: probe builds on study; nothing else of the lab imports the lab
    assert {(m, imp) for m, imp in every if m in LAB and imp in LAB} == {("probe", "study")}


def identifiers(module: str) -> set[str]:
    """Every name the module's code uses or defines (names, attributes, functions, classes, arguments, keywords,
    and the settings it declares), its prose aside."""
    out = set()
    for n in ast.walk(tree(module)):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.keyword) and n.arg:
            out.add(n.arg)
    return out


# What only the credit study uses (issues 33, 41, 53): its oracles, the mixed arm, the fork, the learning curves,
# its statistics, the μ ladder's variants and its probes.
LAB_ONLY = {"ground_truth_scores", "causal_credit", "projection_credit", "mixed", "mixed_advantages", "fork",
            "fork_from", "eval_every", "curve_size", "learning_curve_point", "credit_stats", "credit_summary",
            "ladder", "check_criteria", "criteria_mode", "head_fit", "balance_finishes", "balanced_finishes",
            "policy_samples", "policy_dev_auc", "policy_dev_rollouts", "POLICY_PROBE_QUESTIONS", "Sketch"}


def test_no_core_file_names_what_only_the_study_uses():
    for module in CORE:
        assert identifiers(module) & LAB_ONLY == set(), module


def lab_uses_of_the_core() -> set[tuple[str, str]]:
    """(core module, name) of every core name the lab imports or reads as module.name."""
    out = set()
    for module in LAB:
        t = tree(module)
        aliases = {a.asname or a.name: a.name for n in t.body if isinstance(n, ast.Import) for a in n.names}
        for n in ast.walk(t):
            if isinstance(n, ast.ImportFrom) and n.module in CORE:
                out |= {(n.module, a.name) for a in n.names}
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and aliases.get(n.value.id) in CORE:
                out.add((aliases[n.value.id], n.attr))
    return out


def used_in_the_core(module: str, name: str) -> bool:
    """Is `name` of core `module` used by the core: by another core file, or inside its own file outside its own
    definition?"""
    for other in CORE:
        if other == module:
            continue
        if name in identifiers(other) and re.search(rf"\b{module}\b", (ROOT / f"{other}.py").read_text()):
            return True
    t = tree(module)
    for node in t.body:
        defined = (isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name) or \
            (isinstance(node, (ast.Assign, ast.AnnAssign)) and name in {getattr(x, "id", "") for x in ast.walk(node)})
        if not defined and name in {getattr(x, "id", getattr(x, "attr", None)) for x in ast.walk(node)}:
            return True
    return False


def test_every_core_name_the_lab_uses_is_used_by_the_core_or_shown_to_readers():
    """The core serves the lab only through what it needs itself (or what the README's reading path and
    PORTING.md show a reader): no core function exists for a study alone."""
    shown = (ROOT / "README.md").read_text(encoding="utf-8") + (ROOT / "PORTING.md").read_text(encoding="utf-8")
    lonely = {(m, n) for m, n in lab_uses_of_the_core() if not n.startswith("__") and not used_in_the_core(m, n)
              and f"`{n}`" not in shown and f".{n}`" not in shown}
    assert lonely == set()


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
    assert not any("fast" in project_imports(m, nested) for m in CORE + LAB if m not in ("fast", "warmup")
                   for nested in (False, True))
    warm = tree("warmup")
    assert any(isinstance(n, ast.Import) and [a.name for a in n.names] == ["fast"] for n in warm.body)
    assert not any(isinstance(n, ast.ImportFrom) and n.module == "fast" for n in ast.walk(warm))
    assert not any(isinstance(n, ast.Name) and n.id == "fast" for n in ast.walk(warm))       # names nothing in it


# --------------------------------------------------------------------------- arco.py is Algorithm 1
# The names of the engines (fast.py's machinery) and of data parallelism (torchrun's ranks).
MACHINERY = {"SharedPrefix", "pack", "packed_steps", "packed_hidden", "token_passes", "reference_logq", "backward_prefix",
             "checkpoint", "training_passes", "plain_passes", "fast_passes", "engine", "pass_tokens", "decode",
             "plain_decode", "PromptMemo", "fast",
             "DataParallel", "share", "gather", "sum_gradients", "world", "rank", "mine", "barrier"}
ALGORITHM = ("iteration", "policy_update", "rubric_update", "run")


def arco_functions() -> dict:
    return {n.name: n for n in tree("arco").body if isinstance(n, ast.FunctionDef)}


def test_arco_py_is_algorithm_1_in_700_lines_and_names_no_machinery():
    """Issues 32 and 54: Algorithm 1's knobs, schedule, equations, one iteration, the run and main, each update in
    40 lines; what runs a run is plumbing.py's, which imports nothing from arco.py."""
    assert len((ROOT / "arco.py").read_text(encoding="utf-8").splitlines()) <= 700
    functions = arco_functions()
    assert {"is_dense", "epoch_plan", "reward_to_go", "step_buckets", "bucketed_advantages", "outcome_advantages",
            "policy_loss", "decomposition_loss", "rubric_loss", "annotate", "advantages", "policy_update",
            "rubric_update", "iteration", "run", "select_checkpoint", "main"} <= set(functions)
    for name in ALGORITHM:
        used = {n.id for n in ast.walk(functions[name]) if isinstance(n, ast.Name)} | \
               {n.attr for n in ast.walk(functions[name]) if isinstance(n, ast.Attribute)}
        assert used & MACHINERY == set(), name
    for name in ("policy_update", "rubric_update"):
        assert functions[name].end_lineno - functions[name].lineno + 1 <= 40, name
    assert "arco" not in project_imports("plumbing", False) | project_imports("plumbing", True)


# --------------------------------------------------------------------------- settings: declared once
def settings_classes() -> list[type]:
    """Every dataclass a script's command line is built from (config's layers, each script's *Args)."""
    out = []
    for module in CORE + LAB:
        mod = __import__(module)
        for node in tree(module).body:
            if isinstance(node, ast.ClassDef) and (node.name.endswith("Args") or module == "config") and \
                    dataclasses.is_dataclass(getattr(mod, node.name, None)):
                out.append(getattr(mod, node.name))
    return out


def test_every_setting_is_declared_once():
    """A setting's name appears in one declaration in the whole project: the scripts' Args classes extend
    config's layers and add only their own knobs."""
    declared: dict[str, list[str]] = {}
    for cls in settings_classes():
        for name in cls.__dict__.get("__annotations__", {}):
            declared.setdefault(name, []).append(f"{cls.__module__}.{cls.__name__}")
    assert {n: where for n, where in declared.items() if len(where) > 1} == {}
    assert len(declared) > 100


def test_every_preset_driven_setting_is_declared_with_both_presets_values():
    """from_preset(paper=..., cpu=...) at the declaration of every preset-driven field, and arco.PRESETS read
    from the declarations (config.preset_table), never typed a second time."""
    import arco
    import config
    for module in CORE:
        for node in ast.walk(tree(module)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "from_preset":
                assert {k.arg for k in node.keywords} >= {"paper", "cpu", "help"}, f"{module}.py:{node.lineno}"
    preset_driven = [f for f in dataclasses.fields(arco.Args) if "presets" in f.metadata]
    assert all(f.default is None and set(f.metadata["presets"]) == {"paper", "cpu"} for f in preset_driven)
    assert arco.PRESETS == config.preset_table(arco.Args) and len(arco.PRESETS["paper"]) > 40
    for name in config.PRESET_NAMES:                                      # every one filled from its declaration
        filled = arco.resolve_args(arco.Args(preset=name))
        assert all(getattr(filled, f) == v for f, v in arco.PRESETS[name].items() if f not in ("warmup_size",))


def test_arco_help_lists_fewer_knobs_than_before_and_none_of_the_study():
    """79 options before issue 54 (the study's among them); now the core's only."""
    out = subprocess.run([sys.executable, str(ROOT / "arco.py"), "--help"], capture_output=True, text=True,
                         check=True).stdout
    flags = set(re.findall(r"^  (--[a-z-]+)", out, flags=re.M))
    assert 40 < len(flags) < 79
    assert {f"--{n.replace('_', '-')}" for n in LAB_ONLY} & flags == set()


def test_evaluate_py_holds_only_the_metrics():
    assert top_level_names("evaluate") <= {"_PUNCTUATION", "_ARTICLES", "_SPECIAL", "normalize_answer", "_aliases",
                                           "exact_match", "_f1", "f1_score", "score_predictions", "format_table",
                                           "PredictionError", "_parse_line", "read_predictions", "_average_ranks",
                                           "auc", "report_predictions"}
