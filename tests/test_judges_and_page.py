"""diagnostics.py (issue 6): the RQ3 judges (an OpenAI-compatible one against a local fake
server, and the offline embedding one), the HTML page of trajectories rendered in a real headless
Chromium, and the PNG plots."""
import re
import shutil
import subprocess
import tempfile
import threading
import time
import zlib
from collections import Counter
from html.parser import HTMLParser

import numpy as np
import pytest

from lab import judges, mu_credit, plots
from lab.page import trajectories_html
from conftest import ChatServer

KEY = "sk-judge-test-key-9876543210"

# ----------------------------------------------------------------------------- prompts and parsing


def test_bind_prompt_shows_rubric_and_lettered_candidates_only():
    msgs = judges.bind_messages(["names Hans Schlegel", "asks for a birth date"],
                            ["Search[Hans Schlegel birth date]", "Search[Bertalan Farkas]", "Finish[1951]", "Search[x]"])
    user = msgs[-1]["content"]
    assert "1. names Hans Schlegel\n2. asks for a birth date" in user
    assert "A. Search[Hans Schlegel birth date]\nD. Search[x]" in user.replace("\nB. Search[Bertalan Farkas]\nC. Finish[1951]", "")
    assert "A, B, C, D" in user and "Question" not in user
    spec = judges.spec_messages("Who was born first?", "", "Search[Hans Schlegel]", ["c1"])[-1]["content"]
    assert "Question: Who was born first?" in spec and "Search[Hans Schlegel]" in spec and "1. c1" in spec
    assert "(none: this is the first step)" in spec


@pytest.mark.parametrize("reply,index", [
    ("B", 1), ("b", 1), ("(C)", 2), ("**D.**", 3), ("2", 1), ("The answer is C.", 2), ("Answer: A", 0),
    ("B. Search[Hans Schlegel birth date]", 1), ("I choose B", 1),
    ("E", 4), ("0", -1),                                   # parsed, but out of range: the judge rejects them
    ("", None), ("I cannot tell.", None), ("A or B, hard to say", None), ("option A, or option B", None),
])
def test_parse_choice(reply, index):
    assert judges.parse_choice(reply, 4) == index


@pytest.mark.parametrize("reply,rating", [
    ("4", 4), ("**5**", 5), ("4.", 4), ("3/5", 3), ("4 out of 5", 4), ("Rating: 2", 2), ("**Score:** 3", 3),
    ("I would give it a 4 since it names the entity.", 4), ("7", 7),
    ("four", None), ("4.5", None), ("between 3 and 4", None), ("", None),
])
def test_parse_rating(reply, rating):
    assert judges.parse_rating(reply) == rating


# ----------------------------------------------------------------------------- a fake OpenAI-compatible judge


class FakeJudgeAPI:
    """/v1/chat/completions on 127.0.0.1 (conftest.ChatServer). The user message names its case as
    `case=NAME`; `script[NAME]` lists the (status, text) answers to that case's requests in order,
    the last one repeating. A status other than 200 answers an error body that echoes the key."""

    def __init__(self, script):
        self.script, self.seen, self.lock = script, {}, threading.Lock()
        self.server = ChatServer(self.respond)
        self.url, self.close = self.server.url, self.server.close

    def respond(self, path, body, auth):
        assert path == "/v1/chat/completions" and auth == f"Bearer {KEY}"
        assert body["temperature"] == 0.0
        case = re.search(r"case=(\w+)", body["messages"][-1]["content"]).group(1)
        with self.lock:
            n = self.seen.get(case, 0)
            self.seen[case] = n + 1
        status, text = self.script[case][min(n, len(self.script[case]) - 1)]
        if status != 200:
            return status, ChatServer.error(f"backend failed for {auth}")
        return 200, ChatServer.completion(text, body["model"])


@pytest.fixture
def fake_api():
    servers = []

    def start(script):
        servers.append(FakeJudgeAPI(script))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


CANDIDATES = ["Search[Hans Schlegel birth date]", "Search[Bertalan Farkas birth date]", "Finish[1951]",
              "Search[Soyuz 36]"]


def judge(api, **kw):
    return judges.OpenAIJudge("fake-judge", base_url=api.url, api_key=KEY, timeout=5.0,
                          max_retries=kw.pop("max_retries", 2), backoff=0.01, **kw)


def test_judge_good_answers_and_environment_settings(fake_api, monkeypatch):
    api = fake_api({"b": [(200, "B")], "c": [(200, "**C.**")], "d": [(200, "The answer is D.")],
                    "s4": [(200, "4")], "s5": [(200, "Rating: 5/5")]})
    j = judge(api)
    assert [j.bind([f"case={c}"], CANDIDATES) for c in "bcd"] == [1, 2, 3]
    assert j.spec("Q?", "Step 1: Search[x]\nObservation: y", "Finish[1951]", ["case=s4"]) == 4
    assert j.spec("Q?", "", "Finish[1951]", ["case=s5"]) == 5
    assert j.counters["scored"] == 5 and j.counters["unscored"] == 0 and j.counters["calls"] == 5
    assert j.counters["prompt_tokens"] == 250
    monkeypatch.setenv("OPENAI_BASE_URL", api.url)      # the openai client's own settings are honoured
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    assert judges.OpenAIJudge("fake-judge", timeout=5.0).bind(["case=b"], CANDIDATES) == 1


def test_judge_malformed_and_out_of_range_replies_are_unscored(fake_api):
    api = fake_api({"mal": [(200, "I cannot tell from this checklist.")], "empty": [(200, "")],
                    "far": [(200, "E")], "spec_mal": [(200, "four")], "spec_far": [(200, "7")]})
    j = judge(api)
    assert j.bind(["case=mal"], CANDIDATES) is None
    assert j.bind(["case=empty"], CANDIDATES) is None
    assert j.bind(["case=far"], CANDIDATES) is None                 # a fifth option among four
    assert j.spec("Q?", "", "Finish[1951]", ["case=spec_mal"]) is None
    assert j.spec("Q?", "", "Finish[1951]", ["case=spec_far"]) is None  # outside 1–5
    assert j.counters["malformed"] == 3 and j.counters["out_of_range"] == 2
    assert j.counters["unscored"] == 5 and j.counters["scored"] == 0
    assert j.counters["calls"] == 5 and j.counters["retries"] == 0   # a bad reply is not asked again


def test_judge_http_errors_retry_then_unscored_quickly(fake_api):
    api = fake_api({"down": [(500, "")], "flaky": [(500, ""), (200, "A")], "bad": [(400, "")]})
    j = judge(api, max_retries=2)
    t0 = time.time()
    assert j.bind(["case=down"], CANDIDATES) is None
    assert time.time() - t0 < 3.0                                   # tiny backoff: 0.01 s, 0.02 s
    assert api.seen["down"] == 3 and j.counters["retries"] == 2 and j.counters["failed_calls"] == 1
    assert j.counters["api_error"] == 1 and j.counters["unscored"] == 1
    assert KEY not in j.last_error and "[redacted]" in j.last_error   # the server echoed the key
    assert j.bind(["case=flaky"], CANDIDATES) == 0 and api.seen["flaky"] == 2
    assert j.spec("Q?", "", "Finish[1951]", ["case=bad"]) is None and api.seen["bad"] == 1  # 400: no retry
    assert j.counters["failed_calls"] == 2 and j.counters["scored"] == 1


class ScriptedJudge:
    """A judge with OpenAIJudge's interface whose verdict each item's first criterion dictates:
    'right' picks the gold candidate (named by the second criterion), 'wrong' another one, 'unscored'
    gives None (what OpenAIJudge returns for a malformed reply or a failed call); Spec answers the
    rating after 'spec=' (None for 'spec=none')."""
    model, last_error = "scripted", ""

    def __init__(self):
        self.counters = Counter()

    def bind(self, criteria, candidates):
        verdict, gold = criteria[0], criteria[1]
        if verdict == "unscored":
            return None
        return candidates.index(gold) if verdict == "right" else next(
            i for i, c in enumerate(candidates) if c != gold)

    def spec(self, question, prefix, action, criteria):
        rating = criteria[2].split("=")[1]
        return None if rating == "none" else int(rating)


def test_unscored_items_are_left_out_of_bind_and_spec():
    # one trajectory, four steps with distinct actions: every step is a 4-candidate item
    actions = [("search", "Ann"), ("search", "Bob"), ("search", "Cy"), ("finish", "1951")]
    verdicts = [("right", "spec=5"), ("wrong", "spec=3"), ("unscored", "spec=none"), ("right", "spec=4")]
    steps = [{"action": a, "argument": x, "valid": True, "observation": "",
              "criteria": [v, f"{a.capitalize()}[{x}]", r]} for (a, x), (v, r) in zip(actions, verdicts)]
    rows = [{"question": "Q?", "steps": steps}]
    b = mu_credit.trace_binding(rows, bag_of_words, seed=3, judge=ScriptedJudge(), judge_items=4)
    o = b["openai"]
    # the unscored item is neither right nor wrong: 2 right of 3 scored, not 2 of 4 or 3 of 4
    assert o["bind"]["all"]["n"] == 3 and o["bind"]["all"]["correct"] == 2 and o["bind"]["all"]["unscored"] == 1
    assert o["bind"]["all"]["bind"] == pytest.approx(200 / 3)
    assert o["bind"]["search"] == {**o["bind"]["search"], "n": 2, "correct": 1, "unscored": 1}
    assert o["bind"]["finish"]["n"] == o["bind"]["finish"]["correct"] == 1
    # Spec: the mean of the three ratings given, 4.0 (not 3.0, as if the missing one were 0)
    assert o["spec"]["all"]["n"] == 3 and o["spec"]["all"]["spec"] == pytest.approx(4.0)
    assert o["spec"]["all"]["unscored"] == 1 and o["spec"]["search"]["spec"] == pytest.approx(4.0)


# ----------------------------------------------------------------------------- offline embedding judge


def bag_of_words(texts):
    """A deterministic stand-in for env.Retriever.encode: hashed, lower-cased word counts."""
    out = np.zeros((len(texts), 64))
    for i, t in enumerate(texts):
        for w in re.findall(r"\w+", t.lower()):
            out[i, zlib.crc32(w.encode()) % 64] += 1.0
    return out


def test_embedding_bind_picks_the_candidate_closest_to_the_rubric():
    criteria = ["Does the query name Bertalan Farkas?", "Does it ask for his birth date?"]
    assert judges.embedding_bind(bag_of_words, criteria, CANDIDATES) == 1
    assert judges.embedding_bind(bag_of_words, ["Is 1951 the final answer?"], CANDIDATES) == 2
    calls = []
    judges.embedding_bind(lambda texts: calls.append(texts) or bag_of_words(texts), ["a", "b"], ["x", "y"])
    assert calls == [["a b", "x", "y"]]                            # one batch: the rubric, then the candidates
    assert judges.embedding_bind(lambda texts: np.ones((len(texts), 3)), ["a"], ["x", "y"]) == 0  # ties: the first


# ----------------------------------------------------------------------------- the HTML page

ATTACK = "<script>document.body.setAttribute('data-hacked', 'yes')</script>"


def sample_rows():
    """Two trace rows as arco.trace_rows writes them (a dense-epoch one with G, A and buckets)."""
    step = lambda action, arg, obs, crit, d, s, **kw: {
        "output": f"{action.capitalize()}[{arg}]", "action": action, "argument": arg, "observation": obs,
        "valid": True, "reason": "", "searches_left": 2, "forced_finish": False, "retrieved": 0,
        "criteria": crit, "rubric_parsed": True, "d": d, "s": s, **kw}
    return [
        {"id": "q1", "question": "Who was born first, Hans Schlegel or Bertalan Farkas?",
         "gold": ["Hans Schlegel", "Schlegel"], "answer": "Hans Schlegel", "reward": 1.0, "finished": True,
         "epoch": 3, "batch": 0,
         "steps": [step("search", "Hans Schlegel birth date", "Hans Schlegel (born 3 August 1951) is ...",
                        ["Targets Hans Schlegel's birth date", ATTACK], [0.5, 0.25], 0.375,
                        G=0.625, A=0.125, bucket="search_1"),
                   step("finish", "Hans Schlegel", "Answer submitted & checked",
                        ["Answer is supported by evidence", "Answer names one person"], [0.25, 0.25], 0.25,
                        G=0.25, A=-0.0625, bucket="terminal")]},
        {"id": "q2", "question": "Is Tom <b>bold</b> & \"quoted\"?", "gold": ["yes"], "answer": "no",
         "reward": 0.0, "finished": True, "epoch": 3, "batch": 1,
         "steps": [step("finish", "no", "Answer submitted", ["Gives a yes/no answer"], [-0.75], -0.75)]},
    ]


def test_trajectories_html_is_self_contained_and_escaped():
    page = trajectories_html(sample_rows(), title="Epoch 3 <samples>")
    assert "<script" not in page and "&lt;script&gt;" in page
    assert "<b>bold</b>" not in page and "&lt;b&gt;bold&lt;/b&gt;" in page
    assert not re.search(r"\b(src|href)=|url\(|@import|https?://", page)   # no external asset
    assert "<title>Epoch 3 &lt;samples&gt;</title>" in page


class DomText(HTMLParser):
    """The text a reader sees (style contents left out), the script elements, the body's attributes,
    and each score span's (classes, text)."""

    def __init__(self):
        super().__init__()
        self.text, self.scripts, self.body, self.spans, self.stack = [], 0, {}, [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.scripts += tag == "script"
        if tag == "body":
            self.body = attrs
        self.stack.append((tag, attrs.get("class", "")))
        if tag == "span" and "score" in attrs.get("class", ""):
            self.spans.append([attrs["class"], ""])

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop()[0] != tag:
            pass

    def handle_data(self, data):
        if self.stack and self.stack[-1][0] in ("style", "title"):
            return
        self.text.append(data)
        if self.stack and self.stack[-1][0] == "span" and "score" in self.stack[-1][1]:
            self.spans[-1][1] += data


def chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(chromium() is None, reason="no chromium binary on PATH (Debian: apt-get install -y chromium)")
def test_page_renders_in_headless_chromium(tmp_path):
    # A control script of our own proves this Chromium runs JavaScript, so the escaped one not
    # running means something.
    page = trajectories_html(sample_rows()).replace(
        "</body>", "<script>document.body.setAttribute('data-control', 'ran')</script></body>")
    path = tmp_path / "page.html"
    path.write_text(page, encoding="utf-8")
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--dump-dom", path.as_uri()],
            capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    dom = DomText()
    dom.feed(out.stdout)
    text = " ".join(" ".join(dom.text).split())
    assert dom.body.get("data-control") == "ran"                 # JavaScript is on ...
    assert "data-hacked" not in dom.body and dom.scripts == 1     # ... and the criterion's script did not run
    assert "Targets Hans Schlegel's birth date" in text
    assert ATTACK in text                                        # shown as text, as written
    assert "Who was born first, Hans Schlegel or Bertalan Farkas?" in text
    assert 'Is Tom <b>bold</b> & "quoted"?' in text
    assert "Gold: Hans Schlegel | Schlegel" in text and "Answer: Hans Schlegel" in text
    assert "Search[Hans Schlegel birth date]" in text and "Finish[no]" in text
    assert "Hans Schlegel (born 3 August 1951) is ..." in text and "Answer submitted & checked" in text
    spans = [(cls.split()[-1], t) for cls, t in dom.spans]
    for shown in [("pos", "s_t +0.375"), ("pos", "G_t +0.625"), ("pos", "A_t +0.125"), ("neg", "A_t -0.062"),
                  ("pos", "d +0.500"), ("pos", "d +0.250"), ("neg", "d -0.750"), ("neg", "s_t -0.750"),
                  ("pos", "1.0"), ("neg", "0.0")]:
        assert shown in spans, (shown, spans)
    assert not any("G_t" in t for _, t in spans[spans.index(("neg", "0.0")):])  # a sparse step: no G_t, A_t


# ----------------------------------------------------------------------------- plots


def lines(fig):
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in fig.axes[0].get_lines()}


def read_png(path):
    from matplotlib.image import imread
    return imread(str(path))


def test_plot_dev_em(tmp_path):
    metrics = [{"kind": "eval", "epoch": 0, "em": 20.0}, {"kind": "update", "epoch": 1, "batch": 0},
               {"kind": "eval", "epoch": 2, "em": 31.5}, {"kind": "eval", "epoch": 1, "em": 25.0}]
    runs = {"arco": plots.dev_em_series(metrics), "sparse": [(0, 20.0), (1, 22.0), (2, 21.0)]}
    fig = plots.plot_lines(runs, tmp_path / "plots" / "dev_em.png", "Dev EM", "EM")
    assert read_png(tmp_path / "plots" / "dev_em.png").shape == (400, 640, 4)
    assert lines(fig) == {"arco": ([0, 1, 2], [20.0, 25.0, 31.5]), "sparse": ([0, 1, 2], [20.0, 22.0, 21.0])}


def test_bucket_scores_from_traces_and_plot(tmp_path):
    rows = [dict(r, epoch=e) for e in (1, 2) for r in sample_rows()]
    rows[0]["steps"][0]["s"] = 0.875                              # epoch 1, search_1
    scores = plots.bucket_mean_scores(rows)
    assert list(scores) == ["search_1", "terminal"]              # q2's finish has no recorded bucket: derived
    assert scores["search_1"] == [(1, 0.875), (2, 0.375)]
    assert scores["terminal"] == [(1, pytest.approx(-0.25)), (2, pytest.approx(-0.25))]  # mean of 0.25, -0.75
    fig = plots.plot_lines(scores, tmp_path / "buckets.png", "Buckets", "mean s_t")
    assert read_png(tmp_path / "buckets.png").shape == (400, 640, 4)
    assert lines(fig)["search_1"] == ([1, 2], [0.875, 0.375])


def test_plot_auc(tmp_path):
    fig = plots.plot_lines({"AUC": [(2, 0.7), (1, 0.55), (3, None)]}, tmp_path / "auc.png", "AUC", "AUC", chance=0.5)
    assert read_png(tmp_path / "auc.png").shape == (400, 640, 4)
    got = lines(fig)
    assert got["AUC"] == ([1, 2], [0.55, 0.7])                   # sorted by epoch; an undefined AUC skipped
    assert got["chance"][1] == [0.5, 0.5]
    fig = plots.plot_lines({"mu": [(1, 0.6)], "oracle": [(1, 0.9)]}, tmp_path / "auc2.png", "AUC", "AUC", chance=0.5)
    assert set(lines(fig)) == {"mu", "oracle", "chance"}


def test_the_fork_studys_curves_name_the_arms_as_the_tables_and_mark_the_fork(tmp_path):
    """lab.study.plot_curves (issue 66): the legend says what README's table says ("ARCO", "the control: …", "mixed:
    …"), the fork (the first update of the arms) is a dashed line, and the legend's type is at least 11 points."""
    from lab import study
    curves = {"sparse phase": [[(0, 30.0), (16, 40.0), (32, 45.0)]],
              "arco": [[(32, 45.0), (48, 47.0)], [(32, 44.0), (48, 46.0)]],
              "outcome-dense": [[(32, 45.0), (48, 50.0)]], "mixed": [[(32, 45.0), (48, 48.0)]]}
    fig = study.plot_curves(curves, tmp_path / "c.png", "dev EM", "EM (%)")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[1:] == ["ARCO (2 seeds)", "the control: outcome RL at ARCO's dense rate and λ_π (1 seed)",
                          "mixed: outcome + α·μ's dense advantage (1 seed)"]
    assert min(t.get_fontsize() for t in ax.get_legend().get_texts()) >= 11
    assert [list(line.get_xdata()) for line in ax.lines if line.get_linestyle() == "--"] == [[32, 32]]
    assert (tmp_path / "c.png").stat().st_size > 1000
