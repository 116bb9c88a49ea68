"""Shared test fixtures: the repository on sys.path and the shared data samples."""
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def data_dir() -> str:
    """The real dataset samples: $ARCO_DATA_DIR, else ../shared/data beside the checkout."""
    for d in (os.environ.get("ARCO_DATA_DIR"), REPO.parent / "shared" / "data"):
        if d and (Path(d) / "hotpotqa").is_dir():
            return str(d)
    pytest.skip("no shared data: set ARCO_DATA_DIR to the folder holding hotpotqa/, 2wiki/, musique/")


@pytest.fixture(scope="session")
def retriever():
    import env
    return env.Retriever()


@pytest.fixture(scope="session")
def smol_dir():
    """The embedded SmolLM2 as a cached HF checkpoint (converted on the first run only)."""
    import rubric_model as rm
    return rm.embedded_checkpoint()


@pytest.fixture(scope="session")
def tiny_dir(smol_dir, tmp_path_factory):
    """A tiny random Llama saved with the SmolLM2 tokenizer: a real local HF folder, for mechanics."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(smol_dir)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
