"""How fast the passes and the loop run, and whether the untrained μ writes its criteria: measurements, not part
of the algorithm (the lab: nothing imports this file). It times the models through the passes' interface with the
engine each backbone is loaded with (--engine; infra.engines.ENGINES).

    python -m lab.benchmark passes [--model M --batch 8 --tokens 256]   tokens/s of the passes training needs,
                                                    fp32 and bf16 autocast, and batched against one-at-a-time generation
    python -m lab.benchmark parse-rate [--examples 20]  how often the untrained μ writes parseable K-criteria JSON
                                                    on scripted synthetic steps
    python -m lab.benchmark loop [arco.py flags]    one dense iteration of Algorithm 1 at the flags' preset, phase by
                                                    phase, each beside its raw rate; the memory estimate beside the
                                                    measured peak
    python -m lab.benchmark sample [--model M]      an untrained μ writes and scores a rubric for a sample step
                                                    (plain engine)
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

import arco
import env
import warmup
from infra.data import DataError
from infra.engines import ENGINES, loading
from infra.estimate import memory_estimate
from infra.files import read_jsonl, write_json, write_jsonl
from infra.memory import peak_rss_gib
from infra.models import ModelLoadError, add_lora, fresh_adapter, load_backbone, load_backbone_checkpoint, trainable_parameters
from infra.oracle import OracleTeacher
from infra.parallel import Workers
from infra.passes import (chat_prompt_ids, encode_response, generate, last_hidden_states, pad_right, policy_act,
                          sequence_logprobs)
from infra.settings import ModelSettings, fill_from_preset, main_guard, parse_args
from env import EnvSettings
from rubric_model import EXAMPLES, MuSettings, Rubric, RubricModel, StepContext, contexts_from_trajectory, mean_pool, step_text


@dataclass
class ModelArgs(MuSettings, EnvSettings, ModelSettings):
    """The model the passes and parse-rate measurements load (infra.settings.ModelSettings; --model also takes
    random:<shape>, a random-init model of a public shape), π's and μ's knobs (env.EnvSettings,
    rubric_model.MuSettings), then these."""
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0 = torch's default)"})

    def __post_init__(self):
        fill_from_preset(self)


@dataclass
class PassesArgs(ModelArgs):
    batch: int = field(default=8, metadata={"min": 1, "help": "sequences per batch"})
    tokens: int = field(default=256, metadata={"min": 2, "help": "tokens per sequence"})
    response: int = field(default=64, metadata={"min": 1, "help": "response tokens per sequence (the positions "
                                                                  "sequence_logprobs scores)"})
    repeats: int = field(default=2, metadata={"min": 1, "help": "timed repeats of each pass (after one warm-up)"})


@dataclass
class ParseRateArgs(ModelArgs):
    examples: int = field(default=20, metadata={"min": 1, "help": "synthetic dev examples played by the script"})


# ----------------------------------------------------------------------------------------
# The passes benchmark (formerly rubric_model.py --benchmark)
# ----------------------------------------------------------------------------------------

def best_times(passes: dict, repeats: int) -> dict:
    """Seconds per call of each pass: one warm-up each, then `repeats` rounds that run the
    passes interleaved (so a busy neighbour slows all of them alike); the best round counts."""
    for fn in passes.values():
        fn()
    best = {name: float("inf") for name in passes}
    for _ in range(repeats):
        for name, fn in passes.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def passes_benchmark(args: PassesArgs) -> dict:
    """`python -m lab.benchmark passes`: tokens/s of the passes ARCO trains with (random tokens, fixed shapes), fp32
    against bf16 autocast; how far autocast moves a real loss; batched against one-at-a-time generation."""
    bb = add_lora(load_backbone(args.model, args.device, args.dtype, autocast="off", engine=ENGINES[args.engine]))
    bb.model.train()
    mu = RubricModel(bb, k=args.k)
    B, L, R = args.batch, args.tokens, args.response
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(100, bb.tokenizer.vocab_size - 100, (B, L), generator=gen).tolist()
    prompts, responses = [t[:L - R] for t in tokens], [t[L - R:] for t in tokens]
    ids, mask = pad_right(tokens, bb.tokenizer.pad_token_id, bb.device)
    params = trainable_parameters(bb.model)

    def backward(loss):
        loss.backward()
        for p in params:
            p.grad = None

    def backbone_only():
        backward(last_hidden_states(bb, ids, mask).float().pow(2).mean())

    def full_model():
        with bb.autocast():
            logits = bb.model(input_ids=ids, attention_mask=mask).logits
        backward(F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()))

    def logprobs():
        backward(-sequence_logprobs(bb, prompts, responses).sums().mean())

    @torch.no_grad()
    def score_only():
        mu.head(mean_pool(last_hidden_states(bb, ids, mask).float(), mask))

    def under(dtype, fn):
        def run():
            bb.autocast_dtype = dtype
            fn()
        return run

    names = {"backbone": "backbone only (hidden states, no LM head), fwd+bwd",
             "full": "full model (LM head on every position), fwd+bwd",
             "logprobs": f"sequence_logprobs (LM head on {R} of {L} positions), fwd+bwd",
             "score": "μ score-only forward (no LM head)"}
    fns = {"backbone": backbone_only, "full": full_model, "logprobs": logprobs, "score": score_only}
    passes = {(key, precision): under(dtype, fns[key])
              for precision, dtype in (("fp32", None), ("bf16 autocast", torch.bfloat16)) for key in fns}
    seconds = best_times(passes, args.repeats)
    results: dict = {"shapes": f"batch {B} x {L} tokens, LoRA r 8 on q/v, {torch.get_num_threads()} threads"}
    print(results["shapes"])
    for (key, precision), sec in seconds.items():
        results[f"{key}/{precision}"] = B * L / sec
        print(f"{precision:14s} {names[key]:62s} {B * L / sec:8.1f} tokens/s ({sec:.2f} s)", flush=True)
    for precision in ("fp32", "bf16 autocast"):
        ratio = results[f"logprobs/{precision}"] / results[f"backbone/{precision}"]
        print(f"{precision}: sequence_logprobs / backbone-only rate = {ratio:.2f} (target >= 0.80)")
    # How far bf16 autocast moves a real loss: Eq. 7's rubric text NLL of the worked-example
    # criteria after μ's prompt for the other example, and its gradient.
    (step_a, crit_a), (step_b, crit_b) = EXAMPLES
    ctxs = [StepContext(*step_a), StepContext(*step_b), SAMPLE_STEP]
    rubrics = [mu.rubric_from_criteria(c[:args.k]) for c in (crit_b, crit_a, crit_a)]
    losses, grads = {}, {}
    bb.model.eval()                                 # no dropout: compare like with like
    for precision, dtype in (("fp32", None), ("bf16 autocast", torch.bfloat16)):
        bb.autocast_dtype = dtype
        out = sequence_logprobs(bb, [mu.prompt_ids(c) for c in ctxs], [r.token_ids for r in rubrics])
        loss = -out.sums().sum() / out.mask.sum()
        loss.backward()
        losses[precision] = loss.item()
        grads[precision] = torch.cat([p.grad.flatten() for p in params])
        for p in params:
            p.grad = None
    cosine = F.cosine_similarity(grads["fp32"], grads["bf16 autocast"], dim=0).item()
    rel = abs(losses["bf16 autocast"] - losses["fp32"]) / abs(losses["fp32"])
    results.update(loss_fp32=losses["fp32"], loss_bf16=losses["bf16 autocast"], loss_rel_change=rel,
                   grad_cosine=cosine)
    print(f"rubric NLL per token (real text): fp32 {losses['fp32']:.5f}, bf16 autocast {losses['bf16 autocast']:.5f}, "
          f"relative change {rel:.1e}; gradient cosine fp32 vs bf16 {cosine:.4f}", flush=True)
    # Batched against one-at-a-time generation: 16 chat prompts, 32 new tokens, greedy, fp32.
    bb.autocast_dtype = None
    chats = [[{"role": "user", "content": f"Name a famous scientist whose name starts with {c}, and say why."}]
             for c in "ABCDEFGHIJKLMNOP"]
    for label, size in (("batched", 16), ("one_at_a_time", 1)):
        start = time.perf_counter()
        outs = generate(bb, chats, max_new_tokens=32, temperature=0.0, batch_size=size)
        sec = time.perf_counter() - start
        n_new = sum(len(o.token_ids) for o in outs)
        results[f"generation_{label}_s"] = sec
        print(f"generation of 16 prompts, {label:14s} {sec:7.2f} s for {n_new} new tokens "
              f"({n_new / sec:.1f} tokens/s)", flush=True)
    speedup = results["generation_one_at_a_time_s"] / results["generation_batched_s"]
    print(f"batched generation speed-up: {speedup:.1f}x (target >= 4x)")
    print("These numbers are noisy (shared CPU): rerun before drawing fine conclusions.")
    return results


# ----------------------------------------------------------------------------------------
# The untrained μ's parse rate (formerly rubric_model.py --parse-rate)
# ----------------------------------------------------------------------------------------

def scripted_trajectories(n: int, seed: int = 0):
    """Trajectories of a scripted agent on synthetic dev data: search the title of each
    supporting paragraph, then Finish with the gold answer."""
    examples = env.load_split("synthetic", "dev", size=n, seed=seed)
    plans = {ex.question: [f"Search[{ex.paragraphs[i][0]}]" for i in ex.supporting] + [f"Finish[{ex.answers[0]}]"]
             for ex in examples}
    progress: dict[str, int] = {}

    def act(prompts: list[list[dict]]) -> list[str]:
        out = []
        for messages in prompts:
            question = next(q for q in plans if q in messages[-1]["content"])
            step = progress.get(question, 0)
            progress[question] = step + 1
            out.append(plans[question][min(step, len(plans[question]) - 1)])
        return out

    return env.rollout(examples, act, env.Retriever())


def parse_rate(rubrics: Sequence[Rubric], k: int) -> dict:
    """Shares of rubrics that are valid JSON lists, that hold exactly K criteria, and that
    yield K non-empty criteria after salvage/padding."""
    n = max(1, len(rubrics))
    return {"steps": len(rubrics),
            "parsed": sum(r.parsed for r in rubrics) / n,
            "exactly_k": sum(r.parsed and r.n_written == k for r in rubrics) / n,
            "k_criteria_after_salvage": sum(r.n_written >= k for r in rubrics) / n}


def parse_rate_benchmark(args: ParseRateArgs) -> dict:
    """`python -m lab.benchmark parse-rate`: on the scripted steps of --examples synthetic dev questions, how often the
    untrained μ writes valid K-criteria JSON (parse_rate), with a few of its rubrics, parsed or not."""
    from tqdm import tqdm
    mu = RubricModel(load_backbone(args.model, args.device, args.dtype, args.autocast, engine=ENGINES[args.engine]), k=args.k,
                     rubric_mode=args.rubric)
    contexts = [c for t in scripted_trajectories(args.examples, args.seed) for c in contexts_from_trajectory(t)]
    rubrics: list[Rubric] = []
    for i in tqdm(range(0, len(contexts), 8), desc="rubrics"):
        rubrics += mu.generate_rubrics(contexts[i:i + 8], args.rubric_temperature, args.max_new_tokens_mu)
    rate = {"k": args.k, "temperature": args.rubric_temperature, **parse_rate(rubrics, args.k)}
    print(json.dumps(rate, indent=2))
    for r in rubrics[:3] + [r for r in rubrics if not r.parsed][:3]:
        print(json.dumps({"parsed": r.parsed, "n_written": r.n_written, "text": r.text}))
    return rate


# ----------------------------------------------------------------------------------------
# The loop benchmark: one dense iteration timed phase by phase
# ----------------------------------------------------------------------------------------

def save_batch(path: Path, trajs) -> None:
    """The benchmark's fixed batch: each trajectory as a trace row plus the sampled token ids."""
    rows = []
    for t in trajs:
        row = t.to_dict()
        row["max_searches"] = t.max_searches
        for st, saved in zip(t.steps, row["steps"]):
            saved["output_ids"] = st.output_ids
        rows.append(row)
    write_jsonl(path, rows)


def load_batch(path: Path, examples) -> list:
    """save_batch's trajectories again, with the prompts π saw (rebuilt exactly as env.rollout makes them)."""
    by_id = {ex.id: ex for ex in examples}
    trajs = []
    for row in read_jsonl(path):
        t = env.Trajectory(by_id[row["id"]], row["max_searches"], answer=row["answer"], reward=row["reward"],
                           finished=row["finished"])
        for s in row["steps"]:
            prompt = env.policy_messages(t.example.question, env.format_history(t.steps), s["searches_left"],
                                         s["forced_finish"])
            t.steps.append(env.Step(prompt, s["output"], s["action"], s["argument"], s["observation"], s["valid"],
                                    s["reason"], s["searches_left"], s["forced_finish"], s["retrieved"],
                                    s["output_ids"]))
        trajs.append(t)
    return trajs


def raw_rates(bb, n_seqs: int, length: int, response: int) -> dict:
    """Tokens/s of the kinds of pass training makes, on one uniform batch (n_seqs random sequences of
    `length` tokens, no padding): a forward without the LM head (a score pass), a forward with the
    LM head on the last `response` positions (a reference pass), and that forward + backward (a
    training pass). What a phase would reach with no padding, no small batches and no overhead."""
    gen = torch.Generator().manual_seed(0)
    seqs = torch.randint(100, bb.tokenizer.vocab_size - 100, (n_seqs, length), generator=gen).tolist()
    prompts, responses = [s[:length - response] for s in seqs], [s[length - response:] for s in seqs]
    ids, mask = pad_right(seqs, bb.tokenizer.pad_token_id, bb.device)
    params = trainable_parameters(bb.model)

    def hidden():
        with torch.no_grad():
            last_hidden_states(bb, ids, mask)

    def forward():
        with torch.no_grad():
            sequence_logprobs(bb, prompts, responses)

    def train():
        (-sequence_logprobs(bb, prompts, responses).sums().sum()).backward()
        for p in params:
            p.grad = None
    seconds = best_times({"hidden": hidden, "forward": forward, "train": train}, repeats=2)
    return {name: n_seqs * length / sec for name, sec in seconds.items()}


def raw_generation_seconds(bb, n_prompts: int, prompt_len: int, new_tokens: int) -> float:
    """Seconds of one greedy generate call on n_prompts uniform random prompts that writes exactly
    `new_tokens` tokens each (no end-of-turn stop, no padding): generation at its raw rate."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, bb.tokenizer.vocab_size - 100, (n_prompts, prompt_len), generator=gen).to(bb.device)

    def run():
        with torch.no_grad(), bb.autocast():
            bb.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=bb.tokenizer.pad_token_id)
    return best_times({"generate": run}, repeats=1)["generate"]


def loop_benchmark(args: arco.Args) -> dict:
    """`python -m lab.benchmark loop [arco.py flags]`: one dense iteration of Algorithm 1 (the costliest:
    every pass of both models runs) at the run's preset on `batch_size` training questions × 1 sample, timed
    phase by phase, each beside its raw rate measured in the same process on the same shapes (raw_rates).
    π's rollout of these questions is timed on every call; the later phases all process one fixed batch, saved by the first
    call in runs/<dataset>/benchmark/batch.jsonl: the oracle teacher's trajectories on the same questions
    (gold and imperfect ones, infra.oracle.oracle_script), which hold the valid Search/Finish steps of a policy
    that works, whatever the preset's π does."""
    bench = Path(args.out_dir) / args.dataset / "benchmark"
    warm = warmup.ensure(args, with_mu=True)
    questions = env.training_questions(args.dataset, args.data_dir or None, args.train_size, args.seed,
                                       warm.taught if args.warmup_questions == "before" else frozenset())[:args.batch_size]
    retriever = env.shared_retriever(args.retriever or None, args.retriever_pooling)
    torch.manual_seed(args.seed)
    pi = fresh_adapter(load_backbone_checkpoint(warm.pi, **loading(args))[0], args.lora_dropout)
    mu = RubricModel.load(warm.mu, **loading(args)).fresh_adapter(args.lora_dropout)
    opt_pi, opt_mu = arco.make_optimizers(pi, mu, args)
    one = Workers()
    env.rollout(questions[:1], policy_act(pi, 0.0, 4, 1), retriever)     # warm-up: index, kernels
    phases: dict[str, dict] = {}

    def timed(name, fn):
        start = time.perf_counter()
        out = fn()
        phases[name] = {"seconds": time.perf_counter() - start}
        return out

    torch.manual_seed(args.seed)
    rollout = timed("π rollout", lambda: env.rollout(questions, policy_act(pi, args.rollout_temperature,
                                                                           args.max_new_tokens_pi, args.gen_batch),
                                                    retriever, args.max_searches, args.obs_chars))
    if not (bench / "batch.jsonl").is_file():
        oracle = OracleTeacher(env, seed=args.seed, obs_chars=args.obs_chars)
        save_batch(bench / "batch.jsonl", oracle.rollout([(q, i % 4) for i, q in enumerate(questions)], retriever)[0])
    trajs = load_batch(bench / "batch.jsonl", questions)
    contexts = [c for t in trajs for c in contexts_from_trajectory(t)]
    _, rubrics, _, s = timed("μ rubrics + scores", lambda: arco.annotate(mu, trajs, args, one))
    A = arco.advantages(arco.CreditBatch(trajs, s, True, args)).A
    timed("π update", lambda: arco.policy_update(pi, opt_pi, trajs, A, args, args.kl_pi_dense, one))
    timed("μ update", lambda: arco.rubric_update(mu, opt_mu, trajs, contexts, rubrics, args, one))
    peak_gib = peak_rss_gib()
    gpu_gib = torch.cuda.max_memory_allocated() / 2 ** 30 if pi.device.type == "cuda" else None

    # Token counts of each phase and the raw rates of the same kinds of pass on the same shapes.
    pi_items = [(len(chat_prompt_ids(pi.tokenizer, st.prompt)),
                 len(st.output_ids or encode_response(pi, st.output)))
                for t in trajs for st in t.steps if st.valid]
    mu_ids = mu.scoring_ids(contexts, rubrics)
    mu_rubric = [len(r.token_ids) for r in rubrics]
    mean = lambda xs: max(1, round(sum(xs) / max(1, len(xs))))              # noqa: E731
    n_pi, n_mu = sum(p + r for p, r in pi_items), sum(map(len, mu_ids))
    per_pass = lambda length: max(1, args.pass_tokens // length)           # noqa: E731  sequences in one pass
    rate_pi = raw_rates(pi, per_pass(mean([p + r for p, r in pi_items])), mean([p + r for p, r in pi_items]),
                        mean([r for _, r in pi_items]))
    rate_mu = raw_rates(mu.backbone, per_pass(mean(list(map(len, mu_ids)))), mean(list(map(len, mu_ids))),
                        mean(mu_rubric))
    rollout_steps = [st for t in rollout for st in t.steps]
    rounds = max(len(t.steps) for t in rollout)
    prompt_lens = [len(chat_prompt_ids(pi.tokenizer, st.prompt)) for st in rollout_steps]
    gen_pi = raw_generation_seconds(pi, min(args.gen_batch, len(rollout)), mean(prompt_lens),
                                    mean([len(st.output_ids or []) for st in rollout_steps]))
    gen_mu = raw_generation_seconds(mu.backbone, min(args.gen_batch, len(contexts)),
                                    mean([len(x) - n for x, n in zip(mu_ids, mu_rubric)]), mean(mu_rubric))
    raw = {"π rollout": rounds * gen_pi,                                  # one generate call per round
           "μ rubrics + scores": math.ceil(len(contexts) / args.gen_batch) * gen_mu    # greedy: scores come
           + (n_mu / rate_mu["hidden"] if args.rubric_temperature else 0.0),          # with the generation
           "π update": n_pi / rate_pi["train"] + (n_pi / rate_pi["forward"] if args.kl_pi_dense else 0.0),
           "μ update": n_mu / rate_mu["train"] + (n_mu / rate_mu["forward"] if args.kl_mu else 0.0)}
    tokens = {"π rollout": sum(len(st.output_ids or []) for st in rollout_steps),
              "μ rubrics + scores": sum(mu_rubric), "π update": n_pi, "μ update": n_mu}
    total = sum(p["seconds"] for p in phases.values())
    lines = [f"loop benchmark: {args.dataset}, preset {args.preset}, one dense iteration on {len(trajs)} "
             f"trajectories ({len(contexts)} steps), {torch.get_num_threads()} threads",
             f"{'phase':22s} {'seconds':>8s} {'tokens':>7s} {'tokens/s':>9s} {'raw s':>7s} {'of raw':>7s}"]
    for name, p in phases.items():
        p.update(tokens=tokens[name], tokens_per_s=tokens[name] / p["seconds"], raw_seconds=raw[name],
                 of_raw=raw[name] / p["seconds"])
        lines.append(f"{name:22s} {p['seconds']:8.1f} {p['tokens']:7d} {p['tokens_per_s']:9.1f} "
                     f"{p['raw_seconds']:7.1f} {100 * p['of_raw']:6.0f}%")
    result = {"dataset": args.dataset, "preset": args.preset, "trajectories": len(trajs), "steps": len(contexts),
              "seconds": total, "trajectories_per_minute": 60 * len(trajs) / total, "peak_rss_gib": peak_gib,
              "phases": phases, "raw_rates": {"π": rate_pi, "μ": rate_mu}, "threads": torch.get_num_threads()}
    estimate = memory_estimate(args)
    dense_epoch = math.ceil(args.train_size / args.batch_size) * total       # a dense epoch: train_size / |B| updates
    result.update(peak_gpu_gib=gpu_gib, estimate_gib=estimate.get("peak_gib"), dense_epoch_seconds=dense_epoch)
    lines += [f"{'all':22s} {total:8.1f}   →  {result['trajectories_per_minute']:.2f} trajectories per minute; "
              f"peak RSS {peak_gib:.2f} GiB" + (f", peak GPU memory {gpu_gib:.2f} GiB" if gpu_gib is not None else ""),
              estimate["text"],
              f"projection: one dense epoch ({math.ceil(args.train_size / args.batch_size)} updates of "
              f"{args.batch_size} trajectories) ≈ {dense_epoch / 3600:.2f} h, the paper schedule's "
              f"{args.epochs - args.sparse_epochs} dense epochs ≈ {(args.epochs - args.sparse_epochs) * dense_epoch / 3600:.1f} h "
              f"(paper, Appendix C, HotpotQA / Qwen3-4B on one 80 GB GPU: 1h 22m of dense training up to its "
              f"selected checkpoint)",
              "raw: tokens of the phase at the raw rate of its kind of pass on uniform batches of the same "
              "mean length (tokens: new tokens for generation, sequence tokens otherwise)"]
    print("\n".join(lines))
    bench.mkdir(parents=True, exist_ok=True)
    write_json(bench / f"loop-{time.strftime('%Y%m%d-%H%M%S')}.json", result)
    return result


# Each program: the dataclass its flags are read into, and what runs.
SAMPLE_STEP = StepContext(
    question="Which city is the headquarters of the company that employs the violinist Tarin Voss?",
    prefix="Step 1: Search[Tarin Voss]\nObservation: Tarin Voss: Tarin Voss is a violinist who works for the "
           "Kelmor Press.",
    action="Search[Kelmor Press headquarters]", searches_left=2)


def sample_rubric(args: ModelArgs) -> None:
    """`python -m lab.benchmark sample`: an untrained μ (the --model backbone, a fresh score head, two worked examples in
    its prompt) writes and scores a rubric for SAMPLE_STEP (plain engine)."""
    start = time.perf_counter()
    bb = load_backbone(args.model, args.device, args.dtype, args.autocast, engine=ENGINES["plain"])
    print(f"loaded {args.model} in {time.perf_counter() - start:.1f} s on {bb.device}", flush=True)
    mu = RubricModel(bb, k=args.k, rubric_mode=args.rubric, examples=2, rubric_format=args.rubric_format)
    rubric = mu.generate_rubrics([SAMPLE_STEP], args.rubric_temperature, args.max_new_tokens_mu)[0]
    with torch.no_grad():
        scores = mu.score([SAMPLE_STEP], [rubric])
    print(step_text(SAMPLE_STEP))
    print(f"\nrubric ({'parsed' if rubric.parsed else 'NOT parsed'}): {rubric.text}")
    for c, d in zip(rubric.criteria, scores.d[0].tolist()):
        print(f"  d = {d:+.3f}  {c}")
    print(f"s_t = {scores.s[0].item():+.3f} (untrained score head: near 0)")


PROGRAMS = {"passes": (PassesArgs, passes_benchmark), "parse-rate": (ParseRateArgs, parse_rate_benchmark),
            "loop": (arco.Args, loop_benchmark), "sample": (ModelArgs, sample_rubric)}


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m lab.benchmark PROGRAM [its flags]`: the program's flags are parsed into its dataclass (the loop's are
    arco.py's, its preset filled in), then it runs."""
    pre = argparse.ArgumentParser(prog="python -m lab.benchmark", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = pre.add_subparsers(dest="program", required=True)
    for name, (_, run) in PROGRAMS.items():
        sub.add_parser(name, add_help=False, help=run.__doc__.split(": ", 1)[1].split(";")[0])   # --help: its flags
    own, rest = pre.parse_known_args(argv)
    cls, run = PROGRAMS[own.program]
    args = parse_args(cls, rest, description=run.__doc__)
    if cls is arco.Args:
        args = arco.resolve_args(args)
    elif args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    run(args)


if __name__ == "__main__":
    main_guard(main, DataError, ModelLoadError)
