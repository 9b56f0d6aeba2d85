#!/usr/bin/env bash
# Install (or remove) nvshare-appliance on a bare-metal host: the hook library, a Python venv
# with the daemon, the systemd unit and a default policy. Every file and directory it creates is
# written to an install manifest, and --uninstall removes exactly those (plus the preload line it
# added), so a removal leaves the machine as it was; a policy file you edited is kept.
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: install.sh [options]
  --prefix DIR   where the hook and the venv go (default /opt/nvshare: DIR/lib/libnvshare.so)
  --venv DIR     install the appliance into this venv, creating it if needed (default PREFIX/venv)
  --no-venv      do not install Python parts (packagers, or a venv managed elsewhere)
  --hook FILE    the built hook (default: ld_hook/build/libnvshare.so of this checkout)
  --preload      also add the hook to /etc/ld.so.preload (every dynamically linked program
                 then loads it; it stays dormant in programs that do not use CUDA)
  --root DIR     install into a staging root instead of / (no systemctl calls)
  --dry-run      print what would be done, change nothing
  --uninstall    remove what a previous install recorded in PREFIX/install-manifest
  -h, --help     this text
USAGE
}

PREFIX=/opt/nvshare
VENV=""
NO_VENV=0
HOOK=""
PRELOAD=0
ROOT=/
DRY_RUN=0
UNINSTALL=0
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX="${2:?--prefix needs a directory}"; shift 2 ;;
    --venv) VENV="${2:?--venv needs a directory}"; shift 2 ;;
    --no-venv) NO_VENV=1; shift ;;
    --hook) HOOK="${2:?--hook needs a file}"; shift 2 ;;
    --preload) PRELOAD=1; shift ;;
    --root) ROOT="${2:?--root needs a directory}"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --uninstall) UNINSTALL=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

case "$PREFIX" in /*) ;; *) echo "install.sh: --prefix must be absolute, got '$PREFIX'" >&2; exit 2 ;; esac
ROOT="$(cd "$ROOT" 2>/dev/null && pwd)" || { echo "install.sh: --root directory does not exist" >&2; exit 2; }
[ "$ROOT" = / ] && ROOT=""
VENV="${VENV:-$PREFIX/venv}"
HOOK="${HOOK:-$REPO/ld_hook/build/libnvshare.so}"
LIB="$PREFIX/lib/libnvshare.so"
UNIT=/etc/systemd/system/nvshare-scheduler.service
POLICY_DIR=/etc/nvshare/policy.d
DEFAULT_POLICY="$POLICY_DIR/00-default.yaml"
PRELOAD_FILE=/etc/ld.so.preload
MANIFEST="$PREFIX/install-manifest"
BIN_DIR=/usr/local/bin

if [ -z "$ROOT" ] && [ "$DRY_RUN" = 0 ] && [ "$(id -u)" != 0 ]; then
  echo "install.sh: installing into / needs root (or use --root DIR / --dry-run)" >&2
  exit 1
fi

say() { echo "install.sh: $*"; }
# Run a command, or only show it under --dry-run (words joined by spaces whatever IFS is).
act() {
  if [ "$DRY_RUN" = 1 ]; then printf 'would run:'; printf ' %s' "$@"; printf '\n'; else "$@"; fi
}
systemd_live() { [ -z "$ROOT" ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null; }
record() {  # record "KIND PATH [EXTRA]" once in the manifest
  [ "$DRY_RUN" = 1 ] && return 0
  grep -qxF -- "$*" "$ROOT$MANIFEST" 2>/dev/null || echo "$*" >> "$ROOT$MANIFEST"
}
make_dirs() {  # mkdir -p, recording each directory that did not exist yet, parents first
  local path="" part parts
  IFS=/ read -ra parts <<< "$1"
  for part in "${parts[@]}"; do
    [ -z "$part" ] && continue
    path="$path/$part"
    if [ ! -d "$ROOT$path" ] && [ -z "${DRY_DIRS[$path]:-}" ]; then
      act mkdir -m 0755 "$ROOT$path"
      PENDING_DIRS+=("$path")
      if [ "$DRY_RUN" = 1 ]; then DRY_DIRS[$path]=1; fi
    fi
  done
}
declare -A DRY_DIRS=()  # under --dry-run: directories already shown as made
PENDING_DIRS=()
flush_dirs() { local d; for d in "${PENDING_DIRS[@]}"; do record dir "$d"; done; PENDING_DIRS=(); }

install_files() {
  if [ ! -f "$HOOK" ]; then
    if [ "$DRY_RUN" = 1 ]; then say "note: $HOOK is not built yet (make hook)"
    else echo "install.sh: $HOOK not found: build it with 'make hook', or pass --hook FILE" >&2; exit 1; fi
  fi
  if [ ! -e "$ROOT$MANIFEST" ]; then
    make_dirs "$PREFIX"
    act touch "$ROOT$MANIFEST"
    flush_dirs
  fi
  record file "$MANIFEST"

  make_dirs "$PREFIX/lib"; flush_dirs
  act install -m 0755 "$HOOK" "$ROOT$LIB"
  record file "$LIB"

  if [ "$NO_VENV" = 0 ]; then
    if [ -n "$ROOT" ]; then say "warning: a venv built under --root has that root in its paths"; fi
    if [ ! -x "$ROOT$VENV/bin/python" ]; then
      make_dirs "$(dirname "$VENV")"; flush_dirs
      act python3 -m venv "$ROOT$VENV"
      record venv "$VENV"
    fi
    # Every package at the version requirements.lock names: a new release never changes an install.
    local pins
    pins="$(mktemp)"
    "$REPO/scripts/pins.sh" > "$pins"
    act "$ROOT$VENV/bin/pip" install --quiet --disable-pip-version-check -c "$pins" "$REPO"
    rm -f "$pins"
    # The commands on the PATH, where an existing file of another install is left alone.
    make_dirs "$BIN_DIR"; flush_dirs
    local cmd
    for cmd in nvsharectl nvshare-scheduler; do
      if [ -e "$ROOT$BIN_DIR/$cmd" ] && [ "$(readlink "$ROOT$BIN_DIR/$cmd")" != "$VENV/bin/$cmd" ]; then
        say "keeping $BIN_DIR/$cmd: it is not ours; run $VENV/bin/$cmd"
        continue
      fi
      act ln -sfn "$VENV/bin/$cmd" "$ROOT$BIN_DIR/$cmd"
      record file "$BIN_DIR/$cmd"
    done
  fi

  make_dirs "$(dirname "$UNIT")"; flush_dirs
  if [ "$DRY_RUN" = 1 ]; then
    echo "would write: $ROOT$UNIT (ExecStart from $VENV/bin)"
  else
    sed "s#/opt/nvshare/venv/bin/#$VENV/bin/#" "$REPO/systemd/nvshare-scheduler.service" > "$ROOT$UNIT"
    chmod 0644 "$ROOT$UNIT"
  fi
  record file "$UNIT"

  make_dirs "$POLICY_DIR"; flush_dirs
  if compgen -G "$ROOT$POLICY_DIR/*.yaml" >/dev/null || compgen -G "$ROOT$POLICY_DIR/*.yml" >/dev/null \
     || compgen -G "$ROOT$POLICY_DIR/*.json" >/dev/null; then
    say "$POLICY_DIR already holds a policy; not adding the default one"
  else
    act install -m 0644 "$REPO/configmaps/default/00-default.yaml" "$ROOT$DEFAULT_POLICY"
    if [ "$DRY_RUN" = 0 ]; then
      record conffile "$DEFAULT_POLICY" "$(sha256sum "$ROOT$DEFAULT_POLICY" | cut -d' ' -f1)"
    fi
  fi

  if [ "$PRELOAD" = 1 ]; then
    # Only after the library is in place: a preload line naming a missing file makes every
    # program on the host print an error.
    if [ ! -e "$ROOT$PRELOAD_FILE" ]; then
      make_dirs "$(dirname "$PRELOAD_FILE")"; flush_dirs
      record preload-created "$PRELOAD_FILE"
    fi
    if grep -qxF -- "$LIB" "$ROOT$PRELOAD_FILE" 2>/dev/null; then
      say "$PRELOAD_FILE already names $LIB"
    elif [ "$DRY_RUN" = 1 ]; then
      echo "would append to $ROOT$PRELOAD_FILE: $LIB"
    else
      echo "$LIB" >> "$ROOT$PRELOAD_FILE"
    fi
    record preload "$LIB"
  fi

  if systemd_live; then act systemctl daemon-reload; fi
  if [ "$DRY_RUN" = 1 ]; then say "dry run: nothing was installed"; return 0; fi
  say "installed under ${ROOT:-/}; start it with: systemctl enable --now nvshare-scheduler"
  if [ "$NO_VENV" = 0 ]; then say "nvsharectl and nvshare-scheduler are in $BIN_DIR"; fi
}

remove_preload_line() {
  local file="$ROOT$PRELOAD_FILE" line="$1" kept
  [ -f "$file" ] || return 0
  if [ "$DRY_RUN" = 1 ]; then echo "would remove the line '$line' from $file"; return 0; fi
  kept="$(grep -vxF -- "$line" "$file" || true)"
  if [ -n "$kept" ]; then printf '%s\n' "$kept" > "$file"; else : > "$file"; fi
}

uninstall() {
  if [ ! -f "$ROOT$MANIFEST" ]; then
    echo "install.sh: no install manifest at $ROOT$MANIFEST; nothing was removed" >&2
    exit 1
  fi
  local kind path extra
  # Stop programs from loading the hook before the library goes away.
  while read -r kind path extra; do
    [ "$kind" = preload ] && remove_preload_line "$path"
  done < "$ROOT$MANIFEST"
  while read -r kind path extra; do
    if [ "$kind" = preload-created ] && [ -f "$ROOT$path" ] && [ ! -s "$ROOT$path" ]; then
      act rm -f "$ROOT$path"
    fi
  done < "$ROOT$MANIFEST"
  if systemd_live; then
    act systemctl disable --now nvshare-scheduler.service || true
    # A daemon stopped for good leaves the kernel backstop's limits set: clear them.
    while read -r kind path extra; do
      if [ "$kind" = venv ] && [ -x "$path/bin/nvshare-scheduler" ]; then
        act "$path/bin/nvshare-scheduler" clear-backstop || true
      fi
    done < "$ROOT$MANIFEST"
  fi
  while read -r kind path extra; do
    case "$kind" in
      file) [ "$path" = "$MANIFEST" ] || act rm -f "$ROOT$path" ;;
      venv) act rm -rf "$ROOT$path" ;;
      conffile)
        if [ -f "$ROOT$path" ] && [ "$(sha256sum "$ROOT$path" | cut -d' ' -f1)" = "$extra" ]; then
          act rm -f "$ROOT$path"
        elif [ -e "$ROOT$path" ]; then
          say "keeping $path: it was edited since it was installed"
        fi ;;
    esac
  done < "$ROOT$MANIFEST"
  if systemd_live; then act systemctl daemon-reload; fi
  local dirs
  dirs="$(awk '$1 == "dir" { print $2 }' "$ROOT$MANIFEST" | tac)"
  act rm -f "$ROOT$MANIFEST"
  while read -r path; do
    [ -n "$path" ] || continue
    if [ "$DRY_RUN" = 1 ]; then echo "would remove $ROOT$path if empty"; continue; fi
    rmdir "$ROOT$path" 2>/dev/null || say "keeping $path: not empty"
  done <<< "$dirs"
  if [ "$DRY_RUN" = 1 ]; then say "dry run: nothing was removed"; return 0; fi
  say "removed from ${ROOT:-/}"
}

if [ "$UNINSTALL" = 1 ]; then uninstall; else install_files; fi
