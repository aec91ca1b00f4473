"""The memory plan: the step traced once from abstract values (traced_step.py, the one trace
cache), its per-device memory (memory_plan.py), and the plan as printed (printed.py)."""
