"""XLA GPU target descriptions, one .txtpb per GPU (read by study/gpus.py)."""
