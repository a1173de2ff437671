"""Cascade planning: which shared prefixes of a scheduled batch to read once, and whether it pays.

The planner works on the host from the exact prefix identities kept by the KV cache
manager (`prefix_ids`: equal at column j iff two requests hold identical block ids in
columns 0..j), so the answer depends only on the scheduled set: finished requests still
holding blocks during a KV transfer, unscheduled or preempted holders neither add nor
remove sharing. Its cost is O(R log C) numpy work plus a loop over a bounded number of
candidate groups; never a Python loop over requests x blocks.

A plan has up to two levels:

- level "global": the common prefix of the whole batch, one non-causal call;
- level "groups": when requests split into groups that share a prefix of their own (two
  system prompts; n samples of several prompts; under one header, those under a system
  prompt after it and the others over the header alone), one non-causal call whose
  sequences are the groups, each over the blocks after the global prefix (or from block
  0, dropping the global level, where it saves less than its call and merge beside
  groups from block 0).

Every prefix is capped at the smallest num_computed_tokens of the requests that read it
(so the non-causal pass never covers a query token), and rounded down to whole blocks.
A request whose queries cost more to merge than reading the blocks it could share
(a long prefill chunk) joins no group; where the global level holds it, the level is
dropped for groups from block 0 without it where those weigh more (cascade_left_out).
With page buckets on a backend that reads padded pages, cascade is planned only where
its suffix pass pads to fewer pages than flat attention; where the heaviest groups leave
a request whose pages need a group in none, the groups are chosen again holding it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxkv.buckets import pads_fewer_pages
from jaxkv.cascade_cost import DEFAULT_COST_MODELS, AttentionShape, CascadeCostModel
from jaxkv.cascade_left_out import left_out, merge_bytes_per_query
from jaxkv.cascade_padded import PaddedPlans, suffix_starts
from jaxkv.cascade_plan import CascadeLevel, CascadePlan
from jaxkv.cascade_reads import SearchReads
from jaxkv.cascade_together import global_weight, level_weight, net_bytes, outweigh_global
from jaxkv.kv_cache_manager import KVCacheManager
from jaxkv.plan_memo import PlanMemo
from jaxkv.planner_args import (
    check_computed_held,
    check_distinct,
    checked_plan_args,
    checked_planner_settings,
)

__all__ = [
    "DEFAULT_COST_MODELS",
    "AttentionShape",
    "CascadeCostModel",
    "CascadeLevel",
    "CascadePlan",
    "CascadePlanner",
]


class CascadePlanner(PaddedPlans):
    """Plans flat or cascade attention for each scheduled batch (the group search:
    jaxkv.cascade_groups)."""

    def __init__(
        self,
        shape: AttentionShape,
        *,
        backend: str = "xla",
        cost_model: CascadeCostModel | None = None,
        enable_cascade: bool = True,
        enable_groups: bool = True,
        max_groups: int = 8,
        sliding_window: int | None = None,
        page_buckets: Sequence[int] | None = None,
    ) -> None:
        """`page_buckets`: the page widths metadata is padded to (BucketConfig.page_buckets),
        for a cost model with reads_padded_pages; None skips that check."""
        cost_model = checked_planner_settings(
            shape, backend=backend, cost_model=cost_model, enable_cascade=enable_cascade,
            enable_groups=enable_groups, max_groups=max_groups, sliding_window=sliding_window,
            page_buckets=page_buckets,
        )  # fmt: skip
        self._shape = shape
        self._cost_model = cost_model
        self.enable_cascade = enable_cascade and sliding_window is None
        self.enable_groups = enable_groups
        self.max_groups = int(max_groups)
        self.page_buckets = (
            tuple(page_buckets) if page_buckets and cost_model.reads_padded_pages else None
        )
        # Judges a group by what it adds to a groups level that runs anyway: no call of
        # its own (None for a cost model that is not a CascadeCostModel dataclass).
        self._merge_only_model = (
            dataclasses.replace(cost_model, launch_overhead_bytes=0)
            if isinstance(cost_model, CascadeCostModel) and cost_model.launch_overhead_bytes
            else None
        )
        # rows_of's array whose ids were last found distinct; rows_of returns that same
        # object only for an equal id list, so a repeated batch is not checked again.
        self._distinct_rows: np.ndarray | None = None
        self._memo = PlanMemo()  # what the planner reuses while a batch repeats
        # Merge bytes of one query token (0: no costs, nobody is left out; see _left_out).
        self._merge_per_query = merge_bytes_per_query(cost_model, shape)
        self._kv_bytes_per_token = shape.kv_bytes_per_token

    @property
    def shape(self) -> AttentionShape:
        """The head shapes of one device's attention; fixed at construction (the merge
        bytes per query are derived from it)."""
        return self._shape

    @property
    def cost_model(self) -> CascadeCostModel:
        """The cost model; fixed at construction (page_buckets, the merge-only model and
        the merge bytes per query are derived from it): a planner for another model is a
        new CascadePlanner."""
        return self._cost_model

    def pays(
        self,
        num_requests: int,
        prefix_tokens: int,
        num_query_tokens: int,
        context_tokens: int | None = None,
        *,
        model: CascadeCostModel | None = None,
    ) -> bool:
        """The verdict of `model` (default: the planner's cost model) for one level with
        this planner's head shapes. The counts go unchecked to a CascadeCostModel whose
        pays is not overridden (this runs once per candidate group)."""
        s = self.shape
        model = model or self.cost_model
        unchecked = getattr(type(model), "pays", None) is CascadeCostModel.pays
        return (model.pays_unchecked if unchecked else model.pays)(
            num_requests=num_requests,
            prefix_tokens=prefix_tokens,
            num_query_tokens=num_query_tokens,
            context_tokens=context_tokens,
            num_q_heads=s.num_q_heads,
            num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            kv_itemsize=s.kv_itemsize,
        )

    def _context_limit(
        self,
        num_requests: int,
        prefix_tokens: int,
        num_query_tokens: int,
        model: CascadeCostModel | None = None,
    ) -> int | None:
        """CascadeCostModel.max_context_tokens for a level as pays() weighs it: pays()
        holds exactly for the contexts at most this, where it is >= 0. None where pays(),
        or the model's pays, pays_unchecked or min_saved_fraction test, is not
        CascadeCostModel's own (no such limit is known)."""
        model = model or self.cost_model
        if type(self).pays is not CascadePlanner.pays or any(
            getattr(type(model), name) is not getattr(CascadeCostModel, name)
            for name in ("pays", "pays_unchecked", "_short_of_fraction")
        ):
            return None
        s = self.shape
        return model.max_context_tokens(
            num_requests=num_requests, prefix_tokens=prefix_tokens,
            num_query_tokens=num_query_tokens, num_q_heads=s.num_q_heads,
            num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, kv_itemsize=s.kv_itemsize,
        )  # fmt: skip

    def plan(
        self,
        request_ids: Sequence[str],
        num_computed_tokens: np.ndarray,  # i32[R] tokens already in the cache, per request
        query_lens: np.ndarray,  # i32[R] tokens scheduled this step, per request
        manager: KVCacheManager,
    ) -> CascadePlan:
        """A plan for the scheduled requests, in the order given. Changes nothing. The plan
        is valid until the manager next frees a request (build_attention_metadata checks).

        Every request must hold blocks for its num_computed_tokens (as the scheduler
        guarantees); ValueError naming the batch position otherwise, or for a count
        below 0, an id given twice or unknown, or arguments of the wrong type.
        Cost: a fixed number of numpy calls plus a loop over at most
        4 x max(max_groups, 4) candidate groups (and 4 x max_groups past a member's cap;
        twice that on a step whose global level holds a request left out of cascade, or
        has no group kept over it while two requests may share past it, and up to twice
        more where the groups kept leave a suffix pass as wide as flat's, whose search
        also looks at every run at a column that holds a request needing a group, past
        its cap of 2 x max_groups runs, and weighs its candidates twice where the groups
        it keeps first hold not every such request); repeated id lists
        reuse the manager's common prefix (KVCacheManager.num_common_prefix_blocks).
        """
        num_computed_tokens, query_lens = checked_plan_args(
            request_ids, num_computed_tokens, query_lens, manager
        )
        num_requests = len(request_ids)
        rows = manager.rows_of(request_ids)
        made_for = (manager, manager.row_version)
        if rows is not self._distinct_rows:
            check_distinct(rows, request_ids)
            self._distinct_rows = rows
        check_computed_held(num_computed_tokens, rows, manager)
        identity = np.arange(num_requests, dtype=np.int32)
        if num_requests == 0:
            return CascadePlan(
                identity, rows, identity, (), 0, keeps_order=True, made_for=made_for,
                validate=False,
            )  # fmt: skip
        common = manager.num_common_prefix_blocks(request_ids)
        flat = CascadePlan(
            identity, rows, np.zeros(num_requests, np.int32), (), common, keeps_order=True,
            made_for=made_for, validate=False,
        )  # fmt: skip
        if not self.enable_cascade or num_requests < 2:
            return flat

        bs = manager.block_size
        total_q = int(query_lens.sum())
        least_blocks = int(num_computed_tokens.min()) // bs
        k0 = min(common, least_blocks)
        context = int(num_computed_tokens.sum()) + total_q
        use_global = k0 > 0 and self.pays(num_requests, k0 * bs, total_q, context)
        base = k0 if use_global else 0

        # Requests left out of every level (cascade_left_out) join no group: the search
        # sees them as having computed nothing.
        out, merge = None, self._merge_per_query
        if merge:  # blocks whose read the longest query's merge outweighs
            most = int(int(query_lens.max()) * merge // (bs * self._kv_bytes_per_token))
            # None left out where each request computed more and shares that far (memo).
            if most and not (
                least_blocks > most and self._memo.shares_through(manager, rows, most)
            ):
                out = self._left_out(manager, rows, num_computed_tokens, query_lens)
        searched = num_computed_tokens if out is None else np.where(out, 0, num_computed_tokens)
        # Without a global level, k0 > 0 means every request has computed and shares
        # column 0: the search's first candidate is the whole batch, ending at k0.
        whole = k0 if base == 0 and out is None else 0
        if self._memo.no_groups_past(manager, rows, base, out):
            groups = []
        else:
            groups = self._groups(manager, rows, searched, query_lens, base, whole, out)
        # Weigh dropping the global level for groups from block 0 where it holds requests
        # left out, or where requests share past it in no group kept: a group there that
        # pays its merge but not a second call may pay the global level's one call.
        if use_global and (
            out is not None or not (groups or self._memo.no_groups_past(manager, rows, k0))
        ):
            plan = self._plan_without_global(
                manager, rows, num_computed_tokens, out, query_lens, k0, groups, common,
                made_for,
            )  # fmt: skip
            if plan is not None:
                return plan
        if not groups:
            if not use_global:
                return flat
            if not pads_fewer_pages(self.page_buckets, num_computed_tokens, query_lens, k0, bs):
                return self._holding_or(
                    flat, manager, rows, num_computed_tokens, query_lens, out, common, made_for
                )  # fmt: skip
            return self._memo.global_plan(rows, k0, common, made_for)
        suffix_start = suffix_starts(groups, num_requests, base)
        sizes = [len(members) for members, _ in groups]
        model, shape = self.cost_model, self.shape
        rest = (
            self._rest_of_batch(groups, out, searched, query_lens, k0, bs) if use_global else None
        )
        rest_weight = (
            0.0 if rest is None else net_bytes(model, shape, len(rest[0]), k0 * bs, rest[1])
        )
        if use_global and outweigh_global(
            model, shape, num_requests, k0 * bs, total_q, sizes, rest_weight
        ):
            from_block_0 = groups  # laid out by their first request
            if rest is not None:
                from_block_0 = sorted([*groups, (rest[0], k0)], key=lambda g: int(g[0][0]))
            plan = self._plan_from_block_0(
                from_block_0, rows, num_computed_tokens, query_lens, bs, common, made_for
            )
            if plan is None:  # weighed against the global level with its groups
                under = global_weight(model, shape, num_requests, k0 * bs, total_q)
                under += level_weight(model, shape, groups, k0, bs, query_lens)
                plan = self._plan_holding(
                    manager, rows, num_computed_tokens, query_lens, out, under, common,
                    made_for,
                )  # fmt: skip
            if plan is not None:
                return plan
        if not pads_fewer_pages(
            self.page_buckets, num_computed_tokens, query_lens, suffix_start, bs
        ):
            groups, suffix_start = self._groups_padding_fewer(
                manager, rows, num_computed_tokens, query_lens, base, whole, out
            )
            if not groups and use_global:  # groups from block 0 that pay without it
                return self._holding_or(
                    flat, manager, rows, num_computed_tokens, query_lens, out, common, made_for
                )  # fmt: skip
            if not groups:
                return flat
        global_blocks = k0 if use_global else None
        return self._memo.grouped_plan(groups, rows, suffix_start, global_blocks, common, made_for)

    def _left_out(
        self,
        manager: KVCacheManager,
        rows: np.ndarray,  # i32[R]
        num_computed_tokens: np.ndarray,  # i[R]
        query_lens: np.ndarray,  # i[R]
    ) -> np.ndarray | None:
        """cascade_left_out.left_out for this batch: bool[R], None where no request is
        left out."""
        block_bytes = manager.block_size * self._kv_bytes_per_token
        return left_out(
            lambda column: self._memo.shares_column(manager, rows, column),
            num_computed_tokens, query_lens, self._merge_per_query, block_bytes,
            manager.block_size,
        )  # fmt: skip

    def _rest_of_batch(
        self,
        groups: list[tuple[np.ndarray, int]],  # the groups found under the global level
        out: np.ndarray | None,  # bool[R] the requests left out
        searched: np.ndarray,  # i[R] num_computed_tokens, 0 for the requests left out
        query_lens: np.ndarray,  # i[R]
        k0: int,  # the global level's blocks
        block_size: int,
    ) -> tuple[np.ndarray, int] | None:
        """(members, their queries) of the requests in no group and not left out
        as one more group over the global level's blocks from block 0, where they are two
        or more, pay as a group of the search does (GroupSearch._rest) and the level has
        room for it; else None (also for a cost model that is no CascadeCostModel, under
        which groups never outweigh the global level)."""
        if not isinstance(self.cost_model, CascadeCostModel) or len(groups) >= self.max_groups:
            return None
        grouped = np.zeros(len(searched), bool) if out is None else out.copy()
        for members, _ in groups:
            grouped[members] = True
        others = np.flatnonzero(~grouped)
        if len(others) < 2:
            return None
        reads = SearchReads(searched, block_size, self.pays, self._context_limit)
        found = self._rest(
            others, k0, reads=reads, query_lens=query_lens, base=0, block_size=block_size
        )
        return None if found is None else (others, found[3])

    def _plan_without_global(
        self,
        manager: KVCacheManager,
        rows: np.ndarray,  # i32[R]
        num_computed_tokens: np.ndarray,  # i[R]
        out: np.ndarray | None,  # bool[R] the requests left out
        query_lens: np.ndarray,  # i[R]
        k0: int,  # the global level's blocks
        groups: list[tuple[np.ndarray, int]],  # the groups found under it
        common: int,
        made_for,
    ) -> CascadePlan | None:
        """The plan of groups from block 0 over the requests not left out (the others
        read from block 0 in their own pass), where it weighs more than the global level
        (which spans the batch, left-out requests included) with `groups` over it or
        those groups from block 0 (cascade_together.level_weight); else None. Where
        those groups' pages pad to as many as flat's, the groups from block 0 holding
        the requests whose pages need one (_plan_holding) are weighed instead."""
        searched = num_computed_tokens if out is None else np.where(out, 0, num_computed_tokens)
        alone = self._groups(manager, rows, searched, query_lens, 0)
        if not alone:
            return None
        model, shape, bs = self.cost_model, self.shape, manager.block_size
        total_q, num_requests = int(query_lens.sum()), len(rows)
        under = global_weight(model, shape, num_requests, k0 * bs, total_q)
        under += level_weight(model, shape, groups, k0, bs, query_lens)
        if groups:
            under = max(under, level_weight(model, shape, groups, 0, bs, query_lens))
        if level_weight(model, shape, alone, 0, bs, query_lens) <= under:
            return None
        plan = self._plan_from_block_0(
            alone, rows, num_computed_tokens, query_lens, bs, common, made_for
        )
        if plan is None:
            plan = self._plan_holding(
                manager, rows, num_computed_tokens, query_lens, out, under, common, made_for
            )
        return plan
