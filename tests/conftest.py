"""Shared test fixtures: the repository on sys.path and the shared data samples."""
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from infra import models  # noqa: E402  (the repository on sys.path first)


@pytest.fixture(scope="session")
def data_dir() -> str:
    """The real dataset samples: $ARCO_DATA_DIR, else ../shared/data beside the checkout."""
    for d in (os.environ.get("ARCO_DATA_DIR"), REPO.parent / "shared" / "data"):
        if d and (Path(d) / "hotpotqa").is_dir():
            return str(d)
    why = "no shared data: set ARCO_DATA_DIR to the folder holding hotpotqa/, 2wiki/, musique/"
    if os.environ.get("ARCO_REQUIRE_DATA") == "1":        # CI: a data test that skips would hide a failure
        pytest.fail(why + " (ARCO_REQUIRE_DATA=1)")
    pytest.skip(why)


@pytest.fixture(scope="session")
def retriever():
    import env
    return env.Retriever()


@pytest.fixture(scope="session")
def smol_dir():
    """The embedded SmolLM2 as a cached HF checkpoint (converted on the first run only)."""
    return models.embedded_checkpoint()


def _save_tiny(folder, model, tok):
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


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
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), LlamaForCausalLM(config), tok)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(smol_dir, tmp_path_factory):
    """A tiny random Qwen3 (the paper's architecture, Qwen3-4B-Instruct-2507) with the SmolLM2 tokenizer,
    shaped like the real one where it matters: heads x head_dim (4 x 16 = 64) != hidden size (48), q/k
    norms, untied embeddings, and a vocabulary padded beyond the tokenizer's length (as Qwen3's 151,936 >
    151,669). Saved in bfloat16, the dtype the paper preset loads on a GPU."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
    tok = AutoTokenizer.from_pretrained(smol_dir)
    config = Qwen3Config(vocab_size=len(tok) + 64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=False, use_sliding_window=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2, dtype="bfloat16")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen3"), model, tok)


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def tiny_any_dir(request):
    """Each tiny architecture in turn: the tests of model mechanics run on both."""
    return request.getfixturevalue("tiny_dir" if request.param == "llama" else "tiny_qwen3_dir")


class ChatServer:
    """A fake OpenAI-compatible API on 127.0.0.1 (a free port, a daemon thread), for the tests of the
    warmup's OpenAI teacher and diagnostics.py's judge. `respond(path, body, auth)` returns
    (status, payload) or (status, payload, seconds to sleep before answering); `url` is the base URL
    the openai client takes."""

    def __init__(self, respond):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, payload, *sleep = respond(self.path, body, self.headers.get("Authorization", ""))
                time.sleep(sleep[0] if sleep else 0)
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):   # the client gave up (a timeout test)
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def completion(text: str, model: str = "fake", prompt_tokens: int = 50, completion_tokens: int = 1) -> dict:
        """A chat.completion body whose one choice says `text`."""
        return {"id": "c", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    @staticmethod
    def error(message: str) -> dict:
        """An error body as the API sends it."""
        return {"error": {"message": message, "type": "server_error", "code": None}}
