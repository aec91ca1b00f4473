"""Hugging Face checkpoints (Llama, DeepSeek-V3) -> (model config, params): each of our parameters
is a `Source` built from its family's table in hf/names.py, read whole (one process) or only in
the slices this process's devices hold (multi-host)."""

import dataclasses
import functools
import itertools
import math
from pathlib import Path

import jax
import numpy as np

from hf import config as hf_config
from hf.safetensors import CheckpointError, Reader, read_json, unit_slices
from hf.names import HfTensor, tensors
from model import families
from model.params import ParamSpec


@dataclasses.dataclass(frozen=True)
class Source:
    """One of our parameters as Hugging Face tensors, read a slice at a time. `names` holds the HF
    tensor of each stacked entry (layers, then experts): its shape leads `shape`. With `n_in`, a
    linear one as HfTensor says (hf/names.py), after `batch` leading axes (a fused expert axis),
    its out axis from row `first_row` (the up half of a fused gate and up)."""
    names: np.ndarray
    shape: tuple[int, ...]
    n_in: int | None = None
    batch: int = 0
    first_row: int = 0

    def read(self, reader: Reader, index: tuple[slice, ...] = ()) -> np.ndarray:
        """self[index] as float32, reading only that slice (and, where ours splits heads out of
        one HF axis and a slice cuts through an inner one, whole rows of the outer one)."""
        index = unit_slices(index, self.shape)
        names = self.names[(*index[:self.names.ndim], Ellipsis)]
        parts = [self._read_one(reader, name, index[self.names.ndim:]) for name in names.flat]
        return np.stack(parts).reshape(names.shape + parts[0].shape)

    def _read_one(self, reader: Reader, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if self.n_in is None:
            return reader.read(name, index)
        b, i = self.batch, self.batch + self.n_in
        dims = self.shape[self.names.ndim:]
        cols, rows = _covering(index[b:i], dims[b:i]), _covering(index[i:], dims[i:])
        rows = slice(rows.start + self.first_row, rows.stop + self.first_row)
        x = np.swapaxes(reader.read(name, (*index[:b], rows, cols)), -1, -2)
        x = x.reshape(*x.shape[:b], index[b].stop - index[b].start, *dims[b + 1:i],
                      index[i].stop - index[i].start, *dims[i + 1:])
        whole = (slice(None),)
        return x[whole * (b + 1) + index[b + 1:i] + whole + index[i + 1:]]


def _covering(index: tuple[slice, ...], dims: tuple[int, ...]) -> slice:
    """The range of one axis of size prod(dims) that, split into `dims`, covers `index`:
    whole inner axes of the outer axis's slice."""
    inner = math.prod(dims[1:])
    return slice(index[0].start * inner, index[0].stop * inner)


def _source(reader: Reader, spec: ParamSpec, hf: HfTensor) -> Source:
    """Where `spec` lies in the checkpoint, by its family's table; shapes checked."""
    fused = hf.fused and hf.fused[0].format(layer=hf.first_layer) in reader
    n = next(i for i, axis in enumerate((*spec.axes, None)) if axis not in ("layers", "experts"))
    stacked = spec.shape[:1 if fused else n]  # layers, experts (fused: in each layer's tensor)
    names = np.empty(stacked, object)
    for index in itertools.product(*map(range, stacked)):
        layer, expert = (*index, 0, 0)[:2]
        name = (hf.fused[0] if fused else hf.name).format(layer=layer + hf.first_layer,
                                                         expert=expert)
        if name not in reader and hf.tied in reader:
            name = hf.tied
        if name not in reader:
            raise CheckpointError(f"checkpoint lacks tensor {name!r}")
        names[index] = name
    ours, batch, blocks = spec.shape[len(stacked):], int(bool(fused)), hf.fused[2] if fused else 1
    ins, outs = ours[batch:batch + hf.n_in], ours[batch + hf.n_in:]
    expected = (*ours[:batch], blocks * math.prod(outs), math.prod(ins)) if hf.linear else ours
    for name in set(names.flat):
        if reader.shapes[name] != expected:
            raise CheckpointError(f"{name}: shape {reader.shapes[name]} does not fit config.json "
                                  f"({expected})")
    if not hf.linear:
        return Source(names, spec.shape)
    return Source(names, spec.shape, hf.n_in, batch,
                  (hf.fused[1] if fused else 0) * math.prod(outs))


def _is_source(x) -> bool:
    return isinstance(x, Source)


@dataclasses.dataclass
class Checkpoint:
    """A checkpoint's parameters before any is read: `sources` has the param tree's shape."""
    reader: Reader
    sources: dict

    def read(self) -> dict:
        return jax.tree.map(lambda s: s.read(self.reader), self.sources, is_leaf=_is_source)

    def arrays(self, shardings, dtype) -> dict:
        """Every parameter as a jax.Array with its sharding: this process reads only the
        slices its own devices hold, each once (replicated ones are shared by its devices)."""
        def array(source: Source, sharding):
            read = functools.cache(lambda index: source.read(self.reader, index).astype(dtype))
            return jax.make_array_from_callback(
                source.shape, sharding, lambda index: read(unit_slices(index, source.shape)))

        return jax.tree.map(array, self.sources, shardings, is_leaf=_is_source)


def open_checkpoint(directory: str | Path):
    """(config, Checkpoint) of a Hugging Face checkpoint directory; no weights read yet, only
    config.json and the tensors' names and shapes (checked against it)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    hf = read_json(directory / "config.json")
    if not isinstance(hf, dict):
        raise CheckpointError(f"{directory}/config.json: not a JSON object")
    try:
        cfg = hf_config.from_hf(hf)
    except CheckpointError:
        raise
    except KeyError as e:
        raise CheckpointError(f"{directory}/config.json lacks {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{directory}/config.json: a value of the wrong type ({e})") from None
    if problems := cfg.problems():
        raise CheckpointError(f"{directory}/config.json: {problems[0]}")
    reader = Reader(directory)
    sources = jax.tree.map(functools.partial(_source, reader), families.of(cfg).param_specs(cfg),
                           tensors(cfg), is_leaf=lambda x: isinstance(x, ParamSpec))
    return cfg, Checkpoint(reader, sources)


def load_checkpoint(directory: str | Path):
    """(config, fp32 numpy params) from a Hugging Face checkpoint directory, read whole."""
    cfg, checkpoint = open_checkpoint(directory)
    return cfg, checkpoint.read()
