#!/bin/sh
# One install of testbed into PREFIX/VERSION on a host (testbed/cluster/install.py, step c).
#
# Run as root: sh -c TEXT sh PREFIX VERSION PYTHON WHEELS_DIR FORCE MARKER MARKER_TEXT RUN_ID FINISH
# SHA256 BYTES RECEIVE, with the wheelhouse tar on stdin. FINISH and RECEIVE are the texts of
# install_finish.py and install_receive.py (this host may have no testbed yet: nothing is run from
# a path of it). Under a flock on PREFIX/.install.lock (hosts sharing a filesystem install one after
# the other): receives the tar into WHEELS_DIR, checked against SHA256 and BYTES (exit status 4 and
# nothing unpacked if they differ), unpacks it, makes the venv PREFIX/VERSION, pip-installs
# testbed==VERSION from the wheels only, writes the marker and points PREFIX/bin/testbed at it.
# A PREFIX/VERSION without the marker is refused (exit status 3) unless FORCE is 1; one replaced
# is kept aside until the new one works, and comes back if it fails. WHEELS_DIR is removed in
# every case, and a venv this run left half made too.
#
# Prints "@step NAME" lines on stdout as it goes (install._Steps says them): waiting, already
# MARKER_JSON, unmarked, receive, venv, pip, finish, done. pip's output goes to stderr.
set -eu
prefix=$1 version=$2 python=$3 wheels=$4 force=$5 marker_name=$6 marker_text=$7 run=$8 finish=$9
sha=${10} bytes=${11} receive=${12}
venv=$prefix/$version
marker=$venv/$marker_name
made=0
old=
step() { printf '@step %s\n' "$*"; }
cleanup() {
    rc=$?
    rm -rf -- "$wheels"
    if [ "$rc" != 0 ] && [ "$made" = 1 ]; then
        rm -rf -- "$venv"                                  # half made by this install
        if [ -n "$old" ]; then mv -T -- "$old" "$venv"; fi  # what was there comes back
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' HUP INT TERM
umask 022
command -v flock >/dev/null || { echo "flock (util-linux) is not installed on this host" >&2; exit 1; }
mkdir -p -- "$prefix"
exec 9>>"$prefix/.install.lock"
flock -n 9 || { step waiting; flock 9; }
# a host sharing this filesystem may have installed it while this one waited
if [ -f "$marker" ] && [ -x "$venv/bin/testbed" ] && { [ "$force" = 0 ] || grep -q "\"run\": \"$run\"" "$marker"; }; then
    step already "$(cat -- "$marker")"
    "$venv/bin/python" -I -c "$finish" "$prefix" "$version"
    cat >/dev/null
    exit 0
fi
if [ -e "$venv" ] && [ ! -f "$marker" ] && [ "$force" = 0 ]; then
    step unmarked
    echo "$venv exists but holds no $marker_name: testbed install did not make it, or did not finish it;" \
         "remove it, or give --force to replace it" >&2
    exit 3
fi
step receive
mkdir -m 700 -- "$wheels"
"$python" -I -c "$receive" "$wheels/.wheels.tar" "$sha" "$bytes"
tar -C "$wheels" -xf "$wheels/.wheels.tar"
rm -f -- "$wheels/.wheels.tar"
step venv
if [ -e "$venv" ]; then   # (--force, or a repair): kept aside until the new one works
    old=$prefix/.old-$version-$run
    rm -rf -- "$old"
    mv -T -- "$venv" "$old"
fi
made=1
"$python" -I -m venv "$venv"
step pip
# the wheelhouse only: no configuration file (PIP_CONFIG_FILE=/dev/null), no PIP_* variable (--isolated)
env PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -I -m pip --isolated install --no-index --find-links "$wheels" \
    --no-cache-dir --disable-pip-version-check --no-input "testbed==$version" >&2
step finish
"$venv/bin/python" -I -c "$finish" "$prefix" "$version" "$marker_name" "$marker_text"
made=0
if [ -n "$old" ]; then rm -rf -- "$old"; fi
step "done"
