# The house rules, runnable locally (docs/lint.md). `make lint` is exactly what .ci/run checks before the tests;
# `make fix` applies every automatic fix (formatting, import order, safe ruff fixes); what remains after it is
# for a person (docs/lint.md lists the usual cases).
PYTHON ?= python3
RUFF := $(PYTHON) -m ruff
MYPY := $(PYTHON) -m mypy

.PHONY: lint fix lint-rust-format lint-clippy lint-python-format lint-ruff lint-mypy lint-stubs

# `make -k lint` runs every check and reports each failure (CI does), plain `make lint` stops at the first.
lint: lint-rust-format lint-clippy lint-python-format lint-ruff lint-mypy lint-stubs

lint-rust-format:
	cargo fmt --all --check

# Lint levels are in Cargo.toml's [workspace.lints] (and clippy.toml); -D warnings makes every finding fatal.
lint-clippy:
	cargo clippy --workspace --all-targets --locked -- -D warnings

lint-python-format:
	$(RUFF) format --check

# Rules and the reason for each family are in pyproject.toml's [tool.ruff.lint].
lint-ruff:
	$(RUFF) check --no-fix

# Settings (files, strictness, the modules still excused from some checks) are in pyproject.toml's [tool.mypy].
lint-mypy:
	$(MYPY)

# The package ships py.typed, so a consumer's mypy reads freetoken._core's types from the hand-written _core.pyi:
# stubtest checks that stub against the built extension (every name, signature, class and constant).
lint-stubs:
	$(PYTHON) -m mypy.stubtest freetoken._core

fix:
	cargo fmt --all
	$(RUFF) format
	$(RUFF) check --fix --exit-zero  # what it cannot fix is left for `make lint` to list
	$(RUFF) format
