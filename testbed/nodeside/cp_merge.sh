#!/bin/sh
# testbed cp: a copied directory into one that exists, merged file by file (sh -c TEXT sh TMPDIR ENTRY DST).
# Not at once: a failure midway leaves part of it. An existing entry is replaced, never written
# through (a symbolic link there stays unfollowed).
cp -a --remove-destination -- "$1/$2/." "$3/" && rm -rf -- "$1"
