"""Command-line argument types the benchmark scripts share.

A bad value is refused by argparse with the flag's name, rather than met later as a
ZeroDivisionError, a library traceback or a table of NaN figures.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

# Where the scripts write their JSON without --out: this checkout's benchmarks/results/,
# whatever the working directory.
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (zero requests, tokens, pages or repetitions measure
    nothing)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0 (for a flag whose 0 means "no limit")."""
    return _int_at_least(text, 0)


def seed(text: str) -> int:
    """argparse type: an int in [0, 2**63), as numpy's generators and jax.random.key (an
    int64) both take it; a larger one raised OverflowError in jax once the run began."""
    value = _int_at_least(text, 0)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"{value} must be < 2**63 (jax.random.key takes int64)")
    return value


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a time limit of zero or less measures nothing)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number > 0")
    return value


def out_file(text: str) -> Path:
    """argparse type: a JSON file this process can write, not an existing folder (the
    write at the end of a run of minutes would raise IsADirectoryError or
    PermissionError and lose it)."""
    path = _non_empty_path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name (.json)")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text!r} is not writable")
    else:
        _check_can_create(text, _nearest_existing(path))
    return path


def out_dir(text: str) -> Path:
    """argparse type: a folder this process can write into, not an existing file (its
    mkdir or write at the end of a run would raise FileExistsError or PermissionError
    and lose it)."""
    path = _non_empty_path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file; give a folder")
    _check_can_create(text, path if path.exists() else _nearest_existing(path))
    return path


def _non_empty_path(text: str) -> Path:
    # Path("") is Path("."): an empty --out (an unset shell variable) would write into
    # the working directory.
    if not text:
        raise argparse.ArgumentTypeError("is empty; give a path")
    path = Path(text)
    # A path under a file: the mkdir before the write at the end of the run raised
    # FileExistsError or NotADirectoryError and lost it.
    nearest = _nearest_existing(path)
    if not nearest.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {str(nearest)!r} is a file, not a folder")
    return path


def _nearest_existing(path: Path) -> Path:
    return next(p for p in path.parents if p.exists())  # "." or "/" at the latest


def _check_can_create(text: str, folder: Path) -> None:
    # Creating a file is the test that holds for root and for filesystems that refuse
    # writes whatever their mode bits say (os.access answers True for both). The probe
    # file goes at once, and no folder is made before the run.
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".jaxkv-write-check-")
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"{text!r}: cannot write in {str(folder)!r} ({e.strerror or e})"
        ) from None
    os.close(fd)
    os.unlink(probe)


def check_block_size(
    parser: argparse.ArgumentParser, block_size: int, max_model_len: int, made_of: str
) -> None:
    """parser.error unless --block-size is at most `max_model_len`, the engine's longest
    request (`made_of`: the flags that make it): a request writes the KV of fewer tokens
    than that, so a larger block is never full, never shared as a prefix, and its rest is
    memory allocated for nothing (--block-size 100000 asked for gigabytes)."""
    if block_size > max_model_len:
        parser.error(
            f"--block-size {block_size} must be at most {max_model_len}, the tokens of the "
            f"longest request ({made_of}): a larger block is never full"
        )


def flag_message(error: ValueError, flags: Mapping[str, str], unnamed: str = "") -> str:
    """The message of `error`, a jaxkv check's ValueError that opens with "field=value",
    naming instead the command-line flag that set the field (`flags`: field -> flag):
    "repetition_penalty=0.0 must be ..." reads "--repetition-penalty 0.0 must be ...".
    A message that opens with none of the fields (one no flag sets as it is) comes back
    after `unnamed`, which says whose check it is."""
    message = str(error)
    for field, flag in flags.items():
        if message.startswith(f"{field}="):
            return f"{flag} {message.removeprefix(f'{field}=')}"
    return unnamed + message


def add_decode_grid_args(
    parser: argparse.ArgumentParser, *, heads: tuple[int, int, int], page_flag: str
) -> None:
    """The flags of a flat-vs-cascade decode grid: --batch, --prefix and --suffix (lists
    of sizes), --q-heads, --kv-heads and --head-dim (defaults `heads`), and the page size
    under `page_flag` (default 16)."""
    parser.add_argument("--batch", type=positive_int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--prefix", type=positive_int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--suffix", type=positive_int, nargs="+", default=[16, 128, 1024])
    for flag, default in zip(("--q-heads", "--kv-heads", "--head-dim"), heads, strict=True):
        parser.add_argument(flag, type=positive_int, default=default)
    parser.add_argument(page_flag, type=positive_int, default=16)


def decode_grid(text: str) -> list[tuple[int, int, int]]:
    """argparse type: "B,P,S;B,P,S" as (batch, prefix, suffix) triples of ints >= 1."""
    grid = []
    for cell in text.split(";"):
        parts = cell.split(",")
        if len(parts) != 3:
            raise argparse.ArgumentTypeError(f"{cell!r} must be B,P,S (three ints)")
        batch, prefix, suffix = (positive_int(part) for part in parts)
        grid.append((batch, prefix, suffix))
    return grid


def check_head_groups(parser: argparse.ArgumentParser, q_heads: int, kv_heads: int) -> None:
    """parser.error unless --q-heads is a multiple of --kv-heads (each KV head serves a
    whole group of query heads)."""
    if q_heads % kv_heads:
        parser.error(f"--q-heads {q_heads} must be a multiple of --kv-heads {kv_heads}")


def check_whole_pages(parser: argparse.ArgumentParser, prefixes, page_size: int, flag: str):
    """parser.error unless every prefix is a whole number of pages: the benchmarks'
    page tables hold prefix // page_size shared pages, so the rest of a prefix would be
    keys no page holds (flat and cascade then disagree, and bytes are miscounted)."""
    ragged = [p for p in prefixes if p % page_size]
    if ragged:
        parser.error(f"{flag} {ragged}: each must be a multiple of the page size, {page_size}")
