"""Benchmark results as JSON that every parser reads.

A figure with nothing to measure (no decode step at the goal's batch) is NaN, and an
error can be infinite; Python's json module writes those as NaN and Infinity, which
strict parsers (jq, a browser's JSON.parse) refuse. They are written as null here, as
JavaScript's JSON.stringify writes them.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite_json(obj: Any, **kwargs: Any) -> str:
    """json.dumps(obj, **kwargs) with every non-finite float (numpy's float64 too) as
    null; raises ValueError rather than write a NaN it did not reach."""
    return json.dumps(_nulled(obj), allow_nan=False, **kwargs)


def _nulled(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _nulled(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nulled(v) for v in obj]
    return obj
