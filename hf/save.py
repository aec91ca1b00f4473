"""Our params -> a Hugging Face checkpoint (config.json + safetensors): hf/load.py reversed.

Routed experts are written one tensor per expert (`experts.{e}.gate_proj.weight`), the layout
of the released DeepSeek-V3 checkpoint, which transformers converts on load. Big models are
split into files of at most `shard_bytes`, with the index transformers reads.
"""

import json
import math
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from hf.config import to_hf
from model import families
from model.common import HfTensor, ParamSpec

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def _linear(weight: np.ndarray, n_in: int) -> np.ndarray:
    """Our [*in, *out] weight as HF's [out, in]: the first `n_in` axes are the input."""
    return weight.reshape(math.prod(weight.shape[:n_in]), -1).T


def _entries(value: np.ndarray, spec: ParamSpec, hf: HfTensor, layer: int | None):
    """(HF name, array) of one parameter, of one layer of it when stacked."""
    if layer is None:
        yield hf.name, (_linear(value, hf.n_in) if hf.linear else value)
        return
    for e in range(value.shape[1]) if spec.axes[1] == "experts" else [None]:
        array = value[layer] if e is None else value[layer, e]
        name = hf.name.format(layer=layer + hf.first_layer, expert=e)
        yield name, (_linear(array, hf.n_in) if hf.linear else array)


def hf_tensors(params: dict, cfg) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array in HF's layout) for every weight, layer by layer, by the family's table."""
    family = families.of(cfg)
    specs, names = family.param_specs(cfg), family.hf_tensors(cfg)
    for key, spec in specs.items():
        if isinstance(spec, ParamSpec):
            yield from _entries(np.asarray(params[key]), spec, names[key], None)
            continue
        for layer in range(next(iter(spec.values())).shape[0]):
            for name, one in spec.items():
                yield from _entries(np.asarray(params[key][name]), one, names[key][name], layer)


def write_checkpoint(directory: Path, cfg, params: dict,
                     dtype: str = "float32", shard_bytes: int = 5 * 2**30) -> list[Path]:
    """config.json and the weights, one file or `model-0000k-of-0000n` files and their index.
    Files are written as each fills, so host memory holds the parameters and one file."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(to_hf(cfg, dtype), indent=2))
    shards, current, size = [], {}, 0
    for name, array in hf_tensors(params, cfg):
        array = np.ascontiguousarray(np.asarray(array).astype(DTYPES[dtype]))
        if current and size + array.nbytes > shard_bytes:
            shards.append(_flush(directory, current, len(shards)))
            current, size = {}, 0
        current[name], size = array, size + array.nbytes
    shards.append(_flush(directory, current, len(shards)))
    return _name_shards(directory, shards)


def _flush(directory: Path, tensors: dict, index: int) -> tuple[Path, list[str], int]:
    path = directory / f"part-{index:05d}.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, list(tensors), sum(a.nbytes for a in tensors.values())


def _name_shards(directory: Path, shards: list) -> list[Path]:
    """Rename the parts as transformers expects, once their number is known."""
    if len(shards) == 1:
        return [shards[0][0].rename(directory / "model.safetensors")]
    paths, weight_map = [], {}
    for k, (path, names, _) in enumerate(shards, start=1):
        final = directory / f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        paths.append(path.rename(final))
        weight_map.update(dict.fromkeys(names, final.name))
    index = {"metadata": {"total_size": sum(n for *_, n in shards)}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return paths
