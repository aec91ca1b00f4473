"""The tools that compile full-scale steps for GPUs without one (the gpu-compile extra): a row
compiled, every row's compiled memory, the fit on other machines, every row replayed."""
