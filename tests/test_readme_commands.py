"""The documentation's commands are real. Every `python …` line of the README's code blocks names a script (or a
lab program run as `python -m lab.<program>`, and its subcommand) that runs with `--help`, and every `--flag` on
the line is one that program knows; no stale command form survives in README.md, RESULTS.md, CHOICES.md or
PORTING.md except on a line that quotes history as "(as run then; today: …)"; CHOICES.md's flag table names
exactly the options `arco.py --help` lists; and the README's seam example registers a scorer whose scores sum to R
and builds its run. Only `--help` runs (in parallel): nothing loads a model or data."""
import dataclasses
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "RESULTS.md", "CHOICES.md", "PORTING.md"]
SUBCOMMANDS = {"lab.study": {"ladder", "fork"}, "lab.benchmark": {"passes", "parse-rate", "loop", "sample"}}
# Programs that take arco.py's flags after their own (their --help says so; checked below): a flag missing from
# their own help must be one of arco.py's.
TAKES_ARCO_FLAGS = {"lab.study", "lab.probe"}
MODULES = {"pytest"}                              # other `python -m …` lines the README may hold
HISTORY = "(as run then"                          # a line quoting an old command as history says so
# Stale forms (issue 54) and what replaced them.
STALE = {
    r"python env\.py[^`\n]*--check-retrieval": "python diagnostics.py --check-retrieval",
    r"python warmup\.py[^`\n]*--check-gold": "python diagnostics.py --check-gold",
    r"(?<![\w/])warmup\.py --check-gold": "python diagnostics.py --check-gold",
    r"python rubric_model\.py": "python benchmark.py sample",
    r"study\.py probe": "python probe.py",
    r"--fork-from": "--init-from",
    r"diagnostics\.py --study": "python study.py fork",
    r"python (?:arco|warmup)\.py[^`\n]*--(?:credit|mixed|eval-every|curve-size|criteria|head-fit|balance-finishes|"
    r"policy-samples|micro-batch)\b": "the study's own settings (CHOICES.md), or packed SFT passes",
    r"python (?:study|probe|diagnostics|benchmark)\.py": "python -m lab.<program> (issue 59)",
    r"python env\.py": "python -m lab.diagnostics --check-files / --predictions (issue 59)",
}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def read(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def code_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced code block."""
    blocks, lang, lines = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, lines = line[3:].strip(), []
            else:
                blocks.append((lang, lines))
                lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def readme_commands() -> list[tuple[str, list[str]]]:
    """(the line, its argv after `python`) of every line of a README code block that runs `python …`, after an
    optional `$ ` prompt and `VAR=value` prefixes; comments and pipes cut off."""
    out = []
    for _, lines in code_blocks(read("README.md")):
        for line in lines:
            cmd = re.sub(r"^\$\s+", "", line.strip())
            cmd = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+", "", cmd)
            if not cmd.startswith("python "):
                continue
            cmd = cmd.split(" #")[0].split("|")[0]
            out.append((line, shlex.split(cmd)[1:]))
    return out


def target(argv: list[str]) -> tuple[str, str | None]:
    """The script (`arco.py`) or lab program (`lab.study`) and its subcommand (or None) a command line runs."""
    if argv[0] == "-m":
        argv = argv[1:]
    script = argv[0]
    sub = argv[1] if len(argv) > 1 and argv[1] in SUBCOMMANDS.get(script, ()) else None
    return script, sub


def run_help(key: tuple[str, str | None]) -> tuple[int, str]:
    script, sub = key
    argv = [sys.executable] + (["-m", script] if script.startswith("lab.") else [script]) + ([sub] if sub else []) \
        + ["--help"]
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return p.returncode, p.stdout + p.stderr


@pytest.fixture(scope="module")
def helps() -> dict:
    """--help of every script and subcommand the README runs, of arco.py, and of the scripts that take
    arco.py's flags, in parallel."""
    keys = {target(argv) for _, argv in readme_commands() if argv[0] != "-m" or argv[1].startswith("lab.")}
    keys |= {("arco.py", None)} | {(s, None) for s in TAKES_ARCO_FLAGS}
    ordered = sorted(keys, key=str)
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(ordered, pool.map(run_help, ordered)))


def test_the_readme_has_commands_and_stays_under_300_lines():
    commands = readme_commands()
    assert len(commands) >= 12, commands
    assert len(read("README.md").splitlines()) <= 300


def test_every_readme_command_runs_with_help_and_knows_its_flags(helps):
    problems = []
    for line, argv in readme_commands():
        if argv[0] == "-m" and not argv[1].startswith("lab."):
            if argv[1] not in MODULES:
                problems.append(f"{line!r}: python -m {argv[1]}")
            continue
        program = argv[1] if argv[0] == "-m" else argv[0]
        if not (ROOT / (program.replace(".", "/") + ".py" if argv[0] == "-m" else program)).is_file():
            problems.append(f"{line!r}: no script {program}")
            continue
        key = target(argv)
        rc, text = helps[key]
        if rc != 0:
            problems.append(f"{line!r}: {' '.join(filter(None, key))} --help exited {rc}: {text[-300:]}")
            continue
        known = set(FLAG.findall(text))
        if key[0] in TAKES_ARCO_FLAGS:
            known |= set(FLAG.findall(helps[("arco.py", None)][1]))
        unknown = [f for f in FLAG.findall(" ".join(argv)) if f.split("=")[0] not in known]
        if unknown:
            problems.append(f"{line!r}: {unknown} not in {' '.join(filter(None, key))} --help")
    assert problems == []


def test_the_scripts_that_take_arco_flags_say_so(helps):
    for script in TAKES_ARCO_FLAGS:
        rc, text = helps[(script, None)]
        assert rc == 0 and "arco.py's flags" in text, (script, text[-300:])


def test_no_stale_command_form_outside_quoted_history():
    found = []
    for name in DOCS:
        for n, line in enumerate(read(name).splitlines(), 1):
            for pattern, today in STALE.items():
                if re.search(pattern, line) and HISTORY not in line:
                    found.append(f"{name}:{n}: {pattern!r} (today: {today}): {line.strip()[:120]}")
    assert found == []


def test_the_choices_flag_table_names_exactly_arcos_options(helps):
    rc, text = helps[("arco.py", None)]
    assert rc == 0
    options = set(re.findall(r"^\s+(--[a-z][a-z0-9-]*)", text, re.M)) - {"--help"}
    choices = read("CHOICES.md")
    start = choices.index("## Flags of `arco.py` and the paper")
    section = choices[start:choices.index("\n## ", start + 5)]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `--")]
    in_table = {f for cell in rows for f in FLAG.findall(cell)}
    assert in_table == options, (sorted(options - in_table), sorted(in_table - options))


def test_the_readme_seam_example_registers_a_scorer_and_builds_its_run(monkeypatch):
    import arco
    block = [lines for lang, lines in code_blocks(read("README.md")) if lang == "python" and
             any("arco.register_scorer" in line for line in lines)]
    assert len(block) == 1
    ran = []
    monkeypatch.setattr(arco, "run", lambda args, **kw: ran.append(args))
    monkeypatch.setattr(arco, "SCORERS", dict(arco.SCORERS))             # the example's name is not kept
    exec(compile("\n".join(block[0]), "README.md", "exec"), {})
    args, = ran
    assert isinstance(args, arco.Args) and args.preset == "cpu" and args.scorer == "even-credit"
    arco.check_scheme(dataclasses.replace(args, estimator=args.estimator or "arco", plugin=args.plugin or []))
    trajs = [SimpleNamespace(reward=r, steps=[None] * k) for r, k in ((1.0, 3), (0.0, 2), (1.0, 1))]
    s = arco.SCORERS[args.scorer](trajs)
    assert s.shape == (6,)
    assert [round(float(s[:3].sum()), 6), round(float(s[3:5].sum()), 6), float(s[5])] == [1.0, 0.0, 1.0]
