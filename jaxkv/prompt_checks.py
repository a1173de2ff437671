"""The one check of a prompt's token ids that the engine and the router share."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxkv.field_checks import ints_as_python, is_bool

_PLAIN_INTS = {int, np.int64, np.int32}  # no element of these types can be a bool


def checked_prompt_ids(
    prompt_token_ids: Sequence[int] | np.ndarray, *, limit: int, allow_empty: bool = False
) -> list[int]:
    """`prompt_token_ids` as a list of Python ints.

    Raises ValueError naming prompt_token_ids unless it is a 1-D sequence (or array) of
    integers, each in [0, `limit`), and not empty unless `allow_empty`. Text and bytes are
    refused, as Request refuses them, and so are bools (numpy reads [True, 2] as [1, 2]),
    0-d bool arrays of numpy or JAX among a list's or tuple's elements included.
    """
    if isinstance(prompt_token_ids, (str, bytes, bytearray)):  # numpy reads a bytearray as uint8
        raise ValueError(
            f"prompt_token_ids must be token ids, not {type(prompt_token_ids).__name__} "
            "(encode text with a tokenizer)"
        )
    if isinstance(prompt_token_ids, (list, tuple)):
        types = set(map(type, prompt_token_ids))
        if types - _PLAIN_INTS:  # a bool, or a 0-d array (numpy's or JAX's) that may be one
            at = next((i for i, t in enumerate(prompt_token_ids) if is_bool(t)), None)
            if at is not None:
                raise ValueError(f"prompt_token_ids must be ints, got a bool at index {at}")
            prompt_token_ids = ints_as_python(prompt_token_ids)  # uint64 among int64
    try:
        ids = np.asarray(prompt_token_ids)
    except (ValueError, TypeError) as e:  # ragged nesting, ints past 64 bits in an array
        raise ValueError(f"prompt_token_ids must be a 1-D sequence of ints ({e})") from None
    if ids.ndim != 1 or (ids.size == 0 and not allow_empty):
        kind = "1-D" if allow_empty else "non-empty 1-D"
        raise ValueError(f"prompt_token_ids must be a {kind} sequence of ints, got {ids.shape=}")
    if ids.size == 0:
        return []
    if ids.dtype.kind not in "iu":
        raise ValueError(f"prompt_token_ids must be integers, got dtype {ids.dtype}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= limit:
        raise ValueError(f"prompt_token_ids must lie in [0, {limit}), got min {lo}, max {hi}")
    return ids.tolist()
