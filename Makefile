# Every target sets up what it needs: a fresh clone needs only python3 (3.11+) and make.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup demo test lint protos protos-check wheel-check bench compose-check clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,torch]"
	touch $(STAMP)

setup: $(STAMP)

## The main job: an embedded coordinator and 4 local worker processes train an MLP and report
## accuracy, throughput, bytes through the hub and the match with a single-process run.
demo: $(STAMP)
	$(VENV)/bin/gradstar demo

## Validate docker-compose.yml with `docker-compose config` (needs Debian's docker-compose).
compose-check:
	bash scripts/check_compose.sh

## The test suite (unit + integration with real servers and processes).
test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) scripts/gen_protos.py --check

## Regenerate the committed gRPC stubs after editing protos/.
protos: $(STAMP)
	$(PY) scripts/gen_protos.py

## Build the wheel, install it into a clean venv and import every module.
wheel-check: $(STAMP)
	$(PY) scripts/check_wheel.py

bench: $(STAMP)
	$(PY) benchmarks/allreduce.py

clean:
	rm -rf $(VENV) build dist *.egg-info
