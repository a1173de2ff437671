"""Integer count arrays (tokens per request, tokens computed) in a dtype their sums fit.

Plain numpy, shared by the cascade planner's argument checks and the metadata builder.
"""

from __future__ import annotations

import numpy as np

__all__ = ["widened_counts"]


def widened_counts(counts: np.ndarray) -> np.ndarray:
    """Integer counts in a dtype their sums fit: int32 and int64 as given (the scheduler's
    are int32), others as int64 (int8 or int16 sums overflow; unsigned ones with signed
    ones are floats)."""
    if counts.dtype.kind == "u" or counts.dtype.itemsize < 4:
        return counts.astype(np.int64)
    return counts
