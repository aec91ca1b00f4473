"""What a forward pass depends on besides its parameters and tokens: one value, built once per
program (trainer/program.py) and passed to both families' trunks the same way, so that the
checkpoint policies and axis rules enter the model as arguments (jax-llm-examples keeps its
sharding rules inside one static config the same way)."""

import dataclasses
from collections.abc import Callable

from model.experts import ExpertParallel
from model.quant import Quantization
from model.sharding import AxisRules


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """Hashable (a static argument); the defaults are a plain float32 forward on one device."""
    dtype: str = "float32"  # activations and matmuls; weights are cast per layer
    policies: tuple[tuple[str, Callable], ...] = ()  # (scan, jax.checkpoint policy); none: none
    rules: AxisRules | None = None  # None: traced for one device, no sharding constraints
    attention: str = "xla"  # XLA's; "cudnn": cuDNN's fused kernel (GPUs)
    quantization: Quantization | None = None  # the layer matrices' GEMMs in NVFP4
    experts: str = "sorted"  # routed experts without an expert axis: model/experts.py's paths
    expert_parallel: ExpertParallel | None = None  # routed experts split over an expert axis
    unrolled: bool = False  # layer scans unrolled in the compiled program (short ones on CPUs)
    flat_products: bool = False  # weight products as 2-D dots (CPUs: layers.einsum says why)
    weights_on_host: bool = False  # layer scans' weights in host memory, fetched a layer at a time

    def policy(self, scan: str) -> Callable | None:
        """The checkpoint policy of each layer of `scan` (None: no checkpointing)."""
        return dict(self.policies).get(scan)

    def describe(self, routed_experts: bool) -> str:
        """The kernels, NVFP4 and (a model with `routed_experts`) experts, for a run's header."""
        words = [f"attention {self.attention}",
                 self.quantization.describe() if self.quantization else "weights unquantized"]
        if routed_experts:
            words.append(self.expert_parallel.describe() if self.expert_parallel
                         else f"experts {self.experts}")
        return ", ".join(words)
