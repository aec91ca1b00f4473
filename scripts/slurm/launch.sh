#!/bin/bash
# What both batch scripts run: the XLA memory settings a GPU run needs, then one train.py per
# SLURM task (srun), the tasks joining as one JAX cluster (JAX's own SLURM detection,
# runtime/distributed.py).
# The experiment brings its own XLA flags; this sets what lies outside a compiled program.
#
#   scripts/slurm/launch.sh EXPERIMENT [key=value ...]
set -euo pipefail
python=${PYTHON:-.venv/bin/python}

# The CUDA build of the pinned jax, installed once here (before srun) if the venv lacks it.
if ! "$python" -c "import jax_cuda12_plugin" 2>/dev/null; then
    "$python" -m pip install --quiet \
        "jax[cuda12]==$("$python" -c 'import jax; print(jax.__version__)')"
fi

# XLA's memory pool takes this share of each GPU; the run's header and its fit measure
# against it.
export XLA_CLIENT_MEM_FRACTION=${XLA_CLIENT_MEM_FRACTION:-0.95}

# XLA's pinned-host pool: each run raises it to 3/4 of its host's memory unless set
# (runtime/backend.py), enough for the offloaded activations of all its GPUs.
echo "launch: XLA_CLIENT_MEM_FRACTION=$XLA_CLIENT_MEM_FRACTION"

# A task that fails ends the job: the others would wait for it in their next collective.
exec srun --kill-on-bad-exit=1 "$python" train.py "$@"
