"""Joining a multi-host JAX cluster (docs/clusters.md: the launches): JAX's own detection, plus
what `jax.distributed.initialize` lacks: gloo collectives between CPU processes, a bounded wait
for the others, a taken coordinator port named before JAX binds it, a one-line ConfigError
(exit status 2), not a hang or C++ abort."""

import dataclasses
import errno
import os
import re
import socket
import threading
import warnings

import jax
# Reaching inside: the detection jax.distributed.initialize runs itself, asked first so that a
# single process skips initialize and a taken port is named before JAX binds it.
from jax._src.clusters import ClusterEnv

from configs import ConfigError
from runtime import backend

# Seconds processes wait for each other to join (and, at exit, to leave) before the run ends.
TIMEOUT_VARIABLE = "DISTRIBUTED_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300
# JAX's own deadline stays later than ours: when it passes, XLA aborts the process with a
# C++ stack trace instead of raising.
_JAX_GRACE_S = 30
# An explicit launch sets all three (JAX reads only the address).
EXPLICIT = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


@dataclasses.dataclass(frozen=True)
class Launch:
    """The arguments of `jax.distributed.initialize`."""
    coordinator: str  # host:port of process 0's coordination service
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None  # None: every device this process sees

    def describe(self) -> str:
        return f"process {self.process_id} of {self.num_processes} (coordinator {self.coordinator})"


def _int(name: str) -> int:
    value = os.environ.get(name, "")
    if not re.fullmatch(r"\d+", value.strip()):
        raise ConfigError(f"{name}={value!r}: expected a non-negative integer")
    return int(value)


def _explicit() -> Launch:
    if missing := [name for name in EXPLICIT if not os.environ.get(name)]:
        given = [name for name in EXPLICIT if os.environ.get(name)]
        raise ConfigError(f"{' and '.join(given)} set without {' and '.join(missing)}: an "
                          f"explicit multi-process launch sets all of {', '.join(EXPLICIT)}")
    return Launch(os.environ[EXPLICIT[0]], _int(EXPLICIT[1]), _int(EXPLICIT[2]), _local_ids())


def _local_ids() -> tuple[int, ...] | None:
    """JAX_LOCAL_DEVICE_IDS (which JAX reads too), checked."""
    ids = os.environ.get("JAX_LOCAL_DEVICE_IDS")
    if ids and not re.fullmatch(r"\d+(,\d+)*", ids):
        raise ConfigError(f"JAX_LOCAL_DEVICE_IDS={ids!r}: expected integers, comma-separated")
    return tuple(map(int, ids.split(","))) if ids else None


def detect() -> Launch | None:
    """The launch this process's environment describes; None for a single process."""
    if any(os.environ.get(name) for name in EXPLICIT[1:]):
        launch = _explicit()
    else:
        # What jax.distributed.initialize hands its detection: the two variables it reads.
        given = (os.environ.get(EXPLICIT[0]) or None, None, None, _local_ids())
        try:  # (JAX probes Kubernetes too, and warns in any container without its package)
            with warnings.catch_warnings(action="ignore"):
                address, count, index, local = ClusterEnv.auto_detect_unset_distributed_params(
                    *given, None, None)
        except (ValueError, KeyError, RuntimeError) as e:  # a malformed launcher variable
            raise ConfigError(f"the launch's environment does not parse: {e}") from None
        if count is None:
            if address:  # JAX_COORDINATOR_ADDRESS alone is no launch: say what is missing
                _explicit()
            return None
        launch = Launch(address, count, index, None if local is None else tuple(local))
    if not re.fullmatch(r"\[?[\w.:\-]+\]?:\d+", launch.coordinator or ""):
        raise ConfigError(f"coordinator address {launch.coordinator!r}: expected host:port")
    if launch.num_processes < 1 or launch.process_id >= launch.num_processes:
        raise ConfigError(f"{launch.describe()}: the process id must be below the number of "
                          "processes")
    return launch if launch.num_processes > 1 else None


def _port_taken(coordinator: str) -> bool:
    """Whether another program listens on the coordinator's port here, on any address (JAX
    binds [::]:port). XLA's service has then crashed instead of raising (jaxlib 0.10.2); gRPC
    reuses addresses, so a closed socket's TIME_WAIT is not taken."""
    port = int(coordinator.rsplit(":", 1)[1])
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                probe.bind((host, port))
                return False
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
    return False  # no address family to probe with: let JAX find out


def _give_up(launch: Launch, seconds: int, stderr: int) -> None:
    os.write(stderr, (f"error: {launch.describe()}: the processes did not all join within "
                      f"{seconds} s (one not started, failed, or given another coordinator "
                      f"address; {TIMEOUT_VARIABLE} sets the wait)\n").encode())
    os._exit(2)  # the main thread is blocked inside XLA's connect


def initialize() -> Launch | None:
    """Join the cluster this process was launched into, if any, before JAX's backend starts. A
    CPU backend's collectives then go over gloo (JAX's CPU default runs none across processes)."""
    launch = detect()
    if launch is None or jax.distributed.is_initialized():
        return launch
    seconds = _int(TIMEOUT_VARIABLE) if os.environ.get(TIMEOUT_VARIABLE) else DEFAULT_TIMEOUT_S
    if seconds < 1:
        raise ConfigError(f"{TIMEOUT_VARIABLE}={seconds}: expected at least 1 second")
    if (launch.process_id == 0 and not os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")
            and _port_taken(launch.coordinator)):
        raise ConfigError(f"{launch.describe()}: the coordinator's port is taken on this host "
                          "(another job's coordinator?): choose another")
    if not backend.has_gpu() or os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    local = None if launch.local_device_ids is None else list(launch.local_device_ids)
    try:
        # gRPC's logs of a failed bind or connection are dropped: the failure is one line.
        with backend.captured_stderr(keep_on_error=False) as stderr:
            watchdog = threading.Timer(seconds, _give_up, (launch, seconds, stderr))
            watchdog.daemon = True
            watchdog.start()
            try:
                jax.distributed.initialize(
                    launch.coordinator, launch.num_processes, launch.process_id, local,
                    cluster_detection_method="deactivate",
                    initialization_timeout=seconds + _JAX_GRACE_S,
                    shutdown_timeout_seconds=seconds)
            finally:
                watchdog.cancel()
    except (jax.errors.JaxRuntimeError, RuntimeError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "Failed to start RPC server" in reason:
            reason += " (is the coordinator's port taken?)"
        raise ConfigError(f"{launch.describe()}: {reason}") from None
    return launch
