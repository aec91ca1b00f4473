"""Read a safetensors checkpoint directory (one file or a sharded index) a slice at a time, so
each process of a multi-host run reads about its own share. Block-scaled FP8 weights (DeepSeek-V3's
release: a `weight_scale_inv` per 128x128 block) are dequantized on read: converters see floats."""

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

FP8_BLOCK = 128
SCALE_SUFFIX = "_scale_inv"


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


def unit_slices(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """`index` (a unit-step slice per axis, or () for all) with its bounds resolved: one
    range, however written, is one key."""
    return tuple(slice(*s.indices(n)[:2])
                 for s, n in zip(index or [slice(None)] * len(shape), shape))


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, origin=(0, 0)) -> np.ndarray:
    """weight [out, in] in FP8 times its per-block scales. `weight` may be a slice of a
    tensor starting at row and column `origin`; `scale_inv` then holds the blocks from
    (origin // 128) on, [ceil(out/128), ceil(in/128)] for a whole tensor."""
    rows, cols = weight.shape
    top, left = origin[0] % FP8_BLOCK, origin[1] % FP8_BLOCK
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), FP8_BLOCK, 0), FP8_BLOCK, 1)
    return weight.astype(np.float32) * scale[top:top + rows, left:left + cols]


class Reader:
    """A checkpoint directory's tensors, read as float32 slices; `bytes_read`: bytes as stored."""

    def __init__(self, directory: Path):
        self.files, self.shapes, self.dtypes = {}, {}, {}
        for file in _safetensors_files(directory):
            try:
                handle = safe_open(file, framework="numpy")
            except FileNotFoundError:
                raise CheckpointError(f"{file}: no such file (named by the index)") from None
            except Exception as e:  # safetensors raises its own types for truncated/corrupt files
                raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from None
            for name in handle.keys():
                info = handle.get_slice(name)
                self.files[name] = (file, handle)
                self.shapes[name] = tuple(info.get_shape())
                dtype = self.dtypes[name] = info.get_dtype()
                if dtype.startswith("F8") and dtype != "F8_E4M3":
                    raise CheckpointError(f"{file}: {name} has dtype {dtype}, not readable")
        for name in [n for n in self.files if n.endswith(SCALE_SUFFIX)]:
            if name.removesuffix(SCALE_SUFFIX) not in self.files:
                raise CheckpointError(f"{name} scales a tensor the checkpoint does not have")
        self.headers = {}  # file -> (its bytes mapped, where data starts, header): FP8 only
        self.bytes_read = 0

    def __contains__(self, name: str) -> bool:
        return name in self.files and not name.endswith(SCALE_SUFFIX)

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        """tensor[index] as float32; `index`: one unit-step slice per axis, or () for all."""
        index = unit_slices(index, self.shapes[name])
        raw = self._raw(name, index)
        if name + SCALE_SUFFIX not in self.files:
            return np.asarray(raw, np.float32)
        blocks = tuple(slice(s.start // FP8_BLOCK, -(-s.stop // FP8_BLOCK)) for s in index)
        scale = self._raw(name + SCALE_SUFFIX, blocks)
        return dequantize_fp8(raw, scale, (index[0].start, index[1].start))

    def _raw(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        file, handle = self.files[name]
        fp8 = self.dtypes[name] == "F8_E4M3"
        raw = self._fp8(file, name)[index] if fp8 else handle.get_slice(name)[index]
        self.bytes_read += raw.nbytes
        return raw

    def _fp8(self, file: Path, name: str) -> np.ndarray:
        """An FP8 E4M3 tensor (safetensors 0.8 has no numpy FP8 dtype) mapped straight from
        the file's layout (8-byte header size, JSON header, data): indexing reads its slice."""
        if file not in self.headers:
            data = np.memmap(file, dtype=np.uint8, mode="r")
            size = int(data[:8].view("<u8")[0])
            self.headers[file] = (data, 8 + size, json.loads(bytes(data[8:8 + size])))
        data, start, header = self.headers[file]
        begin, end = (start + offset for offset in header[name]["data_offsets"])
        return data[begin:end].view(ml_dtypes.float8_e4m3fn).reshape(self.shapes[name])
