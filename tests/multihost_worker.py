"""One process of tests/test_multihost.py's two-process cluster, started with the explicit
launch variables (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID).

    python tests/multihost_worker.py RESULTS_DIR RUNS_DIR ONE_PROCESS_CHECKPOINT

Through the trainer's own entry (`train.main`, which joins the cluster): RUNS (a one-row Llama
comparison and a profiled DeepSeek run with expert parallelism and a final checkpoint, both
from the Hugging Face fixtures). Then the fixtures imported sharded as a run shards them (FSDP
for Llama, experts split for DeepSeek): gathered whole and their logits (saved by process 0)
and, per process, the bytes read and the bytes its devices hold, from JAX's own map of them.
Last, two checkpoints restored onto the two processes and gathered: the one they saved, and
one a single process saved. One launch for all: each start costs seconds.
"""

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime import backend  # noqa: E402,F401  (before JAX)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from runtime import checkpoints  # noqa: E402
import configs  # noqa: E402
import train  # noqa: E402

from hf.load import open_checkpoint  # noqa: E402
from model import families  # noqa: E402
from model.options import ForwardOptions  # noqa: E402
from model.params import param_shardings  # noqa: E402
from model.sharding import AxisRules  # noqa: E402
from runtime import setup as runtime_setup  # noqa: E402
from trainer import program  # noqa: E402
from trainer import target as trainer_target  # noqa: E402
from trainer.program import Program  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")  # as tests/conftest.py, which the
jax.config.update("jax_default_matmul_precision", "highest")  # reference runs under

FIXTURES = Path(__file__).resolve().parent / "fixtures"
COMMON = ["steps=2", "seq=32", "quant=none"]
# (argv without out_dir); the comparison is registered by both this worker and the test.
RUNS = {
    "llama": ["multihost-llama", f"init_from={FIXTURES / 'llama_gqa'}", *COMMON],
    "deepseek": ["deepseek671b-offload", f"init_from={FIXTURES / 'deepseek_yarn'}",
                 "mesh.expert=4", "expert_capacity=1.0", "profile=true", "checkpoint_every=2",
                 *COMMON],
}
COMPARISON = ("multihost-llama", ("llama405b-offload",))
IMPORTS = {"llama_gqa": 1, "deepseek_yarn": 4}  # fixture -> the mesh's expert axis


def shardings(cfg, mesh):
    """The parameters' shardings as a run makes them (FSDP, experts split or not)."""
    return param_shardings(families.of(cfg).param_specs(cfg), AxisRules(mesh=mesh))


def sharded_import(fixture: str, mesh) -> dict:
    """The fixture imported as a run imports it: its parameters gathered whole, the logits of
    expected.npz's tokens, the bytes read and the bytes this process's devices hold."""
    cfg, checkpoint = open_checkpoint(FIXTURES / fixture)
    params = checkpoint.arrays(shardings(cfg, mesh), jnp.float32)
    held = 0
    for array in jax.tree.leaves(params):
        boxes = {tuple(s.indices(n)[:2] for s, n in zip(index, array.shape))
                 for index in array.sharding.addressable_devices_indices_map(array.shape).values()}
        held += sum(int(np.prod([b - a for a, b in box])) for box in boxes) * 4  # f32 files
    logits = logits_fn(cfg, mesh)(params, tokens(fixture))
    return {"params": flat(multihost_utils.process_allgather(params, tiled=True)),
            "logits": np.asarray(logits.addressable_data(0)),
            "bytes_read": checkpoint.reader.bytes_read, "held": held}


def flat(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def tokens(fixture: str) -> np.ndarray:
    return np.load(FIXTURES / fixture / "expected.npz")["tokens"]


def logits_fn(cfg, mesh):
    """The model's logits, jitted, replicated on `mesh` (every expert on every token for
    DeepSeek: plain XLA, partitioned as the parameters are)."""
    forward = families.of(cfg).forward
    return jax.jit(lambda p, t: forward(p, t, cfg, ForwardOptions(experts="dense"))[0],
                   out_shardings=NamedSharding(mesh, PartitionSpec()))


def restored_params(checkpoint: Path) -> dict[str, np.ndarray]:
    """The parameters of a checkpoint of RUNS["deepseek"], restored onto this cluster's
    devices as a resumed run places them, then gathered whole."""
    argv = RUNS["deepseek"]
    setup = runtime_setup.resolve(argv[0], argv[1:], jax.devices())
    setup = dataclasses.replace(setup, resume=checkpoints.find(str(checkpoint), "", ""))
    target = trainer_target.this_machine()
    program = Program(setup.model, setup.run, setup.placement, target)
    state, _ = runtime_setup.start_state(program, setup)
    return flat(multihost_utils.process_allgather(state["params"], tiled=True))


def make_mesh(expert: int):
    """A run's data x fsdp x expert mesh over every process's devices."""
    return program.mesh_of(configs.RunConfig(mesh=configs.MeshConfig(expert=expert)),
                             jax.devices())


def main(results: Path, runs: Path, one_process_checkpoint: Path) -> int:
    configs.COMPARISONS[COMPARISON[0]] = COMPARISON[1]
    codes = {name: train.main([*argv, f"out_dir={runs}"]) for name, argv in RUNS.items()}
    found = {"codes": codes, "process": jax.process_index()}
    for fixture, expert in IMPORTS.items():
        imported = sharded_import(fixture, make_mesh(expert))
        for key in ("bytes_read", "held"):
            found.setdefault(key, {})[fixture] = imported[key]
        if jax.process_index() == 0:
            np.save(results / f"{fixture}-logits.npy", imported["logits"])
            np.savez(results / f"{fixture}-params.npz", **imported["params"])
    (ours,) = runs.glob("deepseek671b-offload-*")
    for name, checkpoint in (("two", ours), ("one", one_process_checkpoint)):
        params = restored_params(checkpoint)
        if jax.process_index() == 0:
            np.savez(results / f"restored-from-{name}.npz", **params)
    (results / f"process-{jax.process_index()}.json").write_text(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main(*map(Path, sys.argv[1:4])))
