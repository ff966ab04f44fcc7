PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python

.PHONY: setup run test test-unit test-integration proto proto-check bench-offline lint clean

# Create .venv with the project and its dependencies (CPU torch on CPU machines).
setup:
	VENV=$(VENV) PYTHON=$(PY) bash scripts/setup.sh

# The main job: router + 1 prefill + 1 decode worker on the CPU with the embedded model,
# a few sample chat prompts streamed to the terminal, then everything shut down.
run: setup
	$(VENV)/bin/pdserve up --demo

# Everything CI runs.
test: setup
	$(VPY) scripts/gen_protos.py --check
	$(VPY) -m pytest -q -p no:cacheprovider tests

# Regenerate the Python stubs in pdserve/v1/ from protos/pdserve/v1/*.proto.
proto:
	$(PY) scripts/gen_protos.py

# Fail if the committed stubs differ from what the protos generate (CI).
proto-check:
	$(PY) scripts/gen_protos.py --check

clean:
	rm -rf $(VENV) *.egg-info
