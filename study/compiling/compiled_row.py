"""A run's step compiled for its GPUs on compile-only devices, as the trainer's `Program` builds
it, beside the full-scale static plan and the run's placement list checked on it (host buffers,
addressing)."""

import dataclasses
import functools
from functools import partial

import jax

from offload.optimizer_state import HOST, moment_bytes
from runtime.own_program import CompiledMemory
from runtime.setup import Setup
from study.plan import memory_plan
from study.hardware.compile_only import ARRIVAL, DEVICELESS, compile_only, kernel_checks
from study.hardware.gpus import Gpu
from study.plan.traced_step import traced_step
from trainer.program import Program
from trainer.step import train_step
from trainer.target import Target


@dataclasses.dataclass
class CompiledRow:
    """The compiled step; the plan and the placement list are traced when first asked for.
    `arrived`: bytes of host optimizer state the compile-only program takes as device
    arguments (on a GPU they arrive in host memory)."""
    setup: Setup
    gpu: Gpu
    program: Program
    compiled: jax.stages.Compiled
    arrived: int = 0

    @functools.cached_property
    def hlo(self) -> str:  # (printing a full-width module takes seconds: once)
        return self.compiled.as_text()

    @property
    def mesh(self):
        return self.program.mesh

    def compiled_memory(self) -> CompiledMemory:
        """XLA's memory of the compiled step, the arrived state off its device arguments."""
        compiled = CompiledMemory.of(self.compiled)
        return dataclasses.replace(compiled, arguments=compiled.arguments - self.arrived)

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


def arriving(step_function):
    """The step, its optimizer state's moments first moved to host memory (in ARRIVAL).
    It takes the moments apart from the donated parameters and returns the new parameters
    first: JAX pairs a donated input with the first output of its shape, and without memory
    kinds a new moment (in host memory) looks like a parameter."""
    def step(state, opt_state, batch):
        with jax.named_scope(ARRIVAL):
            moments = jax.tree.map(lambda x: jax.device_put(x, HOST) if x.ndim else x,
                                   opt_state)
        new, metrics = step_function({**state, "opt_state": moments}, batch)
        return (new["params"], new["step"]), new["opt_state"], metrics
    return step


def compile_row(setup: Setup, gpu: Gpu, target: Target | None = None) -> CompiledRow:
    """`setup`'s step compiled as a run on `gpu`s would (one `target` for several rows)."""
    target = target or compile_only(gpu, setup.run.mesh.devices)
    program = Program(setup.model, setup.run, setup.placement, target)
    if setup.run.optimizer_state == "host":
        with kernel_checks(target):
            shapes = dict(program.state_shapes)
            opt_state = shapes.pop("opt_state")
            step = partial(train_step, model=program.model, run=program.run,
                           options=program.options)
            traced = jax.jit(arriving(step), donate_argnums=0).trace(
                shapes, opt_state, program.batch_shape)
            compiled = program.compile(traced, DEVICELESS)
        return CompiledRow(setup, gpu, program, compiled,
                           moment_bytes(program.state_shapes["opt_state"]))
    with kernel_checks(target):
        program.step = program.compile(program.traced, DEVICELESS)  # the run's own, compiled
    return CompiledRow(setup, gpu, program, program.step)
