"""A local JAX cluster for the tests: processes of 4 CPU devices each, an explicit launch
(JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) on a free port."""

import os
import re
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
    alive = [sys.executable, str(Path(__file__).with_name("with_parent.py")), str(os.getpid())]
    return [subprocess.Popen([*alive, *script], env={**base, "JAX_PROCESS_ID": str(i)},
                             stdout=open(folder / f"out-{i}", "w"),
                             stderr=open(folder / f"err-{i}", "w")) for i in range(n)]


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
