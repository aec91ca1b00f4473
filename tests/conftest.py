"""Every test runs on 8 fake CPU devices, in float32 at full matmul precision.

The suite compiles many programs more than once (a resumed run compiles what the run it
resumes compiled; subprocess tests compile what in-process tests did): one compilation cache
per test session, shared by the xdist workers and the subprocesses they start, compiles each
once. It starts empty, so nothing from an earlier session or another jax is reused.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Set by the first process of the session (xdist's controller), inherited by its workers.
if "OFFLOAD_TRAINER_TEST_CACHE" not in os.environ:
    os.environ["OFFLOAD_TRAINER_TEST_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"] = \
        tempfile.mkdtemp(prefix="jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    _OWNER = True
else:
    _OWNER = False

from runtime import backend  # noqa: E402,F401  (before JAX: no CUDA plugin start-up noise without a GPU)
import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_sessionfinish(session, exitstatus):
    if _OWNER:
        shutil.rmtree(os.environ["OFFLOAD_TRAINER_TEST_CACHE"], ignore_errors=True)
