"""The `paper` preset's code path without a GPU (issue 31): Qwen3 in bfloat16, the release recipe's every
switch, only the sizes shrunk. `python arco.py --dataset hotpotqa --preset paper` loads Qwen3-4B-Instruct-2507
in bf16 on a GPU; here a tiny random Qwen3 of the same architecture (conftest.tiny_qwen3_dir) in bf16 runs
the same path on CPU: warmup (collection, π SFT, μ SFT), a sparse and a dense epoch, evaluation, selection,
on the real HotpotQA sample. The retriever is the embedded MiniLM (the preset's SimCSE would be a download)."""
import json

import pytest
import torch

import arco
from infra import fast
from infra import estimate
from infra import models
from infra import passes
from infra.fast import FAST

SHRUNK = dict(train_size=4, eval_size=3, epochs=2, sparse_epochs=1, batch_size=4, warmup_size=4, warmup_samples=2,
              warmup_probe=4, sft_epochs_pi=1, sft_epochs_mu=1, sft_batch_pi=8, sft_batch_mu=8, max_new_tokens_pi=8,
              max_new_tokens_mu=12, gen_batch=8, pass_tokens=2048)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def well_formed(policy_act):
    """π's act, with each sampled reply replaced by a well-formed action (alternately a search and an answer),
    re-encoded as π would write it: a random tiny model writes no valid action, and the policy update (Eq. 3)
    skips invalid steps, so without this the run would never compute π's loss. Mechanics only: log-probs, the
    KL and the backward then run on real tokens under the bf16 model."""
    count = iter(range(10 ** 6))

    def make(pi, *a, **kw):
        act = policy_act(pi, *a, **kw)

        def replies(prompts, seeds=None):
            out = []
            for g in act(prompts, seeds):
                text = "Search[film director]" if next(count) % 2 else "Finish[yes]"
                out.append(passes.Generation(text, passes.encode_response(pi, text), g.prompt_ids))
            return out
        return replies
    return make


def test_the_paper_preset_runs_end_to_end_on_a_tiny_qwen3_in_bf16(tiny_qwen3_dir, data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(arco, "policy_act", well_formed(arco.policy_act))
    argv = ["--dataset", "hotpotqa", "--preset", "paper", "--model", str(tiny_qwen3_dir), "--retriever", "",
            "--retriever-pooling", "mean", "--dtype", "bfloat16", "--device", "cpu", "--data-dir", data_dir,
            "--out-dir", str(tmp_path)]
    for k, v in SHRUNK.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    arco.main(argv)
    run = tmp_path / "hotpotqa" / "arco"
    args = json.loads((run / "args.json").read_text())
    preset = arco.PRESETS["paper"]
    kept = {k: v for k, v in preset.items() if k not in SHRUNK and k not in ("model", "retriever", "retriever_pooling")}
    assert {k: args[k] for k in kept} == kept and args["dtype"] == "bfloat16"   # every other switch: the paper's
    rows = read_jsonl(run / "metrics.jsonl")
    updates = [r for r in rows if r["kind"] == "update"]
    # G = 4: a sparse update is 1 question × 4 samples (4 updates), a dense one 4 questions × 1
    assert [(r["epoch"], r["dense"], r["trajectories"]) for r in updates] == [(1, False, 4)] * 4 + [(2, True, 4)]
    for r in updates:
        assert r["policy_steps"] > 0 and r["invalid_rate"] < 1
        assert all(v == v and abs(v) != float("inf") for k, v in r.items() if isinstance(v, float))
    dense = updates[-1]
    assert dense["policy_loss"] != 0 and dense["decomposition_mse"] > 0 and dense["kl_pi"] >= 0
    assert [r["epoch"] for r in rows if r["kind"] == "eval"] == [0, 1, 2]
    assert json.loads((run / "selection.json").read_text())["selected_epoch"] == 2
    pi, _ = models.load_backbone_checkpoint(run / "checkpoints" / "epoch_2" / "pi", device="cpu", dtype="bfloat16", engine=FAST)
    assert type(pi.model.get_base_model()).__name__ == "Qwen3ForCausalLM"
    assert next(pi.model.get_base_model().parameters()).dtype == torch.bfloat16
    moved = [p for n, p in pi.model.named_parameters() if "lora_B" in n and p.abs().sum() > 0]
    assert moved                                              # the dense update (A ≠ 0) moved π's RL adapter


# ----------------------------------------------------------------------------- the memory estimate (--dry-run)
@pytest.mark.parametrize("fixture", ["tiny_dir", "tiny_qwen3_dir"])
def test_parameter_count_from_the_shape_is_the_models(fixture, request):
    """memory_estimate counts weights from a config alone; on both tiny architectures (tied and untied) the
    count is the loaded model's."""
    folder = request.getfixturevalue(fixture)
    bb = models.load_backbone(str(folder), device="cpu", engine=FAST)
    assert estimate._parameters(models.model_shape(str(folder))) == sum(p.numel() for p in bb.model.parameters())


def test_a_random_model_of_a_public_shape_has_its_size_and_the_same_weights_each_time():
    a = models.load_backbone("random:SmolLM2-135M", device="cpu", engine=FAST)
    assert sum(p.numel() for p in a.model.parameters()) == estimate._parameters(models.SHAPES["SmolLM2-135M"]) == 134_515_008
    b = models.load_backbone("random:SmolLM2-135M", device="cpu", engine=FAST)
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    with pytest.raises(models.ModelLoadError, match="random:"):
        models.model_shape("random:NoSuchModel")


def test_activation_bytes_per_token_match_what_autograd_saves(tiny_qwen3_dir, tiny_dir):
    """_token_bytes' count, against the bytes autograd actually keeps for the backward of one packed LoRA
    training pass (saved_tensors_hooks; each storage once; the frozen weights it saves for the input
    gradients are no extra memory and are left out), on both tiny architectures in float32 and bf16: per
    token, per row's tree mask, per response token's logits — within 25%."""
    for folder in (tiny_dir, tiny_qwen3_dir):
        for dtype in ("float32", "bfloat16"):
            bb = models.add_lora(models.load_backbone(str(folder), device="cpu", dtype=dtype, autocast="off", engine=FAST))
            bb.model.train()
            weights = {p.untyped_storage().data_ptr() for p in bb.model.parameters()}
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(100, 1000, (384,), generator=g).tolist()
            seqs, lens = [ids[:256] + ids[256:320], ids[:256] + ids[320:]], [8, 8]      # one packed row of 384
            ref = fast.reference_logq(bb, seqs, lens, None, 1.0, arco.reference)
            seen = {}

            def pack(t):
                if t.untyped_storage().data_ptr() not in weights:
                    seen[(t.untyped_storage().data_ptr(), t.dtype)] = t.untyped_storage().nbytes()
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                fast.packed_steps(bb, seqs, lens, None, ref, kl=arco.token_kl)
            per = estimate._token_bytes(bb.model.config.to_dict(), 4 if dtype == "float32" else 2)
            counted = 384 * per["activations"] + 384 ** 2 * per["mask"] + sum(lens) * per["logits"]
            assert counted == pytest.approx(sum(seen.values()) + sum(r.numel() * 4 for r in ref), rel=0.25), \
                (folder.name, dtype, counted, sum(seen.values()))


def test_the_estimate_holds_a_decoding_batch_twice_its_first_keys_in_the_weights_dtype():
    """A decoding batch's prompts are held as stored rows and as the batch's padded cache, the latter first
    written with float32 keys under autocast (issue 43): per token of SmolLM2's shape (30 layers, 3 KV heads of
    64), stored 30 × 2 × 192 × b bytes and first 30 × 192 × (4 + b): 46,080 + 46,080 in float32, 23,040 +
    34,560 under bf16 autocast. The plain engine keeps no memo, so the row is that times the batch's tokens."""
    rows = {}
    for path in ("on", "off"):
        args = arco.resolve_args(arco.Args(dataset="hotpotqa", model="random:SmolLM2-135M", engine="plain",
                                           device="cpu", dtype="float32", autocast=path))
        rows[path] = estimate.memory_estimate(args)["rollout KV cache"]
    # μ's batch is the longer (its reply): 32 prompts × (350 + 3 searches × (300/4 + 30) + π's 32 + μ's 64)
    assert (args.gen_batch, args.obs_chars, args.max_new_tokens_pi, args.max_new_tokens_mu) == (32, 300, 32, 64)
    assert rows["off"] == pytest.approx(32 * 761 * (46_080 + 46_080) / 2 ** 30)
    assert rows["on"] == pytest.approx(32 * 761 * (23_040 + 34_560) / 2 ** 30)


def test_dry_run_prints_the_paper_presets_memory_without_any_download(capsys):
    """The paper preset: Qwen3-4B's public shape (no weights, no config download), bf16 on the GPU it is meant
    for; the peak and whether it fits the 80 GB of the paper's GPU, and a smaller --gpu-memory that it does not."""
    arco.main(["--dataset", "hotpotqa", "--preset", "paper", "--dry-run"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("memory (estimate, bfloat16 weights, π+μ)") and "fits --gpu-memory 80 GiB" in line
    arco.main(["--dataset", "hotpotqa", "--preset", "paper", "--dry-run", "--gpu-memory", "24"])
    assert "does NOT fit --gpu-memory 24 GiB" in capsys.readouterr().out
