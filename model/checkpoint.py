"""Read a safetensors checkpoint directory (one file or a sharded index) into numpy arrays.

Block-scaled FP8 weights (DeepSeek-V3's release: float8_e4m3fn with a `weight_scale_inv` per
128x128 block) are dequantized on read, so converters only ever see float arrays.
"""

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

FP8_BLOCK = 128


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or not a model this code can run."""


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map")
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"{directory}: neither model.safetensors nor an index file")
    return [single]


def _read_file(file: Path) -> dict[str, np.ndarray]:
    tensors, fp8 = {}, []
    with safe_open(file, framework="numpy") as f:
        for name in f.keys():
            try:
                tensors[name] = f.get_tensor(name)
            except AttributeError:  # safetensors 0.8 has no numpy FP8 dtype
                fp8.append(name)
    return {**tensors, **_read_fp8(file, fp8)} if fp8 else tensors


def _read_fp8(file: Path, names: list[str]) -> dict[str, np.ndarray]:
    """FP8 E4M3 tensors straight from the file's layout (8-byte header size, JSON header,
    data), viewed with ml_dtypes' float8_e4m3fn."""
    data = np.memmap(file, dtype=np.uint8, mode="r")
    header_size = int(data[:8].view("<u8")[0])
    header = json.loads(bytes(data[8:8 + header_size]))
    found = {}
    for name in names:
        entry = header[name]
        if entry["dtype"] != "F8_E4M3":
            raise CheckpointError(f"{file}: {name} has dtype {entry['dtype']}, not readable")
        begin, end = (8 + header_size + offset for offset in entry["data_offsets"])
        found[name] = np.array(data[begin:end]).view(ml_dtypes.float8_e4m3fn).reshape(
            entry["shape"])
    return found


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """weight [out, in] in FP8 times its per-block scale [ceil(out/128), ceil(in/128)]."""
    rows, cols = weight.shape
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), FP8_BLOCK, 0), FP8_BLOCK, 1)
    return weight.astype(np.float32) * scale[:rows, :cols]


def read_tensors(directory: Path) -> dict[str, np.ndarray]:
    tensors = {}
    for file in _safetensors_files(directory):
        try:
            tensors.update(_read_file(file))
        except FileNotFoundError:
            raise CheckpointError(f"{file}: no such file (named by the index)") from None
        except Exception as e:  # safetensors raises its own types for truncated/corrupt files
            raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from None
    for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        weight = name.removesuffix("_scale_inv")
        if weight not in tensors:
            raise CheckpointError(f"{name} scales a tensor the checkpoint does not have")
        tensors[weight] = dequantize_fp8(tensors[weight], tensors.pop(name))
    return tensors


def check_shapes(params: dict, specs: dict) -> None:
    flat = [("", params, specs)]
    while flat:
        path, p, s = flat.pop()
        if isinstance(s, dict):
            if missing := [k for k in s if k not in p]:
                raise CheckpointError(f"{path or '/'}: the checkpoint has no {missing[0]!r}")
            flat += [(f"{path}/{k}", p[k], s[k]) for k in s]
        elif p.shape != s.shape:
            raise CheckpointError(f"{path}: shape {p.shape} in the checkpoint, {s.shape} expected")
