"""Activation placement: which tagged tensors stay on device, go to host, or are recomputed."""
