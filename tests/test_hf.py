"""Hugging Face checkpoints: imported a slice at a time (any sharding reads exactly the whole
import; FP8 blocks dequantized across 128x128 scale blocks; transformers' fused expert layout)
and exported so that the import reads every fixture back bit for bit."""

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import FIXTURES
from hf.load import load_checkpoint, open_checkpoint
from hf.safetensors import Reader, dequantize_fp8
from hf.save import write_checkpoint
from model import families
from model.params import param_shardings
from model.sharding import AxisRules, make_mesh

HF_FIXTURES = sorted(p.parent for p in FIXTURES.glob("*/config.json"))


def whole_and_sharded(directory, rules_of_mesh):
    """(every parameter read whole, the same parameters read as the shards of `rules`)."""
    cfg, checkpoint = open_checkpoint(directory)
    mesh = make_mesh((2, 4), ("data", "fsdp"))
    specs = families.of(cfg).param_specs(cfg)
    shardings = param_shardings(specs, rules_of_mesh(mesh))
    sharded = checkpoint.arrays(shardings, np.float32)
    return checkpoint.read(), jax.tree.map(np.asarray, sharded)


# Every head, MLP, latent and expert axis split somewhere: reads that cut through the heads HF
# keeps in one axis (head_dim), through fused gate/up rows (mlp), and across layers' files.
RULES = {
    "embed and head_dim": lambda mesh: AxisRules(embed="data", head_dim="fsdp",
                                                         mlp="fsdp", experts=None,
                                                         expert_embed="data", lora=None,
                                                         mesh=mesh),
    "heads and experts": lambda mesh: AxisRules(embed=None, heads="data", kv_heads="data",
                                                        lora="fsdp", experts="data",
                                                        expert_embed="fsdp", mesh=mesh),
}


@pytest.mark.parametrize("rules", RULES.values(), ids=RULES.keys())
@pytest.mark.parametrize("fixture", ["llama_sharded", "deepseek_yarn"])
def test_any_sharding_reads_exactly_the_whole_import(fixture, rules):
    whole, sharded = whole_and_sharded(FIXTURES / fixture, rules)
    jax.tree.map(np.testing.assert_array_equal, sharded, whole)


def test_fp8_slices_across_scale_blocks(tmp_path):
    rng = np.random.default_rng(3)
    weight = rng.normal(size=(300, 200)).astype(ml_dtypes.float8_e4m3fn)
    scale_inv = rng.uniform(0.5, 2, size=(3, 2)).astype(np.float32)
    save_file({"w": weight, "w_scale_inv": scale_inv}, tmp_path / "model.safetensors")
    rows, cols = np.arange(300)[:, None], np.arange(200)[None, :]
    expected = weight.astype(np.float32) * scale_inv[rows // 128, cols // 128]
    reader = Reader(tmp_path)
    for index in [(slice(0, 300), slice(0, 200)), (slice(100, 260), slice(127, 129)),
                  (slice(299, 300), slice(0, 1)), (slice(128, 256), slice(128, 200))]:
        before = reader.bytes_read
        np.testing.assert_array_equal(reader.read("w", index), expected[index])
        # the weight's bytes (1 each) and the float32 scales of the blocks it touches
        blocks = [range(s.start // 128, (s.stop - 1) // 128 + 1) for s in index]
        size = np.prod([s.stop - s.start for s in index])
        assert reader.bytes_read - before == size + 4 * len(blocks[0]) * len(blocks[1])


def test_fp8_block_dequantization_follows_128_blocks():
    rng = np.random.default_rng(2)
    weight = rng.normal(size=(300, 200)).astype(ml_dtypes.float8_e4m3fn)
    scale_inv = rng.uniform(0.5, 2, size=(3, 2)).astype(np.float32)
    got = dequantize_fp8(weight, scale_inv)
    for i, j in [(0, 0), (127, 127), (128, 0), (299, 199), (200, 130)]:
        assert got[i, j] == np.float32(weight[i, j]) * scale_inv[i // 128, j // 128]


def test_an_fp8_checkpoint_loads_dequantized(tmp_path):
    source = FIXTURES / "deepseek_yarn"
    shutil.copy(f"{source}/config.json", tmp_path / "config.json")
    tensors = load_file(f"{source}/model.safetensors")
    name = "model.layers.1.self_attn.q_b_proj.weight"
    fp8 = tensors[name].astype(ml_dtypes.float8_e4m3fn)
    tensors[name] = fp8
    tensors[name + "_scale_inv"] = np.array([[0.5]], np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    cfg, params = load_checkpoint(tmp_path)
    q_b = params["moe_layers"]["wq_b"][0].reshape(cfg.q_lora_rank, -1)
    np.testing.assert_array_equal(q_b, fp8.astype(np.float32).T * 0.5)


def test_fused_experts_read_as_the_unfused_ones(tmp_path):
    """transformers' in-memory layout, experts.gate_up_proj [E, 2F, D] and down_proj
    [E, D, F], saved from the unfused fixture, reads (whole and sharded) as the fixture."""
    source = FIXTURES / "deepseek_halfrot"
    config = json.loads(open(f"{source}/config.json").read())
    tensors = {}
    for name in json.loads(open(f"{source}/model.safetensors.index.json").read())[
            "weight_map"].values():
        tensors.update(load_file(f"{source}/{name}"))
    for layer in range(config["first_k_dense_replace"], config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts."
        experts = range(config["n_routed_experts"])
        fused = {p: np.stack([tensors.pop(f"{prefix}{e}.{p}.weight") for e in experts])
                 for p in ("gate_proj", "up_proj", "down_proj")}
        tensors[prefix + "gate_up_proj"] = np.concatenate(
            [fused["gate_proj"], fused["up_proj"]], axis=1)
        tensors[prefix + "down_proj"] = fused["down_proj"]
    save_file(tensors, tmp_path / "model.safetensors")
    shutil.copy(f"{source}/config.json", tmp_path / "config.json")
    unfused, _ = whole_and_sharded(source, RULES["embed and head_dim"])
    experts_split = lambda mesh: AxisRules(  # noqa: E731  (its 3 heads cannot split)
        embed="data", experts="data", expert_embed=None, mlp="fsdp", mesh=mesh)
    for rules in (RULES["embed and head_dim"], experts_split):
        whole, sharded = whole_and_sharded(tmp_path, rules)
        jax.tree.map(np.testing.assert_array_equal, whole, unfused)
        jax.tree.map(np.testing.assert_array_equal, sharded, unfused)


@pytest.mark.parametrize("fixture", HF_FIXTURES, ids=[p.name for p in HF_FIXTURES])
def test_export_round_trips_the_hf_fixtures(fixture, tmp_path):
    model, params = load_checkpoint(fixture)
    files = write_checkpoint(tmp_path, model, params, shard_bytes=200_000)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    again, read = load_checkpoint(tmp_path)
    assert again == model
    jax.tree.map(np.testing.assert_array_equal, read, params)
