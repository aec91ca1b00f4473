"""`python tests/with_parent.py PARENT_PID SCRIPT ARG ...`: SCRIPT run as `python SCRIPT ARG ...`
would run it, killed (SIGKILL) when the process PARENT_PID that started it ends, however it
ends (tests/cluster.py). JAX's preemption service takes SIGTERM in a cluster's processes, so a
stopped `make test` would otherwise leave them waiting on each other. Set here, in the child
itself (Linux's prctl; elsewhere nothing): a preexec_fn would fork the multithreaded test."""

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h

parent, script = int(sys.argv[1]), sys.argv[2]
if sys.platform == "linux":
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the line above
        sys.exit(1)
sys.argv = sys.argv[2:]
sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
runpy.run_path(script, run_name="__main__")
