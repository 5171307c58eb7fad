#!/usr/bin/env bash
# A private Docker daemon for testbed's docker runtime and tests.
#
#   scripts/dockerd.sh start    start it (if not running), wait until it answers,
#                               print `export DOCKER_HOST=unix://...` on stdout
#   scripts/dockerd.sh stop     end it by its pidfile PID and wait for it to exit
#   scripts/dockerd.sh status   exit 0 and print DOCKER_HOST if it answers, else exit 1
#   scripts/dockerd.sh env      print the export line (whether or not it runs)
#
# It never touches the host's firewall or bridges (--iptables=false
# --ip6tables=false --bridge=none: containers use `--network none` and the
# data plane builds their links), and keeps everything in its own places so
# it coexists with a system daemon:
#   data-root  $TESTBED_DOCKER_ROOT  (default /var/lib/testbed-docker; kept between
#                                     runs, so the image cache survives)
#   exec-root  $TESTBED_DOCKER_RUN/exec   (default /run/testbed-docker/exec)
#   socket     $TESTBED_DOCKER_RUN/docker.sock
#   pidfile    $TESTBED_DOCKER_RUN/dockerd.pid, log $TESTBED_DOCKER_RUN/dockerd.log
# Needs root and Debian's docker.io (dockerd, containerd, runc, docker-init).
set -euo pipefail

DATA_ROOT=${TESTBED_DOCKER_ROOT:-/var/lib/testbed-docker}
RUN_DIR=${TESTBED_DOCKER_RUN:-/run/testbed-docker}
SOCK=$RUN_DIR/docker.sock
PIDFILE=$RUN_DIR/dockerd.pid
LOG=$RUN_DIR/dockerd.log
HOST=unix://$SOCK
# Debian's client matches the daemon (20.10) and has buildx; a newer client
# earlier on PATH (/usr/local/bin/docker) may lack it.
DOCKER=${TESTBED_DOCKER_CLIENT:-/usr/bin/docker}
DOCKERD=${TESTBED_DOCKERD:-/usr/sbin/dockerd}
TIMEOUT=${TESTBED_DOCKER_TIMEOUT:-60}

die() { echo "dockerd.sh: $*" >&2; exit 1; }

pid_alive() {
    local pid
    [[ -s $PIDFILE ]] || return 1
    pid=$(<"$PIDFILE")
    [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null
}

answers() { "$DOCKER" -H "$HOST" version --format '{{.Server.Version}}' >/dev/null 2>&1; }

cmd_start() {
    [[ $(id -u) -eq 0 ]] || die "must run as root"
    [[ -x $DOCKERD ]] || die "$DOCKERD not found: apt-get install docker.io"
    [[ -x $DOCKER ]] || die "$DOCKER not found: apt-get install docker.io"
    if pid_alive && answers; then
        echo "dockerd.sh: already running (pid $(<"$PIDFILE"))" >&2
        echo "export DOCKER_HOST=$HOST"
        return 0
    fi
    pid_alive && die "pid $(<"$PIDFILE") from $PIDFILE is alive but does not answer on $SOCK; stop it first"
    mkdir -p "$DATA_ROOT" "$RUN_DIR/exec"
    rm -f "$SOCK" "$PIDFILE"
    # setsid: the daemon outlives this shell and is not in its process group.
    # containerd is started by dockerd itself (its children, under exec-root).
    setsid "$DOCKERD" \
        --data-root "$DATA_ROOT" \
        --exec-root "$RUN_DIR/exec" \
        --host "$HOST" \
        --pidfile "$PIDFILE" \
        --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false \
        --bridge=none \
        --storage-driver "${TESTBED_DOCKER_STORAGE:-overlay2}" \
        >>"$LOG" 2>&1 </dev/null &
    local launched=$! i
    for ((i = 0; i < TIMEOUT * 5; i++)); do
        if answers; then
            echo "dockerd.sh: dockerd up (pid $launched, data-root $DATA_ROOT, log $LOG)" >&2
            echo "export DOCKER_HOST=$HOST"
            return 0
        fi
        kill -0 "$launched" 2>/dev/null || { tail -n 20 "$LOG" >&2; die "dockerd exited; log: $LOG"; }
        sleep 0.2
    done
    tail -n 20 "$LOG" >&2
    kill "$launched" 2>/dev/null || true
    die "dockerd did not answer on $SOCK within ${TIMEOUT}s; log: $LOG"
}

cmd_stop() {
    if ! pid_alive; then
        echo "dockerd.sh: not running" >&2
        rm -f "$PIDFILE"
        return 0
    fi
    local pid i
    pid=$(<"$PIDFILE")
    # Only our daemon: the pid must be a dockerd using our pidfile.
    if ! tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "--pidfile $PIDFILE"; then
        die "pid $pid in $PIDFILE is not our dockerd; not stopping it"
    fi
    kill -TERM "$pid"
    for ((i = 0; i < TIMEOUT * 5; i++)); do
        kill -0 "$pid" 2>/dev/null || { echo "dockerd.sh: stopped (pid $pid)" >&2; rm -f "$PIDFILE"; return 0; }
        sleep 0.2
    done
    echo "dockerd.sh: pid $pid still alive after ${TIMEOUT}s, sending KILL" >&2
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$PIDFILE"
}

cmd_status() {
    if pid_alive && answers; then
        echo "running (pid $(<"$PIDFILE"))" >&2
        echo "export DOCKER_HOST=$HOST"
        return 0
    fi
    echo "not running" >&2
    return 1
}

case ${1:-} in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) echo "export DOCKER_HOST=$HOST" ;;
    *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
