# The two entry points a fresh machine needs: `make run` and `make test`.
# Both install what they need: Debian packages (when missing and we are root), the virtualenv,
# the Python packages and the hook.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOOK := ld_hook/build/libnvshare.so
POLICY_DIR ?= configmaps/default
SOCKET_DIR ?= $(if $(NVSHARE_SOCKET_DIR),$(NVSHARE_SOCKET_DIR),/var/run/nvshare)

# command -> Debian package that provides it
APT_NEEDS := gcc:gcc make:make kubectl:kubernetes-client systemd-analyze:systemd

.PHONY: run demo test deps venv hook lint clean install uninstall

# exec: the daemon takes the recipe shell's place, so the signal that stops `make run` (make
# passes SIGTERM on to its recipe) stops the daemon, and no daemon is left behind.
run: deps venv hook
	exec env NVSHARE_SOCKET_DIR=$(SOCKET_DIR) $(BIN)/nvshare-scheduler --policy-dir $(POLICY_DIR)

# Two programs under the hook share one fake GPU through a scheduler: no GPU, no root needed.
demo: deps venv hook
	$(BIN)/python scripts/demo.py

test: deps venv hook lint
	$(BIN)/pytest -q

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

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

hook: $(HOOK)

$(HOOK): $(wildcard ld_hook/*.c ld_hook/*.h ld_hook/Makefile ld_hook/tests/*.c)
	$(MAKE) -C ld_hook

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
	rm -rf $(VENV) *.egg-info
