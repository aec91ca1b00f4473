"""A run's step compiled for its GPUs on compile-only devices, as the trainer's `Program` builds
it, beside the full-scale static plan and the run's placement list checked on it (host buffers,
addressing)."""

import dataclasses
import functools

import jax

from offload.state import in_host_memory
from runtime.own_program import CompiledMemory, size_words
from runtime.setup import Setup
from study.plan import memory_plan
from study.hardware.compile_only import DEVICELESS, compile_only, kernel_checks
from study.hardware.gpus import Gpu
from study.plan.traced_step import traced_step
from study.programs import offload_proof
from trainer.program import Program
from trainer.target import Target


@dataclasses.dataclass
class CompiledRow:
    """The compiled step; the plan and the placement list are traced when first asked for."""
    setup: Setup
    gpu: Gpu
    program: Program
    compiled: jax.stages.Compiled

    @functools.cached_property
    def hlo(self) -> str:  # (printing a full-width module takes seconds: once)
        return self.compiled.as_text()

    @property
    def mesh(self):
        return self.program.mesh

    def compiled_memory(self) -> CompiledMemory:
        return CompiledMemory.of(self.compiled)

    @functools.cached_property
    def _mesh_shape(self) -> tuple[int, ...]:
        return self.setup.run.mesh.shape(len(self.program.target.devices))

    @property
    def _is_full_scale(self) -> bool:
        full = self.setup.experiment
        return (full.model, full.run, full.run.mesh.shape(full.run.mesh.devices)) == (
            self.setup.model, self.setup.run, self._mesh_shape)

    @functools.cached_property
    def full_plan(self) -> memory_plan.MemoryPlan:
        """The experiment's full-scale static plan (with this compiled placement if full-scale)."""
        hlo = self.hlo if self._is_full_scale else None
        return memory_plan.full_scale(self.setup.experiment, self.gpu, self.setup.placement, hlo)

    @functools.cached_property
    def run_tags(self) -> list[memory_plan.TagLine]:
        """This run's placement list, checked on its compiled program."""
        if self._is_full_scale:
            return self.full_plan.tags
        step = traced_step(self.setup.model, self.setup.run, self._mesh_shape)
        return memory_plan.tag_lines(step, self.setup.placement, self.hlo)

    @functools.cached_property
    def host_weights(self) -> list[offload_proof.LayerWeight]:
        """parameters=host: each layer scan's stacked weights, per device, with the compiled
        program's host buffers of them and of their gradients (none otherwise)."""
        on_host = jax.tree.map(in_host_memory, self.program.state_shapes["params"])
        stacked = {scan: {jax.tree_util.keystr(path, simple=True, separator="/"): (
                              tuple(x.sharding.shard_shape(x.shape)), str(x.dtype))
                          for path, x in jax.tree_util.tree_leaves_with_path(params)}
                   for scan, params in self.program.state_shapes["params"].items()
                   if all(jax.tree.leaves(on_host[scan]))}
        return offload_proof.compiled_layer_weights(self.hlo, stacked) if stacked else []


def compile_row(setup: Setup, gpu: Gpu, target: Target | None = None) -> CompiledRow:
    """`setup`'s step compiled as a run on `gpu`s would (one `target` for several rows): the
    run's own program, its host state taken as host arguments."""
    target = target or compile_only(gpu, setup.run.mesh.devices)
    program = Program(setup.model, setup.run, setup.placement, target)
    with kernel_checks(target):
        program.step = program.compile(program.traced, DEVICELESS)
    return CompiledRow(setup, gpu, program, program.step)


def host_weight_lines(weights: list[offload_proof.LayerWeight]) -> list[str]:
    """parameters=host: per layer scan, each stacked weight and where the compiled program
    keeps it and its gradient, as the placement list prints the offloaded activations."""
    if not weights:
        return []
    out = [f"{'scan':<13}{'weight':<20}{'stacked, per device':<26}{'bytes':>9}  compiled GPU "
           "program (XLA): the weights; their gradients"]
    for w in weights:
        shape = "x".join(map(str, w.shape)) + f" {w.dtype}"
        out.append(f"{w.scan:<13}{w.name:<20}{shape:<26}"
                   f"{size_words(w.nbytes):>9}  {_where(w.weights)}; {_where(w.gradient)}")
    for scan in dict.fromkeys(w.scan for w in weights):
        held = sum(w.nbytes for w in weights if w.scan == scan and w.weights)
        grads = sum(w.nbytes for w in weights if w.scan == scan and w.gradient)
        out.append(f"in host memory ({scan}): weights {size_words(held)}, gradients "
                   f"{size_words(grads)}, fetched and written a layer at a time")
    return out + [f"{w.scan} {w.name}: {what} addressing {proof.verdict}: {proof.detail}"
                  for w in weights for what, proof in (("weights", w.weights),
                                                       ("gradient", w.gradient))
                  if proof is not None and not proof.holds]


def _where(proof) -> str:
    if proof is None:
        return "NOT IN HOST MEMORY"
    return f"pinned host S(5), {proof.summary}"
