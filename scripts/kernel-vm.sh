#!/bin/bash
# Run the netem-marked tests under a stock Debian kernel booted with virtme-ng.
#
#   scripts/kernel-vm.sh [pytest args...]
#       (default: the files under tests/ that use pytest.mark.netem)
#
# The development/CI kernel has no sch_netem; Debian's generic kernel has it as
# a module. This script resolves the kernel ABI from the linux-image-amd64
# metapackage, downloads that .deb once into a cache, unpacks it, and boots it
# with virtme-ng (TCG, no KVM) on the live system's userspace, where
# scripts/kernel_vm/guest.sh loads sch_netem and runs
#   $VENV/bin/python -m pytest -m netem [pytest args...]
# with TESTBED_REQUIRE_NETEM=1. The guest's exit status is this script's.
# See docs/testing-kernel.md.
#
# Environment (all optional):
#   TESTBED_KERNEL_CACHE    cache dir (default ${XDG_CACHE_HOME:-$HOME/.cache}/testbed-kernel);
#                           must NOT be under /var/cache, /var/tmp, /var/log, /run:
#                           virtme-ng hides those behind a tmpfs in the guest
#   TESTBED_KERNEL_PKG      kernel package to use instead of resolving the metapackage
#                           (e.g. linux-image-6.1.0-57-amd64)
#   TESTBED_KERNEL_META     metapackage to resolve (default linux-image-amd64)
#   TESTBED_KERNEL_CPUS     guest CPUs (default 2)
#   TESTBED_KERNEL_MEM      guest memory (default 1G)
#   TESTBED_KERNEL_TIMEOUT  seconds for the whole VM run (default 780: CI allows 15 min)
#   TESTBED_VENV            venv whose python runs pytest and whose bin has vng
#                           (default REPO/.venv)
#   TESTBED_KERNEL_PREPARE_ONLY=1   download/unpack/depmod only, do not boot
#
# Exit status: the pytest status from inside the VM; 2 usage/prerequisites;
# 3 kernel package resolution/download/unpack; 4 boot failed (no result from
# the guest); 124 timeout.

set -euo pipefail

say() { printf 'testbed-kernel-vm: %s\n' "$*" >&2; }
die() { say "ERROR: $1"; exit "${2:-2}"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN {printf "%.1f", b - a}'; }

T_START=$(now)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
VENV=${TESTBED_VENV:-$REPO/.venv}
PY=$VENV/bin/python
CACHE=${TESTBED_KERNEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/testbed-kernel}
META=${TESTBED_KERNEL_META:-linux-image-amd64}
CPUS=${TESTBED_KERNEL_CPUS:-2}
MEM=${TESTBED_KERNEL_MEM:-1G}
VM_TIMEOUT=${TESTBED_KERNEL_TIMEOUT:-780}
if [ $# -eq 0 ]; then
    # Default: only the test files that carry the netem marker. Collecting the
    # whole tree under TCG costs minutes (a module importing torch at the top
    # did not finish importing in 90 s inside the VM); -m netem still selects.
    mapfile -t DEFAULT_TESTS < <(cd "$REPO" && grep -rlE --include='test_*.py' 'mark\.netem\b' tests | sort)
    [ ${#DEFAULT_TESTS[@]} -gt 0 ] || die "no test file under $REPO/tests uses pytest.mark.netem"
    set -- "${DEFAULT_TESTS[@]}"
fi

# --- prerequisites --------------------------------------------------------
[ "$(uname -m)" = x86_64 ] || die "only x86_64 hosts are supported (uname -m: $(uname -m))"
missing=()
for c in apt-get apt-cache dpkg-deb depmod modprobe qemu-system-x86_64 busybox udevadm file; do
    command -v "$c" >/dev/null 2>&1 || missing+=("$c")
done
[ ${#missing[@]} -eq 0 ] || die "missing commands: ${missing[*]}
  install: apt-get install -y qemu-system-x86 udev busybox-static kmod file"
[ -x "$PY" ] || die "no python at $PY (set TESTBED_VENV)"
[ -x "$VENV/bin/vng" ] || die "no vng in $VENV/bin: $VENV/bin/pip install 'virtme-ng==1.42' (or -e '.[kernel]')"
"$PY" -c 'import pytest, pyroute2' 2>/dev/null || die "$PY cannot import pytest and pyroute2"
export PATH="$VENV/bin:$PATH"   # vng runs virtme-run from PATH

mkdir -p "$CACHE" || die "cannot create cache dir $CACHE"
CACHE=$(cd "$CACHE" && pwd -P)
case "$CACHE/" in
    /var/cache/*|/var/tmp/*|/var/log/*|/var/lib/apt/*|/var/lib/private/*|/run/*|/dev/*)
        die "cache dir $CACHE is hidden behind a tmpfs inside the virtme-ng guest, so the
  kernel modules would be invisible there; use e.g. TESTBED_KERNEL_CACHE=\$HOME/.cache/testbed-kernel" ;;
esac

# --- resolve the kernel package ---------------------------------------------
T_PREP=$(now)
apt_updated=0
apt_update() {
    [ $apt_updated -eq 0 ] || return 1
    [ "$(id -u)" -eq 0 ] || return 1
    say "refreshing apt lists (apt-get update)"
    apt-get update -qq >&2 || die "apt-get update failed" 3
    apt_updated=1
}
resolve_pkg() {
    apt-cache depends "$META" 2>/dev/null \
        | awk '$1 ~ /^\|?Depends:$/ && $2 ~ /^linux-image-.*-amd64$/ && $2 !~ /-cloud-/ {print $2; exit}'
}
if [ -n "${TESTBED_KERNEL_PKG:-}" ]; then
    PKG=$TESTBED_KERNEL_PKG
else
    PKG=$(resolve_pkg) || true
    if [ -z "$PKG" ] && apt_update; then PKG=$(resolve_pkg) || true; fi
    [ -n "$PKG" ] || die "cannot resolve the kernel from '$META' (apt-cache depends $META gave no linux-image-*-amd64;
  run apt-get update, or set TESTBED_KERNEL_PKG)" 3
fi
case "$PKG" in *-cloud-*) die "$PKG is the -cloud- flavour: it has no 9p, virtme-ng cannot boot it" 3 ;; esac
pkg_version() { apt-cache show --no-all-versions "$PKG" 2>/dev/null | awk '/^Version:/ {print $2; exit}'; }
VER=$(pkg_version) || true
if [ -z "$VER" ] && apt_update; then VER=$(pkg_version) || true; fi
[ -n "$VER" ] || die "apt knows no version of $PKG" 3
DEB="$CACHE/${PKG}_${VER//:/%3a}_amd64.deb"
say "kernel package $PKG $VER (from $META)"

if [ ! -s "$DEB" ]; then
    say "downloading $PKG into $CACHE"
    dl() { (cd "$CACHE" && apt-get download -q -o APT::Sandbox::User=root "$PKG=$VER" >&2); }
    if ! dl; then
        # Stale lists: the archive keeps only the current ABI. Refresh once.
        apt_update || die "apt-get download $PKG=$VER failed" 3
        PKG_OLD=$PKG; VER_OLD=$VER
        [ -n "${TESTBED_KERNEL_PKG:-}" ] || PKG=$(resolve_pkg)
        VER=$(pkg_version)
        [ -n "$PKG" ] && [ -n "$VER" ] || die "cannot resolve $META after apt-get update" 3
        [ "$PKG=$VER" = "$PKG_OLD=$VER_OLD" ] || say "now $PKG $VER"
        DEB="$CACHE/${PKG}_${VER//:/%3a}_amd64.deb"
        dl || die "apt-get download $PKG=$VER failed" 3
    fi
    [ -s "$DEB" ] || die "apt-get download did not produce $DEB" 3
fi

# --- unpack once, run depmod ourselves (fail loudly, not virtme's warning) ---
ROOT="$CACHE/${PKG}_${VER}.root"
if [ ! -e "$ROOT/.testbed-ok" ]; then
    say "unpacking $(basename "$DEB")"
    tmp="$ROOT.tmp.$$"
    rm -rf "$tmp"
    mkdir -p "$tmp"
    dpkg-deb -x "$DEB" "$tmp" || { rm -rf "$tmp"; die "dpkg-deb -x $DEB failed" 3; }
    # Newer Debian ships /usr/lib/modules only: give depmod/virtme a /lib/modules.
    if [ ! -d "$tmp/lib/modules" ] && [ -d "$tmp/usr/lib/modules" ]; then ln -s usr/lib "$tmp/lib"; fi
    rm -rf "$ROOT"
    mv "$tmp" "$ROOT"
fi
KVER=$(ls "$ROOT/lib/modules" 2>/dev/null | head -n1)
VMLINUZ="$ROOT/boot/vmlinuz-$KVER"
[ -n "$KVER" ] && [ -f "$VMLINUZ" ] || die "no vmlinuz/modules in $DEB (unpacked at $ROOT)" 3
MODDIR="$ROOT/lib/modules/$KVER"
for m in net/sched/sch_netem.ko fs/9p/9p.ko net/9p/9pnet_virtio.ko; do
    ls "$MODDIR/kernel/$m"* >/dev/null 2>&1 || die "$PKG lacks $m (wrong flavour?)" 3
done
if [ ! -e "$ROOT/.testbed-ok" ]; then
    depmod -a -b "$ROOT" "$KVER" || die "depmod -b $ROOT $KVER failed" 3
    modprobe -d "$ROOT" -S "$KVER" --show-depends sch_netem >/dev/null \
        || die "modprobe cannot resolve sch_netem in $MODDIR" 3
    touch "$ROOT/.testbed-ok"
fi
# Keep only the current kernel in the cache (CI caches the whole directory).
for old in "$CACHE"/linux-image-*; do
    [ -e "$old" ] || continue
    [ "$old" = "$DEB" ] || [ "$old" = "$ROOT" ] || { say "pruning $(basename "$old")"; rm -rf "$old"; }
done
say "kernel $KVER ready in $(since "$T_PREP") s: $VMLINUZ"
[ "${TESTBED_KERNEL_PREPARE_ONLY:-0}" != 1 ] || exit 0

# --- boot ----------------------------------------------------------------
guest_cmd=$(printf '%q ' "$REPO/scripts/kernel_vm/guest.sh" "$REPO" "$PY" "$@")
LOG=$(mktemp "${TMPDIR:-/tmp}/testbed-kernel-vm.XXXXXX")
trap 'rm -f "$LOG" "$LOG.boot"' EXIT
say "booting $KVER: vng --force-9p --disable-kvm --cpus $CPUS -m $MEM (timeout ${VM_TIMEOUT}s)"
say "in the guest: $PY -m pytest -m netem $*"
T_VM=$(now)
set +e
timeout --kill-after=15 "$VM_TIMEOUT" \
    vng --force-9p --disable-kvm --cpus "$CPUS" -m "$MEM" --cwd "$REPO" \
        --run "$VMLINUZ" --exec "$guest_cmd" </dev/null 2>&1 \
    | while IFS= read -r line || [ -n "$line" ]; do
        printf '%s\n' "$line"
        printf '%s\n' "$line" >>"$LOG"
        case $line in
            *"testbed-kernel-vm: guest up"*) since "$T_VM" >"$LOG.boot" ;;
        esac
    done
rc=${PIPESTATUS[0]}
set -e
VM_S=$(since "$T_VM")

guest_rc=$(sed -n 's/.*testbed-kernel-vm: guest-exit=\([0-9]*\).*/\1/p' "$LOG" | tail -n1)
boot_s=$(cat "$LOG.boot" 2>/dev/null || echo "?")
say "timings: prepare $(awk -v a="$T_PREP" -v b="$T_VM" 'BEGIN {printf "%.1f", b - a}') s," \
    "boot (vng start -> guest script) ${boot_s} s, VM total ${VM_S} s, stage total $(since "$T_START") s"
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    say "ERROR: the VM run exceeded ${VM_TIMEOUT}s and was killed"
    exit 124
fi
if [ -z "$guest_rc" ]; then
    grep -q 'testbed-kernel-vm: guest up' "$LOG" \
        && say "ERROR: the guest started but gave no result (crash/panic?); vng exit $rc" \
        || say "ERROR: the kernel did not boot to the guest script; vng exit $rc"
    exit 4
fi
if [ "$rc" -ne "$guest_rc" ]; then
    say "warning: vng exit $rc differs from the guest's $guest_rc"
    [ "$rc" -ne 0 ] || rc=$guest_rc
fi
[ "$rc" -eq 0 ] && say "PASS" || say "FAIL (exit $rc)"
exit "$rc"
