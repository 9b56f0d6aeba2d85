# The two entry points a fresh machine needs: `make run` and `make test`.
# Both install what they need: Debian packages (when missing and we are root), the virtualenv,
# the Python packages and the hook.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Every Python package `make run` and `make test` use, at exact versions with their hashes.
# `make lock` refreshes it (see README, "Dependencies").
LOCK := requirements.lock
UV_VERSION := 0.13.9
HOOK := ld_hook/build/libnvshare.so
POLICY_DIR ?= configmaps/default
SOCKET_DIR ?= $(if $(NVSHARE_SOCKET_DIR),$(NVSHARE_SOCKET_DIR),/var/run/nvshare)

# command -> Debian package that provides it
APT_NEEDS := gcc:gcc make:make kubectl:kubernetes-client systemd-analyze:systemd

.PHONY: run demo sim test deps venv hook lint clean install uninstall lock bench-guard

# exec: the daemon takes the recipe shell's place, so the signal that stops `make run` (make
# passes SIGTERM on to its recipe) stops the daemon, and no daemon is left behind.
run: deps venv hook
	exec env NVSHARE_SOCKET_DIR=$(SOCKET_DIR) $(BIN)/nvshare-scheduler --policy-dir $(POLICY_DIR)

# Two programs under the hook share one fake GPU through a scheduler: no GPU, no root needed.
demo: deps venv hook
	$(BIN)/python scripts/demo.py

# Seed 004's two-node MIG cluster simulated on the fake API server, the real webhook over HTTPS
# and real kubectl running the seed's Pod, Deployment and Job tests (it says what is simulated).
sim: deps venv
	$(BIN)/python tests/kube/sim_seed_004.py

test: deps venv hook lint
	$(BIN)/pytest -q -n auto --maxprocesses 4

deps:
	@missing=""; for pair in $(APT_NEEDS); do cmd=$${pair%%:*}; pkg=$${pair##*:}; \
	  command -v $$cmd >/dev/null 2>&1 || missing="$$missing $$pkg"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "missing:$$missing (install them, or run as root with apt-get)"; fi; \
	fi

venv: $(STAMP)

# A new lock rebuilds the venv from nothing, so no package of an older lock stays behind. The
# venv's own pip (the one that came with $(PYTHON)) installs exactly the lock: hashes checked,
# nothing resolved; then the appliance itself, editable, built with the locked setuptools.
$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv --clear $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --require-hashes --no-deps -r $(LOCK)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(BIN)/pip check --disable-pip-version-check
	touch $@

# Re-resolve pyproject.toml's ranges into $(LOCK) for every Python from 3.10 and every platform:
# versions already locked stay where they still fit; UPGRADE=1 takes the newest of everything.
lock:
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	.venv-lock/bin/uv pip compile --quiet --universal --python-version 3.10 --generate-hashes \
	  --extra test $(if $(UPGRADE),--upgrade) --output-file $(LOCK) pyproject.toml

hook: $(HOOK)

$(HOOK): $(wildcard ld_hook/*.c ld_hook/*.h ld_hook/Makefile ld_hook/tests/*.c)
	$(MAKE) -C ld_hook

# Fails loudly when one lock hand-off at 512 waiting clients costs the core 25 % more
# instructions than recorded (callgrind, bench/results/lock_handoff.md): not part of `make test`.
bench-guard: venv
	$(BIN)/python bench/core_cost.py guard

lint: venv
	$(BIN)/ruff check appliance tests bench scripts
	$(BIN)/ruff format --check appliance tests bench scripts
	$(BIN)/mypy
	$(BIN)/lint-imports --no-logo --no-cache

# Bare-metal install (root): hook, venv, systemd unit, default policy. INSTALL_ARGS=--preload
# also adds the hook to /etc/ld.so.preload. `make uninstall` removes exactly what was installed.
install: hook
	scripts/install.sh $(INSTALL_ARGS)

uninstall:
	scripts/install.sh --uninstall $(INSTALL_ARGS)

clean:
	$(MAKE) -C ld_hook clean
	rm -rf $(VENV) .venv-lock *.egg-info
