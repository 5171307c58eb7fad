#!/bin/sh
# A file from the controller into PATH on a host, mode MODE (sh -c TEXT sh PATH MODE, the file on stdin).
# Written to a temporary name beside PATH and renamed: readers never see half a file.
set -e
mkdir -p -- "$(dirname -- "$1")"
t="$1.tbput.$$"
trap 'rm -f -- "$t"' EXIT
(umask 077; cat >"$t")
chmod "$2" "$t"
mv -f -- "$t" "$1"
trap - EXIT
