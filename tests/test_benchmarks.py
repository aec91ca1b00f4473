"""What the CPU can check of the GPU script: its comparison, measured and replayed, and its
gradient check; the compile table; the CPU step's profile's thread count."""

import re

import pytest

import configs
from study.__main__ import main as study_main
from study.bench import cpu_profile


def test_gpu_check_measures_each_row_in_its_own_process_and_checks_the_gradients(
        tmp_path, capsys):
    """`python -m study gpu-check --smoke`: the comparison of the study's Llama rows, each in
    a process of its own (proxies here), a table, their measured steps (the replay: nan off a
    GPU), and every row's gradients equal to no checkpointing's (no host buffers on a CPU)."""
    assert study_main(["gpu-check", "--smoke", f"out_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    rows = configs.COMPARISONS["llama405b-compare"]
    (folder,) = tmp_path.glob("llama405b-compare-*")
    assert [line.split(",")[0] for line in (folder / "compare.csv").read_text().splitlines()[1:]
            ] == list(rows)
    for row in rows:
        assert re.search(rf"^{row} +\d+\.\d +nan +\+?nan%$", out, re.M), row
        assert re.search(rf"^gradients {row} .* OK; addressing of its 0 host buffers: -$", out,
                         re.M), row
    assert "nvfp4 dequantize path, cpu vs cpu" in out and "WRONG" not in out


@pytest.mark.gpu_compile
def test_the_compile_table_compiles_a_row(capsys):
    assert study_main(["compile-table", "llama8b-offload", "model.n_layers=2"]) == 0
    row = capsys.readouterr().out.splitlines()[-1].split(" | ")
    assert row[0] == "| llama8b-offload" and row[9] == "fits"
    assert float(row[7]) == float(row[8]) > 0  # compiled host bytes equal the plan's


def test_the_profile_counts_the_time_each_number_of_threads_is_busy():
    # Thread 0 runs 0-12 (two overlapping events), 20-30 and 40-50; thread 1 runs 8-25. By hand:
    # none 30-40 (10), one 0-8, 12-20, 25-30, 40-50 (31), both 8-12, 20-25 (9), of 50.
    threads = [[(20, 30), (0, 10), (5, 12), (40, 50)], [(8, 25)]]
    assert cpu_profile.busy_shares(threads) == pytest.approx([10 / 50, 31 / 50, 9 / 50])
