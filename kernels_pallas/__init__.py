"""Attention kernels for jaxkv: plain-jnp references, the LSE merge, Pallas TPU and GPU.

This package imports nothing from jaxkv: kernels take arrays and know nothing of
requests, hashes or scheduling.
"""
