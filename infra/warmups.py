"""A warmup's folder (plumbing beneath warmup.py and arco.py): where it lives, the names of its collections and of
its μs (one folder per μ variant, so that every run of the paper's comparisons shares one collection and one π
SFT), the checks that a run reuses only a warmup made as it asks (the retriever; μ's SFT settings), and the SFT-only
dev evaluation a run takes as its epoch 0 instead of repeating it."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from infra.data import DataError
from infra.files import read_jsonl, write_atomically, write_json, write_jsonl
from infra.settings import EMBEDDED_RETRIEVER

def warmup_folder(args) -> Path:
    """Where a warmup lives: --warmup-dir, else <out-dir>/<dataset>/warmup."""
    return Path(args.warmup_dir or Path(args.out_dir) / args.dataset / "warmup")


def collection_suffix(K: int) -> str:
    """'' for K = 3, else '-k{K}': the suffix of a collection's files in a warmup folder (records, failures,
    the two SFT sets, summary). Every criterion list of a collection has exactly K items, so a run with
    another K collects its own annotations beside the first collection and still shares the folder's
    π SFT, as its μ folder does (`mu_sft-k5`). §4.5 (RQ4) reuses the warmup trajectories and re-runs only
    the annotation for each K: the oracle teacher does exactly that (its trajectories depend only on the
    seed); the OpenAI teacher samples its trajectories again."""
    return "" if K == 3 else f"-k{K}"


def mu_dir_name(settings: dict) -> str:
    """The folder of a warmup's μ, from a run's settings (asdict of the arguments, or a run's args.json):
    `mu_sft` for ARCO's own μ (adaptive, K = 3, π's backbone, the teacher's trajectories), and one folder per
    variant beside it (`mu_sft-none`, `mu_sft-k5`, `mu_sft-policy-q40`, ...), so that every run of the paper's
    comparisons shares one collection and one π SFT. A setting missing from `settings` (a run made before it
    existed) counts as its default."""
    def get(key: str, default):
        return default if settings.get(key) is None else settings[key]
    suffix = "" if get("rubric", "adaptive") == "adaptive" else f"-{settings['rubric']}"
    suffix += collection_suffix(get("k", 3))
    mu_model, model = get("mu_model", ""), get("model", "embedded")
    if mu_model and mu_model != model:
        suffix += "-" + re.sub(r"[^A-Za-z0-9._-]+", "_", mu_model.strip("/").split("/")[-1])
    if get("mu_data", "teacher") != "teacher":           # π_sft's rollouts: of how many questions
        suffix += f"-{settings['mu_data']}-q{get('sft_questions_mu', 0) or 'all'}"
    return "mu_sft" + suffix


def check_retriever(folder: Path, retriever: str, pooling: str) -> None:
    """A warmup folder keeps the retriever its trajectories were played with (retriever.json); a
    warmup or an RL run with another retriever stops here, naming both, instead of mixing them."""
    path = Path(folder) / "retriever.json"
    wanted = {"retriever": retriever or EMBEDDED_RETRIEVER, "pooling": pooling}
    if path.is_file():
        have = json.loads(path.read_text())
        if have != wanted:
            raise DataError(f"the warmup in {folder} was made with retriever {have['retriever']} "
                                f"({have['pooling']} pooling), this run asks for {wanted['retriever']} "
                                f"({wanted['pooling']} pooling); pass the same --retriever / --retriever-pooling, "
                                f"or another --warmup-dir")
    elif (Path(folder) / "records.jsonl").is_file() or (Path(folder) / "pi_sft").is_dir():
        if wanted["retriever"] != EMBEDDED_RETRIEVER or pooling != "mean":   # made before retriever.json
            raise DataError(f"the warmup in {folder} records no retriever (it predates retriever.json, so it "
                                f"used {EMBEDDED_RETRIEVER}); this run asks for {wanted['retriever']}")


# The μ SFT settings a warmup keeps in metrics.json (same names in arco.py and warmup.py), each with the
# value a warmup made before the setting existed had (None: such a warmup passes the check).
MU_SFT_SETTINGS = {"sft_questions_mu": None, "sft_head_steps": 0, "rubric_format": "json"}


def check_mu_settings(folder: Path, name: str, args) -> None:
    """A warmup μ is reused only by runs that ask for the μ SFT it had (MU_SFT_SETTINGS); otherwise RL
    would silently start from another μ."""
    path = Path(folder) / "metrics.json"
    if not (Path(folder) / name / "config.json").is_file():
        return                                                       # no μ there yet: nothing is reused
    made = json.loads(path.read_text()).get("mu", {}).get(name, {}) if path.is_file() else {}
    for key, predated in MU_SFT_SETTINGS.items():
        value = getattr(args, key)
        had = made.get(key, value if predated is None else predated)
        if had != value:
            flag = "--" + key.replace("_", "-")
            raise DataError(f"the μ in {Path(folder) / name} was fine-tuned with {flag} {had}, this run asks "
                                f"for {value}; pass the same, another --warmup-dir, or delete "
                                f"{Path(folder) / name} to fine-tune μ again")


# The π SFT settings a warmup keeps in metrics.json (pi_sft_settings): a run reuses its π_sft only if it asks for the
# same (a warmup made before the key existed: its args.json, written as it started).
PI_SFT_SETTINGS = ("model", "warmup_size", "warmup_samples", "sft_epochs_pi", "sft_lr_pi", "sft_batch_pi")


def pi_sft_settings(args) -> dict:
    return {key: getattr(args, key) for key in PI_SFT_SETTINGS}


def check_pi_settings(folder: Path, args) -> None:
    """A warmup's π_sft is reused only by runs that ask for the base model and π SFT it had (PI_SFT_SETTINGS); else
    one error naming both, instead of RL silently starting from another π."""
    folder = Path(folder)
    if not (folder / "pi_sft" / "config.json").is_file():
        return                                                       # no π_sft there yet: nothing is reused
    metrics = json.loads((folder / "metrics.json").read_text()) if (folder / "metrics.json").is_file() else {}
    made = metrics.get("pi_sft_settings") or \
        (json.loads((folder / "args.json").read_text()) if (folder / "args.json").is_file() else {})
    differ = [key for key in PI_SFT_SETTINGS if key in made and made[key] != getattr(args, key)]
    if differ:
        flags = lambda values: ", ".join(f"--{k.replace('_', '-')} {values[k]}" for k in differ)   # noqa: E731
        raise DataError(f"the π_sft in {folder / 'pi_sft'} was made with {flags(made)}, this run asks for "
                        f"{flags(pi_sft_settings(args))}; pass the same, or another --warmup-dir for a warmup of its "
                        f"own")


def eval_settings(dev: list, seed: int, max_new_tokens: int, obs_chars: int, gen_batch: int) -> dict:
    """What decides a greedy dev evaluation (with the policy): the same dev questions — a digest of their ids,
    text, answers and paragraphs, so that another --data-dir or sample is never served this one's evaluation — and
    the same settings give the same trajectories."""
    questions = json.dumps([[e.id, e.question, e.answers, e.paragraphs] for e in dev])
    return {"eval_size": len(dev), "dev": hashlib.sha256(questions.encode()).hexdigest()[:16], "seed": seed,
            "max_new_tokens": max_new_tokens, "obs_chars": obs_chars, "gen_batch": gen_batch}


def sft_only(warmup_dir: Path, settings: dict | None, evaluate, main: bool = True) -> tuple[dict, list[dict]]:
    """Epoch 0's dev evaluation (the SFT-only policy): the warmup's own (π SFT's kept epoch) when it was made with
    these `settings` (eval_settings), else the one an earlier run of the same settings kept beside the warmup, else
    `evaluate()` → (scores, trace rows), then kept there for the next run (by the first worker, `main`); `settings`
    None: always evaluated, never kept (a run whose settings the key does not hold, e.g. --max-searches). π at
    epoch 0 is π_sft plus a fresh LoRA whose B = 0, which adds exact zeros: greedy decoding gives the same
    trajectories (tests/test_arco.py checks it)."""
    if settings is None:
        return evaluate()
    metrics = json.loads((warmup_dir / "metrics.json").read_text()) if (warmup_dir / "metrics.json").is_file() else {}
    traces = warmup_dir / "eval_sft_only.jsonl"
    cached = warmup_dir / "sft_only_evaluations" / hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    if metrics.get("sft_only_settings") != settings or not traces.is_file():   # another run's evaluation, or none
        if not (cached / "traces.jsonl").is_file():
            ev, rows = evaluate()
            if main:
                def write(tmp: Path) -> None:
                    write_jsonl(tmp / "traces.jsonl", [{k: v for k, v in r.items() if k not in ("epoch", "batch")}
                                                       for r in rows])
                    write_json(tmp / "metrics.json", {"sft_only": ev, "sft_only_settings": settings})
                write_atomically(cached, write)
            return ev, rows
        metrics, traces = json.loads((cached / "metrics.json").read_text()), cached / "traces.jsonl"
    rows = [{**r, "epoch": 0, "batch": -1} for r in read_jsonl(traces)]
    for r in rows:
        for st in r["steps"]:
            st["observation"] = st["observation"][:160]
    if main:
        print(f"[arco] epoch 0 (SFT only): the warmup's evaluation, same settings ({traces})", flush=True)
    return metrics["sft_only"], rows
