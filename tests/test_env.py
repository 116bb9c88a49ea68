"""env.py (and infra/data.py beneath it): loaders, synthetic worlds, action parser, environment rules, rollout,
data errors, the data check (lab.diagnostics --check-files)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from lab import datacheck

import env
from conftest import REPO
from infra import files
from infra import data
from lab import truth

# ----------------------------------------------------------------------------- helpers


class TitleRetriever:
    """Mechanics-only retriever: the paragraph whose title occurs in the query, else paragraph 0."""

    def __init__(self):
        self.calls = []

    def retrieve(self, examples, queries):
        self.calls.append(len(queries))
        out = []
        for ex, q in zip(examples, queries):
            hit = [i for i, (t, _) in enumerate(ex.paragraphs) if t.lower() in q.lower()]
            out.append(hit[0] if hit else 0)
        return out


def scripted(script):
    """An agent that replays `script[example question]` step by step."""
    def act(prompts):
        outs = []
        for p in prompts:
            q = p[1]["content"].split("\n")[0].removeprefix("Question: ")
            n = p[1]["content"].count("\nObservation: ")
            outs.append(script[q][n] if n < len(script[q]) else "I am not sure.")
        return outs
    return act


def oracle(examples):
    """Search the supporting titles (as many as the budget allows), then finish with the gold answer."""
    budget = {ex.id: env.DEFAULT_MAX_SEARCHES[ex.dataset] for ex in examples}
    return scripted({ex.question: [f"Search[{ex.paragraphs[i][0]}]" for i in ex.supporting[:budget[ex.id]]]
                     + [f"Finish[{ex.answer}]"] for ex in examples})


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


HOTPOT = {"_id": "h1", "question": "In what year was the university where Ann Lee taught founded?", "answer": "1755",
          "type": "bridge", "level": "hard",
          "supporting_facts": [["Ann Lee", 0], ["Moscow State University", 1]],
          "context": [["Moscow State University", ["MSU is a university in Moscow.", " It was founded in 1755."]],
                      ["Ann Lee", ["Ann Lee was a professor at Moscow State University."]],
                      ["Kyiv", ["Kyiv is a city."]]]}
TWOWIKI = {"_id": "w1", "type": "compositional", "question": "Where was the performer of Well Well Well born?",
           "context": [["John Lennon", ["John Lennon was an English singer.", "He was born in Liverpool."]],
                       ["Well Well Well (John Lennon song)", ["Well Well Well is a song by John Lennon."]]],
           "supporting_facts": [["Well Well Well (John Lennon song)", 0], ["John Lennon", 1]],
           "evidences": [["Well Well Well", "performer", "John Lennon"], ["John Lennon", "place of birth", "Liverpool"]],
           "answer": "Liverpool"}
MUSIQUE = {"id": "2hop__1_2", "question": "Who founded the label of Album X?", "answer": "Ann Lee",
           "answer_aliases": ["Ann B. Lee", "Ann Lee"], "answerable": True,
           "paragraphs": [{"idx": 0, "title": "Album X", "paragraph_text": "Album X was released by Y Records.", "is_supporting": True},
                          {"idx": 1, "title": "Other", "paragraph_text": "Unrelated.", "is_supporting": False},
                          {"idx": 2, "title": "Y Records", "paragraph_text": "Y Records was founded by Ann Lee.", "is_supporting": True}],
           "question_decomposition": [{"id": 1, "question": "Album X >> record label", "answer": "Y Records", "paragraph_support_idx": 0},
                                      {"id": 2, "question": "Who founded #1?", "answer": "Ann Lee", "paragraph_support_idx": 2}]}


# ----------------------------------------------------------------------------- loaders


def test_hotpot_minimal(tmp_path):
    write_jsonl(tmp_path / "hotpotqa" / "dev.jsonl", [HOTPOT])
    [ex] = env.load_split("hotpotqa", "dev", data_dir=str(tmp_path))
    assert ex.id == "h1" and ex.answers == ["1755"] and ex.type == "bridge" and ex.dataset == "hotpotqa"
    assert ex.paragraphs[0] == ("Moscow State University", "MSU is a university in Moscow. It was founded in 1755.")
    assert ex.supporting == [1, 0]  # in supporting_facts order
    assert ex.hops == []


def test_2wiki_minimal_json_array(tmp_path):
    (tmp_path / "2wiki").mkdir()
    (tmp_path / "2wiki" / "dev.json").write_text(json.dumps([TWOWIKI]), encoding="utf-8")
    [ex] = env.load_split("2wiki", "dev", data_dir=str(tmp_path))
    assert ex.paragraphs[0][1] == "John Lennon was an English singer. He was born in Liverpool."  # space inserted
    assert ex.supporting == [1, 0]
    # evidence subject "Well Well Well" matches the title without its disambiguation
    assert ex.hops == [{"query": "Well Well Well performer", "answer": "John Lennon", "paragraph": 1},
                       {"query": "John Lennon place of birth", "answer": "Liverpool", "paragraph": 0}]


def test_musique_minimal(tmp_path):
    unanswerable = dict(MUSIQUE, id="2hop__9_9", answerable=False)
    write_jsonl(tmp_path / "musique" / "dev.jsonl", [MUSIQUE, unanswerable])
    examples, skipped = env.read_examples(tmp_path / "musique" / "dev.jsonl", "musique")
    assert [e.id for e in examples] == ["2hop__1_2"] and skipped == {"unanswerable": 1}
    ex = examples[0]
    assert ex.answers == ["Ann Lee", "Ann B. Lee"]  # gold first, aliases after, no duplicate
    assert ex.supporting == [0, 2] and ex.type == "2hop"
    assert ex.hops[1] == {"query": "Who founded Y Records?", "answer": "Ann Lee", "paragraph": 2}  # "#1" filled in
    assert env.answer_reward("Ann B. Lee", ex.answers) == 1.0  # an alias counts


def test_official_file_names_are_found(tmp_path):
    write_jsonl(tmp_path / "musique" / "musique_ans_v1.0_dev.jsonl", [MUSIQUE])
    (tmp_path / "hotpotqa").mkdir()
    (tmp_path / "hotpotqa" / "hotpot_dev_distractor_v1.json").write_text(json.dumps([HOTPOT]))
    assert data.find_data_file("musique", "dev", tmp_path).name == "musique_ans_v1.0_dev.jsonl"
    assert data.find_data_file("hotpotqa", "dev", tmp_path).name == "hotpot_dev_distractor_v1.json"


def test_skip_reasons(tmp_path):
    rows = [HOTPOT, dict(HOTPOT, _id="h2", answer=" "), dict(HOTPOT, _id="h3", context=[]),
            dict(HOTPOT, _id="h4", supporting_facts=[["Nowhere", 0]])]
    write_jsonl(tmp_path / "hotpotqa" / "dev.jsonl", rows)
    examples, skipped = env.read_examples(tmp_path / "hotpotqa" / "dev.jsonl", "hotpotqa")
    assert [e.id for e in examples] == ["h1"]
    assert skipped == {"empty answer": 1, "no paragraphs": 1, "no supporting title found in context": 1}


@pytest.mark.parametrize("dataset,n_train,n_dev", [("hotpotqa", 400, 300), ("2wiki", 400, 100), ("musique", 299, 296)])
def test_shared_data_every_example_loads(data_dir, dataset, n_train, n_dev):
    rows = datacheck.load_report([dataset], ["train", "dev"], data_dir)
    assert [(r["split"], r["loaded"], r["skipped"]) for r in rows] == [("train", n_train, "0"), ("dev", n_dev, "0")]
    for ex in env.load_split(dataset, "dev", data_dir=data_dir):
        assert ex.question and ex.answers[0] and len(ex.paragraphs) >= 2 and ex.supporting
        assert all(0 <= i < len(ex.paragraphs) for i in ex.supporting)
        if dataset != "hotpotqa":
            assert ex.hops  # 2Wiki evidences, MuSiQue decomposition
        if dataset == "musique":
            assert all(h["paragraph"] in ex.supporting for h in ex.hops)


def test_env_cli_reports_every_file(data_dir):
    r = subprocess.run([sys.executable, "-m", "lab.diagnostics", "--check-files", "--dataset", "all", "--split", "all",
                        "--data-dir", data_dir],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 10 and "hotpotqa/dev   loaded   300  skipped 0" in r.stdout    # 5 datasets × 2 splits


def test_sampling_is_deterministic_and_nested(data_dir):
    a = [e.id for e in env.load_split("hotpotqa", "train", data_dir, size=50, seed=3)]
    b = [e.id for e in env.load_split("hotpotqa", "train", data_dir, size=50, seed=3)]
    c = [e.id for e in env.load_split("hotpotqa", "train", data_dir, size=80, seed=3)]
    d = [e.id for e in env.load_split("hotpotqa", "train", data_dir, size=50, seed=4)]
    assert a == b and c[:50] == a and a != d and len(set(a)) == 50
    assert len(env.load_split("hotpotqa", "dev", data_dir, size=2000)) == 300  # all there is


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_deterministic_and_split_disjoint():
    a, b = env.synthetic_examples(30, seed=1, split="train"), env.synthetic_examples(30, seed=1, split="train")
    assert [(e.question, e.answers, e.paragraphs) for e in a] == [(e.question, e.answers, e.paragraphs) for e in b]
    dev = env.synthetic_examples(30, seed=1, split="dev")
    assert not {e.question for e in a} & {e.question for e in dev}
    assert env.synthetic_examples(30, seed=2, split="train")[0].question != a[0].question


def test_synthetic_worlds_are_consistent():
    examples = env.synthetic_examples(300, seed=0, split="dev")
    assert {e.type for e in examples} == {"bridge", "comparison"}
    for ex in examples:
        assert len(ex.paragraphs) == 8 and len({t for t, _ in ex.paragraphs}) == 8  # distinct invented titles
        assert len(ex.hops) == 2 and [h["paragraph"] for h in ex.hops] == ex.supporting
        for hop in ex.hops:  # each hop's answer is stated in its paragraph
            assert hop["answer"] in ex.paragraphs[hop["paragraph"]][1]
        if ex.type == "bridge":  # hop 1 finds entity B, whose paragraph holds the answer
            assert ex.hops[0]["answer"] == ex.paragraphs[ex.hops[1]["paragraph"]][0]
            assert ex.answer == ex.hops[1]["answer"]
        elif ex.answer not in ("yes", "no"):
            assert ex.answer in [ex.paragraphs[h["paragraph"]][0] for h in ex.hops]


def test_long_synthetic_worlds_are_chains_with_look_alikes():
    """synthetic-long (issue 33): 3- and 4-hop chains A → employer → founder (→ born, or → employer → city),
    budget 5; each hop's answer is named in its paragraph and is the next hop's title; every chain has
    look-alike distractors (a person sharing a surname with A and with the founder, an organization sharing
    the first word of A's employer), deterministic and split-disjoint as the 2-hop family."""
    examples = env.load_split("synthetic-long", "dev", size=200)
    assert {e.type for e in examples} == {"chain-3", "chain-4"} and env.DEFAULT_MAX_SEARCHES["synthetic-long"] == 5
    assert [e.question for e in examples[:5]] == [e.question for e in env.load_split("synthetic-long", "dev", size=5)]
    assert not {e.question for e in examples} & {e.question for e in env.load_split("synthetic-long", "train", size=200)}
    for ex in examples:
        titles = [t for t, _ in ex.paragraphs]
        assert len(set(titles)) == len(titles) == 11 and ex.dataset == "synthetic-long"
        assert [h["paragraph"] for h in ex.hops] == ex.supporting and len(ex.hops) == int(ex.type[-1])
        for hop, nxt in zip(ex.hops, ex.hops[1:]):
            assert hop["answer"] in ex.paragraphs[hop["paragraph"]][1] and hop["answer"] == titles[nxt["paragraph"]]
        assert ex.answer == ex.hops[-1]["answer"] and ex.answer in ex.paragraphs[ex.hops[-1]["paragraph"]][1]
        a, employer, founder = (titles[h["paragraph"]] for h in ex.hops[:3])
        for name in (a, founder):
            assert sum(t.split(" ", 1)[-1] == name.split(" ", 1)[1] for t in titles) >= 2     # a look-alike person
        assert sum(t.split(" ")[0] == employer.split(" ")[0] for t in titles) >= 2           # a look-alike org


def test_step_usefulness_labels_a_long_chain_by_hand(retriever):
    """The oracle's gold trajectory on a long chain: every step useful (R = 1); a look-alike search, a repeat
    and a wrong answer are useless (the ground truth of the oracle-credit arm)."""
    ex = env.load_split("synthetic-long", "dev", size=1)[0]
    titles = [t for t, _ in ex.paragraphs]
    gold = env.rollout([ex], oracle([ex]), retriever)[0]
    assert gold.reward == 1.0 and truth.step_usefulness(gold) == [True] * (len(ex.hops) + 1)
    a = titles[ex.hops[0]["paragraph"]]
    alike = next(t for t in titles if t != a and t.split(" ", 1)[-1] == a.split(" ", 1)[1])
    script = scripted({ex.question: [f"Search[{a}]", f"Search[{alike}]", f"Search[{a}]", "Finish[nowhere at all]"]})
    traj = env.rollout([ex], script, retriever)[0]
    assert [st.retrieved for st in traj.steps[:3]] == [titles.index(a), titles.index(alike), titles.index(a)]
    assert truth.step_usefulness(traj) == [True, False, False, False] and traj.reward == 0.0


def test_oracle_gets_reward_one_on_every_synthetic_example(retriever):
    examples = env.synthetic_examples(200, seed=0, split="dev")
    trajs = env.rollout(examples, oracle(examples), retriever)
    assert [t.reward for t in trajs] == [1.0] * 200
    assert all([s.action for s in t.steps] == ["search", "search", "finish"] for t in trajs)
    hits = [s.retrieved in t.example.supporting for t in trajs for s in t.steps if s.action == "search"]
    assert sum(hits) / len(hits) > 0.9  # titles are distinct invented names; MiniLM should find them


def test_oracle_on_shared_dev_samples(data_dir, retriever):
    for dataset in ("hotpotqa", "2wiki", "musique"):
        examples = env.load_split(dataset, "dev", data_dir, size=10)
        trajs = env.rollout(examples, oracle(examples), retriever)
        assert all(t.reward == 1.0 and t.finished for t in trajs), dataset
        budget = env.DEFAULT_MAX_SEARCHES[dataset]
        assert all(len(t.steps) == min(len(t.example.supporting), budget) + 1 for t in trajs)


def test_retrieval_hit_rate_arithmetic():
    ex = env.Example("x", "q?", ["a"], [("A", "a"), ("B", "b"), ("C", "c")], supporting=[0, 1])

    class Fixed:  # query "A" -> paragraph 1 (a supporting one, not its own); "B" -> 2 (a miss)
        def retrieve(self, examples, queries):
            return [{"A": 1, "B": 2}[q] for q in queries]
    assert datacheck.retrieval_hit_rate([ex], Fixed()) == {"queries": 2, "supporting_hit": 0.5, "same_paragraph": 0.0}


def test_retriever_encodes_normalized_and_caches(retriever):
    ex = env.synthetic_examples(1, split="dev")[0]
    emb = retriever.encode(["Search for a person", "another text"])
    assert emb.shape == (2, 384)
    assert abs(float(emb.norm(dim=-1)[0]) - 1) < 1e-5
    first = retriever.retrieve([ex, ex], [ex.paragraphs[3][0], ex.paragraphs[5][0]])
    assert first == [3, 5]
    assert (ex.dataset, ex.id) in retriever.cache


def test_a_paragraphs_embedding_depends_on_it_alone():
    """Each text is encoded in its own forward pass, so its embedding is the same bit for bit whatever it is
    encoded beside and whatever the cache already holds: a run resumed in a new process retrieves exactly what
    the uninterrupted one did. (Padded batches moved it by up to 1.6e-7: an argmax flip at a near-tie.)"""
    examples = env.synthetic_examples(8, split="dev", long=True)         # 88 paragraphs
    together, alone = env.Retriever(), env.Retriever()
    a = examples[0]
    texts = [f"{t}. {x}" for t, x in a.paragraphs]
    assert torch.equal(together._paragraphs(examples)[0], torch.cat([alone.encode([t]) for t in texts]))
    # the mean over the text's tokens, L2-normalized: what a padded batch's masked mean computed
    enc = alone.tokenizer(texts[0], return_tensors="pt")
    with torch.no_grad():
        h = alone.model(**enc).last_hidden_state[0].mean(0)
    assert torch.allclose(alone.encode(texts[:1])[0], h / h.norm(), atol=1e-6)


# ----------------------------------------------------------------------------- action parser

PARSES = [
    ("Search[Sergei Tokarev]", "search", "Sergei Tokarev"),
    ("  search [ Sergei Tokarev ]  ", "search", "Sergei Tokarev"),
    ("SEARCH[Moscow State University]", "search", "Moscow State University"),
    ("Finish[1755]", "finish", "1755"),
    ("finish[ yes ]", "finish", "yes"),
    ("I should look him up first. Search[Sergei Tokarev] and then see.", "search", "Sergei Tokarev"),
    ("Action: Search[Tokarev university]\nObservation: ...", "search", "Tokarev university"),
    ("<think>Maybe Finish[1800]? No, search first.</think>Search[MSU founded]", "search", "MSU founded"),
    ("<THINK>\nlong thoughts\n</THINK>\n\nFinish[Paris]", "finish", "Paris"),
    ("Search[A] Finish[B]", "search", "A"),                      # first action wins
    ("Finish[B]\nSearch[A]", "finish", "B"),
    ("Search[Tokarev)", "search", "Tokarev"),                    # ")" for "]"
    ("Search(Tokarev)", "search", "Tokarev"),
    ("Finish[Well Well Well (John Lennon song)]", "finish", "Well Well Well (John Lennon song)"),
    ("Finish[Paris (France)", "finish", "Paris (France)"),       # unclosed, balanced parens kept
    ("Search[John Lennon birthplace\nmore text", "search", "John Lennon birthplace"),
    ('Finish["Liverpool"]', "finish", "Liverpool"),              # quotes stripped
    ("**Finish[Liverpool]**", "finish", "Liverpool"),
    ("Search[ John   Lennon ]", "search", "John Lennon"),         # spaces folded
    ("Search: John Lennon", "search", "John Lennon"),            # colon form on its own line
    ("Thought: I know it.\nFinish: Liverpool", "finish", "Liverpool"),
    ("Finish[1,755 CE]", "finish", "1,755 CE"),
    ("Research[John]", "invalid", ""),                            # not an action word
    ("Search[]", "invalid", ""),
    ("Finish[   ]", "invalid", ""),
    ("", "invalid", ""),
    ("I think the answer is Liverpool.", "invalid", ""),
    ("<think>Search[x]</think>", "invalid", ""),                  # an action inside thoughts does not count
    ("Lookup[John Lennon]", "invalid", ""),
]


@pytest.mark.parametrize("output,kind,arg", PARSES)
def test_parse_action(output, kind, arg):
    a = env.parse_action(output)
    assert (a.kind, a.argument) == (kind, arg)
    assert bool(a.reason) == (kind == "invalid")


def test_parse_action_reasons():
    assert env.parse_action("Search[]").reason == "empty Search[] argument"
    assert env.parse_action("hello").reason == "no Search[...] or Finish[...] found"


# ----------------------------------------------------------------------------- environment rules


def toy(n=1):
    return [env.Example(f"t{i}", f"Question number {i}?", ["gold"], [("Alpha", "alpha text"), ("Beta", "beta text")],
                        [1], dataset="hotpotqa") for i in range(n)]


def test_budget_exhaustion_forces_finish_prompt():
    [ex] = toy()
    act = scripted({ex.question: ["Search[Alpha]", "Search[Beta]", "Search[Alpha]", "Finish[gold]"]})
    [t] = env.rollout([ex], act, TitleRetriever())
    assert [s.action for s in t.steps] == ["search", "search", "search", "finish"]
    assert [s.searches_left for s in t.steps] == [3, 2, 1, 0]
    assert [s.forced_finish for s in t.steps] == [False, False, False, True]
    assert "No searches are left" in t.steps[3].prompt[1]["content"]
    assert "Searches left: 3" in t.steps[0].prompt[1]["content"]
    assert t.steps[1].retrieved == 1 and t.steps[1].observation.startswith("Beta: beta text")
    assert t.reward == 1.0 and t.answer == "gold"


def test_search_after_budget_is_invalid_and_horizon_ends_with_r0():
    [ex] = toy()
    act = scripted({ex.question: ["Search[Alpha]"] * 4})
    [t] = env.rollout([ex], act, TitleRetriever(), max_searches=3)
    assert len(t.steps) == 4  # horizon = budget + 1
    assert [s.valid for s in t.steps] == [True, True, True, False]
    assert t.steps[3].reason.startswith("no search left")
    assert t.steps[3].observation.startswith("Invalid action (no search left")
    assert t.answer == "" and t.reward == 0.0 and not t.finished


def test_invalid_steps_use_up_the_horizon():
    [ex] = toy()
    act = scripted({ex.question: ["hmm", "Search[]", "Search[Beta]", "Search[Alpha]", "Finish[gold]"]})
    [t] = env.rollout([ex], act, TitleRetriever(), max_searches=3)
    # 4 steps allowed: two invalid, two searches; the 4th step is the horizon's last, so finish-only
    assert [s.action for s in t.steps] == ["invalid", "invalid", "search", "invalid"]
    assert [s.forced_finish for s in t.steps] == [False, False, False, True]
    assert t.steps[1].reason == "empty Search[] argument"
    assert "Invalid action (empty Search[] argument)" in t.steps[2].prompt[1]["content"]  # the agent sees it
    assert t.reward == 0.0 and t.answer == ""


def test_wrong_answer_gets_zero_and_finish_ends_early():
    [ex] = toy()
    [t] = env.rollout([ex], scripted({ex.question: ["Finish[silver]"]}), TitleRetriever())
    assert len(t.steps) == 1 and t.finished and t.answer == "silver" and t.reward == 0.0


def test_rollout_is_batched_in_lockstep():
    examples = toy(4)
    script = {ex.question: ["Search[Alpha]"] * i + ["Finish[gold]"] for i, ex in enumerate(examples)}
    calls = []

    def act(prompts):
        calls.append(len(prompts))
        return scripted(script)(prompts)
    r = TitleRetriever()
    trajs = env.rollout(examples, act, r)
    assert calls == [4, 3, 2, 1]  # one call per round for all still-active environments
    assert r.calls == [3, 2, 1]  # one retrieval batch per round that has searches
    assert [len(t.steps) for t in trajs] == [1, 2, 3, 4]
    assert all(t.reward == 1.0 for t in trajs)
    d = trajs[2].to_dict()
    assert d["id"] == "t2" and d["reward"] == 1.0 and len(d["steps"]) == 3 and "prompt" not in d["steps"][0]
    json.dumps(d)  # serializable for traces


def test_act_may_return_generations_with_token_ids():
    class Gen:
        def __init__(self, text):
            self.text, self.token_ids = text, [7, 8, 9]
    [t] = env.rollout(toy(1), lambda prompts: [Gen("Finish[gold]") for _ in prompts], TitleRetriever())
    assert t.steps[0].output == "Finish[gold]" and t.steps[0].output_ids == [7, 8, 9] and t.reward == 1.0
    assert "output_ids" not in t.to_dict()["steps"][0]


def test_act_must_answer_every_prompt():
    with pytest.raises(ValueError, match="1 outputs for 2 prompts"):
        env.rollout(toy(2), lambda prompts: ["Finish[x]"], TitleRetriever())


def test_history_and_observation_cut():
    [ex] = toy()
    long = ("Longtitle", "word " * 200)
    assert len(env.observation_text(long, 50)) <= 54 and env.observation_text(long, 50).endswith(" ...")
    act = scripted({ex.question: ["x" * 300, "Finish[gold]"]})
    [t] = env.rollout([ex], act, TitleRetriever())
    hist = env.format_history(t.steps[:1])
    assert hist.startswith("Step 1: " + "x" * 120 + "...\nObservation: Invalid action")


# ----------------------------------------------------------------------------- errors


def test_missing_data_offline_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("ARCO_OFFLINE", "1")
    monkeypatch.setenv("ARCO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ARCO_DATA_DIR", raising=False)
    with pytest.raises(env.DataError) as e:
        env.load_split("musique", "dev", data_dir=str(tmp_path))
    msg = str(e.value)
    assert "no musique dev data" in msg and "musique_ans_v1.0_dev.jsonl" in msg
    assert "ARCO_OFFLINE=1" in msg and "--dataset synthetic" in msg and "drive" in msg  # names the official source


def test_failed_download_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("ARCO_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("ARCO_DATA_DIR", raising=False)
    monkeypatch.setenv("ARCO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(data.DOWNLOADS["hotpotqa"], "dev", ("http://127.0.0.1:9/hotpot_dev.json", None, "dev.json"))
    with pytest.raises(env.DataError, match="the download failed") as e:
        data.find_data_file("hotpotqa", "dev", tmp_path)
    assert "--dataset synthetic" in str(e.value)
    assert not (tmp_path / "cache" / "data" / "hotpotqa" / "dev.json").exists()


def run_cli(*argv, **kw):
    """The data check of the lab's diagnostics (formerly `python env.py`): every file of --dataset/--split loaded."""
    return subprocess.run([sys.executable, "-m", "lab.diagnostics", "--check-files", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **kw})


def test_cli_errors(tmp_path):
    r = run_cli("--dataset", "squad")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith(
        "error: argument --dataset: invalid choice: 'squad' (choose from 'hotpotqa', '2wiki', 'musique', 'synthetic', "
        "'synthetic-long', 'all')")
    rows = [HOTPOT, HOTPOT]
    write_jsonl(tmp_path / "hotpotqa" / "dev.jsonl", rows)
    with open(tmp_path / "hotpotqa" / "dev.jsonl", "a") as f:
        f.write('{"_id": "broken", "question": \n')
    r = run_cli("--dataset", "hotpotqa", "--data-dir", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith(f"error: {tmp_path / 'hotpotqa' / 'dev.jsonl'}:3: not valid JSON")
    write_jsonl(tmp_path / "2wiki" / "dev.jsonl", [{k: v for k, v in TWOWIKI.items() if k != "question"}])
    r = run_cli("--dataset", "2wiki", "--data-dir", str(tmp_path))
    assert r.stderr.strip() == f"error: {tmp_path / '2wiki' / 'dev.jsonl'}:1: missing field 'question'"
    r = run_cli("--dataset", "musique", "--data-dir", str(tmp_path), ARCO_OFFLINE="1",
                ARCO_CACHE=str(tmp_path / "c"), ARCO_DATA_DIR="")
    assert r.returncode == 2 and r.stderr.startswith("error: no musique dev data") and "Traceback" not in r.stderr


def test_the_one_jsonl_reader_and_writer(tmp_path, monkeypatch):
    """files.write_jsonl / read_jsonl / write_json: appends add, a line cut short by a kill is dropped (and
    truncated away with repair), a bad line elsewhere names itself, and the API key never reaches disk."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-1234")
    path = tmp_path / "sub" / "rows.jsonl"
    files.write_jsonl(path, [{"a": 1}, {"b": "é"}])
    files.write_jsonl(path, [{"c": "key sk-secret-1234 echoed"}], append=True)
    assert files.read_jsonl(path) == [{"a": 1}, {"b": "é"}, {"c": "key [redacted] echoed"}]
    assert "é" in path.read_text(encoding="utf-8")                     # UTF-8, not \u escapes
    with open(path, "a") as f:
        f.write('{"d": ')                                               # a kill mid-line
    assert len(files.read_jsonl(path)) == 3 and path.read_text().endswith('{"d": ')
    assert len(files.read_jsonl(path, repair=True)) == 3 and path.read_text().endswith("}\n")
    files.write_jsonl(path, [{"e": 5}])                                   # not append: replaced
    assert files.read_jsonl(path) == [{"e": 5}] and files.read_jsonl(tmp_path / "none.jsonl") == []
    path.write_text('{"a": 1}\nnot json\n{"b": 2}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: not valid JSON"):
        files.read_jsonl(path)
    files.write_json(tmp_path / "m.json", {"k": "sk-secret-1234"})
    assert json.loads((tmp_path / "m.json").read_text()) == {"k": "[redacted]"}
    assert not (tmp_path / "m.json.tmp").exists()


def test_step_ranges_place_each_trajectorys_steps_in_a_flat_list():
    """The one step-index helper (per-step lists of μ's rubrics, d_t, s_t are flat over a batch)."""
    ex = env.synthetic_examples(1)[0]
    trajs = [env.Trajectory(ex, 3) for _ in range(3)]
    for t, n in zip(trajs, (2, 0, 3)):
        t.steps = [env.Step([], "x", "search", "q", "o", True, "", 2, False, 0)] * n
    assert env.step_ranges(trajs) == [range(0, 2), range(2, 2), range(2, 5)]
    flat = ["a0", "a1", "c0", "c1", "c2"]
    assert [[flat[i] for i in r] for r in env.step_ranges(trajs)] == [["a0", "a1"], [], ["c0", "c1", "c2"]]
