#!/usr/bin/env bash
# Build the worker image (testbed/worker:latest). `make image` runs this.
#
#   images/worker/build.sh [--base IMAGE] [--tag TAG] [--online] [--no-cache]
#
# --base IMAGE  base image (default testbed/debian-base:bookworm; when that one
#               is missing it is made offline: debootstrap --variant=minbase
#               bookworm + docker import). With a registry, e.g.
#               --base pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime for GPUs.
# --tag TAG     image tag (default testbed/worker:latest)
# --online      let pip inside the build reach the index for what the
#               wheelhouse lacks (default: wheelhouse only)
# --no-cache    rebuild every layer
#
# Environment: DOCKER_HOST (from `scripts/dockerd.sh start`), DOCKER (client,
# default Debian's /usr/bin/docker: it has buildx), TESTBED_CACHE (default
# /var/cache/testbed: build context + wheelhouse), TORCH_WHEEL (a local torch
# wheel; default the newest /opt/wheels/torch-*-cp311-*.whl, else torch from
# the index), DEBIAN_MIRROR (default http://deb.debian.org/debian),
# PYTHON (runs pip download; default the repo's .venv python, else python3).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
DOCKER=${DOCKER:-/usr/bin/docker}
export DOCKER_HOST=${DOCKER_HOST:-unix:///var/run/docker.sock}
CACHE=${TESTBED_CACHE:-/var/cache/testbed}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE=testbed/debian-base:bookworm
DEFAULT_BASE=$BASE
TAG=testbed/worker:latest
PIP_OFFLINE=1
NOCACHE=()
PYVER=3.11      # bookworm's python3; the wheelhouse is for this version

while (($#)); do
    case $1 in
        --base) BASE=$2; shift 2 ;;
        --tag) TAG=$2; shift 2 ;;
        --online) PIP_OFFLINE=0; shift ;;
        --no-cache) NOCACHE=(--no-cache); shift ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "build.sh: unknown option $1" >&2; exit 2 ;;
    esac
done

die() { echo "build.sh: $*" >&2; exit 1; }
log() { echo "build.sh: $*" >&2; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }

[[ -x $DOCKER ]] || die "$DOCKER not found: apt-get install docker.io"
"$DOCKER" version --format '{{.Server.Version}}' >/dev/null 2>&1 \
    || die "no Docker daemon answers at $DOCKER_HOST: run \`eval \"\$(scripts/dockerd.sh start)\"\` (as root) first"

if [[ -z ${PYTHON:-} ]]; then
    if [[ -x $REPO/.venv/bin/python ]]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi

# -- 1. base image ---------------------------------------------------------------
if ! "$DOCKER" image inspect "$BASE" >/dev/null 2>&1; then
    if [[ $BASE != "$DEFAULT_BASE" ]]; then
        log "pulling $BASE"
        "$DOCKER" pull "$BASE"
    else
        command -v debootstrap >/dev/null || die "debootstrap not found: apt-get install debootstrap"
        [[ $(id -u) -eq 0 ]] || die "debootstrap needs root"
        ROOTFS=$(mktemp -d /var/tmp/testbed-rootfs.XXXXXX)
        trap 'rm -rf --one-file-system "$ROOTFS"' EXIT
        t0=$(now)
        log "debootstrap --variant=minbase bookworm from $MIRROR into $ROOTFS"
        debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 \
            || { tail -n 30 "$ROOTFS.log" >&2; die "debootstrap failed (log $ROOTFS.log)"; }
        rm -f "$ROOTFS.log"
        rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
        log "debootstrap took $(since "$t0") s ($(du -sh "$ROOTFS" | cut -f1))"
        t0=$(now)
        tar -C "$ROOTFS" --numeric-owner -c . | "$DOCKER" import \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'CMD ["/bin/bash"]' \
            --message "debootstrap --variant=minbase bookworm ($MIRROR)" - "$BASE" >/dev/null
        log "docker import $BASE took $(since "$t0") s"
        rm -rf --one-file-system "$ROOTFS"
        trap - EXIT
    fi
fi

# -- 2. wheelhouse (made on the host, where pip can reach the index) ------------------
CTX=$CACHE/worker-context
WH=$CTX/wheels
mkdir -p "$WH"
REQ=$(mktemp)
trap 'rm -f "$REQ"' EXIT
# The testbed package's runtime deps from pyproject.toml, less mininet (only the
# host's `mn --custom` import needs it), plus py-spy for looking at stuck ranks.
"$PYTHON" - "$REPO/pyproject.toml" >"$REQ" <<'PY'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
skip = {"mininet"}
for d in deps:
    name = re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0].strip().lower()
    if name not in skip:
        print(d)
print("py-spy")
print("numpy")
PY
if [[ -z ${TORCH_WHEEL:-} ]]; then
    TORCH_WHEEL=$(ls -1 /opt/wheels/torch-*-cp311-*manylinux*x86_64.whl 2>/dev/null | sort -V | tail -n 1 || true)
fi
TORCH_SPEC=${TORCH_WHEEL:-torch}
STAMP=$(printf '%s\n' "$TORCH_SPEC" "$PYVER" | cat - "$REQ" | sha256sum | cut -c1-16)
if [[ $(cat "$WH/.stamp" 2>/dev/null) != "$STAMP" ]]; then
    t0=$(now)
    log "pip download into $WH (torch: $TORCH_SPEC)"
    if [[ -n ${TORCH_WHEEL:-} ]]; then
        ln -f "$TORCH_WHEEL" "$WH/" 2>/dev/null || cp -f "$TORCH_WHEEL" "$WH/"
    fi
    "$PYTHON" -m pip download --quiet --dest "$WH" --only-binary=:all: \
        --python-version "$PYVER" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64 \
        "$TORCH_SPEC" -r "$REQ"
    echo "$STAMP" >"$WH/.stamp"
    log "wheelhouse took $(since "$t0") s ($(du -sh "$WH" | cut -f1))"
fi
cp "$REQ" "$WH/requirements.txt"
cp "$HERE/Dockerfile" "$CTX/Dockerfile"

# -- 3. build ----------------------------------------------------------------------
t0=$(now)
log "building $TAG FROM $BASE"
DOCKER_BUILDKIT=1 "$DOCKER" build --network host "${NOCACHE[@]}" \
    --build-arg "BASE_IMAGE=$BASE" --build-arg "PIP_OFFLINE=$PIP_OFFLINE" \
    --label "testbed.owner=testbed" \
    -t "$TAG" -f "$CTX/Dockerfile" "$CTX"
log "build took $(since "$t0") s; $TAG is $("$DOCKER" image inspect "$TAG" --format '{{.Size}}' | awk '{printf "%.2f GB", $1/1e9}')"

# Keep the layer cache (warm rebuilds take well under a second), drop what a
# rebuild left behind: dangling images, and build cache beyond a cap.
"$DOCKER" image prune -f >/dev/null
"$DOCKER" builder prune -f --keep-storage "${TESTBED_BUILD_CACHE_KEEP:-8GB}" >/dev/null 2>&1 || true
