"""The GPUs studied: their figures and XLA's target specs, and compile-only devices made of them."""
