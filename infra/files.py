"""Files (plumbing): the one JSON / JSONL reader and writer of every script (the API key never reaches disk), folders
written whole or not at all, the manifests (every file's size and SHA-256) that find a damaged checkpoint, and the
reader of a predictions file (evaluate.py)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Container, Sequence

from infra.settings import UsageError

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


def write_atomically(dest: Path, write) -> Path:
    """Call `write(tmp_folder)`, then rename the folder to `dest`.

    An interrupted or failed write leaves no `dest` (and no temporary folder), so a
    half-written cache is never mistaken for a good one.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:             # another process finished first: keep its copy
            if not dest.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


MANIFEST = "manifest.json"


def write_manifest(folder: Path) -> None:
    """Record what a saved folder holds — every file's size and SHA-256 — so that a file cut short or changed
    later (a full disk, a killed copy) is found before it is loaded (damaged)."""
    folder = Path(folder)
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps(files, indent=1) + "\n")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def damaged(folder: Path) -> str | None:
    """What is wrong with a saved folder against its manifest (the first missing, cut-short or changed file),
    or None when it is intact. A folder saved before manifests existed has none and counts as intact."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        return None if (folder / "config.json").is_file() or (folder / "state.json").is_file() \
            else f"{folder} has no config.json"
    try:
        files = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"{folder / MANIFEST} is unreadable"
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != want["bytes"]:
            return f"{path} has {path.stat().st_size} bytes, {want['bytes']} were written"
        if _sha256(path) != want["sha256"]:
            return f"{path} differs from what was written (checksum)"
    return None


def check_intact(folder: Path) -> None:
    """Stop with one line naming the damaged file, before anything is loaded from `folder`."""
    problem = damaged(folder)
    if problem:
        raise UsageError(f"damaged checkpoint: {problem}. Delete {folder} to make it again "
                         f"(or --resume a run: it falls back to its newest intact checkpoint)")


# --- a predictions file (evaluate.py) ---------------------------------------------------------------------------

class PredictionError(ValueError):
    """A predictions file that cannot be scored; the message names the file and line."""


def _prediction_line(raw: bytes) -> tuple[str, str] | None:
    """(id, answer) of one predictions line, None for a blank one; ValueError if bad."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f'expected a JSON object {{"id": ..., "answer": ...}}, got {type(record).__name__}')
    for key in ("id", "answer"):
        if key not in record:
            raise ValueError(f"missing field {key!r}")
        if not isinstance(record[key], str):
            raise ValueError(f"field {key!r} must be a string, got {json.dumps(record[key])}")
    return record["id"], record["answer"]


def read_predictions(path: str, known_ids: Container[str] | None = None,
                     source: str = "the dataset") -> dict[str, str]:
    """Read a JSONL file of {"id": ..., "answer": ...} objects into {id: answer}.

    Blank lines are skipped; other fields are ignored. Raises PredictionError, with a
    message 'FILE:LINE: what is wrong', on the first line that is not valid UTF-8 JSON,
    not an object, lacks "id" or "answer", has a non-string id or answer, repeats an
    earlier id, or (when `known_ids` is given) names an id not in `source`.
    """
    try:
        with open(path, "rb") as f:
            raw_lines = f.read().split(b"\n")
    except OSError as e:
        raise PredictionError(f"{path}: cannot read predictions ({e.strerror})") from None
    predictions: dict[str, str] = {}
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(raw_lines, 1):
        try:
            parsed = _prediction_line(raw)
            if parsed is None:
                continue
            pid, answer = parsed
            if pid in first_line:
                raise ValueError(f"duplicate id {pid!r} (first on line {first_line[pid]})")
            if known_ids is not None and pid not in known_ids:
                raise ValueError(f"unknown id {pid!r} (not in {source})")
        except ValueError as e:
            raise PredictionError(f"{path}:{lineno}: {e}") from None
        first_line[pid] = lineno
        predictions[pid] = answer
    return predictions
