"""Writing a file whole or not at all: a temporary file beside it, renamed over it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """Calls `write` with a temporary file beside `path` (its folder must exist), then
    renames that file over `path`. A write stopped midway (SIGTERM, Ctrl-C, an error in
    `write`) leaves the previous file, never a cut one, and no temporary file. The
    temporary file keeps `path`'s suffix, for writers that read the format from it
    (matplotlib's savefig)."""
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        write(tmp)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
