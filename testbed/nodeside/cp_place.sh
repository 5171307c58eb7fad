#!/bin/sh
# testbed cp: the unpacked copy takes its place at once, by a rename (sh -c TEXT sh TMPDIR ENTRY DST).
mv -f -T -- "$1/$2" "$3" && rmdir -- "$1"
