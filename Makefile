# One entry point for people and CI: make install | test | lint | bench | docs.
PY ?= .venv/bin/python
RUST_SOURCES := Cargo.toml $(wildcard Cargo.lock build.rs) $(shell find rust -name "*.rs" -o -name "*.cpp" 2>/dev/null)

.PHONY: install test lint bench fuzz docs

install: .venv/.installed

# maturin's PEP 517 backend builds the native module in release mode, editable or not.
.venv/.installed: pyproject.toml $(RUST_SOURCES)
	[ -x .venv/bin/python ] || python3 -m venv .venv
	$(PY) -m pip install -e '.[test]'
	touch $@

# `--features cuda` adds the cuda backend's tests against the fake driver (tests/cuda_fake.rs); no GPU needed.
# pytest runs one worker per core, at most eight (pytest-xdist): each test builds its own pools and fakes.
test: install
	cargo test --profile checked --features cuda
	$(PY) -m pytest -q -n auto --maxprocesses 8

lint: install
	$(PY) -m pip install -q ruff
	$(PY) -m ruff check python tests benches examples
	$(PY) -m ruff format --check python tests benches examples
	cargo fmt --check
	cargo clippy --all-targets --features cuda -- -D warnings
	cargo clippy --lib --features python,cuda -- -D warnings
	cargo clippy --lib -- -D warnings

bench: install
	cargo bench
	$(PY) benches/bench_api.py

# The misuse machine and the property suites with fresh seeds for MINUTES (60); SEED=n replays one round.
fuzz: install
	$(PY) tests/fuzz.py --minutes $(or $(MINUTES),60) $(if $(SEED),--seed $(SEED))

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a dead link fails the build.
docs: .venv/.docs-installed
	$(PY) -m mkdocs build --strict -d site

# The docs extra, again only when pyproject.toml changes: an editable install rebuilds the extension.
.venv/.docs-installed: pyproject.toml
	[ -x .venv/bin/python ] || python3 -m venv .venv
	$(PY) -m pip install -e '.[docs]'
	touch $@
