"""Bad input refused before any work (issue 34): every numeric flag of every script out of its declared range,
every path flag pointing nowhere, the five inputs that used to slip through, and damaged checkpoints."""
import dataclasses
import math
import os
import subprocess
import sys
import time
import typing
import types

import pytest

import arco
import env
import rubric_model as rm
import warmup
from infra import models
from infra.settings import main_guard
from lab import benchmark, diagnostics

SCRIPTS = {"benchmark": (benchmark, ["sample"], benchmark.ModelArgs),
           "warmup": (warmup, ["--dataset", "synthetic"], warmup.Args), "arco": (arco, ["--dataset", "synthetic"], arco.Args),
           "diagnostics": (diagnostics, [], diagnostics.Args)}


def out_of_range(f, kind) -> list[str]:
    """The values among 0, −1 (and NaN, inf for floats) that the flag's declared range refuses."""
    meta, lo, hi = f.metadata, f.metadata.get("min", 0), f.metadata.get("max")
    bad = []
    for v in ([0, -1] + ([math.nan, math.inf] if kind is float else [])):
        if not math.isfinite(v) or (lo is not None and v < lo) or (hi is not None and v > hi) \
                or ("above" in meta and v <= meta["above"]) or ("below" in meta and v >= meta["below"]):
            bad.append(str(v))
    return bad


def cases():
    for name, (module, base, settings) in SCRIPTS.items():
        hints = typing.get_type_hints(settings)
        for f in dataclasses.fields(settings):
            kind = hints[f.name]
            if typing.get_origin(kind) in (typing.Union, types.UnionType):
                kind = next(a for a in typing.get_args(kind) if a is not type(None))
            flag = "--" + f.name.replace("_", "-")
            if kind in (int, float):
                for v in out_of_range(f, kind):
                    yield pytest.param(name, base + [flag, v], id=f"{name} {flag} {v}")
            elif f.metadata.get("path"):
                yield pytest.param(name, base + [flag, "/nonexistent/arco-path"], id=f"{name} {flag} missing")


def run_guarded(module, argv, capsys) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as exit_:
        main_guard(lambda: module.main(argv), env.DataError, models.ModelLoadError)
    return exit_.value.code, capsys.readouterr().err.strip().splitlines()


def test_a_ctrl_c_nothing_caught_is_one_line_not_a_traceback(capsys, monkeypatch):
    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.delenv("ARCO_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main_guard(interrupted)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 130 and len(err) == 1 and err[0].startswith("interrupted")
    monkeypatch.setenv("ARCO_TRACEBACK", "1")
    with pytest.raises(KeyboardInterrupt):
        main_guard(interrupted)


@pytest.fixture
def no_model(monkeypatch, tmp_path):
    """Loading a model or a retriever fails the test; the working folder is empty and must stay so."""
    def refuse(*a, **kw):
        pytest.fail("a model was loaded")
    for target in (rm, arco, warmup, diagnostics):
        for fn in ("load_backbone", "load_backbone_checkpoint"):
            if hasattr(target, fn):
                monkeypatch.setattr(target, fn, refuse)
    monkeypatch.setattr(env, "Retriever", refuse)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("script,argv", list(cases()))
def test_every_out_of_range_flag_stops_at_once_with_one_error_line(script, argv, no_model, capsys):
    start = time.perf_counter()
    code, err = run_guarded(SCRIPTS[script][0], argv, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and argv[-2] in err[0], err
    assert list(no_model.iterdir()) == []                       # no run or warmup folder
    assert time.perf_counter() - start < 5


def test_the_sweep_covers_every_script_and_many_flags():
    ids = [c.id for c in cases()]
    assert {i.split()[0] for i in ids} == set(SCRIPTS) and len(ids) > 150


# --------------------------------------------------------------------------- the five rows of issue 34
@pytest.mark.parametrize("argv,words", [
    (["--dataset", "hotpotqa", "--train-size", "-5"], "--train-size -5: must be ≥ 1"),
    (["--dataset", "hotpotqa", "--k", "0"], "--k 0: must be ≥ 1"),
    (["--dataset", "hotpotqa", "--data-dir", "/nonexistent"], "--data-dir /nonexistent: no such folder"),
])
def test_the_flags_that_used_to_slip_through(argv, words, no_model, capsys):
    code, err = run_guarded(arco, argv, capsys)
    assert code == 2 and err == [f"error: {words}"]


def test_a_model_that_cannot_be_had_offline_is_one_line_before_any_folder(no_model, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models, "_hub_reachable", lambda *a, **kw: False)
    code, err = run_guarded(arco, ["--dataset", "synthetic", "--model", "nonexistent/model-xyz"], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: model 'nonexistent/model-xyz' is not a local")
    assert list(no_model.iterdir()) == []


def test_the_command_line_prints_one_line_and_exits_2_and_the_traceback_on_request(tmp_path):
    """As a user runs it: a subprocess; ARCO_TRACEBACK=1 keeps the traceback."""
    argv = [sys.executable, str(rm.Path(arco.__file__)), "--dataset", "hotpotqa", "--k", "0"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip() == "error: --k 0: must be ≥ 1" and not done.stdout
    again = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "ARCO_TRACEBACK": "1"})
    assert "Traceback" in again.stderr and "UsageError" in again.stderr
