# kvxfer — build, test and run the main job. `make help` lists the targets.
GO        ?= go
BIN       := bin
FUZZTIME  ?= 20s
# staticcheck from the Go proxy (not a module requirement); `go run` caches the
# binary and staticcheck caches its per-package results, so a warm run takes
# seconds (cold: ~1-2 min, building staticcheck and analysing every package).
STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2
export CGO_ENABLED := 1

.PHONY: generate generate-check help deps build test test-race test-short fuzz vet fmt-check demo ci clean capi ctest test-rdma python-lib test-python python-wheel python-install staticcheck

# The Python package's tests need pytest and numpy: Debian's interpreter has
# them (python3-pytest, python3-numpy); a `python3` on PATH may not (pyenv).
PYTHON    ?= /usr/bin/python3
# libkvxfer.so for the Python package, built as CMake builds it (same flags,
# SONAME libkvxfer.so.0), rebuilt when a Go/C source of the module changes.
PYLIB     := build/python/libkvxfer.so
PYLIB_SRC := go.mod go.sum $(shell find . \( -path ./build -o -path ./.git -o -path ./python -o -path ./bin \) -prune -o \
               \( -name '*.go' -o -name '*.c' -o -name '*.h' \) ! -name '*_test.go' -print 2>/dev/null)

help: ## list targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

deps: ## install the Debian packages the build needs (idempotent)
	@bash scripts/install-deps.sh

build: deps ## build bin/kvxfer
	$(GO) build -o $(BIN)/kvxfer ./cmd/kvxfer

test: deps $(PYLIB) ## run every test (race detector on)
	@$(GO) mod tidy -diff >/dev/null || { echo "go.mod/go.sum are not tidy: run 'go mod tidy' (diff: go mod tidy -diff)"; exit 1; }
	$(GO) vet ./...
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	  if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	@$(MAKE) --no-print-directory staticcheck
	KVXFER_TEST_CSHARED_LIB=$(CURDIR)/$(PYLIB) $(GO) test -race -timeout 15m ./...
	@$(MAKE) --no-print-directory test-python

generate: ## regenerate the *_string.go files (go generate ./...: stringer v0.51.0 via go run)
	$(GO) generate ./...

generate-check: ## fail when a generated file is not current (CI runs it; ~15-35 s)
	@bash scripts/check-generated.sh

staticcheck: ## staticcheck ./... (part of make test; warm ~10 s, cold ~1-2 min)
	$(GO) run $(STATICCHECK) ./...

python-lib: $(PYLIB) ## build build/python/libkvxfer.so for the Python package (go build -buildmode=c-shared)

$(PYLIB): $(PYLIB_SRC)
	@mkdir -p $(dir $@)
	CGO_ENABLED=1 $(GO) build -trimpath -buildmode=c-shared "-ldflags=-extldflags=-Wl,-soname,libkvxfer.so.0" -o $@ ./capi
	@rm -f $(basename $@).h

# Wheels land in PYDIST; python-install installs them into VENV (created with
# --system-site-packages when it does not exist, so Debian's numpy and
# pytest stay visible). Everything offline with Debian's packages: pip
# wheel --no-build-isolation uses python3-setuptools and python3-wheel.
PYDIST    := build/python/dist
VENV      ?= .venv
MOONCAKE  ?= 0
NIXL      ?= 0

# The wheels are rebuilt only when the library or a packaged file changed
# (a second `make python-install` reinstalls the same wheels).
PYWHEEL_SRC := $(shell find python \( -path python/tests -o -path python/build -o -name '*.egg-info' -o -name __pycache__ \) -prune -o \
                 -type f \( -name '*.py' -o -name '*.toml' -o -name '*.md' -o -name '*.cfg' -o -name '*.typed' \) -print 2>/dev/null)
PYWHEEL_STAMP := $(PYDIST)/.built

python-wheel: deps $(PYWHEEL_STAMP) ## wheels in build/python/dist: kvxfer (libkvxfer.so inside) and the optional mooncake and nixl shims (offline)
	@ls $(PYDIST)

$(PYWHEEL_STAMP): $(PYLIB) $(PYWHEEL_SRC)
	@$(PYTHON) -c 'import setuptools, wheel, pip' 2>/dev/null || { echo "$(PYTHON) lacks setuptools, wheel or pip (Debian: python3-setuptools python3-wheel python3-pip; scripts/install-deps.sh installs them)"; exit 1; }
	@rm -rf $(PYDIST) python/build python/mooncake-shim/build python/nixl-shim/build
	KVXFER_LIBRARY=$(CURDIR)/$(PYLIB) $(PYTHON) -m pip wheel -q --no-build-isolation --no-deps --no-index --no-cache-dir -w $(PYDIST) ./python ./python/mooncake-shim ./python/nixl-shim
	@# the in-tree build's leftovers: an egg-info next to the sources would make python/ look installed (entry points)
	@rm -rf python/build python/*.egg-info python/mooncake-shim/build python/mooncake-shim/*.egg-info python/nixl-shim/build python/nixl-shim/*.egg-info
	@touch $@

python-install: python-wheel ## install kvxfer into the venv VENV (default .venv; created with --system-site-packages); MOONCAKE=1 adds the mooncake shim, NIXL=1 the nixl shim
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(VENV)/bin/python -m pip install -q --no-index --no-deps --force-reinstall $(PYDIST)/kvxfer-*.whl $(if $(filter 1,$(MOONCAKE)),$(PYDIST)/kvxfer_mooncake_shim-*.whl) $(if $(filter 1,$(NIXL)),$(PYDIST)/kvxfer_nixl_shim-*.whl)
	@$(VENV)/bin/python -c 'import kvxfer; print("kvxfer", kvxfer.__version__, "installed in $(VENV); library", kvxfer.library_path())'

test-python: deps python-lib ## the Python package's tests (pytest on $(PYTHON), two-process loopback; ~3-4 min)
	@$(PYTHON) -c 'import pytest, numpy' 2>/dev/null || { echo "$(PYTHON) lacks pytest or numpy: run scripts/install-deps.sh (python3-pytest, python3-numpy) or set PYTHON="; exit 1; }
	KVXFER_LIBRARY=$(CURDIR)/$(PYLIB) $(PYTHON) -m pytest -q -p no:cacheprovider python/tests

test-short: deps ## quick tests, no race detector
	$(GO) test -short ./...

fuzz: deps ## run each fuzz target for $(FUZZTIME)
	@bash scripts/fuzz-all.sh $(FUZZTIME)

demo: build ## the main job: bootstrap + prefill + decode on loopback, verified
	$(BIN)/kvxfer demo

.PHONY: bench-results
bench-results: build ## rerun `kvxfer bench` (tcp, shm, peers; ~2 min) and regenerate its section of bench/RESULTS.md and bench/results/
	@bash scripts/install-deps.sh bench
	@mkdir -p bench/results
	$(BIN)/kvxfer bench --transports tcp,shm --peers --quiet --json bench/results/bench.json --plot bench/results/bench.png --markdown bench/RESULTS.md > bench/results/table.txt; s=$$?; cat bench/results/table.txt; exit $$s

capi: deps ## build the C ABI (build/libkvxfer.so.0) and the C++ consumer with CMake
	cmake -S . -B build
	cmake --build build

ctest: capi ## run the C ABI tests (C++ consumer, header/export check, find_package install check)
	ctest --test-dir build --output-on-failure

test-rdma: ## ibverbs/rdma tests, conformance (WRITE and READ), KV end-to-end and ib_write_bw / ib_read_bw side-by-sides in a Soft-RoCE QEMU VM
	@bash scripts/install-deps.sh rdma-vm
	$(GO) test -c -o build/rdma-vm/ibverbs.test ./ibverbs
	$(GO) test -c -o build/rdma-vm/rdma.test ./rdma
	bash scripts/rxe-vm.sh -f build/rdma-vm/ibverbs.test -f build/rdma-vm/rdma.test -f scripts/rdma-vm-guest.sh 'sh ./rdma-vm-guest.sh'

clean: ## remove build outputs
	rm -rf $(BIN) build
