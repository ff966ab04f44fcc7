PY ?= python3

.PHONY: proto proto-check

# Regenerate the Python stubs in pdserve/v1/ from protos/pdserve/v1/*.proto.
proto:
	$(PY) scripts/gen_protos.py

# Fail if the committed stubs differ from what the protos generate (CI).
proto-check:
	$(PY) scripts/gen_protos.py --check
