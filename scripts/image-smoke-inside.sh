#!/bin/sh
# Runs inside the image built by scripts/image-smoke.sh; every step says what it checked.
set -eu
cd /
fail() { echo "image-smoke: FAILED: $*" >&2; exit 1; }

test -f /usr/local/lib/nvshare/libnvshare.so || fail "no hook at /usr/local/lib/nvshare/libnvshare.so"
echo "ok: the hook is where the init container copies it from"

schema=$(python3 -c 'import appliance.policy.schema as s; print(s.SCHEMA_FILE)')
test -f "$schema" && ! test -L "$schema" || fail "the installed schema $schema is not a file"
echo "ok: the installed package carries its schema ($schema)"

nvsharectl policy validate /etc/nvshare/policy.d || fail "nvsharectl policy validate"
echo "ok: nvsharectl policy validate"

mkdir -p /tmp/mig
printf 'migFallback:\n  chains:\n    - ["3g.40gb", "2g.20gb"]\n' >/tmp/mig/50-mig.yaml
chains=$(python3 -c 'from pathlib import Path; from appliance.cluster.webhook import policy_chains
print([list(c) for c in policy_chains(Path("/tmp/mig"))])')
[ "$chains" = "[['3g.40gb', '2g.20gb']]" ] || fail "webhook chains: $chains"
echo "ok: the webhook loads its chains"

export NVSHARE_SOCKET_DIR=/tmp/run
nvshare-scheduler --policy-dir /etc/nvshare/policy.d >/tmp/daemon.log 2>&1 &
pid=$!
i=0
until grep -q "scheduler ready" /tmp/daemon.log; do
  kill -0 "$pid" 2>/dev/null || { cat /tmp/daemon.log; fail "the daemon exited"; }
  i=$((i + 1)); [ "$i" -lt 600 ] || { cat /tmp/daemon.log; fail "the daemon never got ready"; }
  sleep 0.1
done
nvsharectl status --json >/dev/null || fail "nvsharectl status"
kill -TERM "$pid"
wait "$pid" || { cat /tmp/daemon.log; fail "the daemon did not stop cleanly"; }
! grep -q Traceback /tmp/daemon.log || { cat /tmp/daemon.log; fail "a traceback in the log"; }
echo "ok: the daemon started ready, answered nvsharectl status and stopped with status 0"
