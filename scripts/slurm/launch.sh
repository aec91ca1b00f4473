#!/bin/bash
# What both batch scripts run: the XLA memory settings a GPU run needs, then one train.py per
# SLURM task (srun), the tasks joining as one JAX cluster (JAX's own SLURM detection,
# runtime/distributed.py).
# The experiment brings its own XLA flags; this sets what lies outside a compiled program.
#
#   scripts/slurm/launch.sh GPUS_PER_TASK EXPERIMENT [device=GPU] [key=value ...]
#
# device=GPU (gb200, b200, h200, h100) is the study's word for the GPU the plan measures
# against; the run measures its own devices and is not given it.
set -euo pipefail
gpus_per_task=$1
shift
python=${PYTHON:-.venv/bin/python}
run_args=()
for word in "$@"; do
    [[ $word == device=* ]] || run_args+=("$word")
done

# The CUDA build of the pinned jax, installed once here (before srun) if the venv lacks it.
if ! "$python" -c "import jax_cuda12_plugin" 2>/dev/null; then
    "$python" -m pip install --quiet \
        "jax[cuda12]==$("$python" -c 'import jax; print(jax.__version__)')"
fi

# XLA's memory pool takes this share of each GPU; the plan and the run header measure against it.
export XLA_CLIENT_MEM_FRACTION=${XLA_CLIENT_MEM_FRACTION:-0.95}

# XLA's pinned-host pool (64 GiB per process by default) must hold the offloaded activations
# of all the process's GPUs: the study's plan per GPU (printed without a GPU, on this batch
# host's CPU; a comparison's largest row) x GPUs per task, +10%, never below the default.
if [[ -z ${XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB:-} ]]; then
    pool=$(JAX_PLATFORMS=cpu "$python" -m study plan "$@" | awk -v n="$gpus_per_task" '
        /^host \(pinned\)/ { g = $3; if ($4 == "MiB") g /= 1024; if ($4 == "KiB") g = 0
                             if (g > gib) gib = g }
        END { need = gib * n * 1.1; if (need > int(need)) need = int(need) + 1
              if (need < 64) need = 64; print need }')
    export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=$pool
fi
echo "launch: XLA_CLIENT_MEM_FRACTION=$XLA_CLIENT_MEM_FRACTION" \
     "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=$XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"

# A task that fails ends the job: the others would wait for it in their next collective.
exec srun --kill-on-bad-exit=1 "$python" train.py "${run_args[@]}"
