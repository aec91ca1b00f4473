"""Our params -> a Hugging Face checkpoint (config.json + safetensors): hf/load.py reversed, the
routed experts one tensor per expert as the released DeepSeek-V3 has them (docs/checkpoints.md)."""

import json
import math
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from hf.config import to_hf
from hf.names import HfTensor, tensors
from model import families
from model.params import ParamSpec

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def _hf_layout(array: np.ndarray, hf: HfTensor) -> np.ndarray:
    """A linear layer's [*in, *out] weight as HF's [out, in]; any other tensor as it is."""
    return array.reshape(math.prod(array.shape[:hf.n_in]), -1).T if hf.linear else array


def hf_tensors(params: dict, cfg) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array in HF's layout) for every weight, layer by layer, by the family's table."""
    specs, names = families.of(cfg).param_specs(cfg), tensors(cfg)
    for key, spec in specs.items():
        if isinstance(spec, ParamSpec):
            yield names[key].name, _hf_layout(np.asarray(params[key]), names[key])
            continue
        for layer in range(next(iter(spec.values())).shape[0]):
            for name, one in spec.items():
                hf, value = names[key][name], np.asarray(params[key][name])[layer]
                for e in range(value.shape[0]) if one.axes[1] == "experts" else [None]:
                    yield (hf.name.format(layer=layer + hf.first_layer, expert=e),
                           _hf_layout(value if e is None else value[e], hf))


def write_checkpoint(directory: Path, cfg, params: dict,
                     dtype: str = "float32", shard_bytes: int = 5 * 2**30) -> list[Path]:
    """config.json and the weights, each file written once full, so memory holds one at a time."""
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
    paths = [path.rename(directory / f"model-{k:05d}-of-{len(shards):05d}.safetensors")
             for k, (path, _, _) in enumerate(shards, start=1)]
    weight_map = {name: final.name for final, (_, names, _) in zip(paths, shards) for name in names}
    index = {"metadata": {"total_size": sum(n for *_, n in shards)}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return paths
