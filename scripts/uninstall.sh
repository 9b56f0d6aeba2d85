#!/usr/bin/env bash
# Remove what scripts/install.sh installed (same options: --prefix, --root, --dry-run).
exec "$(dirname "${BASH_SOURCE[0]}")/install.sh" --uninstall "$@"
