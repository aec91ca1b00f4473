"""The smallest program whose scan offloads a residual to host memory, compiled for one H200
without a GPU: four layers, one tag offloaded. tests/test_addressing.py compiles it with the
pinned jax and proves its addressing; run directly under jax 0.10.2 (which reads host buffers
back in the wrong layer order), this writes the committed fixtures it is checked against:

    python3.11 -m venv /tmp/jax010 && /tmp/jax010/bin/pip install jax==0.10.2 jaxlib==0.10.2 \\
        jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2
    JAX_PLATFORMS=cpu /tmp/jax010/bin/python tests/tools/offload_probe.py

Each fixture is the optimized HLO with what the proof never reads (metadata, stack frames,
scheduling hints) stripped.
"""

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import topologies

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "addressing"
LAYERS, ROWS, WIDTH = 4, 256, 512
PIPELINED = {"xla_gpu_enable_pipelined_host_offloading": True}


def layer(x, w):
    y = checkpoint_name(jnp.sin(x * w), "offloaded")
    return x + jnp.cos(y) * w, None


def loss(weights, x):
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["offloaded"],
        offload_src="device", offload_dst="pinned_host")
    y, _ = jax.lax.scan(jax.checkpoint(layer, policy=policy, prevent_cse=False), x, weights)
    return jnp.sum(y * y)


def compile_probe(devices, options: dict) -> str:
    """The optimized HLO of the probe's gradient on one compile-only GPU of `devices`."""
    replicated = jax.sharding.NamedSharding(jax.sharding.Mesh(devices[:1], ("x",)),
                                            jax.sharding.PartitionSpec())
    weights = jax.ShapeDtypeStruct((LAYERS, ROWS, WIDTH), jnp.float32, sharding=replicated)
    x = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32, sharding=replicated)
    return jax.jit(jax.grad(loss)).lower(weights, x).compile(options).as_text()


def _spec_for_jax_010(spec: str) -> str:
    """XLA's H200 spec as jaxlib 0.10.2 parses it: no comments, no newer field, a top-level
    runtime_version."""
    lines = [line for line in spec.splitlines() if not line.lstrip().startswith("#")
             and "collective_memory_granularity" not in line]
    version = re.search(r'runtime_version: "(\d+)\.(\d+)\.(\d+)"', spec).groups()
    lines.append("runtime_version { major: %s minor: %s patch: %s }" % version)
    return "\n".join(lines) + "\n"


def strip(hlo: str) -> str:
    """Drop what the addressing proof never reads: metadata, stack frames, scheduling hints."""
    kept, frames = [], False
    for line in hlo.splitlines():
        if re.fullmatch(r"FileNames|FunctionNames|FileLocations|StackFrames", line):
            frames = True
        elif frames and re.match(r"(ENTRY )?%", line):
            frames = False
        if frames:
            continue
        line = re.sub(r", metadata=\{[^{}]*\}", "", line)
        line = re.sub(r'"(operation_queue_id|force_earliest_schedule|reification_cost|'
                      r'device_type|native_emitter_backend_config)":'
                      r'("[^"]*"|\[\]|false|true|\{[^{}]*\}),?', "", line)
        kept.append(line.replace(",}", "}"))
    return "\n".join(kept) + "\n"


def main() -> int:
    spec = _spec_for_jax_010((ROOT / "configs" / "gpu_specs" / "h200.txtpb").read_text())
    devices = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                           target_config=spec).devices
    for name, options in (("", {}), ("-pipelined", PIPELINED)):
        path = FIXTURES / f"jax-{jax.__version__}{name}.hlo"
        path.write_text(strip(compile_probe(devices, options)))
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
