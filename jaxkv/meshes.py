"""1-D device meshes for tensor parallelism: one per engine, or one per replica.

The mesh axis (`DEFAULT_AXIS`, "model") is the one jaxkv.sharding splits heads and
weights along. Each check raises ValueError naming the tensor-parallel size and the
number it must fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxkv.field_checks import as_int

__all__ = [
    "DEFAULT_AXIS",
    "auto_axes",
    "axis_size",
    "check_distinct",
    "check_axis_name",
    "check_axis_names",
    "check_divides",
    "check_head_counts",
    "make_mesh",
    "mesh_for",
    "replica_meshes",
]

DEFAULT_AXIS = "model"


def check_axis_name(axis_name: str) -> None:
    """ValueError naming `axis_name` unless it is a str: a list or array raised TypeError
    "unhashable type" from jax.sharding.Mesh or a mesh lookup, naming nothing."""
    if not isinstance(axis_name, str):
        raise ValueError(f"{axis_name=} must be a mesh axis name (a str)")


def check_axis_names(mesh: Mesh) -> None:
    """ValueError naming mesh.axis_names unless they are distinct. jax.sharding.Mesh takes
    ("model", "model"), whose shape then lists one "model" axis of the first size: over
    2 x 2 devices it planned TP 2 and the engine's first placement failed with an
    XLA error about reshape dimensions."""
    names = mesh.axis_names
    if len(set(names)) != len(names):
        raise ValueError(f"mesh.axis_names={names} must be distinct")


def axis_size(mesh: Mesh, axis_name: str) -> int:
    """The size of `mesh`'s axis `axis_name`; ValueError naming `mesh` unless it is a
    jax.sharding.Mesh, its axis names unless distinct, and `axis_name` unless a str
    naming an axis of it."""
    if not isinstance(mesh, Mesh):  # a str or a device list raised AttributeError: .shape
        raise ValueError(f"mesh={type(mesh).__name__} must be a jax.sharding.Mesh")
    check_axis_names(mesh)
    check_axis_name(axis_name)
    if axis_name not in mesh.shape:
        raise ValueError(f"{axis_name=} is not an axis of {mesh.shape=}")
    return mesh.shape[axis_name]


def check_divides(tp: int, name: str, n: int) -> None:
    """ValueError unless the tensor-parallel size `tp` is >= 1 and divides `name`=`n`."""
    if tp < 1 or n % tp:
        need = "be >= 1" if tp < 1 else f"divide {name}={n}"
        raise ValueError(f"tensor_parallel_size={tp} must {need}")


def check_head_counts(num_heads, num_kv_heads) -> None:
    """ValueError naming both unless they are ints >= 1 and num_heads is a multiple of
    num_kv_heads (grouped-query attention), as LlamaConfig holds them."""
    counts = (as_int(num_heads), as_int(num_kv_heads))
    if None in counts or min(counts) < 1 or counts[0] % counts[1]:
        raise ValueError(
            f"{num_heads=} and {num_kv_heads=} must be ints >= 1, num_heads a multiple of "
            "num_kv_heads"
        )


def check_distinct(devices: Sequence[jax.Device], name: str = "devices") -> None:
    """ValueError naming `name` unless no device is listed twice (jax.sharding.Mesh takes
    such a list; placing an array on it then fails with an AssertionError)."""
    ids = [d.id for d in devices]
    if len(set(devices)) != len(ids):
        raise ValueError(f"{name} must be distinct, got ids {ids}")


def auto_axes(mesh: Mesh) -> Mesh:
    """`mesh` (itself if every axis is AxisType.Auto) over the same devices and axis names
    with every axis Auto: jaxkv's programs leave the collectives to XLA's sharding
    propagation, and an Explicit axis (jax.make_mesh's default) made the first step fail
    with ShardingTypeError on the row-parallel matmuls, a Manual one with AssertionError
    while placing the weights."""
    auto = jax.sharding.AxisType.Auto
    if all(t == auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(mesh.axis_names))


def _device_list(devices: Sequence[jax.Device] | None) -> list:
    """`devices` (default: jax.devices()) as a list; ValueError naming them when they are
    one device or no iterable (list() raised TypeError on them), or a str (a platform
    name such as "cpu", whose characters make_mesh named as ['c'])."""
    if devices is None:
        return list(jax.devices())
    if isinstance(devices, (jax.Device, str, bytes)) or not isinstance(devices, Iterable):
        raise ValueError(f"devices={devices!r} must be a sequence of jax Devices")
    return list(devices)


def replica_meshes(
    tensor_parallel_size: int,
    devices: Sequence[jax.Device] | None = None,
    axis_name: str = DEFAULT_AXIS,
) -> list[Mesh]:
    """Splits `devices` (default: jax.devices()) into consecutive groups of TP devices.

    One 1-D mesh per group, in device order; each group can serve one engine replica.
    Raises ValueError naming both numbers when TP does not divide the device count,
    naming `devices` when they are empty, no sequence of jax Devices (one Device is not)
    or list a device twice, and `axis_name` unless it is a str."""
    check_axis_name(axis_name)
    devices = _device_list(devices)
    if not devices:
        raise ValueError("devices must not be empty")
    if not all(isinstance(d, jax.Device) for d in devices):  # "cpu" gave a mesh of chars
        raise ValueError(f"devices={devices!r} must be jax Devices")
    check_distinct(devices)
    tp = as_int(tensor_parallel_size)
    if tp is None:
        raise ValueError(f"{tensor_parallel_size=} must be an int")
    check_divides(tp, "the device count", len(devices))
    return [Mesh(np.array(devices[i : i + tp]), (axis_name,)) for i in range(0, len(devices), tp)]


def make_mesh(
    tensor_parallel_size: int,
    devices: Sequence[jax.Device] | None = None,
    axis_name: str = DEFAULT_AXIS,
) -> Mesh:
    """A 1-D mesh over the first TP of `devices` (default: jax.devices()), as vLLM's
    tensor_parallel_size takes them; ValueError naming both numbers if TP exceeds them,
    naming tensor_parallel_size unless it is an int >= 1, naming `devices` when they
    are empty or no sequence of jax Devices, or list one of the first TP twice, and
    `axis_name` unless it is a str."""
    devices = _device_list(devices)
    tp = as_int(tensor_parallel_size)
    if tp is not None and tp > len(devices) > 0:
        raise ValueError(f"tensor_parallel_size={tp} exceeds the device count={len(devices)}")
    first = devices[:tp] if tp is not None and tp >= 1 else devices  # else refused below
    return replica_meshes(tensor_parallel_size, first, axis_name)[0]


def mesh_for(mesh: Mesh | None = None, tensor_parallel_size: int | None = None) -> Mesh | None:
    """The mesh an engine runs on: `mesh`, or make_mesh(tensor_parallel_size), or None.

    None (both None) means the default device without sharding. Raises ValueError when
    both are given and disagree (`tensor_parallel_size` is not the size of the mesh's
    DEFAULT_AXIS axis), `tensor_parallel_size` is no int (bools are not) or below 1, or
    `mesh` is no Mesh, has no DEFAULT_AXIS axis, names an axis twice or lists a device
    twice."""
    if mesh is None:
        return None if tensor_parallel_size is None else make_mesh(tensor_parallel_size)
    if not isinstance(mesh, Mesh):  # a str or a device list used to raise AttributeError
        raise ValueError(f"mesh={mesh!r} must be None or a jax.sharding.Mesh")
    check_axis_names(mesh)
    if DEFAULT_AXIS not in mesh.shape:
        raise ValueError(f"{mesh.axis_names=} must contain {DEFAULT_AXIS!r}")
    check_distinct(list(mesh.devices.flat), "mesh.devices")
    if tensor_parallel_size is not None:
        tp = as_int(tensor_parallel_size)
        if tp is None:  # True or 1.0 compared equal to 1
            raise ValueError(f"{tensor_parallel_size=} must be an int")
        if tp < 1:  # named as disagreeing with the mesh before
            raise ValueError(f"tensor_parallel_size={tp} must be >= 1")
        size = mesh.shape[DEFAULT_AXIS]
        if size != tp:
            raise ValueError(
                f"tensor_parallel_size={tp} disagrees with the mesh: it must equal the size "
                f"{size} of its {DEFAULT_AXIS!r} axis (mesh.shape={dict(mesh.shape)})"
            )
    return mesh
