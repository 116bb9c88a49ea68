"""The README's reading path, counted on what the code runs: every function and method of the core that
`python arco.py --engine plain` executes for Algorithm 1 (a tiny run on the synthetic worlds, its warmup made
before), loading and file I/O aside (READING_EXCLUDES: parsing the command line, loading data and models,
writing logs, traces, checkpoints and the report, Ctrl-C, torchrun's ranks, the memory profile). Each function
counts whole, as a reader reads it; the README states the total and lists the functions."""
import ast
import re
import sys
from pathlib import Path

import pytest

import arco
import env
import warmup
from config import parse_args
from test_arco import tiny_args

ROOT = Path(__file__).resolve().parent.parent
CORE = ["config", "evaluate", "env", "rubric_model", "fast", "teachers", "warmup", "plumbing", "arco"]

# Loading and I/O: what a reader of the algorithm takes on trust (by module: function or Class.method names).
READING_EXCLUDES = {
    "config": {"parse_args", "build_parser", "check_args", "_Parser", "main_guard", "fill_from_preset",
               "steady_heap", "release_memory", "PhaseMemory"},
    "env": {"load_split", "read_jsonl", "write_jsonl", "write_json", "scrub", "shared_retriever", "Retriever.__init__",
            "Retriever._encoder", "Retriever.encode", "Retriever._paragraph_vectors", "synthetic_examples",
            "synthetic_record", "parse_hotpot_layout", "data_file", "resolve_data_dir", "Trajectory.to_dict", "_require",
            "_world", "_person_para", "_org_para", "_word", "_title_index", "_join_sentences",
            "embedded_encoder_path"},
    "evaluate": {"auc"},                                             # μ at work: the log's AUC
    "rubric_model": {"load_backbone", "load_backbone_checkpoint", "_from_pretrained", "embedded_checkpoint",
                     "embedded_gguf_path", "arco_cache", "check_model_available", "check_intact", "damaged", "_sha256",
                     "write_manifest", "save_backbone", "write_atomically", "RubricModel.load", "RubricModel.save",
                     "RubricModel.config", "model_shape", "_cached_config", "resolve_device", "resolve_dtype",
                     "resolve_autocast", "cpu_has_native_bf16", "Backbone.lower_frozen_weights", "Backbone.autocast",
                     "Backbone.device", "RubricModel.__init__", "ScoreHead.__init__", "add_lora", "merge_lora",
                     "trainable_parameters", "engine_of"},
    "warmup": {"warmup_folder", "check_retriever", "check_mu_settings", "mu_dir_name", "eval_settings",
               "dev_rank", "collection_suffix"},
    "plumbing": {"open_run", "ensure_warmup", "training_questions", "mu_folder", "build_models", "make_optimizers",
                 "evaluate_policy", "warmup_evaluation", "sft_only_evaluation", "epoch0_settings", "sft_only_cache",
                 "log_evaluation", "update_line", "log_iteration", "trace_rows", "mu_at_work", "bucket_means", "timed",
                 "peak_rss_gib", "progress", "show", "save_checkpoint", "latest_checkpoint", "rewrite_jsonl",
                 "resume_from", "init_from", "CtrlC", "DataParallel", "write_selection", "write_report", "mu_report",
                 "plot_mu", "memory_estimate", "check_finite", "chunks"},
    "arco": {"main", "resolve_args"},
}


def excluded(module: str, qualname: str) -> bool:
    names = READING_EXCLUDES.get(module, set())
    return qualname in names or qualname.split(".")[0] in names


def spans(module: str) -> dict[str, int]:
    """Lines of each top-level function and each method (Class.method) of a module."""
    out = {}
    for node in ast.parse((ROOT / f"{module}.py").read_text(encoding="utf-8")).body:
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
    files = {str(ROOT / f"{m}.py"): m for m in CORE}
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
    assert not {m for m, _ in reading_path} & {"fast"}
