"""Settings every test process needs before JAX starts a backend.

`make test` runs the suite in two processes (pytest-xdist). On a GPU, JAX's default of
preallocating 75% of the device's memory in each process would leave the second one
without room, so the tests allocate as they go.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Many tests build engines whose jitted step programs are the same computation; a shared
# on-disk cache lets each worker, and each later engine, load a program the other
# compiled (the in-memory jit caches the tests count are unaffected).
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "jax")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


def pytest_collection_modifyitems(config, items):
    """Files holding a test marked slow run first, the rest in collection order.

    The two workers take whole files (--dist loadfile) as they free up; a long file
    reached last keeps one worker busy while the other idles, so long ones go first."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: order kept within
