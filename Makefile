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

.PHONY: setup build nvshmem nvshmem-carry baselines baselines-status baselines-carry baselines-wheels baselines-install baselines-check run test gpu-test gpu-check tables clean

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

# A GPU host: nvidia-smi or /dev/nvidia0. Elsewhere `make build` installs no CUDA-only extras (the
# NVSHMEM wheel) and compiles no kernels, nothing would load them; GPU=1 builds them anyway (a build
# host without a GPU), GPU=0 skips them on a GPU host.
GPU ?= $(shell { command -v nvidia-smi || ls /dev/nvidia0; } >/dev/null 2>&1 && echo 1 || echo 0)

# Compiles csrc/ into epbench/_lib/ on a GPU host with nvcc; says so and carries on elsewhere.
# First stamps epbench's commit into the package (epbench/_build_info.json) for copies without .git.
build: setup
	@$(PY) -m epbench.provenance --stamp
	@if [ "$(GPU)" != 1 ]; then echo "no GPU on this host: skipping the CUDA kernels and the NVSHMEM wheel (the reference backend runs on CPU; GPU=1 builds them anyway)"; \
	elif command -v nvcc >/dev/null 2>&1; then $(MAKE) -C csrc && { $(MAKE) --no-print-directory nvshmem || \
	  echo "csrc/nvshmem did not build: the NVSHMEM groundwork is skipped, everything else is unaffected"; }; \
	else echo "nvcc not found: skipping the CUDA kernels (the reference backend still runs)"; fi

# NVSHMEM (groundwork for multi-node): headers and libraries come from a pip wheel, installed
# into the venv unless already there. Where pip cannot get it (no network), a one-line note: csrc/nvshmem
# is then built against an NVSHMEM already installed (torch's CUDA builds bring one), else skipped, and
# the rest builds as before. NVSHMEM_HOME=<folder with include/ and lib/> skips pip altogether.
# Reached through `build` (needs nvcc).
NVSHMEM_WHEEL   ?= nvidia-nvshmem-cu13==3.4.5
NVSHMEM_PIP_LOG := $(VENV)/nvshmem-pip.log
NVSHMEM_FIND    := import os, importlib.util as u; s = u.find_spec('nvidia.nvshmem'); \
                   print(next((p for p in (s.submodule_search_locations if s else []) \
                               if os.path.isfile(os.path.join(p, 'include', 'nvshmem.h'))), ''))
nvshmem: setup
ifdef NVSHMEM_HOME
	$(MAKE) -C csrc nvshmem NVSHMEM_HOME="$(abspath $(NVSHMEM_HOME))"
else
	@if ! $(PY) -c "import importlib.metadata as m, sys; n, v = '$(NVSHMEM_WHEEL)'.split('=='); sys.exit(m.version(n) != v)" 2>/dev/null; then \
	  if $(PY) -m pip install -q --retries 1 --timeout 30 "$(NVSHMEM_WHEEL)" >$(NVSHMEM_PIP_LOG) 2>&1; then \
	    echo "installed $(NVSHMEM_WHEEL)"; \
	  else home=$$($(PY) -c "$(NVSHMEM_FIND)" 2>/dev/null); \
	    if [ -z "$$home" ]; then echo "pip could not install $(NVSHMEM_WHEEL) (see $(NVSHMEM_PIP_LOG)): skipping csrc/nvshmem"; exit 0; fi; \
	    echo "pip could not install $(NVSHMEM_WHEEL) (see $(NVSHMEM_PIP_LOG)): csrc/nvshmem uses the NVSHMEM in $$home"; fi; fi; \
	$(MAKE) -C csrc nvshmem NVSHMEM_HOME="$$($(PY) -c "$(NVSHMEM_FIND)" 2>/dev/null)"
endif

# For a machine without network (the GPU host): copies what csrc/nvshmem needs (headers, device library,
# host library and its bootstrap/transport plugins) from the venv's wheel into .whl/nvshmem (git-ignored,
# about 45 MB); carry `.whl` there and run `make build NVSHMEM_HOME=.whl/nvshmem`.
nvshmem-carry: setup
	@home=$$($(PY) -c "$(NVSHMEM_FIND)" 2>/dev/null); \
	if [ -z "$$home" ]; then echo "no NVSHMEM installed in $(VENV): run make build first"; exit 1; fi; \
	rm -rf .whl/nvshmem && mkdir -p .whl/nvshmem/lib && cp -r "$$home/include" .whl/nvshmem/ && \
	cp "$$home"/lib/libnvshmem_device.a "$$home"/lib/libnvshmem_host.so.3 "$$home"/lib/nvshmem_bootstrap_uid.so.3 \
	   "$$home"/lib/nvshmem_transport_ibrc.so.3 .whl/nvshmem/lib/ && \
	echo "copied $$home to .whl/nvshmem ($$(du -sh .whl/nvshmem | cut -f1))"

# External baselines (DeepEP V1 / V2 / Hybrid-EP, one flavor per venv: all install as deep_ep) at
# pinned commits (tools/baselines.py), from DEEPEP_SRC=<checkout> or a clone; a failure is one line,
# never an error.
# DEEPEP_FLAVOR=v1|v2|hybrid-ep (default v1). torch's symm-mem backend needs no build.
# v2 needs NCCL >= 2.30.4: NCCL_CARRY=.whl/nccl.tar.xz (from baselines-carry) is unpacked into the
# venv, V2 is built against it, and epbench preloads it into deepep-v2's jobs only.
DEEPEP_FLAVOR ?= v1
NCCL_CARRY ?=
baselines: setup
	@$(PY) tools/baselines.py build --flavor $(DEEPEP_FLAVOR) $(if $(NCCL_CARRY),--nccl "$(NCCL_CARRY)")

baselines-status: setup
	@$(PY) tools/baselines.py status

# For the GPU host (no network): the pinned flavor's source, submodules included, as
# .whl/deepep-<flavor>-src.tar.gz (git-ignored), from a git repository (a checkout or a bare clone;
# SUBMODULE_SRC="third-party/fmt=<fmt repo>" where the submodule is not checked out inside it).
# NCCL_WHEEL=<nvidia-nccl-cu13 wheel> (v2) adds .whl/nccl.tar.xz: the library pruned to
# NCCL_ARCH (90: H100/H200) and the headers, ~45 MB. There: mkdir -p /tmp/deepep && tar -xzf
# .whl/deepep-v2-src.tar.gz -C /tmp/deepep && make baselines DEEPEP_FLAVOR=v2 DEEPEP_SRC=/tmp/deepep
# NCCL_CARRY=.whl/nccl.tar.xz
NCCL_WHEEL ?=
NCCL_ARCH ?= 90
SUBMODULE_SRC ?=
baselines-carry:
	@test -n "$(DEEPEP_SRC)" || { echo "baselines-carry needs DEEPEP_SRC=<a DeepEP git checkout>"; exit 2; }
	@$(PYTHON) tools/baselines.py carry --flavor $(DEEPEP_FLAVOR) --src "$(DEEPEP_SRC)" \
	  $(foreach m,$(SUBMODULE_SRC),--submodule "$(m)") $(if $(NCCL_WHEEL),--nccl-wheel "$(NCCL_WHEEL)" --arch $(NCCL_ARCH))

# FlashInfer's MoE all-to-all (backend flashinfer), for a GPU host without network. On a machine with
# network: `make baselines-wheels` downloads flashinfer-python (pure Python, 59 MiB; its kernels are
# compiled by nvcc on first use) into .whl/flashinfer and the few packages its all-to-all imports
# (apache-tvm-ffi, cuda-python 13.0, nvidia-ml-py, ninja, ...; 17 MiB) into
# .whl/flashinfer-deps, both git-ignored, for the host's Python (FI_PYTHON, default 3.12). Each folder
# fits one 64 MiB carry; on the GPU host, in either order: make baselines-install WHEELS=.whl/flashinfer-deps
# and make baselines-install WHEELS=.whl/flashinfer. The rest of flashinfer's requirements (CUTLASS DSL,
# cuDNN frontend, nccl4py: 250 MiB) serve other kernels and are not installed (--no-deps).
FI_VERSION ?= 0.7.2.post1
FI_PYTHON ?= 3.12
FI_DEPS ?= apache-tvm-ffi "cuda-python>=13,<13.1" nvidia-ml-py ninja einops tabulate click tqdm requests
FI_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64,--platform $(p))
WHEELS ?=
baselines-wheels:
	@mkdir -p .whl/flashinfer .whl/flashinfer-deps
	$(PYTHON) -m pip download -q --no-deps -d .whl/flashinfer flashinfer-python==$(FI_VERSION)
	$(PYTHON) -m pip download -q --only-binary=:all: --python-version $(FI_PYTHON) $(FI_PLATFORMS) \
	  -d .whl/flashinfer-deps $(FI_DEPS)
	@du -sh .whl/flashinfer .whl/flashinfer-deps

baselines-install: setup
	@test -n "$(WHEELS)" || { echo "baselines-install needs WHEELS=<a folder of wheels, e.g. .whl/flashinfer>"; exit 2; }
	@case "$(WHEELS)" in *flashinfer-deps*) $(PY) -m pip install -q --no-index --find-links "$(WHEELS)" $(FI_DEPS);; \
	  *) $(PY) -m pip install -q --no-index --no-deps "$(WHEELS)"/*.whl;; esac && echo "installed from $(WHEELS)"

# The fidelity check (docs/fidelity.md): each library's own benchmark and epbench's adapter for it on
# the same shape and SM counts, side by side, flagged where epbench is over 10 % slower. Each DeepEP
# flavor runs from its own venv (make setup VENV=... then make baselines VENV=... DEEPEP_FLAVOR=...)
# and its own unpacked source (the .whl/deepep-<flavor>-src.tar.gz of make baselines-carry). A venv or
# source below that does not exist leaves that library not run (a line says so), never an error;
# the reference (NCCL), symm-mem and flashinfer run from $(VENV), each not run (one line) where it
# cannot: symm-mem without torch's NVSHMEM or with one GPU, flashinfer where make baselines-install
# has not put it there. Exit 1 when a run failed, a row was wrong or a ratio is flagged.
FIDELITY_SCENARIO ?= scenarios/dsv3x4.yaml
FIDELITY_SMS      ?= 8,16,24,32
FIDELITY_LIBS     ?= reference,v1,v2,hybrid-ep,symm-mem,flashinfer
FIDELITY_VENVS    ?= v1=/tmp/venv-v1 v2=/tmp/venv-v2 hybrid-ep=/tmp/venv-hep
FIDELITY_SRCS     ?= v1=/tmp/deepep-v1 v2=/tmp/deepep-v2 hybrid-ep=/tmp/deepep-hep
FIDELITY_TIMEOUT  ?= 1800
FIDELITY_ARGS     ?=
baselines-check: setup
	$(PY) tools/fidelity.py --scenario $(FIDELITY_SCENARIO) --sms $(FIDELITY_SMS) --libraries $(FIDELITY_LIBS) \
	  $(foreach v,$(FIDELITY_VENVS),--venv $(v)) $(foreach s,$(FIDELITY_SRCS),--src $(s)) \
	  --if-present --timeout $(FIDELITY_TIMEOUT) $(FIDELITY_ARGS)

run: build
	$(EPB) run

# The CPU suite on two workers where pytest-xdist is there or pip can get it (CI: 6 min instead of 10
# on 2 cores); a host without network (the GPU machine) runs it on one. --dist loadgroup keeps the
# tests of one xdist_group on one worker: those reading the session's smoke run (conftest.py), and
# the kernel compiles that `make check` then finds done (tests/test_csrc_build.py).
test: build
	@$(PY) -c "import xdist" 2>/dev/null || $(PY) -m pip install -q pytest-xdist >/dev/null 2>&1 || true
	@if $(PY) -c "import xdist" 2>/dev/null; then echo "$(PY) -m pytest -q -n 2 --dist loadgroup"; \
	  $(PY) -m pytest -q -n 2 --dist loadgroup; \
	else echo "$(PY) -m pytest -q (no pytest-xdist: one worker)"; $(PY) -m pytest -q; fi

# On the GPU host: build, GPU tests, then the benchmark sweeps behind README's Performance table.
# With 4+ GPUs the multi-GPU sweeps; with fewer, the one-GPU set: the kernels at world 1 (no link
# crossed), the low-latency floor, and 4 ranks sharing the GPU under MPS (functional figures only).
GPU_COUNT ?= $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
GPU_SWEEP ?= h200x4 dsv3x4 h200x4-fp8 dsv3x4-fp8 h200x2x2-virtual dsv3x2x2-virtual
# The sweeps run even when a GPU test fails (their own verification still guards each point);
# the target fails at the end if anything did.
# gpu-test: the GPU tests alone, each named with its time, every skip with its reason, and a summary
# line for each failure and error (-rsfE; a failed test's report is also printed the moment it fails,
# tests/gpu/conftest.py). Where pytest-timeout is installed, a test that hangs fails after
# GPU_TEST_TIMEOUT s instead of using up a time-limited machine; the first test of a world size
# starts the kernel checks' launch for every test of that world (tests/gpu/suite_worker.py, killed
# after 420 s by tests/gpu/gpu_launch.py), hence more than that. The line before the run says whether
# the timeout applies.
GPU_TEST_TIMEOUT ?= 480
GPU_TEST_TIMEOUT_ARG = $(shell $(PY) -c "import pytest_timeout" 2>/dev/null && echo --timeout=$(GPU_TEST_TIMEOUT))
GPU_TEST_ARGS = -v -rsfE --durations=0 -m gpu $(GPU_TEST_TIMEOUT_ARG)
# what gpu-test runs: all of tests/ by default; e.g. GPU_TESTS="tests/gpu/test_hybrid_ep_gpu.py -k sweep"
GPU_TESTS ?= tests
gpu-test: build
	@echo "pytest $(GPU_TEST_ARGS) $(GPU_TESTS)$(if $(GPU_TEST_TIMEOUT_ARG),, (pytest-timeout not installed: no per-test timeout))"
	@$(PY) -m pytest $(GPU_TEST_ARGS) $(GPU_TESTS)

gpu-check: build
	@status=0; $(PY) -m pytest $(GPU_TEST_ARGS) tests || status=1; \
	if [ "$(GPU_COUNT)" -ge 4 ] 2>/dev/null; then \
	  for s in $(GPU_SWEEP); do $(EPB) sweep scenarios/$$s.yaml --sms 8,16,24,32 || status=1; done; \
	else \
	  $(EPB) sweep scenarios/dsv3x4.yaml --nproc 1 --sms 8,16,24,32 --no-ceilings || status=1; \
	  $(EPB) sweep scenarios/dsv3x4-ll.yaml --nproc 1 --backends epbench-ll --tokens 1,32,128 --sms 32,132 --no-ceilings || status=1; \
	  $(EPB) run scenarios/dsv3x4.yaml --nproc 4 --mps --sms 8,32 || status=1; \
	fi; exit $$status

# README's comparison tables on this host (issue 33): every backend that builds (each DeepEP flavor's
# job from the venv `make baselines VENV=... DEEPEP_FLAVOR=...` recorded for it: epbench/flavors.py),
# both call modes, 4-32 SMs, the DeepSeek-V3 shape and hidden 8192 on 4 GPUs (TABLES_4) and on 2 of
# them (TABLES_2); one results folder per table under TABLES_OUT, then its plots. A backend that
# cannot run here gives skipped rows with the reason; fewer than 2 GPUs: one line, exit 2.
TABLES_OUT      ?= results/tables
TABLES_BACKENDS ?= epbench,deepep,deepep-v2,hybrid-ep,reference,symm-mem
TABLES_SMS      ?= 4,8,16,24,32
TABLES_4        ?= dsv3x4 h200x4
TABLES_2        ?= dsv3x2 h8192x2
tables: build
	@if [ "$(GPU_COUNT)" -lt 2 ] 2>/dev/null || [ -z "$(GPU_COUNT)" ]; then 	  echo "make tables: needs 2 or more CUDA GPUs (this host has $(or $(GPU_COUNT),none))" >&2; exit 2; fi; 	status=0; scen="$(TABLES_2)"; [ "$(GPU_COUNT)" -ge 4 ] && scen="$(TABLES_4) $(TABLES_2)"; 	for s in $$scen; do 	  echo "$(EPB) run scenarios/$$s.yaml --backends $(TABLES_BACKENDS) --sms $(TABLES_SMS) --call-modes call,kernel --results $(TABLES_OUT)"; 	  $(EPB) run scenarios/$$s.yaml --backends $(TABLES_BACKENDS) --sms $(TABLES_SMS) --call-modes call,kernel \
	    --results $(TABLES_OUT) || status=1; done; 	$(EPB) plot $(TABLES_OUT) --force || status=1; exit $$status

clean:
	rm -rf $(VENV) build epbench/_lib
