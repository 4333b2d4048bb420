"""Output paths of the simulator's commands: checked before the minutes of measuring or simulating
they come after, not after them; and files written whole."""

from __future__ import annotations

import os
from pathlib import Path


def directory_problem(path: str | Path) -> str | None:
    """Why files cannot be written into the directory ``path`` (created when missing), or None."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return f"{path} is a file, not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
        _probe(path)
    except OSError as exc:
        return f"cannot write into {path}: {exc.strerror or exc}"
    return None


def file_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be written as a file (its directory created when missing), or None."""
    path = Path(path)
    if path.is_dir():
        return f"{path} is a directory"
    return directory_problem(path.parent)


def write_atomically(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a file beside it renamed over it: an interrupted write
    never leaves half a file where a whole one was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # same directory: the rename is atomic
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _probe(directory: Path) -> None:
    """Create and remove a file in ``directory``: what permissions (and a read-only or virtual file
    system such as /proc) actually allow, for root too. Raises OSError."""
    probe = directory / f".llm-fleet-write-test.{os.getpid()}"
    probe.touch()
    probe.unlink()
