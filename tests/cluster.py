"""A local JAX cluster for the tests: processes of 4 CPU devices each, an explicit launch
(JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) on a free port."""

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

# Whatever launched the test run (a CI job under SLURM, say) is not the tests' cluster.
LAUNCHERS = re.compile(r"^(SLURM_|OMPI_|PMIX_|JAX_COORDINATOR|JAX_NUM_PROCESSES|JAX_PROCESS_ID)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: list[str], n: int, folder: Path, **env) -> list[subprocess.Popen]:
    """Processes 0..n-1 of `script` (python arguments); their output goes to files in
    `folder` (pipes could fill while the test computes); `env` overrides the launch's."""
    base = {k: v for k, v in os.environ.items() if not LAUNCHERS.match(k)}
    base.update({"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                              "--xla_force_host_platform_device_count=4",
                 "JAX_NUM_PROCESSES": str(n), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
                 **env})
    return [subprocess.Popen([sys.executable, *script], env={**base, "JAX_PROCESS_ID": str(i)},
                             stdout=open(folder / f"out-{i}", "w"),
                             stderr=open(folder / f"err-{i}", "w"), preexec_fn=_die_with_parent)
            for i in range(n)]


# Loaded here, not in the forked child, where loading could wait on a lock another thread held.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """In the child, before it runs: SIGKILL when the test's process ends, however it ends.
    JAX's preemption service takes SIGTERM in a cluster's processes, so a stopped `make test`
    would leave them waiting on each other (Linux's prctl; elsewhere nothing)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def finish(processes, folder: Path, timeout: float) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each process; all killed past `timeout` seconds."""
    try:
        codes = [p.wait(timeout=timeout) for p in processes]
    finally:
        for p in processes:
            p.kill()
    return [(code, (folder / f"out-{i}").read_text(), (folder / f"err-{i}").read_text())
            for i, code in enumerate(codes)]


class PortTaken:
    """A port held open on every address, as another program's server would hold it."""

    def __enter__(self) -> int:
        self.socket = socket.socket(socket.AF_INET6)
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        self.socket.bind(("::", free_port()))
        self.socket.listen()
        return self.socket.getsockname()[1]

    def __exit__(self, *_):
        self.socket.close()
