"""A token file's batches are a function of (seed, step), not of the draws before: a resumed
run, and every process of a multi-process run, reads the windows an uninterrupted run reads
at each step (data/tokens.py, trainer/program.global_batch). A source that draws from one
generator seeded once (a stream) gives the same data only to runs that drew alike before."""

import json

import numpy as np
import pytest

from conftest import NARROW
from data.tokens import token_source
from model.sharding import AxisRules, make_mesh
from trainer.program import global_batch

VOCAB = 512
SEQ = 8
BATCH = 16  # 8 devices x 2
SEED = 7


@pytest.fixture
def token_file(tmp_path) -> str:
    """0, 1, .., 511, 0, 1, ..: a window of it is consecutive ids mod 512, wherever it starts
    (so a row shows it is a window of the file without asking the code where it started)."""
    path = tmp_path / "tokens.bin"
    (np.arange(20_000) % VOCAB).astype(np.uint16).tofile(path)
    return str(path)


def source(path: str, seed: int = SEED):
    """A source as a run (fresh or resumed) creates it: runtime/setup.resolve's call."""
    return token_source(path, "uint16", VOCAB, seed, SEQ)


def assert_windows(rows: np.ndarray) -> None:
    steps = (np.diff(rows.astype(np.int64), axis=-1) % VOCAB)
    assert rows.shape[-1] == SEQ + 1 and np.all(steps == 1), rows


def test_the_batch_at_a_step_does_not_depend_on_the_draws_before(token_file):
    uninterrupted = source(token_file)
    drawn = [uninterrupted.batch(step, BATCH, SEQ) for step in range(6)]
    for step in (0, 3, 5):  # resumed after `step` steps: a new source, its first draw
        np.testing.assert_array_equal(source(token_file).batch(step, BATCH, SEQ), drawn[step])
    backwards = source(token_file)  # any order of draws, repeats included
    for step in (5, 2, 2, 0, 4):
        np.testing.assert_array_equal(backwards.batch(step, BATCH, SEQ), drawn[step])
    for batch in drawn:
        assert_windows(batch)
    # What makes the above able to fail: the windows move with the step and with the seed.
    assert len({b.tobytes() for b in drawn}) == len(drawn)
    assert not np.array_equal(source(token_file, seed=SEED + 1).batch(3, BATCH, SEQ), drawn[3])


def process_rows(data, step: int, sharding, devices) -> dict[int, np.ndarray]:
    """What one process reads at `step`: the rows of global_batch its `devices` hold (each
    process of a run builds the global batch from its own source; JAX keeps its rows)."""
    array = global_batch(data.batch(step, BATCH, SEQ), sharding)
    rows = {}
    for shard in array.addressable_shards:
        if shard.device in devices:
            first = shard.index[0].start or 0
            rows.update({first + k: row for k, row in enumerate(np.asarray(shard.data))})
    return rows


@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)], ids=["fsdp 8", "data 2 x fsdp 4"])
def test_each_process_reads_its_rows_of_the_same_global_batch(token_file, mesh_shape):
    """Two processes of 4 devices each (as tests/test_multihost.py launches them): process 0
    has run since step 0, process 1 restarted at step 3 (a fresh source). At steps 3 and 4
    their rows together are one global batch, the one of a source that drew nothing else."""
    mesh = make_mesh(mesh_shape, ("data", "fsdp"))
    sharding = AxisRules(mesh=mesh).sharding(("batch", None))
    devices = list(mesh.devices.flat)
    processes = [(source(token_file), set(devices[:4])), (source(token_file), set(devices[4:]))]
    for step in range(3):
        process_rows(processes[0][0], step, sharding, processes[0][1])
    for step in (3, 4):
        read = [process_rows(data, step, sharding, held) for data, held in processes]
        assert not set(read[0]) & set(read[1])  # each row read by one process
        global_rows = {**read[0], **read[1]}
        assert sorted(global_rows) == list(range(BATCH))
        expected = source(token_file).batch(step, BATCH, SEQ)
        np.testing.assert_array_equal(np.stack([global_rows[r] for r in range(BATCH)]),
                                      expected)
        assert_windows(expected)


def losses(run_dir) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def test_a_resumed_run_on_a_token_file_continues_its_losses(token_file, tmp_path, capsys):
    """train.py on the token file: 4 steps uninterrupted, then steps 3-4 resumed from the
    step-2 checkpoint; their losses are the uninterrupted run's, exactly (a stream of windows
    would give the resumed run steps 1-2's data again)."""
    import train  # (here: JAX starts after conftest.py's settings)
    args = ["llama405b-offload", "steps=4", "seq=32", "model.n_layers=1", f"model.vocab={VOCAB}",
            *NARROW, "quant=none", f"data.path={token_file}", "checkpoint_every=2",
            f"out_dir={tmp_path / 'runs'}"]
    assert train.main(args) == 0, capsys.readouterr().err
    (whole,) = (tmp_path / "runs").iterdir()
    assert train.main([*args, f"resume={whole / 'checkpoints' / '2'}"]) == 0, (
        capsys.readouterr().err)
    (resumed,) = set((tmp_path / "runs").iterdir()) - {whole}
    assert list(losses(resumed)) == [3, 4]
    assert losses(resumed) == {k: v for k, v in losses(whole).items() if k > 2}
    assert len(set(losses(whole).values())) == 4  # the steps' data (and losses) differ
