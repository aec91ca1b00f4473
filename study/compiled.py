"""A run's step compiled for its GPUs on compile-only devices by the trainer's `build`, beside the
full-scale static plan and the run's placement list checked on it (host buffers, addressing)."""

import dataclasses
import functools

from runtime import setup as runtime_setup
from study import memory, plan
from study.compile_only import DEVICELESS, compile_only, kernel_checks
from study.gpus import GPUS, Gpu
from study.traced_step import TracedStep
from trainer.target import Target


@dataclasses.dataclass
class CompiledRow:
    """The compiled step; the plan and the placement list are traced when first asked for."""
    setup: runtime_setup.Setup
    gpu: Gpu
    built: runtime_setup.Built

    @functools.cached_property
    def hlo(self) -> str:  # (printing a full-width module takes seconds: once)
        return self.built.compiled.as_text()

    @property
    def compiled(self):
        return self.built.compiled

    @property
    def mesh(self):
        return self.built.mesh

    def compiled_memory(self):
        return self.built.compiled_memory()

    @functools.cached_property
    def _mesh_shape(self) -> tuple[int, ...]:
        return self.setup.run.mesh.shape(len(self.built.target.devices))

    @property
    def _is_full_scale(self) -> bool:
        full = self.setup.experiment
        return (full.model, full.run, full.run.mesh.shape(full.run.mesh.devices)) == (
            self.setup.model, self.setup.run, self._mesh_shape)

    @functools.cached_property
    def full_plan(self) -> memory.MemoryPlan:
        """The experiment's full-scale static plan (with this compiled placement if full-scale)."""
        hlo = self.hlo if self._is_full_scale else None
        return plan.full_scale(self.setup.experiment, self.setup.placement, hlo)

    @functools.cached_property
    def run_tags(self) -> list[memory.TagLine]:
        """This run's placement list, checked on its compiled program."""
        if self._is_full_scale:
            return self.full_plan.tags
        step = TracedStep(self.setup.model, self.setup.run, self._mesh_shape)
        return memory.tag_lines(step, self.setup.placement, self.hlo)


def compile_row(setup: runtime_setup.Setup, target: Target | None = None) -> CompiledRow:
    """`setup`'s step compiled as a run on its `device`'s GPUs would (one `target` for several)."""
    gpu = GPUS[setup.run.device]
    target = target or compile_only(gpu, setup.run.mesh.devices)
    with kernel_checks(target):
        built = runtime_setup.build(setup, target, extra_options=DEVICELESS)
    return CompiledRow(setup, gpu, built)
