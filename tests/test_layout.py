"""The layout (issue 59): the brief's five scripts at the top, each its paper section; the engineering beneath them
in one package (infra/); the lab beside them (lab/). Imports run one way — the package imports no script, the
scripts import the package, the lab imports both, nothing imports the lab — with no circle between files or between
the three places, and no import inside a function. rubric_model.py is mostly μ; arco.py reads Algorithm 1 and
names none of the machinery (engines, torchrun's processes); the fast engine is chosen by name, not registered as an
import's side effect; the lab reaches the core through public names only; every setting is declared once, with
its presets' values beside it. Checked on the source with `ast`."""
import ast
import dataclasses
import importlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["arco", "env", "rubric_model", "warmup", "evaluate"]
INFRA = sorted(f"infra.{p.stem}" for p in (ROOT / "infra").glob("*.py") if p.stem != "__init__")
LAB = sorted(f"lab.{p.stem}" for p in (ROOT / "lab").glob("*.py") if p.stem != "__init__")
ALL = SCRIPTS + INFRA + LAB


def path_of(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def tree(module: str) -> ast.Module:
    return ast.parse(path_of(module).read_text(encoding="utf-8"))


def place(module: str) -> str:
    return module.split(".")[0] if "." in module else "scripts"


def imports(module: str, nested: bool | None = None) -> set[str]:
    """The project modules `module` imports (at its top level, inside functions, or both with nested=None)."""
    t = tree(module)
    top = set(t.body)
    out = set()
    for node in ast.walk(t):
        if nested is not None and (node in top) == nested:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in ("infra", "lab"):                      # from infra import models, passes
                out |= {f"{node.module}.{a.name}" for a in node.names}
            else:
                out.add(node.module)
    return out & set(ALL)


def test_the_top_level_is_the_five_scripts_in_3000_lines():
    top = sorted(p.stem for p in ROOT.glob("*.py"))
    assert top == sorted(SCRIPTS)
    lines = {m: len(path_of(m).read_text(encoding="utf-8").splitlines()) for m in SCRIPTS}
    assert sum(lines.values()) <= 3000, lines
    assert (ROOT / "infra" / "__init__.py").is_file() and (ROOT / "lab" / "__init__.py").is_file()
    assert not [p for p in ROOT.glob("*/*.py") if p.parent.name not in ("infra", "lab", "tests")]   # no further places
    assert not list((ROOT / "infra").glob("*/")) and not [p for p in (ROOT / "lab").iterdir() if p.is_dir()
                                                          and p.name != "__pycache__"]            # flat


def test_imports_run_one_way_with_no_circle():
    edges = {(m, i) for m in ALL for i in imports(m)}
    assert {(m, i) for m in ALL for i in imports(m, nested=True)} == set()          # none inside a function
    between = {(place(m), place(i)) for m, i in edges if place(m) != place(i)}
    assert between <= {("scripts", "infra"), ("lab", "scripts"), ("lab", "infra")}, between   # no place-level circle
    assert not {m for m, i in edges if i.startswith("lab.") and not m.startswith("lab.")}        # nothing imports the lab
    order, left = [], set(ALL)                                        # file level: a topological order exists
    while left:
        ready = {m for m in left if not {i for i in imports(m) if i in left and i != m}}
        assert ready, f"an import circle among {sorted(left)}"
        order += sorted(ready)
        left -= ready


def test_the_package_and_the_lab_import_cleanly_in_any_order():
    """Each module imported first in a fresh process: no hidden order (an import that needs another first)."""
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in reversed(ALL))
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)


# --------------------------------------------------------------------------- each script is its paper section
MU = {"mean_pool", "ScoreHead", "RUBRIC_SYSTEM", "RUBRIC_SYSTEM_SLOTS", "SCORE_ONLY_SYSTEM", "RUBRIC_INSTRUCTION",
      "RUBRIC_INSTRUCTION_SLOTS", "SCORE_ONLY_INSTRUCTION", "RUBRIC_OPENING", "_EXAMPLE_QUESTION", "EXAMPLES",
      "STATIC_CRITERIA", "StepContext", "step_text", "rubric_messages", "score_only_messages", "contexts_from_trajectory",
      "Rubric", "rubric_text", "one_line", "SlotFrame", "_JSON_STRING", "_TEXT_KEYS",
      "_as_criterion", "_json_criteria", "parse_slots", "parse_criteria", "StepScores", "RubricModel",
      "MuSettings", "RUBRIC_MODES", "RUBRIC_FORMATS"}


def defined(module: str) -> dict[str, ast.AST]:
    out = {}
    for node in tree(module).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Name):
                    out[t.id] = node
    return out


def test_rubric_model_py_is_mostly_mu():
    """μ's code — its prompt, the K criteria and their parsing, mean pooling, the score head, RubricModel and what
    an update logs of μ — is at least 60% of the file; the backbone machinery lives in infra/."""
    nodes = defined("rubric_model")
    total = len(path_of("rubric_model").read_text(encoding="utf-8").splitlines())
    mu = sum(n.end_lineno - n.lineno + 1 for name, n in nodes.items() if name in MU)
    assert mu / total >= 0.6, (mu, total)
    assert set(nodes) <= MU | {"MU"}, set(nodes) - MU                        # nothing else is defined there
    assert {"load_backbone", "Backbone", "training_passes", "plain_decode", "save_backbone"} & set(nodes) == set()


# The names of the machinery: the engines and torchrun's processes.
MACHINERY = {"rank", "world", "world_size", "gather", "engine", "ENGINES", "engine_of", "dp", "DataParallel", "share",
             "all_gather_object", "all_reduce", "barrier", "fast", "FAST", "PLAIN", "decode", "plain_decode", "pack",
             "SharedPrefix", "PromptMemo"}


def identifiers(module: str) -> set[str]:
    """Every name the module's code uses or defines (names, attributes, functions, classes, arguments, keywords),
    its prose aside."""
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
        elif isinstance(n, ast.alias):
            out.add(n.asname or n.name)
    return out


def calls(node: ast.AST) -> set[str]:
    """The dotted names a function calls (`env.training_questions`, `make_optimizers`, ...)."""
    return {ast.unparse(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}


def test_arco_py_reads_algorithm_1_and_names_no_machinery():
    """No engine, process rank, world size or gather in arco.py; the algorithm's steps are read there, one line each
    where their body lives: π_sft and μ_sft (warmup.ensure, then start_from's fresh adapters), the training set D
    (env.training_questions), the optimizers (make_optimizers) and μ's annotation (annotate → RubricModel.annotate);
    each update in 40 lines."""
    assert identifiers("arco") & MACHINERY == set()
    fns = defined("arco")
    assert {"is_dense", "epoch_plan", "reward_to_go", "step_buckets", "bucketed_advantages", "outcome_advantages",
            "policy_loss", "decomposition_loss", "rubric_loss", "annotate", "advantages", "policy_update",
            "rubric_update", "start_from", "make_optimizers", "iteration", "run", "select_checkpoint", "main"} <= set(fns)
    run = calls(fns["run"])
    assert {"warmup.ensure", "env.training_questions", "start_from", "make_optimizers", "iteration"} <= run
    start = calls(fns["start_from"])
    assert "fresh_adapter" in start and any(c.startswith("RubricModel.load(") and c.endswith(".fresh_adapter")
                                            for c in start)
    assert "annotate" in calls(fns["iteration"]) and "mu.annotate" in calls(fns["annotate"])
    for name in ("policy_update", "rubric_update"):
        assert fns[name].end_lineno - fns[name].lineno + 1 <= 40, name


def test_the_fast_engine_is_chosen_by_name_not_registered_by_an_import():
    """infra/engines.py names both engines in one literal table; nothing writes into it; the plain engine is
    infra/passes.py's, the fast one infra/fast.py's, and no script imports infra/fast.py (they ask for an engine by
    --engine's name)."""
    engines = tree("infra.engines")
    table = next(n for n in engines.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "ENGINES")
    assert isinstance(table.value, ast.Dict) and [ast.unparse(k) for k in table.value.keys] == ["'fast'", "'plain'"]
    for m in ALL:
        for n in ast.walk(tree(m)):
            assert not (isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) and "ENGINES" in ast.unparse(n)), m
    assert not {m for m in SCRIPTS if "infra.fast" in imports(m)}
    from infra.engines import ENGINES
    from infra.fast import FAST
    from infra.passes import PLAIN
    assert ENGINES == {"fast": FAST, "plain": PLAIN}


def test_evaluate_py_holds_only_the_metrics():
    """EM and F1 with the official semantics, their means over a predictions file, and its command; the file reading
    and the table are the package's."""
    assert set(defined("evaluate")) == {"_PUNCTUATION", "_ARTICLES", "_SPECIAL", "normalize_answer", "_aliases",
                                        "exact_match", "_f1", "f1_score", "score_predictions", "main"}


# --------------------------------------------------------------------------- the lab: one seam, public names
def test_the_lab_uses_no_private_name_of_the_core():
    """No `from core import _name`, no `core._name` in the lab (core: the scripts and infra/)."""
    core = set(SCRIPTS + INFRA)
    private = set()
    for module in LAB:
        t = tree(module)
        aliases = {}
        for n in ast.walk(t):
            if isinstance(n, ast.Import):
                aliases |= {a.asname or a.name: a.name for a in n.names if a.name in core}
            elif isinstance(n, ast.ImportFrom) and n.module:
                for a in n.names:
                    full = f"{n.module}.{a.name}"
                    if full in core:
                        aliases[a.asname or a.name] = full
                    elif n.module in core and a.name.startswith("_"):
                        private.add((module, f"{n.module}.{a.name}"))
        for n in ast.walk(t):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases \
                    and n.attr.startswith("_") and not n.attr.startswith("__"):
                private.add((module, f"{aliases[n.value.id]}.{n.attr}"))
    assert private == set()


def test_the_lab_changes_the_algorithm_only_through_the_registries():
    """The lab's credit arms are registered names (lab/truth.py's scorers, lab/study.py's estimator) that
    arco.Credit chooses; no lab module assigns into arco (no monkeypatching of the algorithm)."""
    import arco
    import lab.study  # noqa: F401  (registers "mixed"; lab.truth registers the oracles)
    assert {"causal", "projection"} <= set(arco.SCORERS) and {"arco", "mixed"} <= set(arco.ESTIMATORS)
    for module in LAB:
        for n in ast.walk(tree(module)):
            if isinstance(n, (ast.Assign, ast.AugAssign)):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    assert not ast.unparse(t).startswith("arco."), (module, ast.unparse(t))


# --------------------------------------------------------------------------- settings: declared once
def settings_classes() -> list[type]:
    """Every dataclass a command line is built from (infra.settings' layers, the scripts' *Settings, each script's
    and program's *Args)."""
    out = []
    for module in ALL:
        mod = importlib.import_module(module)
        for node in tree(module).body:
            if isinstance(node, ast.ClassDef) and (node.name.endswith(("Args", "Settings")) or
                                                   module == "infra.settings") and \
                    dataclasses.is_dataclass(getattr(mod, node.name, None)):
                out.append(getattr(mod, node.name))
    return out


def test_every_setting_is_declared_once():
    declared: dict[str, list[str]] = {}
    for cls in settings_classes():
        for name in cls.__dict__.get("__annotations__", {}):
            declared.setdefault(name, []).append(f"{cls.__module__}.{cls.__name__}")
    assert {n: where for n, where in declared.items() if len(where) > 1} == {}
    assert len(declared) > 100


def test_every_preset_driven_setting_is_declared_with_both_presets_values():
    """from_preset(paper=..., cpu=...) at the declaration of every preset-driven field, and arco.PRESETS read
    from the declarations (infra.settings.preset_table), never typed a second time."""
    import arco
    from infra import settings
    for module in ALL:
        for node in ast.walk(tree(module)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "from_preset":
                assert {k.arg for k in node.keywords} >= {"paper", "cpu", "help"}, f"{module}:{node.lineno}"
    preset_driven = [f for f in dataclasses.fields(arco.Args) if "presets" in f.metadata]
    assert all(f.default is None and set(f.metadata["presets"]) == {"paper", "cpu"} for f in preset_driven)
    assert arco.PRESETS == settings.preset_table(arco.Args) and len(arco.PRESETS["paper"]) > 40
    for name in settings.PRESET_NAMES:                                    # every one filled from its declaration
        filled = arco.resolve_args(arco.Args(preset=name))
        assert all(getattr(filled, f) == v for f, v in arco.PRESETS[name].items() if f not in ("warmup_size",))


# What only the credit study uses (issues 33, 41, 53, 60): none of it is a core name or an arco.py flag.
LAB_ONLY = {"ground_truth_scores", "causal_credit", "projection_credit", "mixed_advantages", "fork", "fork_from",
            "eval_every", "curve_size", "credit_stats", "credit_summary", "ladder", "check_criteria", "criteria_mode",
            "head_fit", "balance_finishes", "balanced_finishes", "policy_samples", "policy_dev_auc",
            "policy_dev_rollouts", "POLICY_PROBE_QUESTIONS", "Sketch", "step_usefulness", "branch_rollouts"}


def test_no_core_file_names_what_only_the_lab_uses_and_arco_help_has_none_of_it():
    for module in SCRIPTS + INFRA:
        assert identifiers(module) & LAB_ONLY == set(), module
    out = subprocess.run([sys.executable, str(ROOT / "arco.py"), "--help"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    flags = set(re.findall(r"^  (--[a-z-]+)", out, flags=re.M))
    assert 40 < len(flags) < 79
    assert {f"--{n.replace('_', '-')}" for n in LAB_ONLY} & flags == set()
