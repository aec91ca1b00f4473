"""The model: pure functions over plain pytrees of arrays.

Nothing is imported here on purpose: `model.config` is JAX-free, so `configs/` can import it
before JAX starts its backend (XLA flags must be in place by then).
"""
