"""What the CPU can check of the GPU script: its gradient check and one row's measurement."""

import json
import math

import pytest

from study import gpu_check
from study.__main__ import main as study_main


def test_gpu_check_gradients_pass_for_every_row_on_cpu():
    results = gpu_check.check_gradients(smoke=True)
    assert [r["row"] for r in results] == list(gpu_check.ROWS)
    assert all(r["ok"] for r in results), results
    assert all(r["host_buffers"] == 0 for r in results)  # a CPU drops the placements


@pytest.mark.parametrize("row", ["llama405b-offload-pipelined"])
def test_gpu_check_measures_a_row(row, capsys):
    """As the script measures each row in a process of its own: `python -m study gpu-check
    --row NAME --smoke`, whose last line is the row's figures."""
    assert study_main(["gpu-check", "--row", row, "--smoke"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["row"] == row
    assert result["step_ms"] > 0 and result["tflops_per_device"] > 0
    assert math.isnan(result["peak_device_gib"])  # the CPU backend reports no memory stats


@pytest.mark.gpu_compile
def test_the_compile_table_compiles_a_row(capsys):
    assert study_main(["compile-table", "llama8b-offload", "model.n_layers=2"]) == 0
    row = capsys.readouterr().out.splitlines()[-1].split(" | ")
    assert row[0] == "| llama8b-offload" and row[9] == "fits"
    assert float(row[7]) == float(row[8]) > 0  # compiled host bytes equal the plan's
