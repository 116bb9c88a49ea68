"""warmup.py, SFT half: Eq. 7 by hand, π SFT and μ SFT mechanics on a tiny model, and the whole
warmup (collection → SFT → π_sft/, μ_sft/, metrics.json) end to end on the tiny model."""
import dataclasses
import json
import re
import shutil

import pytest
import torch

import env
import rubric_model as rm
from lab import study
import warmup
from infra import models
from infra import passes
from infra import files
from lab import truth
from infra import oracle
from infra.fast import FAST
from infra.passes import PLAIN


# Eq. 7's arithmetic with numbers chosen by hand: two steps, K = 2, rubrics of two tokens.
D = torch.tensor([[0.5, -0.5], [0.0, 1.0]])
TARGETS = torch.tensor([[0.3, -0.5], [0.2, 0.6]])
LOGPROBS = torch.tensor([[-1.5, -0.5], [-3.0, -1.0]])           # sums -2 and -4
MASK = torch.ones_like(LOGPROBS, dtype=torch.bool)


def test_rubric_sft_loss_by_hand():
    # text: NLLs 2 and 4 -> mean 3. score: ||(0.2, 0)||² = 0.04, ||(-0.2, 0.4)||² = 0.2 -> mean 0.12.
    # Eq. 7 with λ = 10: 3 + 10 · 0.12 = 4.2
    loss, text, score = warmup.rubric_sft_loss(D, TARGETS, LOGPROBS, MASK, lam=10.0)
    assert float(text) == pytest.approx(3.0) and float(score) == pytest.approx(0.12) and float(loss) == pytest.approx(4.2)
    # w/o Rubric and static have no rubric text to learn: only λ · score error
    loss, text, _ = warmup.rubric_sft_loss(D, TARGETS, None, MASK, lam=10.0)
    assert float(text) == 0.0 and float(loss) == pytest.approx(1.2)
    # a pass holding the first step of a batch of 2: its part of the batch's loss (0.5·2/... adds up)
    first = warmup.rubric_sft_loss(D[:1], TARGETS[:1], LOGPROBS[:1], MASK[:1], 10.0, "sum", n_steps=2)[0]
    second = warmup.rubric_sft_loss(D[1:], TARGETS[1:], LOGPROBS[1:], MASK[1:], 10.0, "sum", n_steps=2)[0]
    assert float(first + second) == pytest.approx(4.2)


def test_rubric_sft_loss_release_reduction_by_hand():
    # The release averages: text = (1.5 + 0.5 + 3.0 + 1.0) / 4 tokens = 1.5; score = the mean of the
    # 2 steps × K = 2 squared errors (0.04, 0, 0.04, 0.16) = 0.06; 1.5 + 10 · 0.06 = 2.1
    loss, text, score = warmup.rubric_sft_loss(D, TARGETS, LOGPROBS, MASK, lam=10.0, token_reduction="mean")
    assert float(text) == pytest.approx(1.5) and float(score) == pytest.approx(0.06) and float(loss) == pytest.approx(2.1)


def test_sft_schedule_is_a_three_percent_warmup_then_a_cosine():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = warmup.warmup_cosine(opt, total_steps=103)          # warmup: int(0.03 · 103) = 3 steps
    lrs = []
    for _ in range(104):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([2 / 3, 4 / 3, 2.0, 2.0])   # (step + 1) / 3, then the cosine from 1
    assert lrs[53] == pytest.approx(1.0)                        # half way through the 100 decay steps: 0.5
    assert lrs[103] == pytest.approx(0.0, abs=1e-12)




def test_policy_and_rubric_sft_lower_their_losses(tiny_dir, tmp_path, retriever):
    import env
    examples = env.load_split("synthetic", "train", size=3, seed=0)
    warmup.collect(examples, warmup.OracleTeacher(env, seed=0), retriever, tmp_path, k=2, K=3, progress=False)
    records = files.read_jsonl(tmp_path / "records.jsonl")
    pi_examples = warmup.policy_sft_examples(records)
    mu_items = warmup.rubric_sft_examples(warmup.filter_records(records, 3)[0])
    assert pi_examples and mu_items

    pi = models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=FAST)
    losses = warmup.train_policy_sft(pi, pi_examples, epochs=4, lr=3e-2, batch_size=4, progress=False)["losses"]
    assert losses[-1] < losses[0]
    assert not hasattr(pi.model, "peft_config") and len(pi.merged) == 1     # merged after SFT

    # Each term of Eq. 7 learns. On this 2-layer, 32-wide model a LoRA on q/v moves the text NLL by a
    # few nats only, less than the noise the λ = 10 score term adds to it: the text term is checked
    # alone (λ = 0), the score error with the full loss.
    torch.manual_seed(0)
    for lam, term in ((0.0, "text_nll"), (10.0, "score_sq_error")):
        mu = rm.RubricModel(models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=FAST), k=3)
        before = warmup.rubric_sft_terms(mu, mu_items, 10.0)
        losses = warmup.train_rubric_sft(mu, mu_items, epochs=4, lr=3e-2, head_lr=1e-2, lam=lam, batch_size=4,
                                         progress=False)
        after = warmup.rubric_sft_terms(mu, mu_items, 10.0)
        assert after[term] < before[term] and losses[-1] < losses[0], (lam, before, after, losses)


def test_score_head_fit_lowers_eq7_score_term_and_moves_only_the_head(tiny_dir, tmp_path, retriever):
    """--sft-head-steps: Adam on Eq. 7's score term over φ alone; the backbone's weights stay as they were."""
    examples = env.load_split("synthetic", "train", size=3, seed=0)
    warmup.collect(examples, warmup.OracleTeacher(env, seed=0), retriever, tmp_path, k=2, K=3, progress=False)
    items = warmup.rubric_sft_examples(warmup.filter_records(files.read_jsonl(tmp_path / "records.jsonl"), 3)[0])
    torch.manual_seed(0)
    mu = rm.RubricModel(models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=FAST), k=3)
    backbone = {k: v.clone() for k, v in mu.backbone.model.state_dict().items()}
    head = [p.clone() for p in mu.head.parameters()]
    before = warmup.rubric_sft_terms(mu, items, 10.0, token_reduction="mean")["score_sq_error"]
    first, last = warmup.fit_score_head(mu, items, steps=50, lr=1e-2)
    after = warmup.rubric_sft_terms(mu, items, 10.0, token_reduction="mean")["score_sq_error"]
    assert first == pytest.approx(before, rel=1e-4)          # the same term as Eq. 7's (release: mean over steps × K)
    assert last == pytest.approx(after, rel=1e-4) and after < 0.5 * before
    assert all(torch.equal(v, mu.backbone.model.state_dict()[k]) for k, v in backbone.items())
    assert any(not torch.equal(a, b) for a, b in zip(head, mu.head.parameters()))


def test_pi_sft_backward_is_the_plain_token_mean(tiny_dir, tmp_path, retriever):
    """The shared-prefix, packed π SFT pass gives the loss and the LoRA gradient of the plain definition:
    −Σ log p(target tokens) / (target tokens in the batch), one ordinary pass per sequence; however the batch
    is cut into passes (single steps, pairs, trajectories packed to a token budget, all in one)."""
    import env
    examples = env.load_split("synthetic", "train", size=3, seed=0)
    warmup.collect(examples, warmup.OracleTeacher(env, seed=0), retriever, tmp_path, k=1, K=3, progress=False)
    pi_examples = warmup.policy_sft_examples(files.read_jsonl(tmp_path / "records.jsonl"))[:5]
    pi = models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=FAST)
    models.add_lora(pi)
    torch.manual_seed(0)
    for p in models.trainable_parameters(pi.model):           # B ≠ 0, so that A's gradient is not zero
        p.data.normal_(0, 0.05)
    batch = [(passes.chat_prompt_ids(pi.tokenizer, ex["messages"]), passes.encode_response(pi, ex["target"]))
             for ex in pi_examples]
    params = models.trainable_parameters(pi.model)
    lp = passes.sequence_logprobs(pi, [p for p, _ in batch], [r for _, r in batch])
    plain = -lp.logprobs.sum() / lp.mask.sum()
    want = torch.autograd.grad(plain, params)
    for units, budget in (([[i] for i in range(5)], None), ([[0, 1], [2, 3], [4]], None),
                          (warmup.trajectory_units(pi_examples), 300), ([list(range(5))], None)):
        for p in params:
            p.grad = None
        got = warmup.policy_sft_backward(pi, batch, units, budget)
        assert got == pytest.approx(float(plain.detach()), rel=1e-5)
        for g, p in zip(want, params):
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode,reduction", [("adaptive", "sum"), ("adaptive", "mean"), ("none", "sum")])
def test_rubric_sft_backward_is_the_same_on_both_engines(tiny_dir, tmp_path, retriever, mode, reduction):
    """The fast engine's μ SFT passes (shared prefix, packed) give Eq. 7's loss and gradient (LoRA and score
    head) of the plain engine on the whole batch in one pass (one ordinary forward per sequence); whatever
    the passes (single steps, pairs, the trajectories, the whole batch)."""
    import env
    examples = env.load_split("synthetic", "train", size=2, seed=0)
    warmup.collect(examples, warmup.OracleTeacher(env, seed=0), retriever, tmp_path, k=2, K=3, progress=False)
    items = warmup.rubric_sft_examples(warmup.filter_records(files.read_jsonl(tmp_path / "records.jsonl"), 3)[0])[:5]
    torch.manual_seed(0)
    mu = rm.RubricModel(models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=FAST), k=3, rubric_mode=mode)
    models.add_lora(mu.backbone, dropout=0.0)
    for p in models.trainable_parameters(mu.backbone.model):
        p.data.normal_(0, 0.05)
    params = [p for g in mu.parameter_groups(1.0, 1.0) for p in g["params"]]
    mu.backbone.engine = PLAIN                 # the engine is the backbone's (--engine at load)
    loss = warmup.rubric_sft_backward(mu, items, 10.0, [list(range(len(items)))], reduction)
    want = [p.grad.clone() for p in params]
    mu.backbone.engine = FAST
    for units in ([[i] for i in range(5)], [[0, 1], [2, 3], [4]], warmup.trajectory_units(items), [list(range(5))]):
        for p in params:
            p.grad = None
        got = warmup.rubric_sft_backward(mu, items, 10.0, units, reduction, pass_tokens=400)
        assert got == pytest.approx(loss, rel=1e-5)
        for g, p in zip(want, params):
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


def test_pi_sft_keeps_the_epoch_with_the_best_dev_em(tiny_dir, tmp_path, retriever, monkeypatch):
    """π SFT keeps the best dev-EM epoch (EM ties: F1, then the earlier): here the evaluation is scripted
    to rank epoch 2 first, and the merged π gives exactly epoch 2's log-probs."""
    import env
    examples = env.load_split("synthetic", "train", size=3, seed=0)
    warmup.collect(examples, warmup.OracleTeacher(env, seed=0), retriever, tmp_path, k=1, K=3, progress=False)
    pi_examples = warmup.policy_sft_examples(files.read_jsonl(tmp_path / "records.jsonl"))
    pi = models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=FAST)
    probe = (passes.chat_prompt_ids(pi.tokenizer, pi_examples[0]["messages"]), passes.encode_response(pi, pi_examples[0]["target"]))
    seen = []

    def fingerprint(policy):
        with torch.no_grad():
            return float(passes.sequence_logprobs(policy, [probe[0]], [probe[1]]).sums())

    def scripted_eval(policy):
        seen.append(fingerprint(policy))
        em, f1 = {1: (30.0, 30.0), 2: (30.0, 40.0), 3: (30.0, 40.0)}[len(seen)]   # EM ties: F1 decides, then
        return {"em": em, "f1": f1}, [f"trajectories of epoch {len(seen)}"]     # the earlier epoch
    schedules = []
    real_schedule = warmup.warmup_cosine
    monkeypatch.setattr(warmup, "warmup_cosine", lambda *a, **k: schedules.append(real_schedule(*a, **k)) or schedules[-1])
    out = warmup.train_policy_sft(pi, pi_examples, epochs=3, lr=3e-2, batch_size=4, progress=False,
                                  evaluate=scripted_eval)
    assert schedules[0].last_epoch == 3 * -(-len(pi_examples) // 4)      # one schedule step per optimizer step
    assert out["best"]["epoch"] == 2 and out["best"]["trajectories"] == ["trajectories of epoch 2"]
    assert [e["f1"] for e in out["evals"]] == [30.0, 40.0, 40.0]
    assert len(set(seen)) == 3                                           # the epochs differ
    assert fingerprint(pi) == pytest.approx(seen[1], abs=1e-4)           # merged: epoch 2's weights


def test_warmup_end_to_end_on_tiny_model(tiny_dir, tmp_path):
    out = tmp_path / "warmup"
    args = warmup.Args(dataset="synthetic", warmup_size=3, warmup_samples=2, eval_size=3, warmup_dir=str(out),
                       model=str(tiny_dir), device="cpu", sft_epochs_pi=2, sft_epochs_mu=1, sft_batch_pi=4,
                       sft_batch_mu=4, max_new_tokens_pi=8, warmup_probe=4, progress=False, eval_all=True,
                       sft_head_steps=0)              # the release's (the cpu preset fits the head: 500 steps)
    assert args.sft_questions_mu == 20 and args.preset == "cpu"    # the rest: the cpu preset, as in arco.py
    warmup.run(args)
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) >= {"base", "sft_only", "mu_sft_terms_before", "mu_sft_terms_after"}
    assert metrics["base"]["n"] == 3 and len(metrics["pi_sft_dev_em_per_epoch"]) == 2
    best = metrics["pi_sft_epoch"]
    assert metrics["sft_only"]["em"] == metrics["pi_sft_dev_em_per_epoch"][best - 1] == \
        max(metrics["pi_sft_dev_em_per_epoch"])
    pi, config = models.load_backbone_checkpoint(out / "pi_sft", device="cpu", engine=FAST)
    assert config["merged_adapters"] == 1 and config["adapter"] is None
    mu = rm.RubricModel.load(out / "mu_sft", device="cpu", engine=FAST)
    assert mu.k == 3 and mu.rubric_mode == "adaptive"
    ctx = rm.StepContext("q?", "", "Search[x]", 3)
    with torch.no_grad():
        scores = mu.score([ctx], [mu.rubric_from_criteria(["a", "b", "c"])])
    assert float(scores.s) == pytest.approx(float(scores.d.mean()))          # Eq. 2 after a reload
    assert metrics["mu"]["mu_sft"]["sft_head_steps"] == 0 and "mu_head_fit_error" not in metrics["mu"]["mu_sft"]
    torch.manual_seed(12345)            # whatever the process drew before: the same seed, the same warmup
    again = warmup.run(dataclasses.replace(args, warmup_dir=str(tmp_path / "again")))
    repeat = json.loads((again / "metrics.json").read_text())
    assert repeat["pi_sft_loss_per_epoch"] == metrics["pi_sft_loss_per_epoch"]
    assert repeat["mu"]["mu_sft"]["mu_sft_loss_per_epoch"] == metrics["mu"]["mu_sft"]["mu_sft_loss_per_epoch"]
    args.sft_head_steps = 10            # a μ whose head was not fitted alone is not reused by a run asking for it
    with pytest.raises(env.DataError, match="--sft-head-steps 0"):
        warmup.run(args)
    args.sft_head_steps = 0
    args.sft_questions_mu = 2           # a μ fine-tuned on other questions is not silently reused
    with pytest.raises(env.DataError, match="--sft-questions-mu 20"):
        warmup.run(args)


def test_mu_on_pi_own_rollouts_end_to_end_on_tiny_model(tiny_dir, tmp_path, retriever, monkeypatch):
    """--mu-data policy (issue 33): after π SFT, π_sft plays the μ SFT questions, the oracle annotates its steps
    (policy_rollouts/records.jsonl), μ is fine-tuned on them into its own folder (mu_sft-policy-q2: the μ SFT
    questions are in its name); then μ's AUC by step type on π_sft's seeded rollouts of held-out dev questions
    (the same steps for every μ)."""
    out = tmp_path / "warmup"
    args = warmup.Args(dataset="synthetic", warmup_size=3, warmup_samples=2, eval_size=2, warmup_dir=str(out),
                       model=str(tiny_dir), device="cpu", sft_epochs_pi=1, sft_epochs_mu=1, sft_batch_pi=4,
                       sft_batch_mu=4, max_new_tokens_pi=8, warmup_probe=2, progress=False,
                       sft_head_steps=0, sft_questions_mu=2, mu_data="policy")
    warmup.run(args)
    records = files.read_jsonl(out / "policy_rollouts" / "records.jsonl")
    assert len(records) == 4 and {r["teacher"] for r in records} == {"oracle-on-policy"}     # 2 questions × 2
    assert all(len(st["criteria"]) == 3 for r in records for st in r["steps"])
    assert (out / "mu_sft-policy-q2" / "config.json").is_file() and not (out / "mu_sft").exists()
    monkeypatch.setattr(study, "POLICY_PROBE_QUESTIONS", 4)
    mu = rm.RubricModel.load(out / "mu_sft-policy-q2", device="cpu", engine=FAST)
    trajs = study.policy_dev_rollouts(args, out, retriever)
    first = study.policy_dev_auc(mu, trajs, 4)
    assert first["questions"] == 4 and first["steps"] >= 4 and set(first) >= {"search", "finish", "all"}
    again = study.policy_dev_rollouts(args, out, retriever)                          # seeded: the same steps
    assert [[st.output for st in t.steps] for t in again] == [[st.output for st in t.steps] for t in trajs]
    assert study.policy_dev_auc(mu, again, 4) == first


def test_warmup_evaluates_on_its_own_dev_size_and_keeps_the_base_evaluation(tiny_dir, tmp_path, monkeypatch):
    """--sft-eval-size: the base and π SFT evaluations take that many dev questions (arco.py then evaluates
    epoch 0 on its --eval-size itself); the base evaluation is saved at once, so a warmup killed during π SFT
    does not evaluate the base model again when it is run again."""
    out = tmp_path / "warmup"
    args = warmup.Args(dataset="synthetic", warmup_size=3, warmup_samples=1, eval_size=3, sft_eval_size=2,
                       warmup_dir=str(out), model=str(tiny_dir), device="cpu", sft_epochs_pi=1, sft_batch_pi=4,
                       max_new_tokens_pi=8, progress=False, train_mu=False, eval_all=True)
    warmup.run(args)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["dev_questions"] == 2 and metrics["base"]["n"] == 2 and metrics["sft_only_settings"]["eval_size"] == 2
    shutil.rmtree(out / "pi_sft")                                  # as if killed before π SFT finished
    metrics.pop("sft_only")
    (out / "metrics.json").write_text(json.dumps(metrics))
    calls = []
    real = warmup.env.evaluate
    monkeypatch.setattr(warmup.env, "evaluate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    warmup.run(args)
    assert len(calls) == 1 and (out / "pi_sft" / "config.json").is_file()     # π SFT's one epoch, no base again


# --- issue 41: what μ's score head learns to read ---------------------------------------------------------------

def _search(ex, i, left, query=None):
    title = ex.paragraphs[i][0]
    query = query or title
    return env.Step(prompt=[], output=f"Search[{query}]", action="search", argument=query,
                    observation=env.observation_text(ex.paragraphs[i], 300), valid=True, reason="",
                    searches_left=left, forced_finish=False, retrieved=i)


def _finish(answer, left):
    return env.Step(prompt=[], output=f"Finish[{answer}]", action="finish", argument=answer, observation=answer,
                    valid=True, reason="", searches_left=left, forced_finish=False)


def test_check_criteria_carry_no_verdict():
    """--criteria check: a useful and a useless search from the same context get criteria that differ only in the
    query they quote (never in a verdict word or a hop count), and so do a right and a wrong Finish; the oracle's
    verdict criteria for the same steps do differ (hop i of N, the paragraphs found)."""
    ex = env.load_split("synthetic-long", "train", size=1, seed=0)[0]
    hop1, hop2 = ex.supporting[0], ex.supporting[1]
    other = next(i for i in range(len(ex.paragraphs)) if i not in ex.supporting)
    prefix = [_search(ex, hop1, 5)]
    useful, useless = _search(ex, hop2, 4), _search(ex, other, 4)
    assert truth.step_usefulness({"steps": [vars(s) for s in prefix + [useful]], "gold": ex.answers}, ex.supporting)[1]
    assert not truth.step_usefulness({"steps": [vars(s) for s in prefix + [useless]], "gold": ex.answers},
                                   ex.supporting)[1]
    # queries other than the titles they retrieve: a criterion that quoted what the step brought back (its
    # paragraph's title, a verdict) would differ between the two searches beyond the query
    asked, asked_other = _search(ex, hop2, 4, "the next link of the chain"), _search(ex, other, 4, "a look-alike")
    for K in (3, 5):
        a, b = study.check_criteria(prefix, asked, K), study.check_criteria(prefix, asked_other, K)
        assert len(a) == K and a != b
        assert [c.replace(asked.argument, "Q") for c in a] == [c.replace(asked_other.argument, "Q") for c in b]
        assert not any(ex.paragraphs[hop2][0] in c or ex.paragraphs[other][0] in c for c in a + b)
        right, wrong = study.check_criteria(prefix, _finish(ex.answer, 4), K), \
            study.check_criteria(prefix, _finish("1899", 4), K)
        assert [c.replace(ex.answer, "A") for c in right] == [c.replace("1899", "A") for c in wrong]
        for c in a + b + right + wrong:
            assert "hop" not in c.lower() and "support" not in c.lower()
            assert not re.search(r"\d+ of \d+", c)
    # the verdict criteria of the same two searches name the hop only on the useful one
    plan = oracle.choose_queries(env, [ex], env.Retriever())[0]
    t_useful = env.Trajectory(example=ex, max_searches=5, steps=prefix + [useful])
    t_useless = env.Trajectory(example=ex, max_searches=5, steps=prefix + [useless])
    va = oracle.oracle_rubric(env, t_useful, oracle.inferred_intents(t_useful, plan), len(plan), 3)[0][1]
    vb = oracle.oracle_rubric(env, t_useless, oracle.inferred_intents(t_useless, plan), len(plan), 3)[0][1]
    assert any("hop 2 of" in c for c in va) and not any("hop" in c for c in vb)


def test_check_criteria_items_keep_the_teacher_scores(tmp_path, retriever):
    """study.check_items (the ladder's check criteria): the same items, the same scores slot for slot, only the
    text is the checks'; balanced_finishes repeats the rarer finish class until both count alike."""
    examples = env.load_split("synthetic-long", "train", size=4, seed=0)
    warmup.collect(examples, warmup.OracleTeacher(env, seed=0), retriever, tmp_path, k=3, K=3, progress=False)
    kept = warmup.filter_records(files.read_jsonl(tmp_path / "records.jsonl"), 3)[0]
    verdict = warmup.rubric_sft_examples(kept)
    check = study.check_items(verdict, kept, 3)
    assert [(v["action"], v["scores"]) for v in verdict] == [(c["action"], c["scores"]) for c in check]
    assert all(c["criteria"] != v["criteria"] for v, c in zip(verdict, check))
    assert any("hop" in " ".join(v["criteria"]) for v in verdict) and not any("hop" in " ".join(c["criteria"])
                                                                              for c in check)
    fin = [it for it in check if it["action"].startswith("Finish[")]
    right = sum(map(study.right_finish, fin))
    assert 0 < right < len(fin)
    balanced = study.balanced_finishes(check)
    bfin = [it for it in balanced if it["action"].startswith("Finish[")]
    assert sum(map(study.right_finish, bfin)) == len(bfin) - sum(map(study.right_finish, bfin)) == max(
        right, len(fin) - right)
    assert balanced[:len(check)] == check


def test_the_own_rubric_head_fit_reads_what_mu_writes(tiny_dir, tmp_path, retriever, monkeypatch):
    """The ladder's own-rubric head fit (fit_score_head's `rubrics`): the score head's pooled vectors come from
    (q, h_t, a_t, r_t) with μ's own greedy r_t, not the teacher's criteria; by hand on the tiny model: the fitted
    head's error is the one computed here on μ.pooled over μ's own rubrics."""
    examples = env.load_split("synthetic", "train", size=2, seed=0)
    warmup.collect(examples, warmup.OracleTeacher(env, seed=0), retriever, tmp_path, k=2, K=3, progress=False)
    items = warmup.rubric_sft_examples(warmup.filter_records(files.read_jsonl(tmp_path / "records.jsonl"), 3)[0])[:6]
    torch.manual_seed(0)
    mu = rm.RubricModel(models.load_backbone(str(tiny_dir), device="cpu", autocast="off", engine=FAST), k=3)
    contexts, teacher, targets = warmup.rubric_items(mu, items)
    own = mu.generate_rubrics(contexts, 0.0, 12, 4)
    assert [r.text for r in own] != [r.text for r in teacher]
    read = []
    scoring_ids = mu.scoring_ids
    monkeypatch.setattr(mu, "scoring_ids", lambda cs, rs: read.append([r.text for r in rs]) or scoring_ids(cs, rs))
    head = {k: v.clone() for k, v in mu.head.state_dict().items()}
    before, _ = warmup.fit_score_head(mu, items, steps=3, lr=1e-2, rubrics=own)
    assert read == [[r.text for r in own]]
    fitted = {k: v.clone() for k, v in mu.head.state_dict().items()}
    mu.head.load_state_dict(head)
    with torch.no_grad():
        by_hand = float(((mu.head(mu.pooled(contexts, own)).float() - targets) ** 2).mean())
    assert before == pytest.approx(by_hand, rel=1e-4)
    read.clear()
    warmup.fit_score_head(mu, items, steps=3, lr=1e-2)                       # the teacher's text (Eq. 7's)
    assert read == [[r.text for r in teacher]]
    assert any(not torch.equal(fitted[k], head[k]) for k in head)


def test_each_mu_variant_has_a_folder_of_its_own():
    base = {"rubric": "adaptive", "k": 3, "model": "embedded", "mu_model": "embedded", "sft_head_steps": 500}
    assert warmup.mu_dir_name(base) == "mu_sft" == warmup.mu_dir_name({})            # an old run's args.json
    assert warmup.mu_dir_name({**base, "mu_data": "policy", "sft_questions_mu": 40}) == "mu_sft-policy-q40"
    assert warmup.mu_dir_name({**base, "mu_data": "policy", "sft_questions_mu": 0}) == "mu_sft-policy-qall"
    assert warmup.mu_dir_name({**base, "rubric": "none", "mu_data": "policy", "sft_questions_mu": 8}) == \
        "mu_sft-none-policy-q8"


def test_each_ladder_variant_has_a_folder_of_its_own():
    base = {"rubric": "adaptive", "k": 3, "model": "embedded", "mu_model": "embedded", "sft_head_steps": 500,
            "mu_data": "policy", "sft_questions_mu": 0}
    assert study.ladder_mu_name(base, {}) == "mu_sft-policy-qall"                  # no variant: core's own name
    assert study.ladder_mu_name(base, {"policy_samples": 4, "criteria": "check", "head_fit": "own",
                                       "balance_finishes": True}) == "mu_sft-policy-qall-n4-check-ownhead-bal"
    assert study.ladder_mu_name({**base, "sft_head_steps": 0}, {"head_fit": "own"}) == "mu_sft-policy-qall"
    assert study.ladder_mu_name({**base, "mu_data": "teacher"}, {"policy_samples": 4}) == "mu_sft"  # no π rollouts
