#!/usr/bin/env bash
# Builds deploy/Dockerfile without a Docker daemon and runs the appliance's smoke test in the
# image: the daemon starts ready and stops cleanly, `nvsharectl policy validate` and the
# webhook's policy load work, the hook is where the DaemonSet's init container copies it from.
#
# Opt-in (it takes minutes and downloads about 150 MB of Debian packages the first time), never
# part of `make test`. Needs root, Debian's `buildah` and `debootstrap`; the base images come
# from Debian's archive because no container registry is assumed to be reachable:
#
#   apt-get install buildah debootstrap && scripts/image-smoke.sh
#
# What differs from a shipped image, on purpose, and is printed at the end:
# - both stages start from a Debian 12 base made here, not python:3.11-slim and manylinux_2_28;
# - so the hook is built against glibc 2.36 and HOOK_MAX_GLIBC is raised to let the build go on
#   (a shipped image must build it on manylinux_2_28 and keep the 2.28 limit);
# - the base trusts this machine's CA bundle, so pip in the build reaches the index through
#   whatever TLS proxy this machine uses.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-/var/tmp/nvshare-image-smoke}
BASE=localhost/nvshare-debian-base:bookworm
IMAGE=${IMAGE:-localhost/nvshare/appliance:smoke}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

for tool in buildah debootstrap git; do
  command -v "$tool" >/dev/null || { echo "image-smoke: $tool is not installed" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "image-smoke: run as root (buildah and debootstrap need it)" >&2; exit 2; }
mkdir -p "$WORK"

if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
  if [ ! -x "$WORK/rootfs/usr/bin/python3" ]; then
    echo "== debootstrap Debian 12 into $WORK/rootfs"
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase --include=python3,python3-pip,gcc,make,libc6-dev,binutils \
      bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log"
  fi
  echo "== base image $BASE"
  rm -f "$WORK/rootfs/usr/lib/python3."*/EXTERNALLY-MANAGED  # pip installs system-wide, as in python:slim
  rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb
  cp /etc/ssl/certs/ca-certificates.crt "$WORK/rootfs/etc/ssl/certs/ca-certificates.crt"
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$WORK/rootfs/etc/pip.conf"
  ctr=$(buildah from scratch)
  cp -a "$WORK/rootfs/." "$(buildah mount "$ctr")/"
  buildah umount "$ctr" >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
  buildah commit -q "$ctr" "$BASE" >/dev/null
  buildah rm "$ctr" >/dev/null
fi

echo "== build $IMAGE from the committed tree (git HEAD)"
rm -rf "$WORK/context" && mkdir -p "$WORK/context"
git -C "$ROOT" archive HEAD | tar -x -C "$WORK/context"
buildah bud --isolation chroot --layers=false -q -f deploy/Dockerfile \
  --build-arg HOOK_BASE="$BASE" --build-arg APP_BASE="$BASE" --build-arg HOOK_MAX_GLIBC=2.36 \
  -t "$IMAGE" "$WORK/context" >"$WORK/build.log" 2>&1 || { tail -n 40 "$WORK/build.log"; exit 1; }

echo "== smoke test in $IMAGE"
ctr=$(buildah from "$IMAGE")
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
buildah copy -q "$ctr" "$ROOT/configmaps/default" /etc/nvshare/policy.d >/dev/null
buildah copy -q "$ctr" "$ROOT/scripts/image-smoke-inside.sh" /tmp/smoke.sh >/dev/null
buildah run --isolation chroot "$ctr" -- sh /tmp/smoke.sh
echo "image-smoke: passed ($IMAGE; hook built against glibc 2.36 on the Debian base, see above)"
