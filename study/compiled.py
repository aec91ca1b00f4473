"""A run's step compiled for its GPUs on compile-only devices, through the trainer's own `build`
(runtime/setup.py), beside the experiment's full-scale static plan and this run's placement
list checked on the compiled program (host buffers, addressing)."""

import dataclasses

from runtime import setup as runtime_setup
from study import memory, plan
from study.compile_only import DEVICELESS, compile_only, kernel_checks
from study.gpus import GPUS, Gpu
from study.traced_step import TracedStep
from trainer.target import Target


@dataclasses.dataclass
class CompiledRow:
    setup: runtime_setup.Setup
    gpu: Gpu
    built: runtime_setup.Built
    full_plan: memory.MemoryPlan  # the experiment's full-scale static plan
    run_tags: list[memory.TagLine]  # this run's placement list, checked on its program

    @property
    def hlo(self) -> str:
        return self.built.compiled.as_text()

    @property
    def compiled(self):
        return self.built.compiled

    @property
    def mesh(self):
        return self.built.mesh

    def compiled_memory(self):
        return self.built.compiled_memory()


def compile_row(setup: runtime_setup.Setup, target: Target | None = None) -> CompiledRow:
    """`setup`'s step compiled for its `device`'s GPUs (`target`, made once and shared by
    the caller when it compiles several), as a run on them would compile it."""
    gpu = GPUS[setup.run.device]
    target = target or compile_only(gpu, setup.run.mesh.devices)
    with kernel_checks(target):
        built = runtime_setup.build(setup, target, extra_options=DEVICELESS)
    hlo, full, run = built.compiled.as_text(), setup.experiment, setup.run
    mesh_shape = run.mesh.shape(len(target.devices))
    if (full.model, full.run, full.run.mesh.shape(full.run.mesh.devices)) == (
            setup.model, run, mesh_shape):  # this run is the full-scale one: plan it once
        full_plan = plan.full_scale(full, setup.placement, hlo)
        return CompiledRow(setup, gpu, built, full_plan, full_plan.tags)
    run_tags = memory.tag_lines(TracedStep(setup.model, run, mesh_shape), setup.placement, hlo)
    return CompiledRow(setup, gpu, built, plan.full_scale(full, setup.placement), run_tags)
