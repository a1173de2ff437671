"""Tensor parallelism over a device mesh: KV heads, attention per shard, Megatron weights.

One model runs on a 1-D mesh whose axis (`"model"` by default) has TP devices:

- KV cache `[num_blocks, block_size, 2 * num_kv_heads, head_dim]` is sharded along its
  combined-head axis 2 into TP contiguous chunks. K sits at combined head 2h and V at 2h+1,
  so a chunk of an even number of combined heads holds whole (K, V) pairs: device i holds
  KV heads [i*H/TP, (i+1)*H/TP) and its local cache is again in the interleaved layout.
  Axis 0 (blocks) is never sharded, so block ids mean the same on every device and host
  block management stays single.
- Queries and attention outputs are sharded along heads the same way. Query head j uses
  KV head j // group, so contiguous chunks put every query head beside its KV head.
- `sharded_paged_attention` / `sharded_write_kv` run jaxkv.attention's dispatch per shard
  under `jax.shard_map` with the metadata replicated: each kernel call (any backend, flat
  or cascade) sees only its local heads and the cache is never gathered.
- Weights are sharded Megatron-style (`shard_params`): q/k/v/gate/up column-parallel,
  o/down row-parallel, everything else replicated. XLA's sharding propagation then emits
  one all-reduce after each attention block and one after each MLP block.

Meshes come from jaxkv.meshes (make_mesh, replica_meshes, mesh_for; re-exported here).
When TP exceeds the number of KV heads H (TP a multiple of H), every KV head is replicated
on TP / H devices, as vLLM does: K/V are computed for all H heads on every device, each
head repeated TP / H times, and the cache holds 2 * TP combined heads (one pair per device).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv import attention
from jaxkv.batch import AttentionMetadata
from jaxkv.field_checks import checked_int
from jaxkv.meshes import DEFAULT_AXIS as DEFAULT_AXIS
from jaxkv.meshes import auto_axes, axis_size, check_distinct, check_divides, check_head_counts
from jaxkv.meshes import make_mesh as make_mesh
from jaxkv.meshes import mesh_for as mesh_for
from jaxkv.meshes import replica_meshes as replica_meshes

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # kernel [in, out/TP]
ROW_PARALLEL = ("o_proj", "down_proj")  # kernel [in/TP, out]; partial sums are all-reduced


def kv_cache_sharding(mesh: Mesh, axis_name: str = DEFAULT_AXIS) -> NamedSharding:
    """[num_blocks, block_size, 2 * num_kv_heads, head_dim] split along combined heads.

    The spec has no trailing None: the step program returns its caches so (jit drops
    trailing Nones), and jit keys its cache on the spec's form, so caches made with
    P(None, None, axis, None) retraced the first step's program on the second step; over
    an axis of one device jit returns P() (no split), so P(None, None, axis) missed too.
    ValueError naming `mesh` unless it is a jax.sharding.Mesh, and `axis_name` unless an
    axis of it."""
    split = axis_size(mesh, axis_name) > 1  # a str mesh raised AttributeError, a bad axis at use
    return NamedSharding(mesh, P(None, None, axis_name) if split else P())


# ---------------------------------------------------------------- attention per shard


def _check_heads(
    kv_pages: jax.Array,  # [num_blocks, block_size, 2 * num_kv_heads, head_dim]
    num_q_heads: int | None = None,
    kv: dict[str, jax.Array] | None = None,  # name -> [max_num_tokens, num_kv_heads, head_dim]
) -> None:
    """Head counts checked on the whole arrays, so that errors name the caller's numbers
    rather than one shard's."""
    if kv_pages.ndim != 4 or kv_pages.shape[2] % 2 or kv_pages.shape[2] == 0:
        raise ValueError(
            f"{kv_pages.shape=} must be [num_blocks, block_size, 2 * num_kv_heads, head_dim]"
        )
    num_kv_heads = kv_pages.shape[2] // 2
    if num_q_heads is not None and num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
    for name, x in (kv or {}).items():
        if x.ndim != 3 or x.shape[1] != num_kv_heads:
            raise ValueError(
                f"{name}.shape={x.shape} must be [max_num_tokens, {num_kv_heads}, head_dim]"
            )


@attention.checks_as_given  # values and dtypes as given: jit and shard_map hide them
@functools.partial(
    jax.jit,
    static_argnames=(
        "mesh", "axis_name", "sm_scale", "soft_cap", "sliding_window", "k_scale", "v_scale",
        "backend", "interpret", "return_lse",
    ),
)  # fmt: skip
def sharded_paged_attention(
    q: jax.Array,  # [max_num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_blocks, block_size, 2 * num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    *,
    mesh: Mesh,
    axis_name: str = DEFAULT_AXIS,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """jaxkv.attention.paged_attention with heads split over `axis_name` of `mesh`.

    Each device runs the dispatch (flat or cascade, any backend) on its contiguous chunk of
    query heads and KV heads; metadata is replicated. Returns what paged_attention returns,
    sharded along heads, on meshes.auto_axes(mesh) (any axis types serve). Raises
    ValueError naming both numbers when TP does not divide the query heads or the KV
    heads, or the query heads are not a multiple of the KV heads, and as paged_attention
    does for dtypes as given and, outside jit, concrete metadata's values."""
    tp = axis_size(mesh, axis_name)
    mesh = auto_axes(mesh)  # shard_map refused the specs on jax.make_mesh's Explicit axes
    _check_heads(kv_pages, q.shape[1])
    check_divides(tp, "num_q_heads", q.shape[1])
    check_divides(tp, "num_kv_heads", kv_pages.shape[2] // 2)
    heads = P(None, axis_name, None)
    cache = P(None, None, axis_name, None)
    out_specs = (heads, P(None, axis_name)) if return_lse else heads

    def local(q, kv_pages, metadata):
        return attention.paged_attention(
            q,
            kv_pages,
            metadata,
            sm_scale=sm_scale,
            soft_cap=soft_cap,
            sliding_window=sliding_window,
            k_scale=k_scale,
            v_scale=v_scale,
            backend=backend,
            interpret=interpret,
            return_lse=return_lse,
        )

    # check_vma=False: Pallas kernels carry no varying-axis annotations.
    return jax.shard_map(
        local, mesh=mesh, in_specs=(heads, cache, P()), out_specs=out_specs, check_vma=False
    )(q, kv_pages, metadata)


@attention.narrows_wide_slots  # before jit's wrapping cast to int32
@functools.partial(
    jax.jit, donate_argnums=0, static_argnames=("mesh", "axis_name", "k_scale", "v_scale")
)
def sharded_write_kv(
    kv_pages: jax.Array,  # [num_blocks, block_size, 2 * num_kv_heads, head_dim]
    k: jax.Array,  # [max_num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [max_num_tokens, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[max_num_tokens] block_id * block_size + offset
    *,
    mesh: Mesh,
    axis_name: str = DEFAULT_AXIS,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> jax.Array:
    """jaxkv.attention.write_kv per shard: each device writes its own KV heads' K and V.

    The cache is donated; the result keeps kv_cache_sharding (on meshes.auto_axes(mesh):
    any axis types serve). A slot past the cache writes nothing, also in a numpy int64
    slot_mapping (attention.int32_slots). Raises ValueError naming both
    numbers when TP does not divide the KV heads, or k / v do not have the cache's KV heads."""
    tp = axis_size(mesh, axis_name)
    mesh = auto_axes(mesh)  # as in sharded_paged_attention
    _check_heads(kv_pages, kv={"k": k, "v": v})
    check_divides(tp, "num_kv_heads", kv_pages.shape[2] // 2)
    heads = P(None, axis_name, None)
    cache = P(None, None, axis_name, None)

    def local(kv_pages, k, v, slot_mapping):
        return attention.write_kv(kv_pages, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale)

    return jax.shard_map(
        local, mesh=mesh, in_specs=(cache, heads, heads, P()), out_specs=cache, check_vma=False
    )(kv_pages, k, v, slot_mapping)


# ------------------------------------------------------------------ a model on a mesh


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """How a model's paged attention runs on `mesh` (hashable: part of the model graph).

    kv_replicas: devices that hold each KV head (> 1 only when TP exceeds the KV heads).
    `write_kv` and `paged_attention` have the signatures of jaxkv.attention's.
    """

    mesh: Mesh
    axis_name: str = DEFAULT_AXIS
    kv_replicas: int = 1

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis_name]

    def write_kv(
        self,
        kv_pages: jax.Array,  # [num_blocks, block_size, 2 * num_kv_heads * kv_replicas, D]
        k: jax.Array,  # [max_num_tokens, num_kv_heads, head_dim]
        v: jax.Array,  # [max_num_tokens, num_kv_heads, head_dim]
        slot_mapping: jax.Array,  # i32[max_num_tokens]
        **kwargs: Any,
    ) -> jax.Array:
        if self.kv_replicas > 1:
            k = jnp.repeat(k, self.kv_replicas, axis=1)
            v = jnp.repeat(v, self.kv_replicas, axis=1)
        return sharded_write_kv(
            kv_pages, k, v, slot_mapping, mesh=self.mesh, axis_name=self.axis_name, **kwargs
        )

    def paged_attention(
        self,
        q: jax.Array,  # [max_num_tokens, num_q_heads, head_dim]
        kv_pages: jax.Array,  # [num_blocks, block_size, 2 * num_kv_heads * kv_replicas, D]
        metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        return sharded_paged_attention(
            q, kv_pages, metadata, mesh=self.mesh, axis_name=self.axis_name, **kwargs
        )


def plan_tensor_parallel(
    num_heads: int, num_kv_heads: int, mesh: Mesh, axis_name: str = DEFAULT_AXIS
) -> TensorParallel:
    """Validates TP against the head counts; replicates KV heads when TP > num_kv_heads.

    Raises ValueError naming both numbers when TP does not divide num_heads, does not
    divide num_kv_heads (TP <= num_kv_heads), or is not a multiple of num_kv_heads
    (TP > num_kv_heads), naming both counts unless ints >= 1 (num_heads a multiple of
    num_kv_heads), mesh.devices when the mesh lists a device twice, and `mesh` unless it
    is a jax.sharding.Mesh. The plan runs on
    meshes.auto_axes(mesh): a mesh of Explicit or Manual axes (as jax.make_mesh builds
    by default) serves as its Auto twin over the same devices.
    """
    tp = axis_size(mesh, axis_name)
    check_head_counts(num_heads, num_kv_heads)  # 0 raised ZeroDivisionError, "4" TypeError
    check_distinct(list(mesh.devices.flat), "mesh.devices")
    mesh = auto_axes(mesh)
    check_divides(tp, "num_heads", num_heads)
    if tp <= num_kv_heads:
        check_divides(tp, "num_kv_heads", num_kv_heads)
        return TensorParallel(mesh, axis_name, 1)
    if tp % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} exceeds num_kv_heads={num_kv_heads} and must then be "
            "a multiple of it (each KV head is replicated on tensor_parallel_size / "
            "num_kv_heads devices)"
        )
    return TensorParallel(mesh, axis_name, tp // num_kv_heads)


def _checked_tp_size(tp: Any) -> int:
    """tp.size; ValueError naming `tp` unless a TensorParallel on a Mesh that has its axis
    and with kv_replicas an int >= 1 (another object raised AttributeError)."""
    if not isinstance(tp, TensorParallel):
        raise ValueError(
            f"tp={type(tp).__name__} must be a jaxkv.sharding.TensorParallel "
            "(plan_tensor_parallel makes one)"
        )
    checked_int("tp.kv_replicas", tp.kv_replicas, minimum=1)
    return axis_size(tp.mesh, tp.axis_name)


def _param_spec(path: tuple[str, ...], tp: TensorParallel) -> P:
    if not path or path[-1] != "kernel" or len(path) < 2:
        return P()
    layer = path[-2]
    kv_replicated = layer in ("k_proj", "v_proj") and tp.kv_replicas > 1
    if layer in COLUMN_PARALLEL and not kv_replicated:
        return P(None, tp.axis_name)
    if layer in ROW_PARALLEL:
        return P(tp.axis_name, None)
    return P()


def _path_names(path) -> tuple[str, ...]:
    """("layers", "0", "self_attn", "q_proj", "kernel") from a pytree key path."""
    names = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                names.append(str(getattr(key, attr)))
                break
    if names and names[-1] == "value":  # nnx.Variable leaves end in .value
        names.pop()
    return tuple(names)


def shard_params(state: Any, tp: TensorParallel) -> Any:
    """Places every parameter of an nnx.State on tp.mesh, Megatron-style.

    Column-parallel kernels (COLUMN_PARALLEL, [in, out]) split their output dimension,
    row-parallel ones (ROW_PARALLEL) their input dimension; embeddings, norms and the LM head
    are replicated. K/V projections stay replicated when KV heads are replicated. Raises
    ValueError naming the parameter and both numbers when TP does not divide a split dim,
    and naming `tp` unless it is a TensorParallel (as init_kv_caches).
    """
    _checked_tp_size(tp)

    def place(path, x):
        names = _path_names(path)
        spec = _param_spec(names, tp)
        for dim, axis in enumerate(spec):
            if axis is not None and x.shape[dim] % tp.size:
                raise ValueError(
                    f"tensor_parallel_size={tp.size} must divide dimension {dim} "
                    f"(size {x.shape[dim]}) of parameter {'.'.join(names)}"
                )
        return jax.device_put(x, NamedSharding(tp.mesh, spec))

    return jax.tree_util.tree_map_with_path(place, state)


def shard_model(model: Any, mesh: Mesh, *, params: Any = None, axis_name: str = DEFAULT_AXIS):
    """A copy of a jaxkv.models.Llama whose weights live on `mesh` and whose paged attention
    runs per shard. `model` itself is left as it was; `params` (an nnx.State) replaces its
    weights. Raises ValueError (see plan_tensor_parallel, shard_params) on bad TP sizes,
    and naming the argument unless `model` is a Llama, `mesh` a Mesh and `params` None
    or a state of the model's structure, leaf shapes and dtypes.
    """
    from flax import nnx

    from jaxkv.engine_args import check_params
    from jaxkv.models.llama import check_model

    check_model(model)  # None raised AttributeError: .config
    if params is not None:  # other shapes were placed, and failed or ran at the first call
        check_params(model, params)
    c = model.config
    tp = plan_tensor_parallel(c.num_heads, c.num_kv_heads, mesh, axis_name)
    check_divides(tp.size, "intermediate_size", c.intermediate_size)
    graphdef, state = nnx.split(model)
    sharded = nnx.merge(graphdef, shard_params(state if params is None else params, tp))
    for _, module in nnx.iter_modules(sharded):
        if hasattr(module, "tensor_parallel"):
            module.tensor_parallel = tp
    return sharded


def tensor_parallel_of(model: Any) -> TensorParallel | None:
    """The TensorParallel a model's attention layers run with (None: unsharded)."""
    from flax import nnx

    for _, module in nnx.iter_modules(model):
        tp = getattr(module, "tensor_parallel", None)
        if tp is not None:
            return tp
    return None


def place_model(model: Any, params: Any, mesh: Mesh | None) -> tuple[Any, Any]:
    """(model, params) as an engine runs them: sharded over `mesh` when given (params
    then placed as its weights, and None returned in their place); a model shard_model
    placed already keeps its mesh, and `params` given with it are placed the same way
    (not left whole on one device); otherwise both as they are."""
    if mesh is not None:
        return shard_model(model, mesh, params=params), None
    placed = tensor_parallel_of(model)
    if placed is None or params is None:
        return model, params
    return shard_model(model, placed.mesh, params=params, axis_name=placed.axis_name), None


def init_kv_caches(
    config: Any,  # jaxkv.models.LlamaConfig
    tp: TensorParallel,
    num_blocks: int,
    block_size: int,
    dtype: Any = None,
) -> list[jax.Array]:  # num_layers x [num_blocks, block_size, 2*num_kv_heads*kv_replicas, D]
    """Zeroed per-layer caches created directly in kv_cache_sharding (never whole on one
    device); with replicated KV heads the combined-head axis has 2 * TP entries.
    ValueError naming the argument unless `config` is a LlamaConfig, `tp` a
    TensorParallel on a Mesh whose size divides num_kv_heads * kv_replicas (whole K/V
    pairs per device), and num_blocks, block_size and dtype as Llama.init_kv_caches
    takes them."""
    from jaxkv.models.config import check_config
    from jaxkv.models.llama import check_kv_cache_args

    check_config(config)
    size = _checked_tp_size(tp)
    check_divides(size, "num_kv_heads * kv_replicas", config.num_kv_heads * tp.kv_replicas)
    check_kv_cache_args(num_blocks, block_size, dtype)
    heads = 2 * config.num_kv_heads * tp.kv_replicas
    shape = (num_blocks, block_size, heads, config.head_dim)
    dt = jnp.dtype(dtype or config.dtype)
    zeros = jax.jit(
        lambda: jnp.zeros(shape, dt), out_shardings=kv_cache_sharding(tp.mesh, tp.axis_name)
    )
    return [zeros() for _ in range(config.num_layers)]
