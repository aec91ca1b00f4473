"""How JAX starts in this process (trainer/target.py says what a step is built for). Import
this module before anything else imports JAX; it imports nothing of the project, so everything
else may import it first. What each setting below does and why: docs/clusters.md."""

import contextlib
import ctypes.util
import glob
import importlib.util
import os
import re
import sys
import tempfile

# JAX's default (0.75) leaves a quarter of the GPU unused; the study's DeepSeek-V3 row needed
# more (docs/study.md). The other 5% is for the CUDA context and NCCL's buffers.
MEMORY_FRACTION = 0.95
FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
# XLA's pinned host memory (offloaded activations, optimizer_state=host) grows on demand up to
# this many GiB a process, 64 unless set: a fit of a 405B layer's optimizer state needs more, so
# a run raises it to 3/4 of the host's memory, never below XLA's 64 (docs/clusters.md).
HOST_LIMIT_VARIABLE = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_HOST_LIMIT_GIB = 64
# jaxlib 0.12.0.1's GPU compiler aborts on a scalar all-reduce over 64 GB200s ("LLVM Fatal Error
# ... size mismatch when packing elements") in XLA's Triton one-shot kernels; XLA reads this
# list-valued setting only from XLA_FLAGS, not from a compile's options.
NCCL_ALL_REDUCES = "--xla_gpu_experimental_use_collective_kernels=-ALL_REDUCE"
_CUDA_STUB_NOISE = re.compile(r"absl::InitializeLog\(\) is called|cudart_stub\.cc.*cuda drivers")


class BackendError(ValueError):
    """A setting of the environment JAX starts in that cannot work (one line, exit status 2)."""


def has_gpu() -> bool:
    """An NVIDIA GPU's device node (/dev/dxg under WSL) or its driver's library."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg")
                or ctypes.util.find_library("cuda"))


def host_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_host_limit_gib(memory: int) -> int:
    """The pinned host limit a run sets on a machine with `memory` bytes (unless set)."""
    return max(XLA_HOST_LIMIT_GIB, int(0.75 * memory / 2**30))


def host_limit_gib() -> int:
    """XLA's pinned host limit in GiB, as this environment sets it."""
    value = os.environ.get(HOST_LIMIT_VARIABLE, str(XLA_HOST_LIMIT_GIB))
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise BackendError(f"{HOST_LIMIT_VARIABLE}={value!r}: expected a whole number of GiB")
    return int(value)


def host_limit() -> int:
    """Bytes of pinned host memory this process may hold: XLA's limit, within the host's."""
    return min(host_limit_gib() * 2**30, host_memory())


def has_cuda_plugin() -> bool:
    return importlib.util.find_spec("jax_cuda12_plugin") is not None


# glibc's mallopt parameters (malloc.h): XLA's CPU runtime allocates a step's buffers anew at
# every step and frees them after it. By default glibc gives threads arenas of their own (a
# buffer freed in one is not reused by the next step's allocation in another; two arenas keep
# too few), maps blocks of 32 MB and more straight from the OS and trims what is freed, so a
# step page-faulted most of its buffers back in: at nanoGPT's size more time than the step's
# arithmetic (docs/runs.md, "What a CPU step costs").
_ONE_ARENA_KEEPING_FREED = {-8: 1,           # M_ARENA_MAX: every thread's blocks from one heap
                            -4: 0,           # M_MMAP_MAX: no block mapped apart (and unmapped)
                            -1: 2**31 - 1}   # M_TRIM_THRESHOLD: what is freed stays for reuse


def keep_freed_memory() -> bool:
    """On a CPU backend with glibc, freed memory kept for the next step's buffers (whether set):
    called by a process that trains (train.py, `python -m study cpu-step`) before JAX's client
    starts. Not by the compile tools nor the test suite: XLA's compile threads then contend for
    the one arena, and a compile takes about 1.5x as long. A GPU's buffers are XLA's own pool's."""
    if has_gpu() and os.environ.get("JAX_PLATFORMS") != "cpu":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # glibc's (musl's ignores these)
    return mallopt is not None and all(mallopt(k, v) == 1
                                       for k, v in _ONE_ARENA_KEEPING_FREED.items())


def memory_fraction() -> tuple[float, str]:
    """(the share of each GPU's memory XLA's pool takes, the variable that says so)."""
    for name in FRACTION_VARIABLES:
        if value := os.environ.get(name):
            with contextlib.suppress(ValueError):
                if 0 < float(value) <= 1:
                    return float(value), name
            raise BackendError(f"{name}={value!r}: expected a fraction in (0, 1]")
    return MEMORY_FRACTION, FRACTION_VARIABLES[0]


@contextlib.contextmanager
def captured_stderr(rewrite=lambda line: line, keep_on_error=True):
    """Run the body with file descriptor 2 captured (C++ libraries write there directly, below
    Python's sys.stderr), then write each captured line as `rewrite` returns it; a body that
    raises drops them unless `keep_on_error`. Yields the real stderr's descriptor."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        succeeded = False
        try:
            yield saved
            succeeded = True
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if succeeded or keep_on_error:
                captured.seek(0)
                lines = captured.read().decode(errors="replace").splitlines(keepends=True)
                sys.stderr.write("".join(map(rewrite, lines)))


def quiet():
    """Drop the CUDA plugin's start-up messages on a machine without a GPU; keep the rest."""
    if has_gpu() or not has_cuda_plugin():
        return contextlib.nullcontext()
    return captured_stderr(lambda line: "" if _CUDA_STUB_NOISE.search(line) else line)


# XLA's warnings from its own memory estimates, each with the line that explains it
# (docs/placement.md).
REMAT_NOTE = ("  (XLA's rematerialization pass: its estimate counts the host buffers of offloaded "
              "activations as device memory and is made before the final schedule; what the "
              "compiled program holds on the device is measured below)\n")
SCHEDULE_NOTE = ("  (XLA's GPU scheduler: it counts the program's arguments and outputs in host "
                 "memory, the state a run keeps there, against the device's limit; what the "
                 "compiled program holds on the device is measured below)\n")
_EXPLAINED = ((re.compile(r"hlo_rematerialization.*Can't reduce memory use below"), REMAT_NOTE),
              (re.compile(r"gpu_hlo_schedule.*byte size of input/output arguments"),
               SCHEDULE_NOTE))


def explained_compile():
    """While XLA compiles: its warnings from its memory estimates get a line that says what
    they are."""
    return captured_stderr(lambda line: line + "".join(
        note for pattern, note in _EXPLAINED if pattern.search(line)))


def _probe_gradient(policy, weights, x):
    jnp = jax.numpy  # (JAX is imported last in this module, once the environment is set)

    def layer(x, w):
        y = jax.ad_checkpoint.checkpoint_name(jnp.sin(x * w), "probe")
        return x + jnp.cos(y) * w, None

    body = layer if policy is None else jax.checkpoint(layer, policy=policy, prevent_cse=False)
    return jax.grad(lambda w: jnp.sum(jnp.square(jax.lax.scan(body, x, w)[0])))(weights)


def host_reads_in_order(gradient=_probe_gradient, layers: int = 4) -> bool:
    """Whether a scan whose layers each offload one value has the gradient of one that keeps
    them on the device: jaxlib 0.10.2 and 0.11.0 read them back from the wrong layers on GPUs
    (openxla/xla #46231). A property of this backend, probed once a run offloads on a GPU."""
    jnp = jax.numpy
    offload = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["probe"],
        offload_src="device", offload_dst="pinned_host")
    keys = jax.random.split(jax.random.key(0), 2)
    weights = jax.random.normal(keys[0], (layers, 8, 128), jnp.float32)
    x = jax.random.normal(keys[1], (8, 128), jnp.float32)
    kept, offloaded = (jax.jit(gradient, static_argnums=0)(p, weights, x)
                       for p in (None, offload))
    return bool(jnp.allclose(offloaded, kept, rtol=1e-4, atol=1e-5))


if has_cuda_plugin() and not has_gpu():  # the `gpu-compile` extra on a machine without a GPU
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
if not any(os.environ.get(name) for name in FRACTION_VARIABLES):
    os.environ[FRACTION_VARIABLES[0]] = str(MEMORY_FRACTION)
# Whether someone set it, not this module (in this process or the one that started it): the
# study tools plan for other machines, whose runs set their own.
_SET_HERE = "OFFLOAD_TRAINER_HOST_LIMIT_SET"
HOST_LIMIT_GIVEN = HOST_LIMIT_VARIABLE in os.environ and _SET_HERE not in os.environ
if HOST_LIMIT_VARIABLE not in os.environ:
    os.environ[HOST_LIMIT_VARIABLE] = str(default_host_limit_gib(host_memory()))
    os.environ[_SET_HERE] = "1"
if NCCL_ALL_REDUCES.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {NCCL_ALL_REDUCES}".strip()
with quiet():  # the CUDA plugin loads (and speaks) as JAX is imported
    import jax  # noqa: F401
