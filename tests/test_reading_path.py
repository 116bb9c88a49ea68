"""The README's reading path, counted on what the code runs: every function and method of the core (the five scripts
and infra/) that `python arco.py --engine plain` executes for Algorithm 1 (a tiny run on the synthetic worlds, its
warmup made before), loading and file I/O aside (READING_EXCLUDES: parsing the command line, loading data and
models, writing logs, traces, checkpoints and the report, Ctrl-C, the memory profile). Each function counts whole,
as a reader reads it; the README states the total and names the functions."""
import ast
import re
import sys
from pathlib import Path

import pytest

import arco
import env
import warmup
from infra.settings import parse_args
from test_arco import tiny_args

ROOT = Path(__file__).resolve().parent.parent
CORE = ["arco", "env", "rubric_model", "warmup", "evaluate"] + sorted(
    f"infra.{p.stem}" for p in (ROOT / "infra").glob("*.py") if p.stem != "__init__")

# Loading and I/O: what a reader of the algorithm takes on trust (by module: function or Class.method names;
# a module named alone, every function of it).
READING_EXCLUDES = {
    "infra.settings": None, "infra.memory": None, "infra.files": None, "infra.data": None, "infra.runs": None,
    "infra.report": None, "infra.warmups": None, "infra.estimate": None, "infra.engines": None,
    "infra.models": {"load_backbone", "load_backbone_checkpoint", "_from_pretrained", "embedded_checkpoint",
                     "embedded_gguf_path", "arco_cache", "check_model_available", "save_backbone", "model_shape",
                     "_cached_config", "resolve_device", "resolve_dtype", "resolve_autocast", "cpu_has_native_bf16",
                     "Backbone.lower_frozen_weights", "Backbone.autocast", "Backbone.device", "add_lora", "merge_lora",
                     "fresh_adapter", "trainable_parameters", "_is_peft"},
    "infra.parallel": {"Workers.__init__", "Workers.start", "Workers.end", "Workers.barrier", "Workers.any"},
    "env": {"load_split", "shared_retriever", "Retriever.__init__", "Retriever.encode", "Retriever._paragraphs",
            "synthetic_examples", "parse_hotpot_layout", "Trajectory.to_dict", "_title_index", "_join_sentences",
            "embedded_encoder_path", "read_examples", "training_questions"},
    "rubric_model": {"RubricModel.load", "RubricModel.save", "RubricModel.config", "RubricModel.__init__",
                     "ScoreHead.__init__", "RubricModel.fresh_adapter"},
    "warmup": {"ensure", "dev_rank"},
    "arco": {"main", "resolve_args", "make_optimizers", "Credit.check", "start_from", "sft_only_evaluation"},
}


def excluded(module: str, qualname: str) -> bool:
    if module in READING_EXCLUDES and READING_EXCLUDES[module] is None:
        return True
    names = READING_EXCLUDES.get(module) or set()
    return qualname in names or qualname.split(".")[0] in names


def path_of(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def spans(module: str) -> dict[str, int]:
    """Lines of each top-level function and each method (Class.method) of a module."""
    out = {}
    for node in ast.parse(path_of(module).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = node.end_lineno - node.lineno + 1
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef):
                    out[f"{node.name}.{sub.name}"] = sub.end_lineno - sub.lineno + 1
    return out


def traced_run(argv) -> set[tuple[str, str]]:
    """(module, function or Class.method) of every core function the run enters (closures and comprehensions
    count for the function they are in)."""
    files = {str(path_of(m)): m for m in CORE}
    seen = set()

    def tracer(frame, event, arg):
        if event == "call":
            module = files.get(frame.f_code.co_filename)
            if module is not None:
                seen.add((module, frame.f_code.co_qualname.split(".<locals>")[0]))
        return None
    sys.settrace(tracer)
    try:
        arco.main(argv)
    finally:
        sys.settrace(None)
    return seen


@pytest.fixture(scope="module")
def reading_path(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("reading")
    warmup.run_from_arco(arco.resolve_args(parse_args(arco.Args, tiny_args(tiny_dir, out, engine="plain"))))  # first
    env._RETRIEVERS.clear()
    entered = traced_run(tiny_args(tiny_dir, out, engine="plain", name="traced"))
    path = {}
    for module in CORE:
        lines = spans(module)
        for m, name in entered:
            if m == module and name in lines and not excluded(module, name):
                path[(module, name)] = lines[name]
    return path


def test_the_readme_states_the_reading_path_as_the_code_runs_it(reading_path):
    """The README's total is within 3% of the count (a tiny run may skip a branch function a longer one takes),
    every function on the path is named in the README's section, and none is the fast engine's."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Reading path"):readme.index("## ", readme.index("## Reading path") + 5)]
    stated = int(re.search(r"([\d,]+) lines", section).group(1).replace(",", ""))
    total = sum(reading_path.values())
    listing = "\n".join(f"{m}.{n} {k}" for (m, n), k in sorted(reading_path.items()))
    assert abs(stated - total) <= 0.03 * total, f"README says {stated}, the run reads {total}:\n{listing}"
    missing = {f"{m}.{n}" for m, n in reading_path if f"`{n.split('.')[-1]}`" not in section}
    assert missing == set(), missing
    assert not {m for m, _ in reading_path} & {"infra.fast"}
