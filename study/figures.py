"""The study's measured TFLOP/s/device per row (docs/study.md, 128 GB200s): what each row's
replayed step is compared with (python -m study compile, step-times), and the trainer's
comparison table beside its own (runtime/comparison.py). Numbers only: it imports nothing, so
the trainer may read it (tests/test_imports.py places it below the trainer)."""

STUDY_TFLOPS: dict[str, float] = {
    "llama405b-baseline": 2669, "llama405b-offload": 2746, "llama405b-offload-nolhs": 2569,
    "llama405b-offload-pipelined": 2718,
    # Rows 1-2 from the stated ratios: row 3 is 1.57x row 1 and 1.677x row 2.
    "deepseek671b-offload": 908.2, "deepseek671b-remat": 908.2 / 1.57,
    "deepseek671b-offload-nolhs": 908.2 / 1.677,
}
