"""The schedule of Algorithm 1 (lines 3–5) as the presets make it: which epochs are sparse, the
batch composition of each phase, the updates per epoch, the checkpoint selection, --dry-run."""
import json

import pytest

import arco
import env
from infra import files
import warmup
from infra.settings import parse_args


def args_of(*argv):
    return arco.resolve_args(parse_args(arco.Args, list(argv)))


def test_paper_preset_schedule_is_the_releases():
    """configs/hotpotqa/arco_qwen.yaml: epochs 8, dense_start_epoch 3 (0-based: 3 sparse + 5 dense),
    batch_size 64 trajectories, grpo_group_size 4; 2,000 questions, no drop_last."""
    plan = arco.epoch_plan(args_of("--preset", "paper", "--dataset", "hotpotqa"), 2000)
    assert [e["dense"] for e in plan] == [False] * 3 + [True] * 5
    assert [e["selectable"] for e in plan] == [False] * 3 + [True] * 5
    for e in plan[:3]:
        assert (e["questions_per_batch"], e["samples"], e["trajectories_per_update"], e["updates"]) == (16, 4, 64, 125)
        assert (e["pi_lr"], e["kl_pi"]) == (1e-5, 0.0)
    for e in plan[3:]:
        assert (e["questions_per_batch"], e["samples"], e["trajectories_per_update"], e["updates"]) == (64, 1, 64, 32)
        assert (e["pi_lr"], e["kl_pi"]) == (3e-6, 0.05)


def test_paper_preset_recipe_values():
    a = args_of("--preset", "paper")
    assert (a.sparse_baseline, a.bucket_fallback, a.class_balance, a.token_reduction) == ("group", True, True, "mean")
    assert (a.rubric_temperature, a.rollout_temperature, a.weight_decay, a.alpha, a.kl_mu) == (0.0, 0.7, 0.01, 0.5, 0.05)
    assert (a.mu_lr, a.head_lr, a.max_new_tokens_pi, a.max_new_tokens_mu) == (1e-5, 5e-4, 64, 128)
    assert (a.warmup_size, a.warmup_samples, a.sft_batch_pi, a.sft_batch_mu) == (1000, 3, 64, 32)
    assert (a.retriever, a.retriever_pooling) == ("princeton-nlp/unsup-simcse-roberta-base", "cls")


def test_the_papers_text_is_one_flag_away():
    a = args_of("--preset", "paper", "--group-size", "1", "--sparse-baseline", "batch", "--token-reduction", "sum",
                "--kl-pi-sparse", "0.05", "--rubric-temperature", "0.7", "--no-bucket-fallback", "--no-class-balance")
    plan = arco.epoch_plan(a, 2000)
    assert (plan[0]["questions_per_batch"], plan[0]["samples"], plan[0]["updates"], plan[0]["kl_pi"]) == \
        (64, 1, 32, 0.05)
    assert (a.bucket_fallback, a.class_balance) == (False, False)


def test_outcome_runs_are_sparse_in_every_epoch():
    plan = arco.epoch_plan(args_of("--preset", "paper", "--reward", "outcome"), 2000)
    assert not any(e["dense"] for e in plan) and all(e["samples"] == 4 for e in plan)


def test_epoch_batches_cover_every_question_once_in_each_phase():
    a = args_of("--batch-size", "4", "--group-size", "2", "--epochs", "2", "--sparse-epochs", "1")
    train = env.synthetic_examples(7, split="train")
    sparse, dense = arco.epoch_batches(train, 1, a), arco.epoch_batches(train, 2, a)
    assert [len(b) for b in sparse] == [2, 2, 2, 1]           # 4 trajectories = 2 questions × G 2; last smaller
    assert [len(b) for b in dense] == [4, 3]                  # 4 questions × 1
    for batches in (sparse, dense):
        assert sorted(ex.id for b in batches for ex in b) == sorted(ex.id for ex in train)
    assert arco.epoch_batches(train, 1, a) == sparse           # seeded: the same on a resume


def test_dry_run_prints_the_schedule_and_builds_nothing(capsys, monkeypatch):
    from infra import models
    monkeypatch.setattr(models, "load_backbone", lambda *a, **k: pytest.fail("--dry-run loaded a model"))
    arco.main(["--preset", "paper", "--dataset", "hotpotqa", "--dry-run"])
    out = capsys.readouterr().out
    assert "2000 training questions" in out
    assert "epoch 3: sparse 16 questions × 4 = 64 trajectories per update, 125 updates" in out
    assert "epoch 4: dense  64 questions × 1 = 64 trajectories per update, 32 updates" in out
    assert "token reduction: mean" in out and "class-balanced" in out and "weight decay 0.01" in out


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "6", "--group-size", "4"], "multiple of --group-size"),
    (["--sparse-epochs", "3", "--epochs", "2"], "between 0 and --epochs"),
    (["--group-size", "1"], "needs --group-size 2"),
])
def test_bad_combinations_stop_before_any_work(argv, message):
    with pytest.raises(SystemExit, match=message):
        args_of(*argv)


def test_an_unknown_dataset_stops_at_the_command_line(capsys):
    with pytest.raises(SystemExit, match="argument --dataset: invalid choice: 'nq'"):
        arco.main(["--dataset", "nq"])


# ------------------------------------------------------------------ checkpoint selection (§4.1)
def h(epoch, em, dense=None):
    return {"epoch": epoch, "em": em, "f1": em, **({} if dense is None else {"dense": dense})}


def test_sparse_epochs_never_win_selection():
    history = [h(0, 50.0), h(1, 40.0, False), h(2, 35.0, False), h(3, 10.0, True), h(4, 12.0, True)]
    sel = arco.select_checkpoint(history, sparse_epochs=2)
    assert sel["selected_epoch"] == 4 and sel["selected"]["em"] == 12.0
    assert sel["best_overall_epoch"] == 0 and sel["best_overall"]["em"] == 50.0   # recorded beside it


def test_selection_ties_go_to_the_earlier_epoch():
    history = [h(0, 10.0), h(1, 5.0), h(2, 20.0), h(3, 20.0), h(4, 15.0)]
    sel = arco.select_checkpoint(history, sparse_epochs=1)
    assert sel["selected_epoch"] == 2 and sel["best_overall_epoch"] == 2


def test_selection_without_dense_epochs_takes_the_best_trained_epoch():
    history = [h(0, 30.0), h(1, 10.0), h(2, 20.0)]
    assert arco.select_checkpoint(history, sparse_epochs=2)["selected_epoch"] == 2


def test_em_ties_are_broken_by_f1_then_by_fewer_invalid_steps():
    history = [h(0, 0.0), {"epoch": 1, "em": 0.0, "f1": 2.0, "invalid_rate": 0.5},
               {"epoch": 2, "em": 0.0, "f1": 2.0, "invalid_rate": 0.1}, {"epoch": 3, "em": 0.0, "f1": 1.0}]
    assert arco.select_checkpoint(history, sparse_epochs=0)["selected_epoch"] == 2


def training_questions(a, warm):
    """D as arco.run asks env for it: the ids of the warmup's records left out with --warmup-questions before."""
    taught = {r["id"] for path in warm.glob("records*.jsonl") for r in files.read_jsonl(path)}
    return env.training_questions(a.dataset, a.data_dir or None, a.train_size, a.seed,
                                  taught if a.warmup_questions == "before" else frozenset())


def test_rl_questions_start_at_the_warmups_unless_asked_before(tmp_path):
    """--warmup-questions within (both presets): D and the warmup are the first questions of one order, so the
    smaller lies in the larger (also D inside the warmup, the cpu preset's 8 of 150); before: D holds no
    question of the warmup's records, whichever seed made them."""
    a = args_of("--dataset", "synthetic", "--train-size", "5", "--warmup-size", "3")
    assert a.warmup_questions == "within" and args_of("--preset", "paper").warmup_questions == "within"
    order = env.synthetic_examples(8, split="train")
    (tmp_path / "records.jsonl").write_text("".join(
        f'{{"id": "{ex.id}", "sample": {s}}}\n' for ex in order[:3] for s in range(2)))
    assert [q.id for q in training_questions(a, tmp_path)] == [ex.id for ex in order[:5]]
    small = args_of("--dataset", "synthetic", "--train-size", "2", "--warmup-size", "3")   # D inside the warmup
    assert [q.id for q in training_questions(small, tmp_path)] == [ex.id for ex in order[:2]]
    a.warmup_questions = "before"
    assert [q.id for q in training_questions(a, tmp_path)] == [ex.id for ex in order[3:8]]
                                           # a warmup of another sample: only its own questions are left out
    (tmp_path / "records.jsonl").write_text(f'{{"id": "{order[1].id}", "sample": 0}}\n')
    assert [q.id for q in training_questions(a, tmp_path)] == [order[i].id for i in (0, 2, 3, 4, 5)]
    (tmp_path / "records.jsonl").write_text("".join(f'{{"id": "{ex.id}", "sample": 0}}\n' for ex in order[:7]))
    a.train_size = 1                      # a warmup larger than --warmup-size says (e.g. one made earlier)
    assert [q.id for q in training_questions(a, tmp_path)] == [order[7].id]


def test_a_warmup_mu_is_reused_only_with_its_own_sft_settings(tmp_path):
    """A warmup μ fine-tuned with the preset's --sft-questions-mu is not silently reused by a run asking for 60,
    nor one whose score head was not fitted alone (--sft-head-steps; a warmup without the key had 0), nor one
    that wrote its criteria in another --rubric-format (a warmup without the key wrote JSON)."""
    for name in ("pi_sft", "mu_sft"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    a = args_of("--dataset", "synthetic", "--warmup-dir", str(tmp_path))
    made = {"sft_questions_mu": a.sft_questions_mu, "sft_head_steps": 500, "rubric_format": a.rubric_format}
    (tmp_path / "metrics.json").write_text(json.dumps({"mu": {"mu_sft": made}}))
    assert a.sft_head_steps == 500 and warmup.ensure(a, with_mu=True).folder == tmp_path
    a.sft_questions_mu = 60
    with pytest.raises(env.DataError, match=f"--sft-questions-mu {made['sft_questions_mu']}"):
        warmup.ensure(a, with_mu=True)
    a.sft_questions_mu = made["sft_questions_mu"]
    (tmp_path / "metrics.json").write_text(json.dumps({"mu": {"mu_sft": {k: v for k, v in made.items()
                                                                          if k != "sft_head_steps"}}}))
    with pytest.raises(env.DataError, match="--sft-head-steps 0"):
        warmup.ensure(a, with_mu=True)
    a.sft_head_steps = 0
    assert warmup.ensure(a, with_mu=True).folder == tmp_path
    (tmp_path / "metrics.json").write_text(json.dumps({"mu": {"mu_sft": {"sft_questions_mu": a.sft_questions_mu}}}))
    with pytest.raises(env.DataError, match="--rubric-format json"):            # made before the setting: JSON
        warmup.ensure(a, with_mu=True)
    fresh = tmp_path / "fresh"                                          # a folder with no μ yet: nothing to refuse
    fresh.mkdir()
    warmup.check_mu_settings(fresh, "mu_sft", a)
    assert warmup.ensure(a, with_mu=False).folder == tmp_path        # outcome RL needs no μ
