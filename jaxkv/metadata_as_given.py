"""Checks of an AttentionMetadata as given to paged_attention, before its jit sees it.

jit converts a numpy int64 index array to int32 (a page id past int32 wrapping to another
block's) and keys its cache on the static fields by == and hash, under which 2.0,
np.int64(2) and 2 are one key, as are 1 and True. A hand-made metadata with max_q_len=2.0
was refused by the kernels when first traced, yet ran the program compiled for
max_q_len=2 once one was cached; interpret=1 ran interpret=True's, block_size=4.0 and
num_blocks=8.0 those of 4 and 8. Checked here, the answer does not depend on what jit
has compiled.
"""

from __future__ import annotations

import numpy as np

from jaxkv.batch import BACKENDS, AttentionMetadata, checked_passes
from jaxkv.field_checks import is_integer

_INDEX_FIELDS = ("kv_lens", "page_indices", "cu_q_lens", "num_seqs")
_INT32 = np.dtype(np.int32)


def check_static_fields(metadata: AttentionMetadata) -> None:
    """ValueError naming the field unless metadata.block_size is an int >= 1, backend one
    of BACKENDS, interpret a bool, num_blocks None or an int >= 1, and each pass's
    max_q_len (the main one's and each level's, named as checked_passes names them) None
    or an int >= 1, the kernels' own rule. A numpy integer counts as an int."""
    if not is_integer(metadata.block_size) or metadata.block_size < 1:
        raise ValueError(f"metadata.block_size={metadata.block_size!r} must be an int >= 1")
    if not isinstance(metadata.backend, str) or metadata.backend not in BACKENDS:
        raise ValueError(f"metadata.backend={metadata.backend!r} must be one of {BACKENDS}")
    if not isinstance(metadata.interpret, bool):
        raise ValueError(f"metadata.interpret={metadata.interpret!r} must be a bool")
    num_blocks = metadata.num_blocks
    if num_blocks is not None and (not is_integer(num_blocks) or num_blocks < 1):
        raise ValueError(f"metadata.num_blocks={num_blocks!r} must be None or an int >= 1")
    for where, arrays in checked_passes(metadata):
        bound = arrays.max_q_len
        if bound is not None and (not is_integer(bound) or bound < 1):
            raise ValueError(f"{where}.max_q_len={bound!r} must be an int >= 1 or None")


def check_index_dtypes(metadata: AttentionMetadata) -> None:
    """ValueError naming the array unless every index array of the metadata (and of each
    of its levels) that has a dtype is int32. Values without a dtype (a list) are left to
    paged_attention's check_arrays."""
    for where, arrays in checked_passes(metadata):
        for field in _INDEX_FIELDS:
            dtype = getattr(getattr(arrays, field, None), "dtype", None)
            if dtype is not None and dtype != _INT32:
                raise ValueError(f"{where}.{field}.dtype={dtype} must be int32")
