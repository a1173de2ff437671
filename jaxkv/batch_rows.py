"""Where the sampler's per-request tables put each request: its row of the batch.

The scheduler lists a step's requests in schedule order; a cascade plan may reorder them
into batch rows (`order[row]` is the schedule index of that row). The tables kept by
schedule index (stop-token bans, penalties, min_p, prompt-logprob rows) map through here.
"""

from __future__ import annotations

import numpy as np

NO_TOKEN = np.iinfo(np.int32).max  # padding in token-id tables: past every vocabulary


def batch_rows(indices: list[int], order: np.ndarray | None) -> np.ndarray:
    """intp[len(indices)]: the batch row of each schedule index (the row i with order[i]
    == index; the index itself when `order` is None)."""
    rows = np.array(indices, np.intp)
    if order is None:
        return rows
    row_of = np.empty(len(order), np.intp)
    row_of[order] = np.arange(len(order))
    return row_of[rows]
