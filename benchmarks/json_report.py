"""Benchmark results as JSON that every parser reads.

A figure with nothing to measure (no decode step at the goal's batch) is NaN, and an
error can be infinite; Python's json module writes those as NaN and Infinity, which
strict parsers (jq, a browser's JSON.parse) refuse. They are written as null here, as
JavaScript's JSON.stringify writes them.

Every result file, the plots too, is written whole or not at all (write_whole).
"""

from __future__ import annotations

import json
import math
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from jaxkv import whole_file


def finite_json(obj: Any, **kwargs: Any) -> str:
    """json.dumps(obj, **kwargs) with every non-finite float (numpy's float64 too) as
    null and every Path as its str; raises ValueError rather than write a NaN it did not
    reach."""
    return json.dumps(_nulled(obj), allow_nan=False, **kwargs)


def write_json(path: Path, obj: Any, *, indent: int = 1) -> None:
    """Writes finite_json(obj) to `path`, making its folder first; a Path anywhere in
    `obj` (an argparse --out, say) is written as its str. The text goes to a temporary
    file beside `path`, renamed over it once whole: a run stopped mid-write (a time
    limit's SIGTERM while gpu_kernel.py rewrites its JSON after a row) leaves the
    previous file, never a cut one."""
    text = finite_json(obj, indent=indent)
    write_whole(path, lambda tmp: tmp.write_text(text))


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """jaxkv.whole_file.write_whole, making `path`'s folder first: a run stopped
    mid-write (SIGTERM, Ctrl-C, an error in `write`) leaves the previous file, never a
    cut one, and no temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    whole_file.write_whole(path, write)


def machine_fields() -> dict[str, str]:
    """What a run ran on, as the engine benchmarks report it: JAX's backend ("cpu",
    "gpu", "tpu") and first device, the OS (platform.platform()), and the versions of
    Python and JAX."""
    return {
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
    }


def _nulled(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k) if isinstance(k, Path) else k: _nulled(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nulled(v) for v in obj]
    return obj
