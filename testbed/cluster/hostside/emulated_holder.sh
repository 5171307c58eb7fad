#!/bin/sh
# The holder of an emulated host (testbed/cluster/emulate.py): the process that keeps the host's
# mount and UTS namespaces, and its own /run, alive while its sshd comes and goes.
#
# Started by emulate as `nsenter --net=/run/netns/NETNS -- unshare --mount --uts --propagation
# private -- /bin/sh -c TEXT`, so it runs in the host's network namespace and in new mount and UTS
# namespaces of its own. Given in its environment:
#   TB_HOST   the host's name (its hostname)
#   TB_MARK   "TOKEN NAME": written to /run/.testbed-emulated-host, which proves a process ours
#   TB_ETC, TB_HOME, TB_HOMES   with a login user: DIR/hN/etc, DIR/hN/home and where that goes
#   TB_DOCKER, TB_DOCKER_STAGE, TB_DOCKER_AT   with a shared Docker daemon: its socket, a file
#             under DIR it is bound on first, and where the host sees it (/run/docker.sock)
# Prints "ready" once all is set up, then sleeps until it is killed.
set -e
# every mount below is made in the host's private mount namespace: this machine never sees it, and
# it vanishes with the host
# the Docker daemon's socket (TB_DOCKER) may live under /run, which is covered next: first bound on
# a file under DIR (TB_DOCKER_STAGE), from where it goes to the host's own /run
if [ -n "$TB_DOCKER" ]; then mount --bind "$TB_DOCKER" "$TB_DOCKER_STAGE"; fi
# the machine's mounts under /run (its /run/netns and namespace files) must not show through the
# host's own /run: detached here, deepest first
# (mountinfo escapes blanks in paths as \040: one word per mount point)
# shellcheck disable=SC2013
for m in $(awk '$5 ~ "^/run/" {print $5}' /proc/self/mountinfo | sort -r); do umount -l "$m" 2>/dev/null || true; done
mount -t tmpfs -o mode=0755,nosuid,nodev tbh-run /run
mkdir -p /run/netns /run/testbed /run/lock
mkdir -m 0755 /run/sshd
chmod 1777 /run/lock
if [ -n "$TB_DOCKER" ]; then
  : > "$TB_DOCKER_AT"
  mount --bind "$TB_DOCKER_STAGE" "$TB_DOCKER_AT"
  umount "$TB_DOCKER_STAGE"
fi
# the login user (TB_ETC): the host's own copies of the user and group files, which add it, of
# /etc/hosts (which names the host: sudo looks its name up) and of /etc/sudoers.d (its rule); its
# home (under DIR/hN/home, which it cannot reach: DIR is root's) at /run/home
if [ -n "$TB_ETC" ]; then
  for f in passwd group shadow hosts; do mount --bind "$TB_ETC/$f" "/etc/$f"; done
  if [ -d "$TB_ETC/sudoers.d" ]; then mount --bind "$TB_ETC/sudoers.d" /etc/sudoers.d; fi
  mkdir -m 0755 "$TB_HOMES"
  mount --bind "$TB_HOME" "$TB_HOMES"
fi
printf '%s\n' "$TB_MARK" > /run/.testbed-emulated-host
printf '%s\n' "$TB_HOST" > /proc/sys/kernel/hostname
ip link set dev lo up
echo ready
# (stdin too: the holder keeps nothing of emulate's pipe open)
# shellcheck disable=SC2217
exec sleep infinity </dev/null >/dev/null 2>&1
