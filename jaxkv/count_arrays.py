"""Integer count arrays (tokens per request, tokens computed) in a dtype their sums fit.

Plain numpy, shared by the cascade planner's argument checks and the metadata builder.
"""

from __future__ import annotations

import numpy as np

__all__ = ["checked_step_counts", "widened_counts"]


def widened_counts(counts: np.ndarray) -> np.ndarray:
    """Integer counts in a dtype their sums fit: int32 and int64 as given (the scheduler's
    are int32), others as int64 (int8 or int16 sums overflow; unsigned ones with signed
    ones are floats)."""
    if counts.dtype.kind == "u" or counts.dtype.itemsize < 4:
        return counts.astype(np.int64)
    return counts


def checked_step_counts(query_lens, num_computed_tokens, num_requests: int):
    """build_attention_metadata's per-request counts as signed integer arrays of shape
    (num_requests,); ValueError naming them unless both are integers of that shape and
    no num_computed_tokens entry is negative."""
    query_lens = np.asarray(query_lens)
    num_computed = np.asarray(num_computed_tokens)
    if query_lens.shape != (num_requests,) or num_computed.shape != (num_requests,):
        raise ValueError(
            f"{query_lens.shape=} and num_computed_tokens.shape={num_computed.shape} must be "
            f"({num_requests},)"
        )
    if not num_requests:  # (an empty list is a float64 array)
        return query_lens.astype(np.int64), num_computed.astype(np.int64)
    if query_lens.dtype.kind not in "iu" or num_computed.dtype.kind not in "iu":
        raise ValueError(
            f"{query_lens.dtype=} and num_computed_tokens.dtype={num_computed.dtype} must "
            "be integer dtypes"
        )
    # Unsigned counts (accepted, as the planner accepts them) made the in-place
    # `main_kv -= suffix_start * block_size` fail numpy's casting rule, and int8 or int16
    # counts overflowed in the builder's sums (kv_lens of -128: keys silently dropped).
    query_lens, num_computed = widened_counts(query_lens), widened_counts(num_computed)
    if num_computed.min() < 0:  # numpy would read column -1 of the table
        raise ValueError(f"every num_computed_tokens entry must be >= 0, got {num_computed.min()}")
    return query_lens, num_computed
