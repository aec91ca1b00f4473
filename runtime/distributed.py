"""Joining a multi-host JAX cluster: which launcher started this process, the
`jax.distributed.initialize` arguments that follow from its environment, and one clear line
(a ConfigError, exit status 2) instead of a hang or a C++ abort when they cannot work.

Launchers, first match wins:
  - Open MPI (`mpirun`): OMPI_COMM_WORLD_SIZE / _RANK / _LOCAL_RANK / _LOCAL_SIZE; the
    coordinator is the launching host from OMPI_MCA_orte_hnp_uri (Open MPI 4), or
    JAX_COORDINATOR_ADDRESS (Open MPI 5 has no such variable).
  - SLURM (`srun`): SLURM_NTASKS / _PROCID / _LOCALID, the coordinator the first host of
    SLURM_STEP_NODELIST. Only a job step (srun) sets SLURM_STEP_*: a batch script's own
    commands (a plan before the srun) stay single processes though SLURM_NTASKS is set.
    Checked after Open MPI because `mpirun` inside a SLURM job inherits SLURM_* variables.
  - An explicit launch: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, all
    three (JAX itself reads only the address).
JAX_COORDINATOR_ADDRESS overrides a launcher's coordinator, JAX_COORDINATOR_PORT its port (the
default port is JAX's, from the job id). A process sees every device of its host when it is
the only one there, else the one GPU of its local rank (JAX_LOCAL_DEVICE_IDS to choose).
"""

import contextlib
import dataclasses
import errno
import os
import re
import socket
import sys
import tempfile
import threading

import jax

from configs import ConfigError
from runtime import backend

# How long processes wait for each other to join (and, at exit, to leave): a missing process
# or a wrong address ends the run after this many seconds.
TIMEOUT_VARIABLE = "DISTRIBUTED_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300
# JAX's own deadline stays later than ours: when it passes, XLA aborts the process with a
# C++ stack trace instead of raising.
_JAX_GRACE_S = 30


@dataclasses.dataclass(frozen=True)
class Launch:
    """The arguments of `jax.distributed.initialize` and where they came from."""
    launcher: str  # "openmpi", "slurm" or "explicit"
    coordinator: str  # host:port of process 0's coordination service
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None  # None: every device this process sees

    def describe(self) -> str:
        return (f"process {self.process_id} of {self.num_processes} ({self.launcher} launch, "
                f"coordinator {self.coordinator})")


def _int(env, name: str) -> int:
    value = env.get(name, "")
    if not re.fullmatch(r"\d+", value.strip()):
        raise ConfigError(f"{name}={value!r}: expected a non-negative integer")
    return int(value)


def _address(env, host: str, default_port: int) -> str:
    """JAX_COORDINATOR_ADDRESS if set, else host and JAX_COORDINATOR_PORT or `default_port`."""
    if address := env.get("JAX_COORDINATOR_ADDRESS"):
        return address
    port = _int(env, "JAX_COORDINATOR_PORT") if env.get("JAX_COORDINATOR_PORT") else default_port
    return f"{host}:{port}"


def _job_port(job_id: int) -> int:
    """JAX's port for a job: one of the top 4096, so concurrent jobs rarely collide."""
    return job_id % 4096 + 61440


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: 'gpu[007-010,12],cpu1' -> 'gpu007'."""
    match = re.match(r"([^,\[]+)(?:\[([^,\-\]]+))?", nodelist.strip())
    if not match:
        raise ConfigError(f"SLURM_STEP_NODELIST={nodelist!r}: no host in it")
    return match.group(1) + (match.group(2) or "")


def _local_ids(env, local_rank: str | None = None) -> tuple[int, ...] | None:
    """JAX_LOCAL_DEVICE_IDS if set; else, for a process sharing its host, the GPU of its rank
    there (the variable `local_rank`); else None: every device it sees."""
    if ids := env.get("JAX_LOCAL_DEVICE_IDS"):
        if not re.fullmatch(r"\d+(,\d+)*", ids):
            raise ConfigError(f"JAX_LOCAL_DEVICE_IDS={ids!r}: expected integers, comma-separated")
        return tuple(int(i) for i in ids.split(","))
    return None if local_rank is None else (_int(env, local_rank),)


def _openmpi(env) -> Launch:
    size, rank = _int(env, "OMPI_COMM_WORLD_SIZE"), _int(env, "OMPI_COMM_WORLD_RANK")
    uri = env.get("OMPI_MCA_orte_hnp_uri", "")
    # e.g. 1531576320.0;tcp://10.96.0.1,10.148.0.1:34911: the launcher's job id and its IPs
    host = re.search(r"tcp://([^,:;]+)|tcp6://\[([^,\]]+)", uri)
    if host is None and not env.get("JAX_COORDINATOR_ADDRESS"):
        raise ConfigError("Open MPI launch without OMPI_MCA_orte_hnp_uri (Open MPI 5?): set "
                          "JAX_COORDINATOR_ADDRESS=<rank 0's host>:<free port>")
    job = int(uri.split(".")[0]) // 4096 if uri.split(".")[0].isdigit() else 0
    shared = env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1") != "1"
    return Launch("openmpi", _address(env, host and (host[1] or host[2]), _job_port(job)),
                  size, rank, _local_ids(env, "OMPI_COMM_WORLD_LOCAL_RANK" if shared else None))


def _slurm(env) -> Launch:
    tasks, task = _int(env, "SLURM_NTASKS"), _int(env, "SLURM_PROCID")
    nodes = _int(env, "SLURM_STEP_NUM_NODES") if "SLURM_STEP_NUM_NODES" in env else tasks
    host = first_host(env["SLURM_STEP_NODELIST"])
    return Launch("slurm", _address(env, host, _job_port(_int(env, "SLURM_JOB_ID"))), tasks,
                  task, _local_ids(env, "SLURM_LOCALID" if tasks > nodes else None))


EXPLICIT = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _explicit(env) -> Launch:
    if missing := [name for name in EXPLICIT if not env.get(name)]:
        given = [name for name in EXPLICIT if env.get(name)]
        raise ConfigError(f"{' and '.join(given)} set without {' and '.join(missing)}: an "
                          f"explicit multi-process launch sets all of {', '.join(EXPLICIT)}")
    return Launch("explicit", env["JAX_COORDINATOR_ADDRESS"], _int(env, "JAX_NUM_PROCESSES"),
                  _int(env, "JAX_PROCESS_ID"), _local_ids(env))


def detect(env=os.environ) -> Launch | None:
    """The launch this environment describes; None for a single process."""
    if "OMPI_COMM_WORLD_SIZE" in env:
        launch = _openmpi(env)
    elif all(name in env for name in ("SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")):
        launch = _slurm(env)
    elif any(env.get(name) for name in EXPLICIT):
        launch = _explicit(env)
    else:
        return None
    if not re.fullmatch(r"\[?[\w.:\-]+\]?:\d+", launch.coordinator):
        raise ConfigError(f"coordinator address {launch.coordinator!r}: expected host:port")
    if launch.num_processes < 1 or launch.process_id >= launch.num_processes:
        raise ConfigError(f"{launch.describe()}: the process id must be below the number of "
                          "processes")
    return launch if launch.num_processes > 1 else None


def _timeout(env) -> int:
    seconds = _int(env, TIMEOUT_VARIABLE) if env.get(TIMEOUT_VARIABLE) else DEFAULT_TIMEOUT_S
    if seconds < 1:
        raise ConfigError(f"{TIMEOUT_VARIABLE}={seconds}: expected at least 1 second")
    return seconds


def _port_taken(coordinator: str) -> bool:
    """Whether another program listens on the coordinator's port here, on any address (JAX
    binds [::]:port). XLA's service (jaxlib 0.10.2) then sometimes crashes instead of
    raising; gRPC reuses addresses, so a closed socket's TIME_WAIT is not taken."""
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


@contextlib.contextmanager
def _stderr_held():
    """While XLA connects, what C++ writes to file descriptor 2 (gRPC's logs of a failed bind
    or connection) goes to a file, written out only if the connection succeeds: a failure is
    reported in one line instead. Yields the real stderr's descriptor."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield saved
        except BaseException:
            os.dup2(saved, 2)
            raise
        else:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
        finally:
            os.close(saved)


def _give_up(launch: Launch, seconds: int, stderr: int) -> None:
    os.write(stderr, (f"error: {launch.describe()}: the processes did not all join within "
                      f"{seconds} s (one not started, failed, or given another coordinator "
                      f"address; {TIMEOUT_VARIABLE} sets the wait)\n").encode())
    os._exit(2)  # the main thread is blocked inside XLA's connect


def initialize(env=os.environ) -> Launch | None:
    """Join the cluster this process was launched into, if any, before JAX's backend starts.
    A CPU backend's collectives then go over gloo (JAX's CPU default runs none across
    processes)."""
    launch = detect(env)
    if launch is None or jax.distributed.is_initialized():
        return launch
    seconds = _timeout(env)
    if (launch.process_id == 0 and not env.get("JAX_COORDINATOR_BIND_ADDRESS")
            and _port_taken(launch.coordinator)):
        raise ConfigError(f"{launch.describe()}: the coordinator's port is taken on this host "
                          "(another job's coordinator?): choose another")
    if not backend.has_gpu() or env.get("JAX_PLATFORMS", "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    local = None if launch.local_device_ids is None else list(launch.local_device_ids)
    try:
        with _stderr_held() as stderr:
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
