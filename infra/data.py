"""Where the questions come from (plumbing beneath env.py): the data files (--data-dir, $ARCO_DATA_DIR, a download
of the official public files when the machine is online), the records of a JSON array or JSONL file, MuSiQue's
own layout, the gold answers of a data file (evaluate.py), and our synthetic worlds (`synthetic`: 2-hop bridge and comparison questions over invented entities;
`synthetic-long`: 3-4-hop chains with look-alike distractors), generated in the HotpotQA distractor layout that
env.py reads (env.parse_hotpot_layout, env.load_split).
"""
from __future__ import annotations

import json
import os
import random
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from infra.settings import DATASETS

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


def cache_dir() -> Path:
    return Path(os.environ.get("ARCO_CACHE") or Path.home() / ".cache" / "arco")


def require(rec: dict, keys: Sequence[str], where: str) -> None:
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    for k in keys:
        if k not in rec:
            raise DataError(f"{where}: missing field '{k}'")


def musique_fields(rec: dict, where: str) -> dict | str:
    """MuSiQue-Ans layout: the fields of env.Example, or why the record is skipped (answerable questions only;
    the answer and its aliases all count)."""
    require(rec, ("id", "question", "answer", "paragraphs"), where)
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
    return dict(id=str(rec["id"]), question=str(rec["question"]), answers=answers, paragraphs=paras,
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


@dataclass
class Gold:
    """A question's gold answers (the first the official one, then its aliases) and its type, for a predictions file."""
    id: str
    answers: list[str]
    type: str


def gold_answers(path: str | os.PathLike) -> list[Gold]:
    """The gold answers of a data file in its official layout (evaluate.py): HotpotQA and 2WikiMultiHopQA (`_id`,
    `answer`, `type`), MuSiQue (`id`, `answer`, `answer_aliases`), JSON or JSONL; a record without an id or an
    answer is a DataError naming it."""
    if not Path(path).is_file():
        raise DataError(f"{path}: no such gold file")
    out = []
    for where, rec in read_records(Path(path)):
        qid = rec.get("_id", rec.get("id")) if isinstance(rec, dict) else None
        if qid is None or "answer" not in rec:
            raise DataError(f"{where}: a gold question needs an id (`_id` or `id`) and an `answer`")
        out.append(Gold(str(qid), [str(rec["answer"])] + [str(a) for a in rec.get("answer_aliases") or []],
                        str(rec.get("type", ""))))
    return out


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


# --- synthetic worlds (HotpotQA layout) ----------------------------------------------

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


def synthetic_records(n: int, seed: int = 0, split: str = "train", long: bool = False) -> list[tuple[str, dict]]:
    """n synthetic records (where, record), deterministic from (seed, split); train and dev use different streams.
    `long`: the 3–4-hop family (synthetic_long_record) instead of the 2-hop one."""
    name = "synthetic-long" if long else "synthetic"
    rng = random.Random(f"arco-{name}-{seed}-{split}")
    record = synthetic_long_record if long else synthetic_record
    return [(f"{name} #{i}", record(rng, f"{'synl' if long else 'syn'}-{split}-{seed}-{i:06d}")) for i in range(n)]
