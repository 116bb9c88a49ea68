"""diagnostics.py --run (issue 6, the CLI half): the side-by-side comparison of finished runs (reused,
stored and forced evaluations) and --diagnose (credit assignment of μ on held-out oracle
trajectories, μ as a judge, RQ3 Bind / Spec, RQ4 redundancy, plots, the trajectory page).

Everything runs on whole tiny runs (a random 2-layer Llama, synthetic data): an ARCO run with a
sparse and a dense epoch and an outcome run, sharing one warmup. A tiny model writes no usable
rubric, so the diagnostics of rubric TEXT (Bind, redundancy, the page) also run on copies of the
ARCO run whose last training traces are replaced by oracle-annotated ones, where the expected
numbers are known.
"""
import html
import json
import os
import re
import shutil
from pathlib import Path

import pytest

import arco
import env
from infra.runs import auc
from lab import compare, diagnostics, mu_credit, stats, study, truth
import rubric_model as rm
import warmup
from conftest import ChatServer
from infra.settings import main_guard
from test_arco import tiny_args
from infra import models
from infra.fast import FAST


def tiny_argv(tiny_dir, out, **kw):
    """test_arco's tiny run, with 2 training questions."""
    return tiny_args(tiny_dir, out, train_size=2, **kw)


@pytest.fixture(scope="module")
def runs(tiny_dir, tmp_path_factory):
    """runs/synthetic/{warmup, arco (2 epochs, dense from 2), outcome (1 epoch)}, every stage evaluated (--eval-all:
    the base model and every epoch, the rows a comparison reuses)."""
    out = tmp_path_factory.mktemp("runs")
    arco.main(tiny_argv(tiny_dir, out, eval_all=True))
    arco.main(tiny_argv(tiny_dir, out, reward="outcome", epochs=1, eval_all=True))
    return out / "synthetic"


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def evals_of(run):
    return {r["epoch"]: r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval"}


def main(argv):
    """diagnostics.py as its command line runs it (main_guard: one-line errors exit 2); its exit status."""
    try:
        main_guard(lambda: diagnostics.main([str(a) for a in argv]), env.DataError, models.ModelLoadError)
    except SystemExit as e:
        return e.code
    return 0


def no_evaluation(monkeypatch):
    def fail(*a, **kw):
        pytest.fail("a policy was loaded or evaluated although an evaluation was stored")
    monkeypatch.setattr(env, "evaluate", fail)
    monkeypatch.setattr(models, "load_backbone_checkpoint", fail)


def counting_evaluation(monkeypatch):
    calls = []
    real = env.evaluate

    def spy(examples, *a, **kw):
        calls.append([ex.id for ex in examples])
        return real(examples, *a, **kw)
    monkeypatch.setattr(env, "evaluate", spy)
    return calls


# ----------------------------------------------------------------------------- scores of trace rows

def _row(type_, gold, answer, finished, actions):
    steps = [{"action": a, "valid": a != "invalid", "argument": "x", "output": "x"} for a in actions]
    return {"type": type_, "gold": gold, "answer": answer, "finished": finished, "steps": steps}


def test_trajectory_scores_by_type_by_hand():
    rows = [_row("bridge", ["Paris"], "paris", True, ["search", "search", "finish"]),            # EM 1, F1 1
            _row("bridge", ["the Eiffel Tower"], "Eiffel", True, ["search", "invalid", "finish"]),  # F1 2/3
            _row("3hop1", ["1850"], "1850", False, ["search", "search", "search", "invalid"]),   # unfinished: 0
            _row("3hop2", ["1850"], "1850", True, ["finish"]),                                  # EM 1
            _row("", ["a"], "b", True, ["finish"])]
    got = compare.trajectory_scores(rows)
    assert list(got["by_type"]) == ["3hop", "bridge", "unknown"]        # MuSiQue hop count from the id prefix
    # "Eiffel" vs "eiffel tower": precision 1, recall 1/2 -> F1 2/3
    assert got["by_type"]["bridge"] == pytest.approx({"n": 2, "em": 50.0, "f1": 100 * (1 + 2 / 3) / 2,
                                                      "mean_searches": 1.5, "invalid_rate": 1 / 6,
                                                      "finished_rate": 1.0})
    assert got["by_type"]["3hop"] == pytest.approx({"n": 2, "em": 50.0, "f1": 50.0, "mean_searches": 1.5,
                                                    "invalid_rate": 1 / 5, "finished_rate": 0.5})
    assert got["n"] == 5 and got["em"] == pytest.approx(40.0) and got["f1"] == pytest.approx(100 * (2 + 2 / 3) / 5)
    assert got["mean_searches"] == pytest.approx(6 / 5) and got["invalid_rate"] == pytest.approx(2 / 12)   # 12 steps
    assert [compare.question_type(t) for t in ("2hop", "4hop1", "comparison", "bridge_comparison", None)] == \
        ["2hop", "4hop", "comparison", "bridge_comparison", "unknown"]


# ----------------------------------------------------------------------------- comparison

def test_paired_difference_by_hand():
    # questions a, b, c in both; d only after (left out). Differences (after − before, EM %):
    # a 100 − 0 = 100, b 100 − 100 = 0, c 0 − 100 = −100 → mean 0; sd = sqrt((100² + 0 + 100²) / 2) = 100;
    # half-width 1.96 · 100 / √3 = 113.16
    d = compare.paired_difference({"a": 0.0, "b": 100.0, "c": 100.0}, {"a": 100.0, "b": 100.0, "c": 0.0, "d": 100.0})
    assert d == pytest.approx({"n": 3, "delta_em": 0.0, "half_width": 1.96 * 100 / 3 ** 0.5})
    assert compare.paired_difference({"a": 0.0}, {"b": 100.0}) is None


def test_method_rows_pool_the_seeds_of_each_method(tmp_path):
    # Two seeds of one method on different questions: seed 0 goes 0,0 → 100,100 (q1, q2), seed 1 goes
    # 100,0 → 100,100 (q3, q4). Pooled differences 100, 100, 0, 100: mean 75, sd = sqrt((3·25² + 75²)/3) = 50,
    # half-width 1.96·50/2 = 49. EM of the runs: 100 and 100 → 100 ± 0; SFT-only EM 0 and 50 → 25.
    runs, rows = [], []
    for seed, before, after in ((0, {"q1": 0, "q2": 0}, {"q1": 1, "q2": 1}), (1, {"q3": 1, "q4": 0}, {"q3": 1, "q4": 1})):
        folder = tmp_path / f"arco-s{seed}"
        (folder / "traces").mkdir(parents=True)
        for epoch, em in ((0, before), (2, after)):
            (folder / "traces" / f"eval_epoch_{epoch}.jsonl").write_text(
                "".join(json.dumps({"id": q, "reward": r}) + "\n" for q, r in em.items()))
        runs.append(compare.Run(folder, folder.name, {}, "epoch_2", 2, True, tmp_path))
        rows.append({"system": folder.name, "run": str(folder), "reward": "arco", "rubric": "adaptive", "k": 3,
                     "em": 100.0, "f1": 100.0})
    rows.append({"system": "SFT only", "em": 0.0, "f1": 0.0})                  # a warmup row: no run, left out
    (m,) = compare.method_rows(rows, runs)
    assert (m["method"], m["runs"], m["em"], m["em_spread"], m["sft_only_em"]) == ("ARCO", 2, 100.0, 0.0, 25.0)
    assert m["vs_sft_only"] == pytest.approx({"n": 4, "delta_em": 75.0, "half_width": 49.0})
    assert [compare.method_of(r) for r in ({"reward": "outcome"}, {"reward": "arco", "rubric": "none", "k": 3},
                                      {"reward": "arco", "rubric": "adaptive", "k": 5},
                                      {"reward": "arco", "rubric": "adaptive", "k": 3, "mu_data": "policy"},
                                      {"reward": "arco", "rubric": "adaptive", "k": 3, "mu_data": "teacher"})] == \
        ["outcome RL", "ARCO w/o Rubric", "ARCO K=5", "ARCO (μ SFT on π's rollouts)", "ARCO"]

def test_method_rows_keep_runs_of_different_settings_apart(tmp_path):
    # Three outcome runs: seeds 1 and 2 at G = 4, seed 1 at G = 2. Only the G = 4 pair is pooled; each
    # group is labelled with the flag that differs (the seed, the name and the sparse run a study's arm forks
    # from, one per seed, do not count as settings, nor does a dense-epoch learning rate, which outcome RL
    # never uses).
    runs, rows = [], []
    for name, seed, group, dense_lr in (("a", 1, 4, 1e-4), ("b", 2, 4, 5e-5), ("c", 1, 2, 1e-4)):
        folder = tmp_path / name
        (folder / "traces").mkdir(parents=True)
        for epoch in (0, 1):
            (folder / "traces" / f"eval_epoch_{epoch}.jsonl").write_text(json.dumps({"id": "q", "reward": epoch}) + "\n")
        args = {"reward": "outcome", "seed": seed, "name": name, "group_size": group, "pi_lr_sparse": 2e-4,
                "pi_lr_dense": dense_lr, "fork_from": f"runs/sparse-s{seed}/checkpoints/epoch_2"}
        runs.append(compare.Run(folder, name, args, "epoch_1", 1, True, tmp_path))
        rows.append({"system": name, "run": str(folder), "reward": "outcome", "em": 100.0, "f1": 100.0})
    got = {m["method"]: m["runs"] for m in compare.method_rows(rows, runs)}
    assert got == {"outcome RL (--group-size 4)": 2, "outcome RL (--group-size 2)": 1}
    assert [m["method"] for m in compare.method_rows(rows[:2], runs[:2])] == ["outcome RL"]
    for row, run in zip(rows, runs):                      # as ARCO runs, the dense learning rate matters
        row["reward"] = run.args["reward"] = "arco"
    assert len(compare.method_rows(rows[:2], runs[:2])) == 2


def test_the_arms_pair_against_outcome_rl_at_their_own_sparse_settings(tmp_path):
    # Seed 0 on questions q1, q2 (EM at the end): the control at a dense rate 1e-4 gets 0, 0 (listed first, and
    # its label sorts first: neither order nor name makes it the baseline); outcome RL at the sparse π rate 5e-4
    # gets 1, 0; ARCO, whose runs share the rate 5e-4, gets 1, 1. ARCO shares the control's --pi-lr-dense, which
    # outcome RL never reads: it must not count (or the two would tie).
    # Paired on (seed, question): ARCO − outcome RL = 0, 100 → 50; control − outcome RL = −100, 0 → −50
    # (half-width 1.96 · 70.71 / √2 = 98); outcome RL itself: none. ARCO − control = 100, 100 → 100 ± 0.
    runs, rows = [], []
    for name, reward, lr, dense_lr, em in (("outcome-dense-s0", "outcome", 1e-4, 6e-5, (0, 0)),
                                           ("outcome-s0", "outcome", 5e-4, 1e-4, (1, 0)),
                                           ("arco-s0", "arco", 5e-4, 6e-5, (1, 1))):
        folder = tmp_path / name
        (folder / "traces").mkdir(parents=True)
        for epoch, ems in ((0, (0, 0)), (1, em)):
            (folder / "traces" / f"eval_epoch_{epoch}.jsonl").write_text(
                "".join(json.dumps({"id": q, "reward": r}) + "\n" for q, r in zip(("q1", "q2"), ems)))
        runs.append(compare.Run(folder, name, {"reward": reward, "seed": 0, "name": name, "pi_lr_sparse": lr,
                                          "pi_lr_dense": dense_lr}, "epoch_1", 1, True, tmp_path))
        rows.append({"system": name, "run": str(folder), "reward": reward, "rubric": "adaptive", "em": 50.0 * sum(em),
                     "f1": 0.0})
    methods = compare.method_rows(rows, runs)
    got = {m["method"]: m["vs_outcome"] for m in methods}
    assert got["outcome RL (--pi-lr-sparse 0.0005)"] is None
    assert got["ARCO"] == pytest.approx({"n": 2, "delta_em": 50.0, "half_width": 1.96 * 2 ** 0.5 * 50 / 2 ** 0.5})
    assert got["outcome RL (--pi-lr-sparse 0.0001)"] == pytest.approx({"n": 2, "delta_em": -50.0,
                                                                      "half_width": 1.96 * 2 ** 0.5 * 50 / 2 ** 0.5})
    other = {m["method"]: m["vs_other_outcome"] for m in methods}
    assert other["ARCO"] == {"outcome RL (--pi-lr-sparse 0.0001)": {"n": 2, "delta_em": 100.0, "half_width": 0.0}}
    assert other["outcome RL (--pi-lr-sparse 0.0001)"] == {}


def test_comparison_of_two_runs_reuses_their_own_evaluations(runs, monkeypatch, capsys):
    no_evaluation(monkeypatch)
    arco_dir, outcome_dir = runs / "arco", runs / "outcome"
    assert main(["--run", arco_dir, "--run", outcome_dir]) == 0
    out = capsys.readouterr().out
    comp = json.loads((arco_dir / "comparison.json").read_text())
    assert (comp["dataset"], comp["split"]) == ("synthetic", "dev")
    rows = {r["system"]: r for r in comp["rows"]}
    assert list(rows) == ["base", "SFT only", "arco", "outcome"]
    warm = json.loads((runs / "warmup" / "metrics.json").read_text())
    for system, key in (("base", "base"), ("SFT only", "sft_only")):
        assert {k: rows[system][k] for k in warm[key]} == warm[key]
    for system, run, epoch in (("arco", arco_dir, 2), ("outcome", outcome_dir, 1)):   # selection.json's epochs
        r = rows[system]
        assert r["checkpoint"] == f"epoch_{epoch} (selected)" and "metrics.jsonl, epoch" in r["source"]
        recorded = evals_of(run)[epoch]
        assert {k: r[k] for k in ("n", "em", "f1", "mean_searches", "invalid_rate")} == \
            {k: recorded[k] for k in ("n", "em", "f1", "mean_searches", "invalid_rate")}
        traces = compare.trajectory_scores(read_jsonl(run / "traces" / f"eval_epoch_{epoch}.jsonl"))
        # the breakdown comes from the run's greedy dev trajectories, and they agree with its metrics
        assert r["by_type"] == traces["by_type"]
        assert {k: traces[k] for k in ("em", "f1", "mean_searches", "invalid_rate")} == \
            pytest.approx({k: recorded[k] for k in ("em", "f1", "mean_searches", "invalid_rate")})
        types = {ex.type for ex in env.load_split("synthetic", "dev", size=3, seed=0)}
        assert set(r["by_type"]) == types and sum(b["n"] for b in r["by_type"].values()) == r["n"] == 3
    assert comp["types"] == sorted(types)
    md = (arco_dir / "comparison.md").read_text()
    assert md in out + "\n"                                                   # the printed table is the file
    a = rows["arco"]
    header = ("| system | checkpoint | n | EM | F1 | Δ EM vs SFT only ± 95% | searches / q | invalid steps % | "
              + " | ".join(f"{t} EM / F1" for t in comp["types"]) + " |")
    assert header in md.splitlines()
    d = a["vs_sft_only"]                       # paired with the run's own epoch 0 on the same 3 questions
    before = {r["id"]: r["reward"] for r in read_jsonl(arco_dir / "traces" / "eval_epoch_0.jsonl")}
    after = {r["id"]: r["reward"] for r in read_jsonl(arco_dir / "traces" / "eval_epoch_2.jsonl")}
    assert d["n"] == 3 and d["delta_em"] == pytest.approx(100 * sum(after[q] - before[q] for q in before) / 3)
    assert (f"| arco | epoch_2 (selected) | 3 | {a['em']:.1f} | {a['f1']:.1f} | "
            f"{d['delta_em']:+.1f} ± {d['half_width']:.1f} (n 3) | {a['mean_searches']:.2f} | "
            f"{100 * a['invalid_rate']:.1f} |") in md
    assert [m["method"] for m in comp["methods"]] == ["ARCO", "outcome RL"] and "By method" in md
    assert md.index("| base |") < md.index("| SFT only |") < md.index("| arco |") < md.index("| outcome |")
    assert f"comparison table: {arco_dir / 'comparison.md'}" in out
    assert not (outcome_dir / "comparison.md").exists()


def test_checkpoint_flag_reuse_and_forced_reevaluation(runs, monkeypatch, capsys):
    arco_dir, outcome_dir = runs / "arco", runs / "outcome"
    no_evaluation(monkeypatch)
    assert main(["--run", arco_dir, "--run", outcome_dir, "--checkpoint", "epoch_1"]) == 0   # recorded: reused
    rows = {r["system"]: r for r in json.loads((arco_dir / "comparison.json").read_text())["rows"]}
    assert rows["arco"]["checkpoint"] == "epoch_1" and rows["arco"]["em"] == evals_of(arco_dir)[1]["em"]
    monkeypatch.undo()

    calls = counting_evaluation(monkeypatch)
    assert main(["--run", arco_dir, "--run", outcome_dir, "--checkpoint", "epoch_1", "--reevaluate",
                 "--device", "cpu"]) == 0
    dev_ids = [ex.id for ex in env.load_split("synthetic", "dev", size=3, seed=0)]
    assert calls == [dev_ids, dev_ids]                               # both runs, the run's own dev sample
    rows = {r["system"]: r for r in json.loads((arco_dir / "comparison.json").read_text())["rows"]}
    for system, run in (("arco", arco_dir), ("outcome", outcome_dir)):
        r, recorded = rows[system], evals_of(run)[1]
        assert r["source"].startswith("evaluated now")
        # the reloaded epoch-1 checkpoint, evaluated greedily, is the policy the run evaluated after epoch 1
        assert {k: r[k] for k in ("n", "em", "f1", "mean_searches", "invalid_rate")} == \
            pytest.approx({k: recorded[k] for k in ("n", "em", "f1", "mean_searches", "invalid_rate")})
        now = read_jsonl(run / "evals" / "dev_epoch_1.jsonl")
        then = read_jsonl(run / "traces" / "eval_epoch_1.jsonl")
        assert [[(s["output"], s["action"]) for s in x["steps"]] for x in now] == \
            [[(s["output"], s["action"]) for s in x["steps"]] for x in then]
        stored = json.loads((run / "evals" / "dev_epoch_1.json").read_text())
        assert stored["checkpoint"] == "epoch_1" and stored["em"] == r["em"] and stored["by_type"] == r["by_type"]

    calls.clear()                                                    # another split: evaluated, then stored
    assert main(["--run", arco_dir, "--run", outcome_dir, "--split", "train", "--device", "cpu"]) == 0
    train_ids = [ex.id for ex in env.load_split("synthetic", "train", size=3, seed=0)]
    assert calls == [train_ids, train_ids]
    first = json.loads((arco_dir / "comparison-train.json").read_text())
    assert [r["system"] for r in first["rows"]] == ["arco", "outcome"]      # the warmup rows are dev scores
    assert [r["checkpoint"] for r in first["rows"]] == ["epoch_2 (selected)", "epoch_1 (selected)"]
    assert (arco_dir / "evals" / "train_epoch_2.jsonl").is_file()
    monkeypatch.undo()
    no_evaluation(monkeypatch)
    capsys.readouterr()
    assert main(["--run", arco_dir, "--run", outcome_dir, "--split", "train"]) == 0
    again = json.loads((arco_dir / "comparison-train.json").read_text())
    assert [r["source"] for r in again["rows"]] == [f"stored: {arco_dir / 'evals' / 'train_epoch_2.json'}",
                                                    f"stored: {outcome_dir / 'evals' / 'train_epoch_1.json'}"]
    strip = lambda rows: [{k: v for k, v in r.items() if k != "source"} for r in rows]   # noqa: E731
    assert strip(again["rows"]) == strip(first["rows"])


def test_bad_commands_exit_2_with_a_clear_message(runs, tmp_path, capsys):
    arco_dir, outcome_dir = runs / "arco", runs / "outcome"
    assert main(["--run", outcome_dir, "--run", arco_dir, "--diagnose"]) == 2
    assert "has no μ checkpoint (an outcome run); put an ARCO run first" in capsys.readouterr().err
    assert main(["--run", arco_dir, "--checkpoint", "epoch_9"]) == 2
    assert "no checkpoint epoch_9 (it has: epoch_1, epoch_2)" in capsys.readouterr().err
    assert main(["--run", tmp_path]) == 2
    assert "not a run folder (no args.json)" in capsys.readouterr().err
    other = tmp_path / "hotpotqa" / "arco"
    other.mkdir(parents=True)
    args = json.loads((arco_dir / "args.json").read_text())
    (other / "args.json").write_text(json.dumps({**args, "dataset": "hotpotqa"}))
    (other / "selection.json").write_text(json.dumps({"selected_epoch": 1}))
    assert main(["--run", arco_dir, "--run", other]) == 2
    assert "different datasets" in capsys.readouterr().err
    assert main(["--run", arco_dir, "--predictions", "p.jsonl"]) == 2
    assert main([]) == 2
    assert "--run DIR" in capsys.readouterr().err


def test_untrained_mu_is_the_base_backbone_with_a_seeded_fresh_head(runs):
    warm = runs / "warmup" / "mu_sft"
    a, b, c = (mu_credit.untrained_mu(warm, "cpu", seed) for seed in (3, 3, 4))
    trained = rm.RubricModel.load(warm, device="cpu", engine=FAST)
    assert a.k == trained.k and a.rubric_mode == trained.rubric_mode and a.examples == trained.examples
    for key, value in a.head.state_dict().items():
        assert value.equal(b.head.state_dict()[key])                        # same seed, same head
    assert not a.head.net[1].weight.equal(c.head.net[1].weight)
    assert not a.head.net[1].weight.equal(trained.head.net[1].weight)      # not the trained one


# ----------------------------------------------------------------------------- diagnostics

def oracle_trace_rows(K, epoch, n_questions=3):
    """Training-trace rows as arco.trace_rows writes them, from oracle trajectories annotated by the
    oracle teacher: d_t = its K criterion scores, s_t = their mean (a useful step gets s_t = 1,
    every useless one less), G_t and buckets by Eq. 3-4."""
    teacher = warmup.OracleTeacher(env, seed=1)
    examples = env.synthetic_examples(n_questions, seed=5, split="train")
    trajs, metas = teacher.rollout([(ex, s) for ex in examples for s in range(3)], env.Retriever())
    rows = []
    for t, meta in zip(trajs, metas):
        criteria, scores, _ = teacher.annotate(t, meta, K)
        row = {**t.to_dict(), "epoch": epoch, "batch": 0}
        s = [sum(x) / K for x in scores]
        G = arco.reward_to_go(s)
        buckets = arco.step_buckets([st.action for st in t.steps], [st.valid for st in t.steps])
        for st, c, d, s_t, g, b in zip(row["steps"], criteria, scores, s, G, buckets):
            st.update(criteria=c, rubric_parsed=True, d=d, s=s_t, G=g, bucket=b, A=0.0)
        rows.append(row)
    return rows


class FakeJudge:
    """An OpenAI-compatible /v1/chat/completions that judges like an oracle: Bind picks the candidate of
    the checklist's kind (a checklist for a "final answer" grades a Finish) whose argument's words the
    checklist names most; Spec rates 5 for a search and 3 for a final answer."""

    def __init__(self):
        self.calls = 0
        self.server = ChatServer(lambda path, body, auth: (200, ChatServer.completion(
            self.reply(body["messages"][-1]["content"]), body["model"])))
        self.url = self.server.url

    def reply(self, prompt):
        self.calls += 1
        if "Candidate actions:" in prompt:
            checklist = prompt.split("Checklist:")[1].split("Candidate actions:")[0].lower()
            options = re.findall(r"^([A-Z])\. (\w+)\[(.*)\]$", prompt.split("Candidate actions:")[1], re.M)

            def fit(option):
                _, kind, argument = option
                words = re.findall(r"\w+", argument.lower())
                return ((kind == "Finish") == ("final answer" in checklist),
                        sum(w in checklist for w in words) / max(len(words), 1))
            return max(options, key=fit)[0]
        return "5" if "Action being graded: Search[" in prompt else "3"


@pytest.fixture(scope="module")
def diagnosed(runs, tmp_path_factory):
    """`--run arco-oracle --run arco-k7 --run outcome --diagnose` with the fake judge: arco-oracle is the
    ARCO run with its epoch-2 training traces replaced by oracle ones (K = 3), arco-k7 the same with K = 7."""
    for name, K in (("arco-oracle", 3), ("arco-k7", 7)):
        dest = runs / name
        shutil.copytree(runs / "arco", dest)
        for f in ("comparison.md", "comparison.json", "comparison-train.md", "comparison-train.json"):
            (dest / f).unlink(missing_ok=True)
        (dest / "traces" / "epoch_2.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in oracle_trace_rows(K, epoch=2)))
        args = json.loads((dest / "args.json").read_text())
        (dest / "args.json").write_text(json.dumps({**args, "name": name, "k": K}))
    judge = FakeJudge()
    mp = pytest.MonkeyPatch()
    mp.setenv("OPENAI_BASE_URL", judge.url)
    mp.setenv("OPENAI_API_KEY", "sk-test-not-a-secret")
    import io
    from contextlib import redirect_stdout
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["--run", runs / "arco-oracle", "--run", runs / "arco-k7", "--run", runs / "outcome",
                     "--diagnose", "--heldout-questions", 3, "--heldout-samples", 2, "--device", "cpu",
                     "--judge-model", "fake-judge", "--judge-items", 6, "--html-trajectories", 4])
    mp.undo()
    judge.server.close()
    assert code == 0
    run = runs / "arco-oracle"
    return run, json.loads((run / "diagnostics.json").read_text()), out.getvalue(), judge


def test_diagnose_credit_assignment_on_heldout_oracle_trajectories(diagnosed, runs):
    run, d, out, _ = diagnosed
    h = d["credit"]["heldout"]
    # the held-out set, rebuilt here: the oracle's trajectories on the first 3 dev questions, 2 samples each
    examples = env.load_split("synthetic", "dev", size=3, seed=0)
    obs_chars = json.loads((run / "args.json").read_text())["obs_chars"]
    trajs, metas = warmup.OracleTeacher(env, seed=0, obs_chars=obs_chars).rollout(
        [(ex, s) for ex in examples for s in range(2)], env.Retriever())
    labels = [truth.step_usefulness(t) for t in trajs]
    assert h["trajectories"] == 6 and h["variants"]["gold"] == 3 and sum(h["variants"].values()) == 6
    assert h["steps"] == sum(len(t.steps) for t in trajs) and h["useful_steps"] == sum(map(sum, labels))
    assert h["reward_1"] == sum(t.reward for t in trajs) >= 3                 # every gold trajectory is right
    assert 0 < h["useful_steps"] < h["steps"]                                  # both classes present
    assert h["auc_length_vs_R"] == auc([len(t.steps) for t in trajs], [t.reward == 1 for t in trajs])
    assert f"the number of steps alone has AUC {h['auc_length_vs_R']:.3f} for R" in (run / "diagnostics.md").read_text()
    by_count = auc([-len(t.steps) for t in trajs for _ in t.steps], [y for lt in labels for y in lt])
    assert h["auc_step_count"] == max(by_count, 1 - by_count)
    assert f"how many steps the trajectory has reaches {h['auc_step_count']:.3f}" in (run / "diagnostics.md").read_text()
    stages = d["credit"]["stages"]
    assert [(s["stage"], s["x"]) for s in stages] == [("untrained", -1), ("warmup", 0), ("epoch_1", 1), ("epoch_2", 2)]
    assert stages[1]["model"] == str(runs / "warmup" / "mu_sft")
    assert stages[3]["model"] == str(run / "checkpoints" / "epoch_2" / "mu")
    for s in stages:
        assert s["steps"] == h["steps"] and s["useful"] == h["useful_steps"]
        for key in ("auc_steps", "auc_search", "auc_finish", "auc_sum_vs_R"):
            assert s[key] is None or 0.0 <= s[key] <= 1.0
        assert s["auc_steps"] is not None                                      # both classes: defined
        assert -1 <= s["mean_s_useful"] <= 1 and -1 <= s["mean_s_useless"] <= 1
        j = s["judge"]
        assert j["threshold"] == 0.5 and j["n"] == 6
        assert j["true_pass"] + j["false_fail"] == h["reward_1"]
        assert j["false_pass"] + j["true_fail"] == 6 - h["reward_1"]
        assert 0 <= j["agreement"] <= 1 and (s["spearman_sum_vs_f1"] is None or -1 <= s["spearman_sum_vs_f1"] <= 1)
        c = s["judge_crossfit"]                     # every stage, folds by question (3 questions x 2 samples)
        assert c["n"] == 6 and len(c["threshold"]) == 2
        assert c["true_pass"] + c["false_fail"] == h["reward_1"]
    assert [s["stage"] for s in stages if "judge_fitted" in s] == ["epoch_2"] == [d["credit"]["selected_stage"]]
    fitted = stages[3]["judge_fitted"]
    rows = read_jsonl(run / "traces" / "epoch_2.jsonl")
    expected = stats.best_threshold([sum(st["s"] for st in r["steps"]) for r in rows], [r["reward"] == 1 for r in rows])
    assert fitted["threshold"] == pytest.approx(expected) and fitted["fitted_on_trajectories"] == len(rows)
    assert fitted["n"] == 6 and fitted["true_pass"] + fitted["false_fail"] == h["reward_1"]
    # μ's own rollouts: epoch 1 is the tiny policy's (no useful step: AUC undefined); epoch 2 the oracle's,
    # where every useful step has s_t = 1 and every useless one less
    by_epoch = {r["epoch"]: r for r in d["credit"]["training_traces_auc"]}
    assert by_epoch[1]["useful"] == 0 and by_epoch[1]["auc"] is None
    assert by_epoch[2]["steps"] == sum(len(r["steps"]) for r in rows) and by_epoch[2]["auc"] == 1.0
    md = (run / "diagnostics.md").read_text()
    assert f"| epoch_2 | fitted: {expected:.3f} |" in md
    assert f"| warmup | {stages[1]['auc_steps']:.3f} |" in md


def test_diagnose_binding_with_the_embedding_and_the_api_judge(diagnosed, runs):
    run, d, _, judge = diagnosed
    rows = read_jsonl(run / "traces" / "epoch_2.jsonl")
    b = d["runs"]["arco-oracle"]["binding"]
    steps = sum(len(r["steps"]) for r in rows)
    distinct = [len({mu_credit.step_action_text(st) for st in r["steps"]}) for r in rows]
    # a step is an item when its trajectory has another distinct action; min(4, distinct) candidates
    chance = [1 / min(4, m) for r, m in zip(rows, distinct) if m > 1 for _ in r["steps"]]
    with_item = len(chance)
    assert (b["steps"], b.get("without_criteria", 0), b["items"]) == (steps, 0, with_item)
    e = b["embedding"]
    assert e["all"]["chance"] == pytest.approx(100 * sum(chance) / len(chance))
    assert e["all"]["n"] == e["search"]["n"] + e["finish"]["n"] == with_item
    assert e["finish"]["n"] == sum(m > 1 for m in distinct)        # one Finish per trajectory
    for part in e.values():
        assert part["ci95"][0] <= part["bind"] <= part["ci95"][1]
        assert part["half_width"] == pytest.approx((part["ci95"][1] - part["ci95"][0]) / 2)
    assert e["all"]["bind"] >= 80 > e["all"]["chance"]             # the oracle's criteria name what a step targets
    o = b["openai"]                                                 # the fake judge: always right, Spec 5 / 3
    assert o["model"] == "fake-judge" and o["items"] == 6
    assert o["bind"]["all"]["bind"] == 100.0 and o["bind"]["all"]["n"] == 6 and o["bind"]["all"]["unscored"] == 0
    assert o["bind"]["all"]["ci95"] == pytest.approx([100 * x for x in stats.proportion_ci(6, 6)])
    n_search = o["bind"]["search"]["n"]
    assert o["spec"]["search"] == {"n": n_search, "spec": 5.0, "half_width": 0.0, "unscored": 0}
    assert o["spec"]["finish"]["spec"] == (3.0 if n_search < 6 else None) and o["spec"]["all"]["n"] == 6
    assert o["spec"]["all"]["spec"] == pytest.approx((5 * n_search + 3 * (6 - n_search)) / 6)
    assert o["counters"]["calls"] == o["counters"]["scored"] == 12             # 6 items × (Bind, Spec)
    assert d["runs"]["arco-k7"]["binding"]["openai"]["counters"]["calls"] == 12   # counted per run
    assert "binding" not in d["runs"]["outcome"] and d["runs"]["outcome"]["trajectories"] > 0
    md = (run / "diagnostics.md").read_text()
    assert f"| arco-oracle | 2 | embedding | all | {with_item} | {e['all']['bind']:.1f} |" in md
    assert "| arco-oracle | 2 | fake-judge | search |" in md and "5.00 ± 0.00" in md


def test_diagnose_redundancy_per_run_compares_k(diagnosed, runs):
    _, d, _, _ = diagnosed
    k3, k7 = d["runs"]["arco-oracle"]["redundancy"], d["runs"]["arco-k7"]["redundancy"]
    assert d["runs"]["arco-oracle"]["k"] == 3 and d["runs"]["arco-k7"]["k"] == 7
    # the oracle has a few criterion templates per kind of step and repeats them when K is larger
    expected = {}
    for name in ("arco-oracle", "arco-k7"):
        steps = [st for r in read_jsonl(runs / name / "traces" / "epoch_2.jsonl") for st in r["steps"]]
        expected[name] = sum(1 - len(set(st["criteria"])) / len(st["criteria"]) for st in steps) / len(steps)
    assert k3["k"] == 3 and k3["exact_duplicate_rate"] == pytest.approx(expected["arco-oracle"])
    assert k7["k"] == 7 and k7["exact_duplicate_rate"] == pytest.approx(expected["arco-k7"]) and expected["arco-k7"] > 0
    assert k3["steps_without_criteria"] == k7["steps_without_criteria"] == 0
    assert k7["paraphrase_duplicate_rate"] >= k7["exact_duplicate_rate"]        # an exact copy has cosine 1
    assert k7["themes"] <= 7 * (1 - k7["exact_duplicate_rate"]) + 1e-9        # at most the distinct criteria
    assert k3["themes"] <= 3 and k3["theme_ratio"] == pytest.approx(k3["themes"] / 3)
    assert k3["steps"] == k7["steps"] == k3["n_k"]
    assert k7["score_range"] is None or 0 <= k7["score_range"] <= 2
    assert "redundancy" not in d["runs"]["outcome"]


def test_diagnose_plots_page_and_printed_paths(diagnosed, runs):
    run, d, out, _ = diagnosed
    from matplotlib.image import imread
    for png in ("dev_em.png", "train_reward.png", "bucket_scores.png", "credit_auc.png"):
        assert imread(str(run / png)).shape == (400, 640, 4)
        assert f"{png}: {run / png}" in out
    figs = d["figures"]
    assert figs["dev_em.png"]["arco-k7"] == [[e, r["em"]] for e, r in sorted(evals_of(run).items())]
    assert [x for x, _ in figs["dev_em.png"]["outcome"]] == [0, 1]
    updates = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "update"]
    assert figs["train_reward.png"]["arco-k7"] == [[i, r["mean_R"]] for i, r in enumerate(updates, 1)]
    rows = read_jsonl(run / "traces" / "epoch_2.jsonl")
    terminal = [r["steps"][-1]["s"] for r in rows]
    first = [r["steps"][0]["s"] for r in rows if len(r["steps"]) > 1]
    assert list(figs["bucket_scores.png"])[0] == "search_1" and list(figs["bucket_scores.png"])[-1] == "terminal"
    assert dict(figs["bucket_scores.png"]["terminal"])[2] == pytest.approx(sum(terminal) / len(terminal))
    assert dict(figs["bucket_scores.png"]["search_1"])[2] == pytest.approx(sum(first) / len(first))
    assert [x for x, _ in figs["credit_auc.png"]["held-out steps"]] == [-1, 0, 1, 2]
    assert figs["credit_auc.png"]["own rollouts (traces)"] == [[1, None], [2, 1.0]]   # epoch 1: undefined
    page = (run / "trajectories.html").read_text()
    rows = rows[:4]
    assert page.count('<section class="traj">') == 4
    assert html.escape(rows[0]["steps"][0]["criteria"][0]) in page and html.escape(rows[3]["question"]) in page
    for f in ("diagnostics.md", "diagnostics.json", "trajectories.html", "comparison.md"):
        assert str(run / f) in out
    assert not (runs / "arco-k7" / "diagnostics.json").exists()              # one run is diagnosed


def test_the_fork_study_branches_its_arms_from_one_sparse_phase_and_resumes(tiny_dir, tmp_path, monkeypatch):
    """study.py fork (issue 41) on the tiny model, one seed, every arm: one sparse phase (μ co-evolving by Eq. 5),
    then each arm forked from its last checkpoint: every arm starts from the same π, μ and optimizer states
    (the rubric-free arm from its own sparse run), shares the sparse phase's logs, and draws the same first
    dense batch; the curves have a point every study.EVAL_EVERY updates; the table pairs each arm with outcome RL
    of the same seed (at the sparse settings, not the control at the dense ones); a second call finds every run finished and trains nothing."""
    argv = tiny_args(tiny_dir, tmp_path, train_size=4, eval_size=3, group_size=2, dense_samples=2, batch_size=4,
                     epochs=2, sparse_epochs=1, warmup_size=4, sft_eval_size=3)
    monkeypatch.setattr(study, "EVAL_EVERY", 1)                              # a curve point after every update
    monkeypatch.setattr(study, "CURVE_SIZE", 2)
    argv = [a for a in argv if a not in ("--dataset", "synthetic")]          # the study's synthetic-long
    started = {}
    resume_at = arco.resume_at

    def recording(checkpoint, folder, args, *rest):
        out = resume_at(checkpoint, folder, args, *rest)
        pi, mu, opt_pi, opt_mu = out[:4]
        started[folder.path.name] = (Path(checkpoint).parent.parent.name, out[5:7],
                                 sum(float(p.detach().double().sum()) for p in pi.model.parameters()),
                                 None if mu is None else sum(float(p.detach().double().sum()) for p in
                                                             [*mu.backbone.model.parameters(), *mu.head.parameters()]),
                                 sum(float(v.double().sum()) for st in opt_pi.state_dict()["state"].values()
                                     for v in st.values()))
        return out
    monkeypatch.setattr(arco, "resume_at", recording)
    players, judges = [], []                             # μ's AUC at the fork: who played, which μ scored
    teacher, load = warmup.on_policy_teacher, rm.RubricModel.load
    monkeypatch.setattr(warmup, "on_policy_teacher", lambda a, o, policy=None: players.append(policy) or
                        teacher(a, o, policy))
    monkeypatch.setattr(rm.RubricModel, "load", lambda folder, **kw: judges.append(Path(folder)) or load(folder, **kw))
    monkeypatch.setattr(study, "POLICY_PROBE_QUESTIONS", 2)
    arms = list(study.ARMS)
    out = study.fork_study(argv, [0], arms)
    root = tmp_path / "synthetic-long"
    assert {name: s[:2] for name, s in started.items()} == {
        f"{arm}-s0": ("sparse-norubric-s0" if arm == "arco-norubric" else "sparse-s0", (2, 0)) for arm in arms}
    same = [started[f"{arm}-s0"] for arm in arms if arm != "arco-norubric"]
    assert len({s[2] for s in same}) == 1 and len({s[4] for s in same}) == 1     # π and its AdamW state
    assert len({s[3] for s in same if s[3] is not None}) == 1                    # μ of the μ arms
    assert {arm for arm in arms if started[f"{arm}-s0"][3] is not None} == {"arco", "mixed", "arco-norubric"}
    sparse = read_jsonl(root / "sparse-s0" / "metrics.jsonl")
    assert [r["dense"] for r in sparse if r["kind"] == "update"] == [False, False]
    assert all("decomposition_mse" in r for r in sparse if r["kind"] == "update")   # μ co-evolves while sparse
    first = {}
    for arm in arms:
        rows = read_jsonl(root / f"{arm}-s0" / "metrics.jsonl")
        updates = [r for r in rows if r["kind"] == "update"]
        assert [(r["epoch"], r["trajectories"], r["questions"]) for r in updates] == [(1, 4, 2)] * 2 + [(2, 4, 2)] * 2
        if arm != "arco-norubric":
            assert [r["mean_R"] for r in updates[:2]] == [r["mean_R"] for r in sparse if r["kind"] == "update"]
        assert [r["dense"] for r in updates[2:]] == ([False] * 2 if arm.startswith("outcome") else [True] * 2)
        assert [(r["kind"], r["epoch"]) for r in rows if r["kind"] != "update"] == \
            [("eval", 0), ("curve", 1), ("eval", 1), ("curve", 2), ("eval", 2)]
        final = read_jsonl(root / f"{arm}-s0" / "traces" / "eval_epoch_2.jsonl")[:2]    # on the curve's slice
        assert len(study.dev_curve(root / f"{arm}-s0")) == 5
        assert study.dev_curve(root / f"{arm}-s0")[-1] == (4, 100.0 * sum(t["reward"] for t in final) / 2)
        batch0 = [t for t in read_jsonl(root / f"{arm}-s0" / "traces" / "epoch_2.jsonl") if t["batch"] == 0]
        first[arm] = [(t["id"], [st["output"] for st in t["steps"]]) for t in batch0]
        if arm in ("arco", "mixed"):
            assert {"mean_s_by_step", "corr_excess_searches", "singleton_buckets"} <= set(updates[-1])
    assert len({json.dumps(v) for v in first.values()}) == 1
    table = (out / "fork.md").read_text()
    assert "causal oracle" in table and "mixed" in table and "Δ EM vs outcome RL, same seed" in table
    fork = json.loads((out / "fork.json").read_text())
    vs = [m for m in fork["comparison"]["methods"] if m["method"] == "causal oracle"][0]["vs_outcome"]
    assert vs["n"] == 3                                         # the 3 dev questions, paired
    sparse_args, control = (json.loads((root / f"{r}-s0" / "args.json").read_text()) for r in ("sparse", "outcome-dense"))
    assert (control["reward"], control["pi_lr_sparse"], control["kl_pi_sparse"]) == \
        ("outcome", sparse_args["pi_lr_dense"], sparse_args["kl_pi_dense"])       # the control: ARCO's dense rate
    outcomes = {m["method"]: m["vs_outcome"] for m in fork["comparison"]["methods"] if m["method"].startswith("outcome")}
    assert len(outcomes) == 2 and [v is None for v in outcomes.values()].count(True) == 1   # one is the baseline
    assert outcomes[f"outcome RL (--kl-pi-sparse {sparse_args['kl_pi_sparse']}, --pi-lr-sparse "
                    f"{sparse_args['pi_lr_sparse']})"] is None
    assert f"Paired with outcome RL (--kl-pi-sparse {sparse_args['kl_pi_dense']}, " in table   # ARCO − the control
    assert len(fork["update_aucs"]["sparse-s0"]) == 2 and "decomposition_mse" in fork["update_aucs"]["sparse-s0"][0]
    assert (out / "study_dev_em.png").stat().st_size > 1000
    curves = fork["curves"]                         # each sparse phase once, then each arm from its fork (2 updates)
    assert list(curves)[:2] == ["sparse phase", "sparse phase, rubric-free μ"]
    assert curves["sparse phase"] == [[list(p) for p in study.dev_curve(root / "sparse-s0")]]
    assert all(series[0][0][0] == 2 and len(series[0]) == 3 for arm, series in curves.items() if arm in arms)
    forks = sorted(root / f"{r}-s0" / "checkpoints" / "epoch_1" for r in ("sparse", "sparse-norubric"))
    assert players == [None] + [f / "pi" for f in forks]           # π_sft, then each seed's π at the fork, once
    starts = [root / "study-warmup" / ("mu_sft-none" if "norubric" in str(f) else "mu_sft") for f in forks]
    assert judges[-8:] == [j for s, f in zip(starts, forks) for j in (s, s, f / "mu", f / "mu")]
    labels = [f"{f.parent.parent.name}/epoch_1" for f in forks]
    assert set(fork["fork_mu"]) == {f"{m} on {p}" for s, label in zip(starts, labels) for m in (s.name, label)
                                   for p in ("pi_sft", label)}
    assert all(r["questions"] == 2 and {"search", "finish", "all", "position"} <= set(r)
               for r in fork["fork_mu"].values())
    assert {"arco-s0", "mixed-s0"} <= set(fork["credit_summary"]) and "outcome-s0" not in fork["credit_summary"]
    assert fork["credit_summary"]["arco-s0"]["updates"] == 2                        # the dense updates only
    assert all(fork["credit_summary"][f"{o}-oracle-s0"]["corr_excess_searches"] is None   # Σ s = R: nothing to
               for o in ("causal", "projection"))                                        # correlate
    stamps = {arm: (root / f"{arm}-s0" / "metrics.jsonl").stat().st_mtime_ns for arm in arms}
    started.clear(), players.clear(), judges.clear()
    study.fork_study(argv, [0], ["outcome"])             # one arm asked for: the report has every finished arm
    assert started == {} and players == [] and judges == []
    assert {m["method"] for m in json.loads((out / "fork.json").read_text())["comparison"]["methods"]} == \
        {m["method"] for m in fork["comparison"]["methods"]}
    assert stamps == {arm: (root / f"{arm}-s0" / "metrics.jsonl").stat().st_mtime_ns for arm in arms}


def test_a_study_run_another_process_is_running_is_refused(tmp_path, monkeypatch):
    """study.run_once holds an exclusive lock on the run it runs (its process id in the file): a second holder
    (here another open file, as another process would be) is refused with the owner's id; once the lock is
    dropped the run goes ahead, this process's id in the file."""
    import fcntl
    args = arco.Args(out_dir=str(tmp_path), dataset="synthetic-long", name="arco-s2")
    run_dir = tmp_path / "synthetic-long" / "arco-s2"
    seen = []
    monkeypatch.setattr(arco, "run", lambda a, **kw: seen.append((run_dir / "running.lock").read_text()) or run_dir)
    run_dir.mkdir(parents=True)
    with open(run_dir / "running.lock", "w") as other:
        other.write("12345")
        other.flush()
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit) as exit_:
            study.run_once(args)
    assert str(exit_.value.code).startswith("error:") and "arco-s2" in str(exit_.value.code) and \
        "12345" in str(exit_.value.code) and seen == []
    assert study.run_once(args) == run_dir and seen == [str(os.getpid())]
    assert study.run_once(args) == run_dir and seen == [str(os.getpid())] * 2      # the lock went with the run


def test_train_reward_is_the_mean_of_the_last_four_updates_by_hand(tmp_path):
    # mean_R per update 1, 0, 0, 1, 1 (an evaluation row between): the last ≤ 4 updates' mean at each update:
    # 1, 1/2, 1/3, 2/4, 2/4.
    rows = [{"kind": "update", "mean_R": r} for r in (1, 0, 0)] + [{"kind": "eval", "em": 50.0}] + \
        [{"kind": "update", "mean_R": r} for r in (1, 1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = study.train_reward(tmp_path)
    assert [x for x, _ in got] == [1, 2, 3, 4, 5] and [y for _, y in got] == pytest.approx([1, 0.5, 1 / 3, 0.5, 0.5])
