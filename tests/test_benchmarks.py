"""What the CPU can check of the GPU script: its gradient check and one row's measurement."""

import importlib.util
import math

import pytest

spec = importlib.util.spec_from_file_location("gpu_check", "benchmarks/gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_gpu_check_gradients_pass_for_every_row_on_cpu():
    results = gpu_check.check_gradients(smoke=True)
    assert [r["row"] for r in results] == list(gpu_check.ROWS)
    assert all(r["ok"] for r in results), results
    assert all(r["host_buffers"] == 0 for r in results)  # a CPU drops the placements


@pytest.mark.parametrize("row", ["llama405b-offload-pipelined"])
def test_gpu_check_measures_a_row(row):
    result = gpu_check.measure_row(row, smoke=True, steps=1)
    assert result["step_ms"] > 0 and result["tflops_per_device"] > 0
    assert math.isnan(result["peak_device_gib"])  # the CPU backend reports no memory stats


def test_the_compile_table_compiles_a_row(capsys):
    spec = importlib.util.spec_from_file_location("compile_table", "benchmarks/compile_table.py")
    compile_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compile_table)
    assert compile_table.main(["llama8b-offload", "model.n_layers=2"]) == 0
    row = capsys.readouterr().out.splitlines()[-1].split(" | ")
    assert row[0] == "| llama8b-offload" and row[9] == "fits"
    assert float(row[7]) == float(row[8]) > 0  # compiled host bytes equal the plan's
