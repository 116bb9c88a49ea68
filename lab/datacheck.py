"""Checks of the data and of the oracle teacher (`python -m lab.diagnostics --check-files | --check-retrieval |
--check-gold`): every data file loads, how often a supporting title retrieves a supporting paragraph, how often the
oracle's gold trajectories find every supporting paragraph."""
from typing import Sequence

import env
from infra.data import GENERATED, find_data_file
from infra.oracle import OracleTeacher, evidence_found
from infra.settings import DATASETS

# --------------------------------------------------------------------------- checks of the data and the oracle teacher
def retrieval_hit_rate(examples: list, retriever) -> dict:
    """Query = the title of a supporting paragraph; hit = the top-1 paragraph is a supporting one."""
    pairs = [(ex, ex.paragraphs[i][0], i) for ex in examples for i in ex.supporting]
    got = retriever.retrieve([ex for ex, _, _ in pairs], [q for _, q, _ in pairs])
    hits = sum(g in ex.supporting for (ex, _, _), g in zip(pairs, got))
    same = sum(g == i for (_, _, i), g in zip(pairs, got))
    n = max(len(pairs), 1)
    return {"queries": len(pairs), "supporting_hit": hits / n, "same_paragraph": same / n}


def gold_evidence_rate(examples: Sequence, retriever, obs_chars: int = 400) -> dict:
    """Play the oracle's gold trajectory on every example and measure the evidence it retrieved.

    `all_evidence`: share of questions whose searches retrieved every supporting paragraph;
    `fits_budget`: questions with no more supporting paragraphs than searches (2Wiki
    bridge_comparison needs 4 with a budget of 3) and the share of those with all evidence.
    """
    teacher = OracleTeacher(env, obs_chars=obs_chars)
    trajs, metas = teacher.rollout([(ex, 0) for ex in examples], retriever)
    found = [evidence_found(t) for t in trajs]
    fits = [m["evidence_fits_budget"] for m in metas]
    n, nf = len(trajs), sum(fits)
    by_type = {}
    for ty in sorted({t.example.type for t in trajs}):
        idx = [i for i, t in enumerate(trajs) if t.example.type == ty]
        by_type[ty] = {"n": len(idx), "all_evidence": sum(found[i] for i in idx) / len(idx)}
    return {"questions": n, "all_evidence": sum(found) / max(n, 1), "reward": sum(t.reward for t in trajs) / max(n, 1),
            "fits_budget": nf, "all_evidence_when_fits": sum(f for f, ok in zip(found, fits) if ok) / max(nf, 1),
            "by_type": by_type}


def check_data(args) -> None:
    """--check-retrieval: how often a supporting paragraph's title, as a query, retrieves a supporting paragraph;
    --check-gold: how often the oracle teacher's gold trajectories retrieve every supporting paragraph."""
    retriever = env.Retriever(args.retriever or None, pooling=args.retriever_pooling)
    for ds in (DATASETS if args.dataset == "all" else [args.dataset]):
        for sp in (("train", "dev") if args.split == "all" else [args.split]):
            examples = env.load_split(ds, sp, args.data_dir or None, args.check_size or None, args.seed)
            if args.check_retrieval:
                r = retrieval_hit_rate(examples, retriever)
                print(f"{ds}/{sp}: {r['queries']} supporting-title queries, supporting paragraph retrieved "
                      f"{100 * r['supporting_hit']:.1f}%, the titled paragraph itself {100 * r['same_paragraph']:.1f}%")
            if args.check_gold:
                r = gold_evidence_rate(examples, retriever)
                print(f"{ds}/{sp}: {r['questions']} questions; the gold trajectory retrieved every supporting "
                      f"paragraph for {100 * r['all_evidence']:.1f}% (R = 1 for {100 * r['reward']:.1f}%); "
                      f"{r['fits_budget']} need no more searches than the budget ({env.DEFAULT_MAX_SEARCHES[ds]}), "
                      f"{100 * r['all_evidence_when_fits']:.1f}% of those; by type: "
                      + ", ".join(f"{t} {100 * v['all_evidence']:.0f}% of {v['n']}" for t, v in r["by_type"].items()))


def load_report(datasets: Sequence[str], splits: Sequence[str], data_dir: str | None) -> list[dict]:
    """--check-files: load every file asked for; count examples loaded and skipped (with reasons)."""
    rows = []
    for ds in datasets:
        for sp in splits:
            if ds in GENERATED:
                n = len(env.synthetic_examples(200, split=sp, long=ds == "synthetic-long"))
                rows.append({"dataset": ds, "split": sp, "file": "(generated)", "loaded": n, "skipped": "0"})
                continue
            path = find_data_file(ds, sp, data_dir)
            examples, skipped = env.read_examples(path, ds)
            rows.append({"dataset": ds, "split": sp, "file": str(path), "loaded": len(examples),
                         "skipped": ", ".join(f"{n} {why}" for why, n in skipped.items()) or "0"})
    return rows


def check_files(args) -> None:
    """--check-files: the counts and skips of every data file asked for."""
    splits = ("train", "dev") if args.split == "all" else [args.split]
    for row in load_report(DATASETS if args.dataset == "all" else [args.dataset], splits, args.data_dir):
        print(f"{row['dataset']:>14}/{row['split']:<5} loaded {row['loaded']:>5}  skipped {row['skipped']:<24} {row['file']}")
