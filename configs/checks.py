"""A run checked whole before anything is traced, each mistake one line. No JAX import."""

import functools

from configs.settings import XLA_FLAG_TYPES, ModelConfig, Range, RunConfig, declared, xla_flag_value
from model.config import DeepSeekConfig

RANGES = {key: m["allowed"] for key, m in declared() if isinstance(m["allowed"], Range)}
CHOICES = {key: m["allowed"] for key, m in declared() if isinstance(m["allowed"], tuple)}


def out_of_range(model: ModelConfig, run: RunConfig) -> list[str]:
    """The model's own problems (its numbers' ranges, then their combinations); a line for each
    run field out of its declared range (`router_bias_rate=-0.01 must be >= 0`)."""
    return [*model.problems(), *(f"{key}={value!r} must be {allowed}"
                                 for key, allowed in RANGES.items()
                                 if (value := _value(run, key)) not in allowed)]


def problems(model: ModelConfig, run: RunConfig, n_devices: int) -> list[str]:
    """Every impossible combination for this many devices, one line each."""
    found = out_of_range(model, run)
    mesh, (data, fsdp, expert) = run.mesh, run.mesh.shape(n_devices)
    for key, choices in CHOICES.items():
        if (value := _value(run, key)) not in choices:
            found.append(f"{key}={value!r}: choose one of {', '.join(choices)}")
    if run.loss_chunks >= 1 and run.seq % run.loss_chunks:
        found.append(f"seq={run.seq} is not divisible into loss_chunks={run.loss_chunks}")
    fp4_backward = run.quant == "nvfp4" and run.quant_backward == "fp4"
    if fp4_backward and run.quant_tiles != "16x16":
        found.append("quant_backward=fp4 reuses the forward's quantized weights transposed, which "
                     f"needs quant_tiles=16x16 (got {run.quant_tiles}; or quant_backward=bf16)")
    elif fp4_backward and run.seq % 16:
        found.append("quant_backward=fp4 quantizes the weight gradient's operands in blocks of "
                     f"16 tokens: seq={run.seq} must be a multiple of 16")
    if 0 < model.max_position < run.seq:  # (out of its range: the model says so)
        found.append(f"seq={run.seq} is longer than the RoPE table allows "
                     f"(model.max_position={model.max_position})")
    axes_in_range = not any(line.startswith("mesh.") for line in found)  # (else said above)
    if axes_in_range and (fsdp < 1 or data * fsdp * expert != n_devices):
        found.append(f"mesh data={mesh.data} x fsdp={mesh.fsdp} x expert={mesh.expert} does "
                     f"not cover the {n_devices} devices")
    elif axes_in_range and run.batch(n_devices) % n_devices:
        found.append(f"global_batch={run.batch(n_devices)} is not divisible over the "
                     f"{n_devices} devices")
    found += _expert_problems(model, run, fsdp)
    found += [f"xla_flags.{flag}: XLA flag names start with xla_"
              for flag in run.xla_flags if not flag.startswith("xla_")]
    words = {bool: "true or false", int: "a whole number"}
    found += [f"xla_flags.{flag}={text!r}: expected {words[XLA_FLAG_TYPES[flag]]}"
              for flag, text in run.xla_flags.items()
              if flag in XLA_FLAG_TYPES and type(xla_flag_value(text)) is not XLA_FLAG_TYPES[flag]]
    if not run.out_dir:  # (an unset shell variable): not the current folder
        found.append("out_dir='': name the folder a run's folder goes in (runs by default)")
    return found


def _expert_problems(model: ModelConfig, run: RunConfig, fsdp: int) -> list[str]:
    expert = run.mesh.expert
    if expert < 1 or fsdp < 1 or (isinstance(model, DeepSeekConfig) and model.n_experts < 1):
        return []  # out of a range, or the mesh does not cover the devices: said elsewhere
    if not isinstance(model, DeepSeekConfig):
        return [] if expert == 1 else [f"mesh.expert={expert}: this model has no routed "
                                       "experts to split (only DeepSeek does)"]
    if model.n_experts % expert:
        return [f"mesh.expert={expert} does not divide the model's n_experts={model.n_experts}"]
    if model.n_experts % (fsdp * expert):
        return [f"model.n_experts={model.n_experts} is not divisible over the fsdp x expert = "
                f"{fsdp * expert} devices the routed experts are sharded over"]
    return []


def _value(config, key: str):
    return functools.reduce(getattr, key.split("."), config)  # the field at a dotted key
