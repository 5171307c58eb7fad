#!/bin/bash
# Runs INSIDE the virtme-ng guest (started by scripts/kernel-vm.sh).
# Usage: guest.sh REPO PYTHON [pytest args...]
# Loads sch_netem (fails if it cannot), then runs the netem-marked tests with
# TESTBED_REQUIRE_NETEM=1 and the strict plugin, so nothing passes by skipping.
# Its exit status is the stage's: vng hands it back to the host.
set -u
repo=$1 py=$2
shift 2

say() { printf 'testbed-kernel-vm: %s\n' "$*"; }
die() { say "FAIL: $1"; say "guest-exit=$2"; exit "$2"; }

say "guest up: kernel $(uname -r), uptime $(cut -d' ' -f1 /proc/uptime) s," \
    "$(nproc) cpus, $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) MiB"

cd "$repo" || die "cannot cd to $repo inside the guest" 91
[ -x "$py" ] || die "python $py is not visible inside the guest" 91

# Kernel modules come from the unpacked .deb (virtme links it at
# /lib/modules/$(uname -r)); the kernel autoloads most of them (veth, bridge),
# but load sch_netem explicitly so a broken module tree fails here, loudly.
modprobe sch_netem || die "modprobe sch_netem failed (modules: $(readlink -f /lib/modules/"$(uname -r)"))" 92
[ -d /sys/module/sch_netem ] || die "sch_netem not loaded after modprobe" 92
say "sch_netem loaded"

export TESTBED_REQUIRE_NETEM=1
export TESTBED_IN_KERNEL_VM=1
# The host root is shared read-only over 9p (only /tmp, /home, /var, ... get a
# tmpfs overlay): no bytecode or pytest cache writes into the repo.
export PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$repo/scripts/kernel_vm${PYTHONPATH:+:$PYTHONPATH}"

t0=$(cut -d' ' -f1 /proc/uptime)
"$py" -m pytest -p no:cacheprovider -p pytest_require_netem -m netem "$@"
rc=$?
t1=$(cut -d' ' -f1 /proc/uptime)
say "pytest exit=$rc in $(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.1f", b - a}') s (guest clock)"
say "guest-exit=$rc"
exit "$rc"
