"""jaxkv: paged KV cache management and cascade attention for JAX serving loops.

The host side (requests, block pool, KV cache manager, scheduler) is plain Python and
numpy; planning turns each scheduled batch into static-shape attention metadata; the
attention dispatch runs flat or cascade attention through Pallas kernels or XLA.
"""

from __future__ import annotations

__version__ = "0.1.0"

# Public names are re-exported below, one block per module, as modules land.
