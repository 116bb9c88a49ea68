"""A sweep of kill points (issue 34): the tiny ARCO run is killed (SIGKILL: nothing saved, no handler runs) at
seeded points spread over the whole command — warmup collection, π SFT, μ SFT, the score-head fit, the epoch-0
evaluation, each RL phase, an evaluation, the middle of writing a checkpoint, the final report — then run again
with --resume, which must finish and write the uninterrupted run's metrics.jsonl (the per-batch seeding makes
this exact; seconds and peak memory apart).

Two kill points run in every CI run; the whole sweep (12 points, ~6 minutes on 2 cores) with ARCO_SLOW=1."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_arco import numbers, read_jsonl, tiny_args

REPO = Path(__file__).resolve().parents[1]

# (module.function, the call that is killed): in the order the command reaches them
KILL_POINTS = [
    ("warmup.make_record", 4),              # warmup collection, after three of its records were written
    ("warmup.policy_sft_backward", 1),      # π SFT, its first batch
    ("warmup.rubric_sft_backward", 2),      # μ SFT, second batch
    ("warmup.fit_score_head", 1),           # μ's score-head fit
    ("runs.RunFolder.log_evaluation", 1),   # epoch 0 (SFT only) evaluation, before it is logged
    ("arco.policy_update", 1),              # sparse epoch, first batch: π's update
    ("arco.rubric_update", 2),              # sparse epoch, second batch: μ's update
    ("arco.dev_evaluation", 1),             # the epoch-2 evaluation (the cpu preset evaluates no sparse epoch)
    ("runs.write_manifest", 1),             # the middle of writing epoch 1's checkpoint
    ("arco.annotate", 3),                   # dense epoch: μ's rubrics
    ("arco.policy_update", 3),              # dense epoch: π's update
    ("runs.RunFolder.report", 1),           # after the last checkpoint, before the selection and report
]
FAST = {("arco.policy_update", 1), ("runs.write_manifest", 1)}       # the two every CI run takes

DRIVER = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import arco, warmup
from infra import runs
target, n = sys.argv[1], int(sys.argv[2])
*owner, name = target.split(".")
module = {{"arco": arco, "runs": runs, "warmup": warmup}}[owner[0]]
for part in owner[1:]:                      # a method: runs.RunFolder.report
    module = getattr(module, part)
real, calls = getattr(module, name), [0]
def killing(*a, **kw):
    calls[0] += 1
    if calls[0] == n:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **kw)
setattr(module, name, killing)
arco.main(sys.argv[3:])
"""


@pytest.fixture(scope="module")
def reference(tiny_dir, tmp_path_factory):
    """The uninterrupted run, in a subprocess as the killed ones."""
    out = tmp_path_factory.mktemp("reference")
    subprocess.run([sys.executable, str(REPO / "arco.py")] + tiny_args(tiny_dir, out), check=True, cwd=REPO,
                   capture_output=True)
    return out


@pytest.mark.parametrize("target,n", [pytest.param(t, n, id=f"{t}#{n}", marks=() if (t, n) in FAST else
                                                   pytest.mark.skipif(os.environ.get("ARCO_SLOW") != "1",
                                                                      reason="the whole sweep: ARCO_SLOW=1"))
                                      for t, n in KILL_POINTS])
def test_killed_then_resumed_ends_as_the_uninterrupted_run(target, n, reference, tiny_dir, tmp_path):
    if target.startswith(("arco.", "runs.")) and target != "runs.RunFolder.log_evaluation":   # RL kill points share
        # the warmup (epoch 0's evaluation is killed before the warmup exists to copy: its run makes its own)
        shutil.copytree(reference / "synthetic" / "warmup", tmp_path / "synthetic" / "warmup")
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(repo=str(REPO)))
    killed = subprocess.run([sys.executable, str(driver), target, str(n)] + tiny_args(tiny_dir, tmp_path),
                            cwd=REPO, capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = subprocess.run([sys.executable, str(REPO / "arco.py")] + tiny_args(tiny_dir, tmp_path, resume=True),
                             cwd=REPO, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    run, ref = tmp_path / "synthetic" / "arco", reference / "synthetic" / "arco"
    assert numbers(read_jsonl(run / "metrics.jsonl")) == numbers(read_jsonl(ref / "metrics.jsonl"))
    assert json.loads((run / "selection.json").read_text()) == json.loads((ref / "selection.json").read_text())
