"""Data parallel (torchrun, issue 15): a 2-process gloo run of Algorithm 1 on CPU gives the numbers of the
1-process run of the same global batch, and the batch statistics of Eq. 3-5 are the whole batch's."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_arco import first_difference, numbers, read_jsonl

REPO = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, script: list[str], cwd: Path, timeout: int = 900, fails: bool = False) -> str:
    """`torchrun --standalone --nproc_per_node nproc script...` with one thread per rank (2 cores here)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *script]
    envs = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run(cmd, cwd=cwd, env=envs, capture_output=True, text=True, timeout=timeout)
    assert (res.returncode != 0) == fails, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


BUCKET_SCRIPT = """
import json, sys
import torch
import arco, env
from infra.parallel import Workers
# Two processes, unequal parts (Workers.part): the first holds trajectories a (search, search, finish) and
# b (search, finish), the second c (finish). s per step: a 0.2, 0.3, 0.5 | b 0.1, 0.4 | c -0.5.
workers = Workers()
workers.start(arco.resolve_args(arco.parse_args(arco.Args, ["--dataset", "synthetic", "--sampling", "trajectory"])))
ex = env.Example(id="q", question="?", answers=["x"], paragraphs=[("t", "p")], supporting=[0], dataset="synthetic")
def traj(actions, reward):
    t = env.Trajectory(ex, 3)
    t.steps = [env.Step(prompt=[], output="", action=a, argument="", observation="", valid=True, reason="",
                        searches_left=0, forced_finish=False) for a in actions]
    t.reward = reward
    return t
batch = [traj(["search", "search", "finish"], 1.0), traj(["search", "finish"], 0.0), traj(["finish"], 1.0)]
scores = [[0.2, 0.3, 0.5], [0.1, 0.4], [-0.5]]
got = workers.map(lambda idx: [(batch[i], scores[i]) for i in idx], list(range(3)))   # each its part, all back
trajs = [t for t, _ in got]
s = torch.tensor([x for _, xs in got for x in xs])
args = arco.resolve_args(arco.parse_args(arco.Args, ["--dataset", "synthetic", "--no-bucket-fallback",
                                                     "--sparse-baseline", "batch"]))
dense = arco.advantages(arco.CreditBatch(trajs, s, True, args))
A, means = dense.A, dense.mean_G_per_bucket
A_sparse = arco.advantages(arco.CreditBatch(trajs, None, False, args)).A
total = workers.total(float(len(workers.own(range(3)))))
if workers.main:
    json.dump({"A": A, "means": means, "A_sparse": A_sparse, "n": total,
               "share": [workers.part(5).start, workers.part(5).stop]}, open(sys.argv[1], "w"))
workers.end()
"""


def test_two_ranks_with_unequal_shares_compute_the_whole_batchs_bucket_means(tmp_path):
    """Eq. 4's Ḡ_{B,b} over the whole batch when the ranks hold unequal numbers of steps per bucket.
    By hand: G_a = (1.0, 0.8, 0.5), G_b = (0.5, 0.4), G_c = (−0.5). search_1: a 1.0, b 0.5 → 0.75;
    search_2: a 0.8 alone → 0.8; terminal: a 0.5, b 0.4, c −0.5 → 0.4/3 = 0.1333…
    A = α (G − Ḡ), α 0.5: a (0.125, 0, 0.18333), b (−0.125, 0.13333), c (−0.31667).
    Sparse, batch baseline (Alg. 1, line 31): mean R = 2/3 → a +1/3, b −2/3, c +1/3."""
    (tmp_path / "buckets.py").write_text(textwrap.dedent(BUCKET_SCRIPT))
    torchrun(2, ["buckets.py", str(tmp_path / "out.json")], tmp_path, timeout=300)
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["means"] == pytest.approx({"search_1": 0.75, "search_2": 0.8, "terminal": 0.4 / 3})
    assert [x for a in got["A"] for x in a] == pytest.approx(
        [0.125, 0.0, 0.5 * (0.5 - 0.4 / 3), -0.125, 0.5 * (0.4 - 0.4 / 3), 0.5 * (-0.5 - 0.4 / 3)])
    assert [a[0] for a in got["A_sparse"]] == pytest.approx([1 / 3, -2 / 3, 1 / 3])
    assert got["n"] == [3.0]                      # |B| summed over the workers: 2 + 1
    assert got["share"] == [0, 3]                 # the first of 2 takes 3 of 5 items (the second: 3..5)


# arco.py in fp32: a CPU with native bf16 runs every pass under bf16 autocast (infra.models.CPU_AUTOCAST_DEFAULT),
# whose rounding depends on the shape of a batch, hence on how the batch is split across ranks.
FP32_ARCO = "import sys\nfrom infra import models\nmodels.CPU_AUTOCAST_DEFAULT = False\nimport arco\narco.main(sys.argv[1:])\n"
# The same, and every rank gets a SIGINT (Ctrl-C) right after epoch 1's first update.
CTRL_C_ARCO = """import os, signal, sys
from infra import models
models.CPU_AUTOCAST_DEFAULT = False
import arco
real = arco.iteration
def iteration(*a, **k):
    u = real(*a, **k)
    if (u.epoch, u.batch) == (1, 0):
        os.kill(os.getpid(), signal.SIGINT)
    return u
arco.iteration = iteration
arco.main(sys.argv[1:])
"""


def test_a_two_process_run_writes_the_numbers_of_the_one_process_run(tiny_dir, tmp_path):
    """Acceptance 1: `torchrun --nproc_per_node 2 arco.py` (gloo, the tiny model) against `python arco.py` with
    the same seed and global batch: the same metrics.jsonl (every update's R, losses, KL, μ's scores and
    bucket means; every evaluation), within rel 1e-4 / abs 1e-6 (test_arco.first_difference). --sampling trajectory gives each trajectory its own random
    stream; --lora-dropout 0 because a dropout mask is drawn per training pass, and a rank's passes hold
    other steps than the single process's."""
    common = ["--dataset", "synthetic", "--model", str(tiny_dir), "--train-size", "7", "--eval-size", "5",
              "--epochs", "2", "--sparse-epochs", "1", "--batch-size", "6", "--group-size", "2",
              "--max-new-tokens-pi", "8", "--max-new-tokens-mu", "12", "--out-dir", str(tmp_path / "runs"),
              "--sft-epochs-pi", "1", "--sft-epochs-mu", "1", "--warmup-samples", "2", "--device", "cpu",
              "--sampling", "trajectory", "--lora-dropout", "0", "--seed", "3"]
    (tmp_path / "fp32_arco.py").write_text(FP32_ARCO)
    one = subprocess.run([sys.executable, "fp32_arco.py", *common, "--name", "one"], cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=900)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    out = torchrun(2, ["fp32_arco.py", *common, "--name", "two"], tmp_path)
    runs = tmp_path / "runs" / "synthetic"
    assert sorted(p.name for p in runs.iterdir()) == ["one", "two", "warmup"]      # one run folder, rank 0's
    assert out.count("[arco] done:") == 1                                           # rank 0 speaks
    a, b = (numbers(read_jsonl(runs / n / "metrics.jsonl")) for n in ("one", "two"))
    updates = [r for r in a if r["kind"] == "update"]
    # 7 questions: sparse batches of 3 questions × G 2 (3, 3, 1 questions), dense batches of 6 questions × 1
    # (6, then 1: rank 1 holds no trajectory of that last batch); the ranks' shares are 3+3, 3+3, 1+1, 3+3, 1+0
    assert [(r["epoch"], r["trajectories"]) for r in updates] == [(1, 6), (1, 6), (1, 2), (2, 6), (2, 1)]
    assert any(r["rubric_loss"] for r in updates)
    diff = first_difference(b, a)
    assert diff is None, diff
    # Ctrl-C on every rank mid-epoch: all stop after the same batch, rank 0 saves; --resume continues to the
    # same numbers (every batch is seeded by itself, the optimizers' states are in the checkpoint).
    (tmp_path / "ctrl_c_arco.py").write_text(CTRL_C_ARCO)
    out = torchrun(2, ["ctrl_c_arco.py", *common, "--name", "three"], tmp_path, fails=True)
    assert "is saved in" in out and (runs / "three" / "checkpoints" / "interrupted" / "state.json").is_file()
    torchrun(2, ["fp32_arco.py", *common, "--name", "three", "--resume"], tmp_path)
    c = numbers(read_jsonl(runs / "three" / "metrics.jsonl"))
    diff = first_difference(c, a)
    assert diff is None, diff


def test_torchrun_refuses_the_batch_wide_random_stream(monkeypatch):
    """--sampling batch draws once over the generation batch, so a rank's rollouts would depend on the split:
    a torchrun run (WORLD_SIZE > 1) stops before joining the process group, saying what to pass."""
    import arco
    from infra.parallel import Workers
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    workers = Workers()
    assert (workers.count, workers.index, workers.main) == (2, 1, False)
    with pytest.raises(SystemExit, match="--sampling trajectory"):
        workers.start(arco.resolve_args(arco.parse_args(arco.Args, ["--dataset", "synthetic"])))
    assert [workers.part(7) for workers.index in (0, 1)] == [slice(0, 4), slice(4, 7)]
    assert Workers(alone=True).count == 1
