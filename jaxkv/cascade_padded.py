"""Cascade plans under a cost model that reads padded pages (xla): a suffix pass must pad
to fewer pages than flat attention for cascade to pay (buckets.pads_fewer_pages).

Plain Python and numpy. CascadePlanner (jaxkv.cascade) inherits it. Where the groups it
weighs first leave a request whose own pages need a group (buckets.least_suffix_starts)
in none, the search is run again holding such requests, left out or not: past the
planner's base, or from block 0 in place of a global level where those groups weigh
more than the global level with its groups, or where the global level's own suffix
passes pad as wide as flat's and those groups pay alone.
"""

from __future__ import annotations

import numpy as np

from jaxkv.buckets import least_suffix_starts, pads_fewer_pages
from jaxkv.cascade_groups import GroupSearch
from jaxkv.cascade_plan import CascadePlan
from jaxkv.cascade_together import level_weight
from jaxkv.kv_cache_manager import KVCacheManager

__all__ = ["PaddedPlans", "suffix_starts"]


class PaddedPlans(GroupSearch):
    """The padded-pages checks of CascadePlanner, which sets the attributes they read
    (page_buckets besides GroupSearch's)."""

    def _groups_padding_fewer(
        self,
        manager: KVCacheManager,
        rows: np.ndarray,  # i32[R]
        num_computed_tokens: np.ndarray,  # i[R]
        query_lens: np.ndarray,  # i[R]
        base: int,
        whole_batch_end: int,
        out: np.ndarray | None,  # bool[R] the requests left out
    ) -> tuple[list[tuple[np.ndarray, int]], np.ndarray | None]:
        """(groups, their suffix starts: suffix_starts) past `base` whose suffix pass
        pads to fewer pages than flat attention (buckets.pads_fewer_pages), where the
        heaviest groups' does not: each request whose pages need it is held in a group
        ending far enough (the search's `need`), left out or not; ([], None) where the
        search finds none."""
        bs = manager.block_size
        need = least_suffix_starts(self.page_buckets, num_computed_tokens, query_lens, bs)
        if need is None:
            return [], None
        must = need > base
        if out is not None:
            out = out & ~must
            out = out if out.any() else None
        searched = num_computed_tokens if out is None else np.where(out, 0, num_computed_tokens)
        groups = self._groups(
            manager, rows, searched, query_lens, base, whole_batch_end, out, need
        )  # fmt: skip
        suffix_start = suffix_starts(groups, len(rows), base)
        return (groups, suffix_start) if bool((suffix_start >= need).all()) else ([], None)

    def _plan_holding(
        self,
        manager: KVCacheManager,
        rows: np.ndarray,  # i32[R]
        num_computed_tokens: np.ndarray,  # i[R]
        query_lens: np.ndarray,  # i[R]
        out: np.ndarray | None,  # bool[R] the requests left out
        under: float,  # the weight of the plan with a global level it would replace
        common: int,
        made_for,
    ) -> CascadePlan | None:
        """The plan of groups from block 0 that hold each request whose pages need a
        group (_groups_padding_fewer at block 0, left out or not), so that its suffix
        pass pads to fewer pages than flat's, where they weigh more than `under`
        (cascade_together.level_weight); else None."""
        groups, suffix_start = self._groups_padding_fewer(
            manager, rows, num_computed_tokens, query_lens, 0, 0, out
        )
        if not groups:
            return None
        weight = level_weight(
            self.cost_model, self.shape, groups, 0, manager.block_size, query_lens
        )
        if weight <= under:
            return None
        return self._memo.grouped_plan(groups, rows, suffix_start, None, common, made_for)

    def _holding_or(
        self,
        flat: CascadePlan,
        manager: KVCacheManager,
        rows: np.ndarray,  # i32[R]
        num_computed_tokens: np.ndarray,  # i[R]
        query_lens: np.ndarray,  # i[R]
        out: np.ndarray | None,  # bool[R] the requests left out
        common: int,
        made_for,
    ) -> CascadePlan:
        """Where a global level's plan pads a suffix pass as wide as flat's: the groups
        from block 0 holding each request whose pages need a group, where they pay alone
        (_plan_holding against no cascade), else `flat`."""
        plan = self._plan_holding(
            manager, rows, num_computed_tokens, query_lens, out, 0.0, common, made_for
        )
        return flat if plan is None else plan

    def _plan_from_block_0(
        self,
        groups: list[tuple[np.ndarray, int]],  # (members, end block), each from block 0
        rows: np.ndarray,  # i32[R]
        num_computed_tokens: np.ndarray,  # i[R]
        query_lens: np.ndarray,  # i[R]
        block_size: int,
        common: int,
        made_for,
    ) -> CascadePlan | None:
        """The plan of one groups level of `groups` from block 0 and no global level (the
        requests in no group read from block 0 in their own pass); None where its pages
        pad to more than flat's (buckets.pads_fewer_pages)."""
        suffix_start = suffix_starts(groups, len(rows), 0)
        if not pads_fewer_pages(
            self.page_buckets, num_computed_tokens, query_lens, suffix_start, block_size
        ):
            return None
        return self._memo.grouped_plan(groups, rows, suffix_start, None, common, made_for)


def suffix_starts(groups: list[tuple[np.ndarray, int]], num_requests: int, base: int) -> np.ndarray:
    """i32[num_requests]: the first block of each request's own pass: its group's end, or
    `base` for a request in no group."""
    suffix_start = np.full(num_requests, base, np.int32)
    for members, end in groups:
        suffix_start[members] = end
    return suffix_start
