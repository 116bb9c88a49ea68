"""warmup.py: Eq. 6 projection, the oracle teacher, the OpenAI-compatible teacher against a local
fake server, collection and resume, filtering, and the π / μ SFT datasets."""
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from lab import datacheck, diagnostics

import env
import warmup
from conftest import REPO, ChatServer
from infra import files
from infra import openai_teacher
from infra import oracle

FAKE_KEY = "sk-fake-ARCO-test-key-0123456789"

# ----------------------------------------------------------------------------- Eq. 6


def close(a, b, tol=1e-9):
    return all(abs(x - y) <= tol for ra, rb in zip(a, b) for x, y in zip(ra, rb)) and len(a) == len(b)


def test_project_scores_hand_worked():
    # means 0.3 + 0.1 = 0.4; R = 1 needs +0.6 over two steps: shift c = 0.3, nothing clips
    out = warmup.project_scores([[0.2, 0.4], [0.0, 0.2]], 1.0)
    assert close(out, [[0.5, 0.7], [0.3, 0.5]])
    assert abs(warmup.step_means_sum(out) - 1.0) <= 1e-9
    # with clipping: (min(1, 0.8 + c) + c) / 2 + c = 1.5  ->  0.5 + 1.5 c = 1.5  ->  c = 2/3
    out = warmup.project_scores([[0.8, 0.0], [0.0, 0.0]], 1.5)
    assert close(out, [[1.0, 2 / 3], [2 / 3, 2 / 3]], 1e-6)
    # R = 0 from an all-negative single step: shifted up to 0
    assert close(warmup.project_scores([[-1.0, -1.0, -1.0]], 0.0), [[0.0, 0.0, 0.0]], 1e-6)
    # |R| = T is feasible: everything at the bound
    assert close(warmup.project_scores([[0.1], [0.2]], 2.0), [[1.0], [1.0]], 1e-6)
    assert close(warmup.project_scores([[0.1], [0.2]], -2.0), [[-1.0], [-1.0]], 1e-6)


def test_project_scores_identity_and_infeasible():
    s = [[0.5, 0.5], [0.25, 0.75]]  # means 0.5 + 0.5 = 1
    assert warmup.project_scores(s, 1.0) == s
    assert warmup.project_scores([[0.0, 0.0]], 0.0) == [[0.0, 0.0]]
    assert warmup.project_scores([[0.1], [0.2]], 2.5) is None  # |R| > T
    assert warmup.project_scores([[0.1], [0.2]], -3.0) is None
    assert warmup.project_scores([], 0.0) is None  # T = 0
    assert warmup.project_scores([[]], 1.0) is None  # K = 0
    with pytest.raises(ValueError, match="step 2 has 1 scores"):
        warmup.project_scores([[0.1, 0.2], [0.3]], 1.0)
    with pytest.raises(ValueError, match="outside"):
        warmup.project_scores([[1.5, 0.0]], 1.0)
    with pytest.raises(ValueError, match="outside"):
        warmup.project_scores([[float("nan")]], 0.0)


def random_scores(rng, T, K):
    kind = rng.random()
    if kind < 0.3:  # coarse grid: many ties, many values at the bounds
        return [[rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0]) for _ in range(K)] for _ in range(T)]
    if kind < 0.4:  # all at one bound
        v = rng.choice([-1.0, 1.0])
        return [[v] * K for _ in range(T)]
    return [[rng.uniform(-1, 1) for _ in range(K)] for _ in range(T)]


def test_project_scores_properties():
    rng = random.Random(1234)
    feasible = infeasible = clipped = 0
    for case in range(600):
        T, K = rng.randint(1, 7), rng.randint(1, 5)
        s = random_scores(rng, T, K)
        R = rng.choice([0.0, 1.0, 1.0, rng.uniform(-T - 1.5, T + 1.5)])
        out = warmup.project_scores(s, R)
        if abs(R) > T:
            assert out is None, (case, s, R)
            infeasible += 1
            continue
        feasible += 1
        assert out is not None, (case, s, R)
        assert len(out) == T and all(len(row) == K for row in out)
        assert abs(warmup.step_means_sum(out) - R) <= 1e-6, (case, s, R)
        assert all(-1.0 <= v <= 1.0 for row in out for v in row)
        flat_in = [v for row in s for v in row]
        flat_out = [v for row in out for v in row]
        clipped += any(abs(v) == 1.0 for v in flat_out)
        for a in range(len(flat_in)):  # order kept within and across steps (ties allowed)
            for b in range(len(flat_in)):
                if flat_in[a] <= flat_in[b]:
                    assert flat_out[a] <= flat_out[b], (case, s, R, a, b)
        # identity: projecting a projection returns it unchanged
        assert warmup.project_scores(out, R) == out
        if abs(warmup.step_means_sum(s) - R) <= 1e-6:
            assert out == s
    assert feasible > 400 and infeasible > 20 and clipped > 100  # the cases cover what they should


def test_fit_scores():
    """App. B's clip-and-fit of a step's teacher scores to K numbers in [−1, 1] (warmup.fit_scores)."""
    fit = lambda raw, K: warmup.fit_scores(raw, K)[0]                      # noqa: E731
    assert fit([0.5, "-0.25", 3, "-7"], 4) == [0.5, -0.25, 1.0, -1.0]
    assert fit([0.5], 3) == [0.5, 0.0, 0.0]  # padded with 0.0
    assert fit([0.1, 0.2, 0.3, 0.4], 2) == [0.1, 0.2]  # cut
    assert fit(["high", None, True, float("nan")], 4) == [0.0, 0.0, 0.0, 0.0]
    assert fit(0.7, 2) == [0.7, 0.0] and fit(None, 2) == [0.0, 0.0]
    assert fit([float("inf"), " 0.5 "], 2) == [1.0, 0.5]
    assert warmup.fit_scores([2, "x"], 3)[1] == ["2 scores for K=3", "out of range score 2", "non-numeric score 'x'"]


# ----------------------------------------------------------------------------- the oracle teacher


def oracle_records(retriever, examples, tmp_path, k=4, K=3):
    run = warmup.collect(examples, warmup.OracleTeacher(env, seed=0), retriever, tmp_path, k=k, K=K, progress=False)
    return run, files.read_jsonl(tmp_path / "records.jsonl")


def check_record(r, K):
    assert all(len(s["criteria"]) == K and all(c.strip() for c in s["criteria"]) for s in r["steps"])
    assert all(len(s["scores"]) == K and all(-1 <= v <= 1 for v in s["scores"]) for s in r["steps"])
    assert r["projected"] and abs(warmup.step_means_sum([s["scores"] for s in r["steps"]]) - r["reward"]) <= 1e-6
    for s in r["steps"]:  # the projection keeps the teacher's order within each step
        for a in range(K):
            for b in range(K):
                if s["teacher_scores"][a] <= s["teacher_scores"][b]:
                    assert s["scores"][a] <= s["scores"][b]


def test_oracle_on_synthetic(retriever, tmp_path):
    examples = env.synthetic_examples(12, seed=5, split="train")
    run, records = oracle_records(retriever, examples, tmp_path, k=4, K=3)
    assert run["records"] == 48 and len(records) == 48
    assert {(r["id"], r["sample"]) for r in records} == {(ex.id, s) for ex in examples for s in range(4)}
    rewards = Counter(r["reward"] for r in records)
    assert rewards[1.0] >= 12 and rewards[0.0] >= 12  # both outcomes in the warmup set
    gold = [r for r in records if r["variant"] == "gold"]
    assert len(gold) == 12 and all(r["reward"] == 1.0 and r["evidence_found"] for r in gold)
    assert {r["variant"] for r in records} == {"gold", *oracle.VARIANTS}
    for r in records:
        check_record(r, 3)
        for s in r["steps"]:  # every step logged as the environment saw it
            assert {"output", "action", "argument", "observation", "valid", "searches_left", "retrieved"} <= set(s)
    ex = examples[0]
    g = next(r for r in gold if r["id"] == ex.id)
    first = g["steps"][0]
    entity = ex.paragraphs[ex.hops[0]["paragraph"]][0]
    assert first["action"] == "search" and entity in first["argument"] and entity in first["criteria"][0]
    assert first["retrieved"] == ex.hops[0]["paragraph"]
    assert g["steps"][-1]["argument"] == ex.answer and "final answer" in g["steps"][-1]["criteria"][0]
    # the rubric scores what happened: a redundant search loses novelty, a wrong answer loses correctness
    red = [r for r in records if r["variant"] == "redundant"]
    assert red and all(any(s["teacher_scores"][2] == -1.0 for s in r["steps"] if s["action"] == "search") for r in red)
    wrong = [r for r in records if r["variant"] == "wrong_answer"]
    assert wrong and all(r["reward"] == 0.0 and r["steps"][-1]["teacher_scores"][0] == -1.0 for r in wrong)
    # a missed hop: a distractor searched in place of one gold hop, the evidence incomplete, R = 0
    missed = [r for r in records if r["variant"] == "missed_hop"]
    assert missed and all(r["reward"] == 0.0 and not r["evidence_found"] for r in missed)
    for r in missed:
        searches = [s for s in r["steps"] if s["action"] == "search"]
        same = next(g for g in gold if g["id"] == r["id"])
        assert len(searches) == sum(s["action"] == "search" for s in same["steps"])
        assert sum(s["retrieved"] not in r["supporting"] for s in searches) == 1
        assert any(s["retrieved"] in r["supporting"] for s in searches) == (len(searches) > 1)
    went = [r for r in records if r["variant"] == "wrong_entity"]
    assert went and all(any(s["teacher_scores"][0] == -1.0 and s["retrieved"] not in r["supporting"]
                            for s in r["steps"]) for r in went)
    # a rerun finds everything done
    assert warmup.collect(examples, warmup.OracleTeacher(env), retriever, tmp_path, k=4, progress=False) == \
        {"skipped_finished": 48}


def test_mu_sft_takes_the_first_questions_when_capped(retriever, tmp_path):
    """--sft-questions-mu N: μ's SFT items come from the first N warmup questions only; π's from all."""
    examples = env.synthetic_examples(6, seed=5, split="train")
    _, records = oracle_records(retriever, examples, tmp_path, k=2, K=3)
    args = warmup.Args(dataset="synthetic", warmup_samples=2, sft_questions_mu=2)
    summary, pi, mu = warmup.summarize(records, examples, {}, args, warmup.OracleTeacher(env))
    assert {x["id"] for x in mu} == {ex.id for ex in examples[:2]}
    assert {x["id"] for x in pi} == {ex.id for ex in examples}    # the oracle's gold trajectories all end R = 1 here
    assert summary["mu_records_kept"] == 4 and summary["rubric_sft_examples"] == len(mu)
    args.sft_questions_mu = 0
    assert {x["id"] for x in warmup.summarize(records, examples, {}, args, warmup.OracleTeacher(env))[2]} == \
        {ex.id for ex in examples}


def test_oracle_width_K(retriever, tmp_path):
    examples = env.synthetic_examples(3, seed=6, split="train")
    for K in (1, 7):
        _, records = oracle_records(retriever, examples, tmp_path / str(K), k=2, K=K)
        for r in records:
            check_record(r, K)


def test_oracle_on_shared_dev_samples(data_dir, retriever, tmp_path):
    for dataset in ("hotpotqa", "2wiki", "musique"):
        examples = env.load_split(dataset, "dev", data_dir, size=4, seed=1)
        if dataset == "2wiki":  # include a bridge_comparison question: 4 supporting paragraphs, 3 searches
            ids = {e.id for e in examples}
            examples += [e for e in env.load_split(dataset, "dev", data_dir)
                         if e.type == "bridge_comparison" and e.id not in ids][:1]
        _, records = oracle_records(retriever, examples, tmp_path / dataset, k=3)
        assert Counter(r["reward"] for r in records)[0.0] >= 1
        budget = env.DEFAULT_MAX_SEARCHES[dataset]
        for r in records:
            check_record(r, 3)
            seen = {s["retrieved"] for s in r["steps"] if s["action"] == "search"}
            assert r["evidence_found"] == (set(r["supporting"]) <= seen)
            assert sum(s["action"] == "search" for s in r["steps"]) <= budget
            if r["variant"] == "gold":
                assert r["reward"] == 1.0 and r["steps"][-1]["action"] == "finish"
            for s in r["steps"]:
                if s["action"] == "search":  # natural queries: no paragraph text pasted in
                    assert len(s["argument"].split()) <= 30
        pi = warmup.policy_sft_examples(records)
        assert {(x["id"], x["sample"]) for x in pi} == {(r["id"], r["sample"]) for r in records
                                                       if r["variant"] == "gold" and r["evidence_found"]}
        if dataset == "2wiki":
            bc = [r for r in records if r["id"] == examples[-1].id and r["variant"] == "gold"]
            assert bc[0]["reward"] == 1.0 and not bc[0]["evidence_found"]  # can't fit the budget: no π example


def test_gold_evidence_rate_hotpotqa_sample(data_dir, retriever):
    # Acceptance 2 is measured on the whole dev sample by `diagnostics.py --check-gold` (README); here a slice.
    examples = env.load_split("hotpotqa", "dev", data_dir, size=20, seed=2)
    r = datacheck.gold_evidence_rate(examples, retriever)
    assert r["questions"] == 20 and r["reward"] == 1.0 and r["all_evidence"] >= 0.85


def test_check_gold_cli(capsys):
    diagnostics.main(["--check-gold", "--check-retrieval", "--dataset", "synthetic", "--split", "train", "--check-size", "8"])
    out = capsys.readouterr().out
    assert re.search(r"synthetic/train: 8 questions; the gold trajectory retrieved every supporting paragraph for \d", out)
    assert re.search(r"synthetic/train: \d+ supporting-title queries, supporting paragraph retrieved \d", out)


# ----------------------------------------------------------------------------- SFT datasets and filtering


def test_policy_sft_prompts_match_the_environment(retriever):
    examples = env.synthetic_examples(6, seed=7, split="train")
    teacher = warmup.OracleTeacher(env)
    pairs = [(ex, s) for ex in examples for s in range(4)]
    trajs, metas = teacher.rollout(pairs, retriever)
    records = []
    for (ex, s), t, m in zip(pairs, trajs, metas):
        c, sc, issues = teacher.annotate(t, m, 3)
        records.append(warmup.make_record(ex, s, t, m, c, sc, issues, 3, 1e-6, "oracle"))
    records = [json.loads(json.dumps(r)) for r in records]  # as read back from records.jsonl
    # every valid step of every trajectory: the rebuilt prompt is exactly what env.rollout showed π
    loose = [dict(r, imperfect=False) for r in records]
    examples_pi = warmup.policy_sft_examples(loose, min_reward=0.0, require_evidence=False)
    shown = {(r["id"], r["sample"], i): s.prompt for r, t in zip(records, trajs) for i, s in enumerate(t.steps)}
    assert len(examples_pi) == sum(len(t.steps) for t in trajs)
    assert any("No searches are left" in x["messages"][1]["content"] for x in examples_pi)  # forced finish covered
    traj_of = {(ex.id, s): t for (ex, s), t in zip(pairs, trajs)}
    for x in examples_pi:
        assert x["messages"] == shown[(x["id"], x["sample"], x["step"])]
        step = traj_of[(x["id"], x["sample"])].steps[x["step"]]
        assert x["target"] == f"{step.action.capitalize()}[{step.argument}]"
    # the real filter: R >= 1, evidence found, not a deliberately imperfect variant
    dropped = Counter()
    pi = warmup.policy_sft_examples(records, dropped=dropped)
    assert {x["sample"] for x in pi} == {0} and len(pi) == sum(len(t.steps) for t, (_, s) in zip(trajs, pairs) if s == 0)
    assert dropped["low_reward"] >= 6 and dropped["imperfect_variant"] >= 1
    # μ SFT items
    mu = warmup.rubric_sft_examples(records)
    assert len(mu) == sum(len(t.steps) for t in trajs)
    item = next(x for x in mu if x["step"] == 1)
    t = traj_of[(item["id"], item["sample"])]
    assert item["prefix"] == env.format_history(t.steps[:1]) and item["action"] == t.steps[1].action_text()
    assert item["question"] == t.example.question and item["searches_left"] == t.steps[1].searches_left
    assert len(item["criteria"]) == 3 and len(item["scores"]) == 3


def test_filter_records():
    def rec(reward, scores, criteria=None, projected=True):
        steps = [{"scores": s, "criteria": (criteria or [["a", "b"]] * len(scores))[i]} for i, s in enumerate(scores)]
        return {"reward": reward, "projected": projected, "steps": steps}
    good = rec(1.0, [[0.5, 0.5], [0.25, 0.75]])
    gap = rec(1.0, [[0.5, 0.5], [0.5, 0.5]], criteria=[["a", "b"], ["", "b"]])
    records = [good, gap, rec(1.0, [[0.5, 0.5], [0.5, 0.4]]), rec(0.0, [None], projected=False),
               rec(0.0, [[0.0, 0.0, 0.0]]), rec(1.0, [[1.0, 1.0]], criteria=[[]])]
    kept, dropped = warmup.filter_records(records, K=2, tol=1e-6)
    assert kept == [good, gap, records[-1]]
    assert dropped == {"constraint_violated": 1, "infeasible_projection": 1, "wrong_width": 1, "empty_criteria_steps": 2}


# ----------------------------------------------------------------------------- a fake OpenAI-compatible server


class FakeAPI:
    """/v1/chat/completions on 127.0.0.1: a scripted policy and a scripted rubric annotator.

    `behaviour[question]` lists what happens to that question's requests: "429" / "500" (the first
    policy or rubric request fails), "fail" (every policy request fails with 500, echoing the key),
    "timeout" (the first policy request sleeps past the client timeout), "malformed" (the first
    rubric reply is not JSON, the second is fenced JSON with trailing commas), "missing_step",
    "out_of_range", "wrong" (the policy finishes with a wrong answer), "invalid" (its first reply
    holds no action).
    """

    def __init__(self, examples, behaviour=None, delay=0.0, K=3):
        self.examples = {ex.question: ex for ex in examples}
        self.behaviour = behaviour or {}
        self.delay, self.K = delay, K
        self.log = []  # (question, kind, messages)
        self.seen = Counter()
        self.lock = threading.Lock()
        self.server = ChatServer(self.respond)
        self.url, self.close = self.server.url, self.server.close

    def count(self, question=None, kind=None, since=0):
        return sum((question is None or q == question) and (kind is None or k == kind) for q, k, _ in self.log[since:])

    @staticmethod
    def reply(text):
        return ChatServer.completion(text, prompt_tokens=100, completion_tokens=10)

    @staticmethod
    def error(status, message):
        return ChatServer.error(message)

    def respond(self, path, body, auth):
        if path != "/v1/chat/completions":
            return 404, self.error(404, f"no route {path}"), 0
        messages = body["messages"]
        user = messages[-1]["content"]
        kind = "policy" if messages[0]["content"] == env.SYSTEM_PROMPT else "rubric"
        question = re.search(r"Question: (.*)\n", user).group(1)
        ex = self.examples[question]
        todo = self.behaviour.get(question, ())
        with self.lock:
            self.log.append((question, kind, messages))
            n = self.seen[(question, kind)]
            self.seen[(question, kind)] += 1
        if kind == "policy":
            if "fail" in todo:
                return 500, self.error(500, f"backend exploded while serving {auth}"), self.delay
            if n == 0 and "429" in todo:
                return 429, self.error(429, "slow down"), 0
            if n == 0 and "timeout" in todo:
                return 200, self.reply("Finish[too late]"), 2.5
            step = user.count("\nObservation: ")
            invalid = "invalid" in todo and step == 0 and "Invalid action" not in user
            script = [f"Search[{ex.paragraphs[h['paragraph']][0]}]" for h in ex.hops]
            script.append(f"Finish[{'wrong guess' if 'wrong' in todo else ex.answer}]")
            if invalid:
                return 200, self.reply("Let me think about who this is."), self.delay
            step -= "invalid" in todo  # the invalid step took one turn
            return 200, self.reply("Thought: I need evidence.\n" + script[min(step, len(script) - 1)]), self.delay
        if n == 0 and "500" in todo:
            return 500, self.error(500, "internal error"), 0
        T = len(re.findall(r"^Step \d+ \(searches left", user, flags=re.MULTILINE))
        K = self.K
        steps = [{"step": t, "criteria": [f"criterion {j} of step {t} about {ex.question[:20]}" for j in range(K)],
                  "scores": [0.5] * K} for t in range(1, T + 1)]
        if "missing_step" in todo:
            steps = [s for s in steps if s["step"] != 2]
        if "out_of_range" in todo:
            steps[0]["scores"] = [3, "-7", "0.25", 0.9]  # too wide, out of range, a string
            steps[-1]["scores"] = [0.1]  # too narrow
        text = json.dumps({"steps": steps})
        if "malformed" in todo:
            if n == 0:
                return 200, self.reply("Sure! Here is my assessment: the agent did well."), self.delay
            text = "```json\n" + text.replace("]}", "],}") + "\n```"
        return 200, self.reply(text), self.delay


@pytest.fixture
def api_env(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", FAKE_KEY)

    def start(examples, **kw):
        api = FakeAPI(examples, **kw)
        monkeypatch.setenv("OPENAI_BASE_URL", api.url)
        servers.append(api)
        return api
    servers = []
    yield start
    for s in servers:
        s.close()


def api_teacher(**kw):
    return warmup.OpenAITeacher(env, "fake-policy", "fake-rubric", temperature=0.7, max_retries=kw.pop("max_retries", 2),
                                backoff=0.01, timeout=kw.pop("timeout", 1.0), concurrency=kw.pop("concurrency", 3), **kw)


def files_under(folder):
    return [p for p in Path(folder).rglob("*") if p.is_file()]


def test_openai_teacher_end_to_end(api_env, retriever, tmp_path):
    examples = env.synthetic_examples(10, seed=8, split="train")
    names = ["good", "malformed", "missing_step", "out_of_range", "429", "500", "fail", "timeout", "wrong", "invalid"]
    behaviour = {ex.question: {name} for ex, name in zip(examples, names)}
    api = api_env(examples, behaviour=behaviour)
    q = {name: ex for ex, name in zip(examples, names)}
    teacher = api_teacher()
    run = warmup.collect(examples, teacher, retriever, tmp_path, k=2, K=3, progress=False)
    records = files.read_jsonl(tmp_path / "records.jsonl")
    got = Counter(r["id"] for r in records)
    assert got == {ex.id: 2 for ex in examples if ex is not q["fail"]}  # the failing question skipped, run went on
    failures = files.read_jsonl(tmp_path / "failures.jsonl")
    assert {(f["id"], f["stage"]) for f in failures} == {(q["fail"].id, "policy")}
    assert "500" in failures[0]["error"] and "[redacted]" in failures[0]["error"]
    assert run["records"] == 18 and run["failed_policy"] == 2
    assert api.count(q["fail"].question) == 3  # one call and two retries, then given up
    by = {name: [r for r in records if r["id"] == q[name].id] for name in names if name != "fail"}
    for name, rs in by.items():
        for r in rs:
            assert r["teacher"] == "openai" and r["K"] == 3 and r["projected"], name
            if name != "missing_step":
                check_record(r, 3)
            assert abs(warmup.step_means_sum([s["scores"] for s in r["steps"]]) - r["reward"]) <= 1e-6
    assert all(r["reward"] == 1.0 for r in by["good"]) and all(r["reward"] == 0.0 for r in by["wrong"])
    assert all(r["steps"][0]["criteria"][0] == f"criterion 0 of step 1 about {q['good'].question[:20]}" for r in by["good"])
    # retried and then fine: 429 and timeout on the policy, 500 on the rubric, malformed rubric asked again
    assert api.count(q["429"].question, "policy") == 2 * 3 + 1
    assert api.count(q["timeout"].question, "policy") == 2 * 3 + 1
    assert api.count(q["500"].question, "rubric") == 2 + 1
    assert api.count(q["malformed"].question, "rubric") == 2 + 1
    # a missing step: no criteria (dropped from μ SFT), neutral scores before projection
    for r in by["missing_step"]:
        assert "step 2 missing" in r["annotation_issues"] and r["steps"][1]["criteria"] == ["", "", ""]
        assert r["steps"][1]["teacher_scores"] == [0.0, 0.0, 0.0]
    kept, dropped = warmup.filter_records(records, 3)
    assert len(kept) == 18 and dropped["empty_criteria_steps"] == 2
    mu = warmup.rubric_sft_examples(kept)
    assert not any(x["id"] == q["missing_step"].id and x["step"] == 1 for x in mu)
    # scores out of range and of the wrong width: clipped and fitted to K, then projected
    for r in by["out_of_range"]:
        assert r["steps"][0]["teacher_scores"] == [1.0, -1.0, 0.25] and r["steps"][-1]["teacher_scores"] == [0.1, 0.0, 0.0]
        assert any("out of range" in i for i in r["annotation_issues"])
    # the invalid first step is logged, and later prompts show it exactly as the environment did
    for r in by["invalid"]:
        assert not r["steps"][0]["valid"] and r["steps"][0]["reason"] and r["reward"] == 1.0
    pi = warmup.policy_sft_examples(records, require_evidence=False)
    sent = [m for qq, k, m in api.log if qq == q["invalid"].question and k == "policy"]
    for x in (x for x in pi if x["id"] == q["invalid"].id):
        assert x["messages"] in sent and x["step"] > 0  # the invalid step itself is never a target
    for name in ("good", "429"):
        for x in (x for x in pi if x["id"] == q[name].id):
            assert x["messages"] in [m for qq, k, m in api.log if qq == q[name].question]
    # counters
    use = teacher.usage()
    assert use["retries"] == 1 + 1 + 1 + 2 and use["failed_calls"] == 1  # 429, timeout, 500, and the failing question
    answered = use["calls"] - use["retries"] - use["failed_calls"]
    assert use["prompt_tokens"] == 100 * answered and use["completion_tokens"] == 10 * answered
    assert use["cost_usd"] == pytest.approx((use["prompt_tokens"] * 0.15 + use["completion_tokens"] * 0.60) / 1e6)
    # a rerun asks nothing about finished questions; only the failed one is tried again
    before = len(api.log)
    run2 = warmup.collect(examples, api_teacher(), retriever, tmp_path, k=2, K=3, progress=False)
    assert run2 == {"skipped_finished": 18, "failed_policy": 2}
    assert {qq for qq, _, _ in api.log[before:]} == {q["fail"].question}
    # the key never reaches a file
    for path in files_under(tmp_path):
        assert FAKE_KEY not in path.read_text(encoding="utf-8", errors="replace"), path


def test_parse_annotation_variants():
    T, K = 2, 2
    text = ('Here you go:\n[{"step": 0, "criteria": [{"criterion": "a1", "score": "0.5"}, {"text": "a2", "score": 2}]},'
            ' {"step": 1, "criteria": ["b1", "b2", "b3"], "scores": [0.1, 0.2, 0.3]}]')
    c, s, issues = openai_teacher.parse_annotation(text, T, K)
    assert c == [["a1", "a2"], ["b1", "b2"]] and s == [["0.5", 2], [0.1, 0.2, 0.3]]          # as the teacher wrote them
    assert [warmup.fit_scores(row, K)[0] for row in s] == [[0.5, 1.0], [0.1, 0.2]]
    assert any("out of range" in i for row in s for i in warmup.fit_scores(row, K)[1])
    c, s, issues = openai_teacher.parse_annotation('{"steps": [{"step": "Step 2", "criteria": ["x"], "scores": [1]}]}', T, K)
    assert c == [["", ""], ["x", ""]] and s == [[], [1]] and "step 1 missing" in issues
    assert [warmup.fit_scores(row, K)[0] for row in s] == [[0.0, 0.0], [1.0, 0.0]]
    with pytest.raises(warmup.TeacherError):
        openai_teacher.parse_annotation("I cannot grade this.", T, K)
    with pytest.raises(warmup.TeacherError):
        openai_teacher.parse_annotation('{"verdict": "good"}', T, K)


def test_rubric_prompt_states_the_constraint(retriever):
    [ex] = env.synthetic_examples(1, seed=9, split="train")
    trajs, metas = warmup.OracleTeacher(env).rollout([(ex, 0)], retriever)
    msgs = openai_teacher.annotation_messages(trajs[0], 3)
    user = msgs[1]["content"]
    assert ex.question in user and "R = 1" in user and "exactly 3 criteria" in user
    assert "must sum to R = 1" in user and "Step 3 (searches left: 1): Finish[" in user
    assert '"scores"' in user and '"criteria"' in user


def test_missing_api_key_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(warmup.TeacherError, match="OPENAI_API_KEY"):
        warmup.OpenAITeacher(env)


# ----------------------------------------------------------------------------- resume after a kill


class InterruptingOracle(warmup.OracleTeacher):
    """Stops the run (as Ctrl-C would) at the n-th annotation."""

    def __init__(self, n):
        super().__init__(env)
        self.n, self.annotated = n, []

    def annotate(self, traj, meta, K):
        if len(self.annotated) + 1 == self.n:
            raise KeyboardInterrupt
        self.annotated.append(traj.example.id)
        return super().annotate(traj, meta, K)


class CountingOracle(warmup.OracleTeacher):
    def __init__(self):
        super().__init__(env)
        self.annotated = []

    def annotate(self, traj, meta, K):
        self.annotated.append((traj.example.id, meta["variant"]))
        return super().annotate(traj, meta, K)


def test_resume_after_interrupt(retriever, tmp_path):
    examples = env.synthetic_examples(5, seed=10, split="train")
    with pytest.raises(KeyboardInterrupt):
        warmup.collect(examples, InterruptingOracle(8), retriever, tmp_path, k=3, progress=False)
    first = (tmp_path / "records.jsonl").read_text().splitlines()
    assert len(first) == 7
    teacher = CountingOracle()
    run = warmup.collect(examples, teacher, retriever, tmp_path, k=3, progress=False)
    assert run["skipped_finished"] == 7 and run["records"] == 8 and len(teacher.annotated) == 8
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert lines[:7] == first  # nothing written before is touched
    pairs = [(json.loads(x)["id"], json.loads(x)["sample"]) for x in lines]
    assert sorted(pairs) == sorted((ex.id, s) for ex in examples for s in range(3)) and len(set(pairs)) == 15


def test_kill_and_resume_the_cli(api_env, retriever, tmp_path):
    """SIGKILL `python warmup.py --teacher openai` mid-collection, rerun: nothing lost, nothing repeated."""
    examples = env.load_split("synthetic", "train", size=6, seed=0)
    api = api_env(examples, delay=0.1)
    out = tmp_path / "run"
    cmd = [sys.executable, "warmup.py", "--dataset", "synthetic", "--warmup-size", "6", "--warmup-samples", "2",
           "--teacher", "openai",
           "--teacher-policy-model", "fake-policy", "--teacher-rubric-model", "fake-rubric", "--concurrency", "1",
           "--backoff", "0.01", "--timeout", "5", "--warmup-dir", str(out), "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    records = out / "records.jsonl"
    deadline = time.time() + 90
    while time.time() < deadline and proc.poll() is None:
        if records.exists() and records.read_text().count("\n") >= 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(0.3)  # let the server log anything the killed process had already sent
    before = records.read_text().splitlines()
    assert 3 <= len(before) < 12
    with open(records, "a") as f:  # and a record cut short by the kill
        f.write('{"id": "syn-train-0-000005", "sample": 1, "stee')
    finished = Counter(json.loads(x)["id"] for x in before)
    start = len(api.log)
    run = warmup.collect(examples, api_teacher(concurrency=2), retriever, out, k=2, K=3, progress=False)
    assert run["skipped_finished"] == len(before) and run["records"] == 12 - len(before)
    lines = records.read_text().splitlines()
    assert lines[:len(before)] == before and all(json.loads(x) for x in lines)
    pairs = [(json.loads(x)["id"], json.loads(x)["sample"]) for x in lines]
    assert len(pairs) == 12 and len(set(pairs)) == 12
    for ex in examples:  # no call for finished (id, sample) pairs
        left = 2 - finished[ex.id]
        assert api.count(ex.question, "rubric", since=start) == left, ex.id
        assert api.count(ex.question, "policy", since=start) == 3 * left, ex.id  # 3 steps per trajectory
    args = json.loads((out / "args.json").read_text())
    assert args["teacher"] == "openai" and FAKE_KEY not in json.dumps(args)
    for path in files_under(out):
        assert FAKE_KEY not in path.read_text(encoding="utf-8", errors="replace"), path


def test_records_from_another_configuration_are_refused(retriever, tmp_path):
    examples = env.synthetic_examples(2, seed=11, split="train")
    warmup.collect(examples, warmup.OracleTeacher(env), retriever, tmp_path, k=1, K=3, progress=False)

    class OtherTeacher(warmup.OracleTeacher):
        name = "other"
    with pytest.raises(ValueError, match="teacher=oracle K=3, this run uses teacher=other K=3"):
        warmup.collect(examples, OtherTeacher(env), retriever, tmp_path, k=1, K=3, progress=False)
    # another K is not refused: it is another collection, beside the first (warmup.collection_suffix)
    warmup.collect(examples, warmup.OracleTeacher(env), retriever, tmp_path, k=1, K=5, progress=False)
    assert [r["K"] for r in files.read_jsonl(tmp_path / "records-k5.jsonl")] == [5, 5]
    assert [r["K"] for r in files.read_jsonl(tmp_path / "records.jsonl")] == [3, 3]
    (tmp_path / "records-k5.jsonl").write_text((tmp_path / "records.jsonl").read_text())   # mixed by hand
    with pytest.raises(ValueError, match="K=3, this run uses teacher=oracle K=5"):
        warmup.collect(examples, warmup.OracleTeacher(env), retriever, tmp_path, k=1, K=5, progress=False)


def test_on_policy_collection_labels_pi_own_steps_by_hand(retriever, tmp_path):
    """Issue 33: the oracle annotates a policy's own trajectory. On a long chain a scripted 'π' searches A (hop 1),
    a look-alike of A (a wrong entity), A again (a repeat), then answers wrongly: the relevance score of each
    search is +1 / −1 / +1 (the repeat targets a gold paragraph), its novelty +1 / +1 / −1, the Finish's
    correctness −1; R = 0, so the projected scores sum to 0 (Eq. 6). Records go to their own file."""
    ex = env.load_split("synthetic-long", "dev", size=1)[0]
    titles = [t for t, _ in ex.paragraphs]
    a = titles[ex.hops[0]["paragraph"]]
    alike = next(t for t in titles if t != a and t.split(" ", 1)[-1] == a.split(" ", 1)[1])
    teacher = warmup.OnPolicyTeacher.__new__(warmup.OnPolicyTeacher)
    warmup.OracleTeacher.__init__(teacher, env, seed=0, obs_chars=400)
    script = iter([f"Search[{a}]", f"Search[{alike}]", f"Search[{a}]", "Finish[nowhere at all]"])
    teacher.act = lambda prompts, seeds=None: [next(script) for _ in prompts]
    warmup.collect([ex], teacher, retriever, tmp_path, k=1, K=3, progress=False)
    (rec,) = files.read_jsonl(tmp_path / "records.jsonl")
    assert rec["teacher"] == "oracle-on-policy" and rec["variant"] == "policy" and rec["reward"] == 0.0
    steps = rec["steps"]
    assert [st["teacher_scores"][0] for st in steps] == [1.0, -1.0, 1.0, -1.0]     # relevant / right answer
    assert [st["teacher_scores"][2] for st in steps[:3]] == [1.0, 1.0, -1.0]          # new query and paragraph
    assert "hop 1 of" in steps[0]["criteria"][0] and f'"{alike}"' in steps[1]["criteria"][0]
    assert sum(sum(st["scores"]) / 3 for st in steps) == pytest.approx(0.0, abs=1e-6)   # Σ_t s_t = R
