"""Settings every test process needs before JAX starts a backend.

`make test` runs the suite in two processes (pytest-xdist). On a GPU, JAX's default of
preallocating 75% of the device's memory in each process would leave the second one
without room, so the tests allocate as they go.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
