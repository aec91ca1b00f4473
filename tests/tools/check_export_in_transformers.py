"""Export every Hugging Face fixture through hf/save.py and load the result in
transformers: its logits must equal the fixture's expected ones (the original model's).

Needs torch and transformers (like the fixture scripts; never run by `make test`):

    python3 -m venv /tmp/fixvenv
    /tmp/fixvenv/bin/pip install torch==2.13.0 transformers==5.24.0 jax==0.10.2 einops==0.8.2 \\
        safetensors==0.8.0 orbax-checkpoint==0.12.4
    JAX_PLATFORMS=cpu /tmp/fixvenv/bin/python tests/tools/check_export_in_transformers.py
"""

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hf.load import load_checkpoint  # noqa: E402
from hf.save import write_checkpoint  # noqa: E402


@torch.no_grad()
def check(fixture: Path) -> float:
    """The largest |logit difference| of the exported fixture against its expected logits."""
    expected = np.load(fixture / "expected.npz")
    model_config, params = load_checkpoint(fixture)
    with tempfile.TemporaryDirectory() as out:
        write_checkpoint(Path(out), model_config, params, shard_bytes=200_000)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        logits = model(input_ids=torch.from_numpy(expected["tokens"]).long()).logits.numpy()
    return float(np.abs(logits - expected["logits"]).max())


def main() -> int:
    failed = 0
    for fixture in sorted(p.parent for p in (ROOT / "tests/fixtures").glob("*/config.json")):
        diff = check(fixture)
        scale = float(np.abs(np.load(fixture / "expected.npz")["logits"]).max())
        ok = diff <= 1e-5 * max(scale, 1.0)  # float32 reruns of the same weights
        failed += not ok
        print(f"{fixture.name:<20} exported, in transformers: max |logit diff| {diff:.2e} "
              f"(max |logit| {scale:.2f}) {'ok' if ok else 'FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
