# Every target sets up what it needs: a fresh clone needs only python3 (3.11+) and make.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
## Which torch build the venv gets (scripts/install_torch.py says more):
##   cpu   the CPU wheel, from PyTorch's CPU index when it answers (default)
##   cuda  the wheel PyPI serves: on Linux x86-64 the CUDA build (several GB)
##   none  no torch: gradstar with numpy only (the library and the CLI; not demo or test)
## The last choice is remembered in $(VENV)/.torch; a new one reinstalls.
TORCH_FILE := $(VENV)/.torch
TORCH ?= $(or $(shell cat $(TORCH_FILE) 2>/dev/null),cpu)
## Where TORCH=cpu looks for the CPU wheel; empty: pip's own configuration decides.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
EXTRAS := $(if $(filter none,$(TORCH)),,[dev,torch,plot])

.PHONY: setup demo test lint protos protos-check wheel-check bench compose-check clean \
	need-torch FORCE chromium nftables gcc etcd torch-suite test-cuda docs

$(STAMP): pyproject.toml constraints.txt $(TORCH_FILE)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) scripts/install_torch.py "$(TORCH)" --index "$(TORCH_CPU_INDEX)"
	$(PY) -m pip install --quiet -c constraints.txt -e ".$(EXTRAS)"
	touch $(STAMP)

# Rewritten only when the choice changes, so that only a change reinstalls.
$(TORCH_FILE): FORCE
	@mkdir -p $(VENV)
	@test "$$(cat $@ 2>/dev/null)" = "$(TORCH)" || echo "$(TORCH)" > $@

FORCE:

setup: $(STAMP)

need-torch:
	@test "$(TORCH)" != none || { echo "make: TORCH=none sets up gradstar alone (numpy only);" \
	    "'make $(MAKECMDGOALS)' needs the full set-up: add TORCH=cpu or TORCH=cuda" >&2; exit 2; }

## The main job: an embedded coordinator and 4 local worker processes train an MLP and report
## accuracy, throughput, bytes through the hub and the match with a single-process run.
## Its loss/accuracy plot and JSON report go to $(DEMO_OUT)/.
DEMO_OUT ?= demo-out
demo: need-torch $(STAMP)
	$(VENV)/bin/gradstar demo --plot $(DEMO_OUT)/demo.png --report $(DEMO_OUT)/report.json

## Validate docker-compose.yml with `docker-compose config` (needs Debian's docker-compose).
compose-check:
	bash scripts/check_compose.sh

## The test suite (unit + integration with real servers and processes).
test: need-torch $(STAMP) chromium nftables gcc etcd
	$(PY) scripts/crash_report.py -- $(PY) -m pytest -q

## The CUDA tests alone (tests/cuda/), on a machine with a GPU: `make TORCH=cuda test-cuda`.
## Without a CUDA device each is reported as skipped, "needs a CUDA device" (they also run, and
## skip, in `make test`).
test-cuda: need-torch $(STAMP)
	$(PY) -m pytest -q -rs tests/cuda

## Chromium for tests/runtime/test_status_page.py: installed with apt-get as root when missing
## (about 2 minutes); elsewhere a one-line hint, and that test fails saying the same.
chromium:
	-@bash scripts/ensure_chromium.sh

## nftables for the emulated cluster's outbound-only hosts (tests/cluster): installed with
## apt-get as root when missing; elsewhere a one-line hint, and those tests fail saying so.
nftables:
	-@bash scripts/ensure_package.sh nft nftables "the emulated cluster's outbound-only hosts"

## gcc for the emulated cluster's delay line (benchmarks/emulated_cluster/delay_line.c, built on
## first use): installed with apt-get as root when missing; elsewhere a one-line hint, and a
## cluster with a round trip fails saying the same.
gcc:
	-@bash scripts/ensure_package.sh gcc "gcc libc6-dev" "the emulated cluster's delay line"

## etcd for the --ha coordinator tests (a real etcd on 127.0.0.1, tests/integration/conftest.py's
## etcd_server): Debian's etcd-server, installed with apt-get as root when missing; elsewhere a
## one-line hint, and those tests fail saying so.
etcd:
	-@bash scripts/ensure_package.sh etcd etcd-server "the --ha coordinator tests"

lint: need-torch $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) scripts/gen_protos.py --check

## Regenerate the committed gRPC stubs after editing protos/.
protos: need-torch $(STAMP)
	$(PY) scripts/gen_protos.py

## Build the wheel, install it into a clean venv and import every module.
wheel-check: need-torch $(STAMP)
	$(PY) scripts/check_wheel.py

## The documentation site: mkdocs.yml and docs/ into site/, strict (a broken link or anchor, a
## missing included file or a documented name that no longer exists fails it). Installs the docs
## extra into the venv first; torch is not needed (the API reference is read from the source).
DOCS_STAMP := $(VENV)/.docs-stamp
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: need-torch $(STAMP)
	$(PY) benchmarks/allreduce.py

## PyTorch's own distributed test suite over backend "gradstar" next to gloo, at 2 and 3 ranks:
## passed/run per test family, and every test gloo passes and gradstar fails with its error
## (docs/guides/torch-backend.md, "PyTorch's own test suite"). About 10 minutes on 2 cores.
torch-suite: need-torch $(STAMP)
	$(PY) scripts/torch_suite.py --world-sizes 2 3

clean:
	rm -rf $(VENV) build dist site *.egg-info
