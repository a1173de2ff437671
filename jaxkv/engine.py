"""Engine: the serving loop. add_request / step / abort / generate over a paged Llama.

Its parts: a step's host path (jaxkv.engine_step), request intake
(jaxkv.engine_requests), what it builds from its config (jaxkv.engine_args,
jaxkv.engine_parts, jaxkv.engine_device) and its end (jaxkv.engine_lifetime).

One program per combination of buckets met and variant (logprobs, min_tokens ban width,
penalty table width, prompt-logprob rows), shared by engines over one model graph;
EngineConfig.max_step_programs bounds them for workloads without the last three.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxkv.attention import default_backend
from jaxkv.cascade import CascadePlan
from jaxkv.closable import Closable, one_at_a_time, step_until_landed
from jaxkv.completion import run_to_completion
from jaxkv.config import EngineConfig
from jaxkv.detokenizer import Detokenizer
from jaxkv.engine_args import checked_engine_args
from jaxkv.engine_device import device_state, engine_copier
from jaxkv.engine_lifetime import LOST, caches_lost, close_engine
from jaxkv.engine_parts import cascade_planner, kv_cache_manager
from jaxkv.engine_requests import abort_requests, queue_request
from jaxkv.engine_step import run_step
from jaxkv.kv_transfer import KVConnector, bound_stats
from jaxkv.metrics import EngineMetrics, StepStats, StepTotals, engine_metrics
from jaxkv.outputs import CompletionOutput, RequestOutput
from jaxkv.parallel_sampling import IdsInUse, ParallelSamples
from jaxkv.request_serials import RequestSerials, SerialsCheckpoint
from jaxkv.sampler import SamplingRows
from jaxkv.sampling_params import SamplingParams
from jaxkv.scheduler import Scheduler, SchedulerOutput
from jaxkv.sharding import mesh_for
from jaxkv.step_inputs import batch_inputs
from jaxkv.token_texts import TokenTexts


class Engine(Closable):
    """Serves generation requests on a flax NNX Llama (jaxkv.models.Llama) with paged KV.

    `params` (an nnx.State of the model's parameters) replaces the weights the model holds;
    None uses them as they are. `connector` (e.g. HostOffloadConnector) sees finished
    requests and prefix-cache misses. `mesh` (a jax Mesh with a "model" axis, of any axis
    types: jax.make_mesh's Explicit ones run as Auto, see self.mesh) or
    `tensor_parallel_size` (a mesh over the first that many devices) runs the model
    tensor-parallel (jaxkv.sharding); None of both: as the model is placed (one that
    jaxkv.sharding.shard_model returned keeps its mesh), else the default device.
    `tokenizer` (anything with decode(token_ids) -> str) reads the output text that
    SamplingParams.stop strings are looked for in, and each finished request's text
    (RequestOutput.text), or streams it (SamplingParams.stream_text), through
    jaxkv.detokenizer, and each logprob's decoded_token (jaxkv.token_texts); without
    one, stop strings and stream_text are refused.
    Not thread-safe: one thread drives the engine. close() (or leaving a `with` block)
    frees its device memory at once; so does a constructor that raises, before the
    exception propagates (its traceback holds no KV cache and no placed weights).
    """

    def __init__(
        self,
        model: nnx.Module,
        params: nnx.State | None = None,
        config: EngineConfig | None = None,
        *,
        connector: KVConnector | None = None,
        mesh: jax.sharding.Mesh | None = None,
        tensor_parallel_size: int | None = None,
        tokenizer: Any = None,
    ) -> None:
        config = checked_engine_args(model, params, config, connector)
        detokenizer = None if tokenizer is None else Detokenizer(tokenizer)  # checks it
        mc = model.config
        self.config = config
        self.model_config = mc
        self.vocab_size = mc.vocab_size
        self.backend = config.backend or default_backend()
        self.manager = kv_cache_manager(config)
        self.connector = connector if connector is not None else KVConnector()
        self.scheduler = Scheduler(config.scheduler, self.manager, self.connector)
        self.tokenizer = tokenizer
        self.scheduler.detokenizer = detokenizer
        self._token_texts = None if tokenizer is None else TokenTexts(tokenizer.decode)
        self.buckets = config.buckets
        self._sampling = SamplingRows(min(config.max_logprobs, self.vocab_size), mc.eos_token_ids)
        self._samples = ParallelSamples()  # requests of SamplingParams.n > 1
        self._serials = RequestSerials()  # default ids and seeds of queued requests
        self._programs: set[tuple] = set()
        self._totals = StepTotals()
        self.last_step: StepStats | None = None  # the last step that ran the model
        # The device state last, and freed if what follows raises: the traceback keeps this
        # frame and `self`, which must not keep its memory (a retry could run out of it).
        device = device_state(
            model, params, config, self.backend, mesh_for(mesh, tensor_parallel_size)
        )
        try:
            placed = device.placed
            self.mesh = None if placed is None else placed.mesh
            self._state_leaves = device.state_leaves
            self._program = device.program
            self.kv_caches = device.kv_caches
            self.planner = cascade_planner(config, device.heads, self.backend)
            self.copier = engine_copier(
                self, device, mc, max_blocks=self.manager.max_blocks_per_seq
            )
            self._transfers_at_bind = self._transfers_at_close = bound_stats(
                self.connector,
                self.copier,
                block_size=config.cache.block_size,
                hash_seed=config.cache.hash_seed,
            )
        except BaseException:
            device.free()
            self._closed = True
            raise

    # --------------------------------------------------------------- requests

    def add_request(
        self,
        prompt_token_ids: Sequence[int] | np.ndarray,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queues a request; returns its id. Raises ValueError (nothing queued) when the
        prompt is empty, not 1-D integers, holds ids outside [0, vocab_size), leaves no
        room for output within max_model_len, could not fit the whole KV cache, or the
        params (logprobs or prompt_logprobs above config.max_logprobs too), id or salt
        are invalid or the id is in use (unfinished, or finished or aborted with a KV
        copy in flight: drain_transfers frees it). Requests share cached KV only if their
        `cache_salt` (e.g. one per tenant) is equal: None is a salt of its own. A request
        stops at the model's eos_token_ids unless params.ignore_eos; params.stop strings
        and params.stream_text need the engine's tokenizer. Under params.n > 1 its n
        samples are queued (ids "0_<id>" to "<n-1>_<id>", in use too) and report under
        its id. A Ctrl-C queues it whole, its id and seed taken, or not at all."""
        self._check_open(idle=False)
        return queue_request(self, prompt_token_ids, sampling_params, request_id, cache_salt)

    def queue_checkpoint(self) -> SerialsCheckpoint:
        """A function that, called once every request queued since has been aborted (as
        generate does when it refuses a prompt), gives the next request the default id and
        seed it would have had; it raises RuntimeError, changing nothing, while the engine
        still holds one. Its check() raises that error without rewinding (a router checks
        every replica before it rewinds any). Raises RuntimeError after close()."""
        super()._check_open()  # closed, or inside a step (lost caches: add_request refuses)
        return self._serials.checkpoint(self.scheduler.requests)

    def abort(self, request_ids: str | Iterable[str]) -> bool:
        """Cancels a request, or each of an iterable of them, in any unfinished state (under
        n > 1, each of its unfinished samples; a sample's own id cancels that one); True if
        one was, False if each is unknown or finished. Raises ValueError, cancelling none,
        unless each id is a str encodable as UTF-8 (as the ids add_request returns are).

        No RequestOutput follows for it: step() reports only requests that got a token. A
        Ctrl-C is raised once each is cancelled, its sampling row and samples forgotten."""
        self._check_not_running()
        return abort_requests(self, request_ids)

    def has_unfinished_requests(self) -> bool:
        """True while a request (a sample under n) waits or runs; finished ones whose KV
        copies are in flight are not counted (has_pending_transfers). False once closed."""
        return self.scheduler.has_unfinished_requests()

    @property
    def ids_in_use(self) -> Container[str]:
        """A live view of the request ids add_request refuses as in use (see there)."""
        return IdsInUse(self.scheduler.requests, self._samples)

    def reset_prefix_cache(self) -> bool:
        """Empties the device prefix cache (vLLM's LLM.reset_prefix_cache): True if it did,
        False (nothing changed) while a request holds blocks; a connector's store stays."""
        self._check_open(idle=False)
        return self.manager.reset_prefix_cache()

    def has_pending_transfers(self) -> bool:
        """True while finished requests' blocks wait for KV copies to land; False once closed."""
        return not self._closed and self.scheduler.has_pending_transfers()

    # ------------------------------------------------------------------- step

    @one_at_a_time
    def step(self) -> list[RequestOutput]:
        """Runs one scheduled batch; returns the requests that got a token, in schedule
        order. Returns [] without running the model when nothing can be scheduled.

        An exception before the sampled tokens reach the host (the planner or the model
        raising, an interrupt during a compile) hands the batch back to the scheduler
        (Scheduler.discard) before it propagates: no block its tokens were to fill stays in
        the prefix cache, running requests schedule the same tokens next step, and requests
        it admitted wait again; the engine keeps serving (a Ctrl-C while a compiled program
        runs is raised once the KV caches it returns, replacing the ones it donated, are
        stored). An interrupt in the tokenizer (read after the model ran) loses the step's
        outputs: each request the update reached keeps its tokens, those that finished free
        their blocks, those after it compute the same tokens next step, and the step counts
        in metrics and last_step (num_prompt_tokens counting a prompt chunk computed again
        in both steps). Calls back into the engine from a step (a tokenizer's) raise
        RuntimeError. A KV connector's exception while the batch is chosen (a load that
        fails to start) propagates before the model runs, the batch handed back the same
        way; a HostOffloadConnector first drops the blocks that load was to read, so the
        next step computes them. A batch an interrupt kept from being applied or handed back
        (a Ctrl-C as schedule() returned) is handed back by the next step; a Ctrl-C once
        the update began (but in the tokenizer) is raised when the step's bookkeeping ends.
        A program that fails after the caches were donated to it loses them: see
        jaxkv.engine_lifetime (the engine must be rebuilt; its error notes it).
        """
        return run_step(self)

    def _step_inputs(self, out: SchedulerOutput, plan: CascadePlan):
        """jaxkv.step_inputs.batch_inputs of a scheduled batch on this engine."""
        return batch_inputs(
            out,
            plan,
            manager=self.manager,
            buckets=self.buckets,
            config=self.config,
            backend=self.backend,
            sampling_rows=self._sampling,
        )

    # ----------------------------------------------------------------- driving

    def drain_transfers(self, timeout_s: float = 60.0) -> None:
        """Steps until every finished request's KV copy has landed (blocks all freed).

        Runs other requests' steps meanwhile if any are queued (their outputs are
        dropped; call it when the engine is otherwise idle). Raises TimeoutError and
        ValueError as jaxkv.closable.step_until_landed does: copies that landed within
        `timeout_s` are collected, under timeout_s=0 too.
        """
        self._check_open()
        pending = self.scheduler.has_pending_transfers
        step_until_landed(pending, lambda: bool(self.step()), timeout_s)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = True,
    ) -> list[CompletionOutput]:
        """Runs `prompts` to completion; one CompletionOutput per prompt and sample
        (SamplingParams.n), in prompt order, then by sample index.

        Prompts are queued in order; one that fails validation raises ValueError, noted
        with its index (prompts[i]), after the ones before it are aborted (none has run).
        An exception while stepping (KeyboardInterrupt too) aborts the prompts' unfinished
        requests, then propagates. Requests already in the engine progress too; their
        outputs are not returned. `progress` draws a tqdm bar once all are queued.
        """
        self._check_open(idle=False)
        return run_to_completion(self, prompts, sampling_params, progress=progress)

    # --------------------------------------------------------------- lifetime

    def close(self, timeout_s: float = 60.0, *, force: bool = False) -> None:
        """Aborts every unfinished request, waits for the KV copies in flight to land (the
        connector keeps what they saved, for another engine it is bound to), stops the
        copy thread and frees the KV cache's device memory.

        Afterwards add_request, step, generate, queue_checkpoint, drain_transfers and
        reset_prefix_cache raise RuntimeError, and abort returns False (close aborted
        every request; a caller's cleanup may abort its ids); metrics stay readable;
        closing again does nothing. Raises ValueError, changing nothing, unless
        `timeout_s` is a number >= 0. When the copies have not landed within `timeout_s`
        it raises TimeoutError, the engine left open, without requests, for a close with
        more time; `force` closes it all the same, then raises (a copy that never lands
        cannot hold it open). Any other exception (a step's as it waits: the connector's
        poll) is raised once it is closed. Either way, copies not landed are lost with it;
        an interrupt leaves it open. `with Engine(...) as engine:` closes it on leaving.
        """
        close_engine(self, timeout_s, force)

    def _check_open(self, *, idle: bool = True) -> None:
        """Closable's check, then RuntimeError once the KV caches are lost (0.2 us); with
        `idle` not while it holds no request (a step then only lands the KV copies)."""
        super()._check_open()
        if caches_lost(self.kv_caches) and not (idle and not self.has_unfinished_requests()):
            raise RuntimeError(LOST)

    # ----------------------------------------------------------------- metrics

    @property
    def num_compiles(self) -> int:
        """Distinct step programs this engine has run (EngineMetrics.num_compiles), one per
        program key: also those another engine over the same model graph compiled first."""
        return len(self._programs)

    @property
    def metrics(self) -> EngineMetrics:
        """A frozen snapshot (EngineMetrics) of the counters since the engine was built;
        readable after close(), with the connector's bytes as they were at close."""
        transfers = self._transfers_at_close if self._closed else self.connector.stats
        return engine_metrics(
            self._totals, self.scheduler, self.num_compiles, transfers, self._transfers_at_bind
        )
