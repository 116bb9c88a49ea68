"""arco.py: the policy update against a hand computation on a tiny model, and Algorithm 1 end to
end (warmup → sparse epoch → dense epoch → evaluation → report), with --resume after a kill."""
import json

import pytest
import torch

import arco
import env
import rubric_model as rm


def test_policy_update_matches_hand_computation(tiny_dir):
    """Eq. 3 on a tiny model: the loss policy_update reports equals −(1/|B|) Σ A log p(a|h), with
    log p(a|h) recomputed here the slow way, one sequence and one token at a time."""
    pi = rm.load_backbone(str(tiny_dir), device="cpu", autocast="off")
    rm.add_lora(pi)
    examples = env.synthetic_examples(2, split="dev")
    title = examples[0].paragraphs[0][0]
    script = iter(["Search[" + title + "]", "Finish[no]", "Finish[" + examples[1].answer + "]"])
    trajs = env.rollout(examples, lambda prompts: [next(script) for _ in prompts], TitleRetriever())
    A = [[0.5, -0.25], [1.0]]
    args = arco.resolve_args(arco.Args(micro_batch=2))
    out = arco.policy_update(pi, torch.optim.SGD(rm.trainable_parameters(pi.model), lr=0.0), trajs, A, args, 0.0)

    expected = 0.0
    pi.model.eval()
    with torch.no_grad():
        for t, a_t in zip(trajs, A):
            for st, a in zip(t.steps, a_t):
                prompt = rm.chat_prompt_ids(pi.tokenizer, st.prompt)
                response = rm.encode_response(pi, st.output)
                logits = pi.model(torch.tensor([prompt + response])).logits[0].float()
                logp = sum(torch.log_softmax(logits[len(prompt) - 1 + i], -1)[tok] for i, tok in enumerate(response))
                expected += a * float(logp)
    expected = -expected / len(trajs)
    assert out["policy_steps"] == 3
    assert out["policy_loss"] == pytest.approx(expected, rel=1e-4)


class TitleRetriever:
    def retrieve(self, examples, queries):
        return [next((i for i, (t, _) in enumerate(ex.paragraphs) if t in q), 0) for ex, q in zip(examples, queries)]


def tiny_args(tiny_dir, out, **kw):
    argv = ["--dataset", "synthetic", "--model", str(tiny_dir), "--train-size", "4", "--eval-size", "3",
            "--epochs", "2", "--dense-start-epoch", "2", "--batch-size", "2", "--group-size", "2",
            "--max-new-tokens-pi", "8", "--max-new-tokens-mu", "12", "--out-dir", str(out), "--sft-epochs-pi", "1",
            "--sft-epochs-mu", "1", "--warmup-samples", "2", "--device", "cpu"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return argv


@pytest.fixture(scope="module")
def tiny_run(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    arco.main(tiny_args(tiny_dir, out))
    return out


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_whole_loop_leaves_a_readable_run(tiny_run):
    run = tiny_run / "synthetic" / "arco"
    assert (tiny_run / "synthetic" / "warmup" / "pi_sft" / "config.json").is_file()   # warmup ran first
    args = json.loads((run / "args.json").read_text())
    assert args["epochs"] == 2 and args["preset"] == "cpu" and args["reward"] == "arco"
    rows = read_jsonl(run / "metrics.jsonl")
    evals = [r for r in rows if r["kind"] == "eval"]
    updates = [r for r in rows if r["kind"] == "update"]
    assert [r["epoch"] for r in evals] == [0, 1, 2]
    assert [(r["epoch"], r["dense"]) for r in updates] == [(1, False), (1, False), (2, True), (2, True)]
    for r in updates:
        assert 0 <= r["mean_R"] <= 1 and 0 <= r["invalid_rate"] <= 1 and r["decomposition_mse"] >= 0
        assert r["seconds_rollout"] > 0 and r["seconds_mu_update"] > 0 and -1 <= r["mean_s"] <= 1
    dense_trace = read_jsonl(run / "traces" / "epoch_2.jsonl")
    assert len(dense_trace) == 8                               # 4 questions × G = 2
    for row in dense_trace:
        G = [st["G"] for st in row["steps"]]
        s = [st["s"] for st in row["steps"]]
        assert G == pytest.approx(arco.reward_to_go(s), abs=1e-3)   # traces hold Eq. 3 as computed
        assert all(len(st["d"]) == 3 and len(st["criteria"]) == 3 and "A" in st for st in row["steps"])
        assert row["steps"][-1]["bucket"] == "terminal"
    assert (run / "checkpoints" / "epoch_2" / "pi" / "config.json").is_file()
    sel = json.loads((run / "selection.json").read_text())
    assert sel["selected_epoch"] == 2                           # the only post-transition epoch
    report = (run / "report.md").read_text()
    assert "| 0 | SFT only |" in report and "| 2 | dense |" in report and "Selected" in report


def test_outcome_baseline_has_no_mu(tiny_run, tiny_dir):
    arco.main(tiny_args(tiny_dir, tiny_run, reward="outcome", epochs=1,
                        warmup_dir=tiny_run / "synthetic" / "warmup"))
    run = tiny_run / "synthetic" / "outcome"
    updates = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "update"]
    assert updates and all("decomposition_mse" not in r and not r["dense"] for r in updates)
    assert not (run / "checkpoints" / "epoch_1" / "mu").exists()


def test_an_ablation_reuses_the_warmup_and_trains_only_its_own_mu(tiny_run, tiny_dir, monkeypatch):
    """Table 2's w/o Rubric: the same collection and π SFT as ARCO, a μ of its own (mu_sft-none)."""
    import warmup
    monkeypatch.setattr(warmup, "train_policy_sft", lambda *a, **kw: pytest.fail("π SFT ran a second time"))
    arco.main(tiny_args(tiny_dir, tiny_run, rubric="none", epochs=1))
    warm = tiny_run / "synthetic" / "warmup"
    assert rm.RubricModel.load(warm / "mu_sft-none", device="cpu").rubric_mode == "none"
    assert rm.RubricModel.load(warm / "mu_sft", device="cpu").rubric_mode == "adaptive"
    assert set(json.loads((warm / "metrics.json").read_text())["mu"]) == {"mu_sft", "mu_sft-none"}
    updates = [r for r in read_jsonl(tiny_run / "synthetic" / "arco-none" / "metrics.jsonl") if r["kind"] == "update"]
    assert updates and all(r["kl_mu"] == 0 and r["decomposition_mse"] >= 0 for r in updates)


def test_a_k_ablation_collects_its_own_annotations_and_shares_pi_sft(tiny_run, tiny_dir, monkeypatch):
    """RQ4's K = 5 beside the K = 3 run: its K-criteria collection goes to records-k5.jsonl (the K = 3
    records untouched), its μ to mu_sft-k5/, and π SFT is the folder's one."""
    import warmup
    warm = tiny_run / "synthetic" / "warmup"
    before = (warm / "records.jsonl").read_bytes()
    monkeypatch.setattr(warmup, "train_policy_sft", lambda *a, **kw: pytest.fail("π SFT ran a second time"))
    arco.main(tiny_args(tiny_dir, tiny_run, k=5, epochs=1))
    assert (warm / "records.jsonl").read_bytes() == before
    records = read_jsonl(warm / "records-k5.jsonl")
    assert records and all(r["K"] == 5 for r in records)
    # §4.5: the same warmup trajectories, annotated again with K = 5 (the oracle's depend only on the seed)
    def actions(rs):
        return {(r["id"], r["sample"]): [(st["action"], st["argument"]) for st in r["steps"]] for r in rs}
    assert actions(records) == actions(read_jsonl(warm / "records.jsonl"))
    assert all(len(r["criteria"]) == len(r["scores"]) == 5 for r in read_jsonl(warm / "rubric_sft-k5.jsonl"))
    assert rm.RubricModel.load(warm / "mu_sft-k5", device="cpu").k == 5
    rows = read_jsonl(tiny_run / "synthetic" / "arco-k5" / "traces" / "epoch_1.jsonl")
    assert rows and all(len(st["d"]) == 5 for r in rows for st in r["steps"])


def test_epoch_0_is_the_warmups_sft_only_evaluation_and_equals_a_fresh_one(tiny_run, tiny_dir):
    """arco.py takes the warmup's SFT-only evaluation as epoch 0 (same settings); evaluating π_sft
    plus the fresh B = 0 adapter again gives exactly the same numbers and trajectories."""
    from evaluate import parse_args
    warm, run = tiny_run / "synthetic" / "warmup", tiny_run / "synthetic" / "arco"
    sft_only = json.loads((warm / "metrics.json").read_text())["sft_only"]
    ev0 = next(r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval")
    assert {k: ev0[k] for k in sft_only} == sft_only
    args = arco.resolve_args(parse_args(arco.Args, tiny_args(tiny_dir, tiny_run)))
    torch.manual_seed(args.seed)
    pi, _ = arco.build_models(args, warm)
    dev = env.load_split("synthetic", "dev", None, args.eval_size, args.seed)
    ev, trajs = arco.evaluate_policy(pi, dev, args, env.Retriever())
    assert ev == sft_only
    assert [[st.output for st in t.steps] for t in trajs] == \
        [[st["output"] for st in r["steps"]] for r in read_jsonl(run / "traces" / "eval_epoch_0.jsonl")]


def evals(run):
    return [(r["epoch"], r["em"], r["f1"], r["invalid_rate"]) for r in read_jsonl(run / "metrics.jsonl")
            if r["kind"] == "eval"]


def updates(run):
    return [(r["epoch"], r["batch"], r["mean_R"], round(r["policy_loss"], 5), round(r["decomposition_mse"], 5))
            for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "update"]


def failing_on_call(real, n, action):
    """`real`, except that its n-th call first does `action` (raise, send a signal, ...)."""
    calls = {"n": 0}

    def wrapped(*a, **kw):
        calls["n"] += 1
        if calls["n"] == n:
            action()
        return real(*a, **kw)
    return wrapped


def test_resume_after_a_kill_mid_epoch(tiny_run, tiny_dir, monkeypatch):
    """A hard kill (nothing saved) in epoch 2: --resume redoes epoch 2 from the epoch-1 checkpoint."""
    warm = tiny_run / "synthetic" / "warmup"

    def kill():
        raise RuntimeError("simulated kill")
    real_update = arco.rubric_update
    monkeypatch.setattr(arco, "rubric_update", failing_on_call(real_update, 3, kill))   # epoch 2, batch 0
    with pytest.raises(RuntimeError, match="simulated kill"):
        arco.main(tiny_args(tiny_dir, tiny_run, name="killed", warmup_dir=warm))
    monkeypatch.setattr(arco, "rubric_update", real_update)
    with pytest.raises(SystemExit, match="--resume"):             # never overwritten by accident
        arco.main(tiny_args(tiny_dir, tiny_run, name="killed", warmup_dir=warm))
    arco.main(tiny_args(tiny_dir, tiny_run, name="killed", warmup_dir=warm, resume=True))
    run, ref = tiny_run / "synthetic" / "killed", tiny_run / "synthetic" / "arco"
    assert evals(run) == evals(ref)
    assert updates(run) == updates(ref)
    assert len(read_jsonl(run / "traces" / "epoch_2.jsonl")) == 8          # redone rows are not duplicated


def test_ctrl_c_finishes_the_batch_saves_and_resumes_from_the_next_one(tiny_run, tiny_dir, monkeypatch):
    """Ctrl-C (SIGINT) in epoch 2, batch 0: the batch finishes, a checkpoint is saved, the run exits;
    --resume continues at batch 1 and ends exactly where the uninterrupted run ended."""
    import os
    import signal
    warm = tiny_run / "synthetic" / "warmup"
    handler_before = signal.getsignal(signal.SIGINT)            # SIG_IGN under nohup, for example
    real_update = arco.rubric_update
    monkeypatch.setattr(arco, "rubric_update",
                        failing_on_call(real_update, 3, lambda: os.kill(os.getpid(), signal.SIGINT)))
    with pytest.raises(SystemExit, match="interrupted.*--resume"):
        arco.main(tiny_args(tiny_dir, tiny_run, name="ctrl-c", warmup_dir=warm))
    run, ref = tiny_run / "synthetic" / "ctrl-c", tiny_run / "synthetic" / "arco"
    state = json.loads((run / "checkpoints" / "interrupted" / "state.json").read_text())
    assert (state["epoch"], state["next_batch"]) == (2, 1)
    assert updates(run) == updates(ref)[:3]                                   # batch 0 of epoch 2 finished
    monkeypatch.setattr(arco, "rubric_update", real_update)
    seen = []
    real_iteration = arco.iteration
    monkeypatch.setattr(arco, "iteration", lambda *a, **kw: seen.append(a[5:7]) or real_iteration(*a, **kw))
    arco.main(tiny_args(tiny_dir, tiny_run, name="ctrl-c", warmup_dir=warm, resume=True))
    assert seen == [(2, 1)]                                                  # only what was left
    assert evals(run) == evals(ref) and updates(run) == updates(ref)
    assert not (run / "checkpoints" / "interrupted").exists()
    assert signal.getsignal(signal.SIGINT) is handler_before                  # handler restored


def test_a_nan_loss_stops_with_a_clear_message_and_keeps_the_last_checkpoint(tiny_run, tiny_dir, monkeypatch):
    warm = tiny_run / "synthetic" / "warmup"
    real_loss, real_update = arco.rubric_loss, arco.rubric_update
    batches = {"n": 0}

    def counting_update(*a, **kw):
        batches["n"] += 1
        return real_update(*a, **kw)

    def nan_from_epoch_2(*a, **kw):                                 # batches 1-2 are epoch 1
        loss = real_loss(*a, **kw)
        return loss * float("nan") if batches["n"] >= 3 else loss
    monkeypatch.setattr(arco, "rubric_update", counting_update)
    monkeypatch.setattr(arco, "rubric_loss", nan_from_epoch_2)
    with pytest.raises(SystemExit, match=r"rubric-model \(Eq. 5\) loss is nan at epoch 2, batch 0.*epoch_1"):
        arco.main(tiny_args(tiny_dir, tiny_run, name="nan", warmup_dir=warm))
    ckpts = tiny_run / "synthetic" / "nan" / "checkpoints"
    assert (ckpts / "epoch_1" / "state.json").is_file() and not (ckpts / "epoch_2").exists()


def test_whole_loop_on_the_embedded_model(tmp_path):
    """Algorithm 1 end to end with the real embedded SmolLM2 for π and μ, on a handful of synthetic
    questions: warmup → sparse epoch → dense epoch → evaluations → report, with sane files."""
    argv = ["--dataset", "synthetic", "--train-size", "2", "--eval-size", "2", "--epochs", "2",
            "--dense-start-epoch", "2", "--batch-size", "2", "--group-size", "2", "--max-new-tokens-pi", "16",
            "--max-new-tokens-mu", "24", "--sft-epochs-pi", "1", "--sft-epochs-mu", "1", "--warmup-samples", "2",
            "--warmup-probe", "2", "--out-dir", str(tmp_path), "--device", "cpu"]
    arco.main(argv)
    run = tmp_path / "synthetic" / "arco"
    args = json.loads((run / "args.json").read_text())
    assert args["model"] == "embedded" and args["mu_model"] == "embedded" and args["max_new_tokens_mu"] == 24
    rows = read_jsonl(run / "metrics.jsonl")
    evals = [r for r in rows if r["kind"] == "eval"]
    updates = [r for r in rows if r["kind"] == "update"]
    assert [r["epoch"] for r in evals] == [0, 1, 2] and all(r["n"] == 2 and 0 <= r["em"] <= 100 for r in evals)
    assert [(r["epoch"], r["dense"]) for r in updates] == [(1, False), (2, True)]
    for r in updates:
        batch_rows = [t for t in read_jsonl(run / "traces" / f"epoch_{r['epoch']}.jsonl") if t["batch"] == r["batch"]]
        assert r["policy_steps"] == sum(st["valid"] for t in batch_rows for st in t["steps"])   # V_τ, invalid out
        assert r["decomposition_mse"] >= 0 and -1 <= r["mean_s"] <= 1
        assert 0 <= r["rubric_parse_rate"] <= 1 and r["kl_mu"] >= 0 and r["kl_pi"] >= 0
        assert min(r["seconds_rollout"], r["seconds_mu_annotate"], r["seconds_pi_update"], r["seconds_mu_update"]) > 0
    trace = read_jsonl(run / "traces" / "epoch_2.jsonl")
    assert len(trace) == 4                                                    # 2 questions × G = 2
    for row in trace:
        for st in row["steps"]:
            assert len(st["criteria"]) == 3 and len(st["d"]) == 3 and -1 <= st["s"] <= 1
            assert st["rubric_parsed"] or st.get("rubric_text")               # what μ wrote, always kept
        assert [st["G"] for st in row["steps"]] == pytest.approx(arco.reward_to_go([st["s"] for st in row["steps"]]),
                                                                 abs=1e-3)
    assert (run / "checkpoints" / "epoch_2" / "mu" / "score_head.safetensors").is_file()
    assert json.loads((run / "selection.json").read_text())["selected_epoch"] == 2
    assert "## Sample training trajectories (epoch 2)" in (run / "report.md").read_text()
