#!/usr/bin/env bash
# A local base image for docker/Dockerfile where no registry can be reached (`make image-base`):
#   scripts/image_base.sh [TAG]          (default TAG: local/kvpool-base:bookworm)
# debootstrap builds a minimal Debian bookworm with python3, python3-venv, python3-pip and ca-certificates, and
# `docker import` turns it into an image that stands in for both of the Dockerfile's bases (CUDA_IMAGE and
# CLIENT_IMAGE; scripts/image_smoke.sh passes it as both). Needs root, debootstrap and a running Docker engine.
#
# What the base adds beyond debootstrap's tree, and why:
# - /usr/bin/python -> python3: the client target's `RUN python -m venv` runs on the base itself (python:3.11-slim
#   has `python`), and the classic builder builds that stage even for --target server.
# - this machine's CA bundle at /etc/ssl/certs/kvpool-base-ca.crt, named by PIP_CERT and SSL_CERT_FILE: pip in the
#   build trusts the same authorities as pip on the host (a TLS-inspecting proxy's CA among them).
# Settings: KVPOOL_BASE_MIRROR (default: the first Debian URI in this machine's apt sources, else deb.debian.org),
# KVPOOL_BASE_SUITE (default bookworm), KVPOOL_BASE_CA (default /etc/ssl/certs/ca-certificates.crt).
set -euo pipefail

tag=${1:-local/kvpool-base:bookworm}
suite=${KVPOOL_BASE_SUITE:-bookworm}
ca=${KVPOOL_BASE_CA:-/etc/ssl/certs/ca-certificates.crt}

die() { echo "image_base: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "debootstrap needs root"
command -v debootstrap >/dev/null || die "debootstrap not found (apt-get install debootstrap)"
docker info >/dev/null 2>&1 || die "no Docker engine answers (start dockerd)"
[ -r "$ca" ] || die "no CA bundle at $ca (set KVPOOL_BASE_CA)"

apt_mirror() {  # the first .../debian URI of this machine's apt sources (deb822 or one-line format)
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
        | grep -v '^[[:space:]]*#' | grep -oE '(https?|file)://[^[:space:]]+/debian/?([[:space:]]|$)' \
        | head -n 1 | tr -d '[:space:]' || true
}
mirror=${KVPOOL_BASE_MIRROR:-$(apt_mirror || true)}
mirror=${mirror:-http://deb.debian.org/debian}

work=$(mktemp -d /tmp/kvpool-base.XXXXXX)
trap 'rm -rf "$work"' EXIT
rootfs=$work/rootfs

echo "image_base: debootstrap $suite from $mirror (about a minute)"
if ! debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        "$suite" "$rootfs" "$mirror" > "$work/debootstrap.log" 2>&1; then
    tail -n 20 "$work/debootstrap.log" >&2
    die "debootstrap failed (log above)"
fi

[ -e "$rootfs/usr/bin/python" ] || ln -s python3 "$rootfs/usr/bin/python"
cp "$ca" "$rootfs/etc/ssl/certs/kvpool-base-ca.crt"
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/log/*.log

tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/kvpool-base-ca.crt' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/kvpool-base-ca.crt' \
    --change 'CMD ["python3"]' \
    --message "kvpool local base: debootstrap $suite minbase + python3" - "$tag" > /dev/null
docker run --rm --network none "$tag" python -c 'import sys, venv, ensurepip; print("image_base:", "'"$tag"'", "Python", sys.version.split()[0])'
