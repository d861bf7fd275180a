# Two entry points for a fresh machine: `make run` and `make test`.
# The virtual environment sees the site-packages that already hold torch (a GPU host's CUDA
# build); where no torch exists it installs the CPU build (pinned: an unpinned torch pulls GBs).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
EPB    := $(VENV)/bin/epbench
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1

.PHONY: setup build run test gpu-check clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	@host_site=$$($(PYTHON) -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))" 2>/dev/null); \
	if [ -n "$$host_site" ]; then \
	  echo "$$host_site" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/epbench-host-site.pth"; \
	  echo "using the torch already installed in $$host_site"; fi
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -c "import wheel" 2>/dev/null || $(PY) -m pip install -q wheel
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	@touch $@

# Compiles csrc/ into epbench/_lib/ when nvcc exists; says so and carries on when it does not.
build: setup
	@if command -v nvcc >/dev/null 2>&1; then $(MAKE) -C csrc; \
	else echo "nvcc not found: skipping the CUDA kernels (the reference backend still runs)"; fi

run: build
	$(EPB) run

test: build
	$(PY) -m pytest -q

# On the GPU host: build, GPU tests, then the benchmark sweeps behind README's Performance table.
GPU_SWEEP ?= h200x4 dsv3x4 h200x4-fp8 dsv3x4-fp8
# The sweeps run even when a GPU test fails (their own verification still guards each point);
# the target fails at the end if anything did.
gpu-check: build
	@status=0; $(PY) -m pytest -q -m gpu tests || status=1; \
	for s in $(GPU_SWEEP); do $(EPB) sweep scenarios/$$s.yaml --sms 8,16,24,32 || status=1; done; \
	exit $$status

clean:
	rm -rf $(VENV) build epbench/_lib
