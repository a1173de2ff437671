"""Settings every test process needs before JAX starts a backend.

`make test` runs the suite in two processes (pytest-xdist). On a GPU, JAX's default of
preallocating 75% of the device's memory in each process would leave the second one
without room, so the tests allocate as they go; and float32 matmuls run in full float32,
not TF32. On the CPU, compiling is most of the suite's time: the processes share an
on-disk compilation cache and compile without LLVM optimisation.
"""

import os
import pkgutil

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The oracles are float64 numpy and the tolerances float32's (1e-4 on logits and
# logprobs). On a GPU, XLA's default float32 matmul is TF32 (10-bit mantissa), which moved
# the tiny model's logits by about 1e-3 on an H200 (a TPU's default, bfloat16 passes, is
# coarser still): the model's matmuls, like the kernels' (which name their precision), run
# in full float32 here. A caller's own setting wins.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# Many tests build engines whose jitted step programs are the same computation; a shared
# on-disk cache lets each worker, and each later engine, load a program the other
# compiled (the in-memory jit caches the tests count are unaffected).
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "jax")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


def _accelerator_plugin_installed() -> bool:
    try:
        import jax_plugins  # the namespace JAX's GPU plugins (CUDA, ROCm) install into
    except ImportError:
        return False
    return any(True for _ in pkgutil.iter_modules(jax_plugins.__path__))


# The suite's CPU programs are tiny and each runs a few times: XLA's CPU compiler spends
# most of the suite's time optimising them. Compiled without LLVM optimisation and with
# the classic fusion emitters, a serving step's program compiles 3.5x faster; its values
# move by float rounding only (about 1e-7 relative: vectorised sums and transcendentals
# round differently), well inside every tolerance here. XLA also splits each program's
# LLVM module into parts compiled on parallel threads; with both cores busy running the
# two test processes, the splitting only adds work: one part cuts compile CPU time by
# about a fifth (the dense model's logits came out bit for bit the same). Any XLA_FLAGS
# of the caller's own are kept; a GPU's compiles keep their defaults.
_FAST_CPU_COMPILE = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)
if not _accelerator_plugin_installed():
    _flags = os.environ.get("XLA_FLAGS", "")
    _missing = [f for f in _FAST_CPU_COMPILE if f.split("=")[0] not in _flags]
    os.environ["XLA_FLAGS"] = " ".join([_flags, *_missing]).strip()


def pytest_collection_modifyitems(config, items):
    """Files holding a test marked slow run first, the rest in collection order.

    The two workers take whole files (--dist loadfile) as they free up; a long file
    reached last keeps one worker busy while the other idles, so long ones go first."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: order kept within
