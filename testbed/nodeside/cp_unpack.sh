#!/bin/sh
# testbed cp: a tar stream on stdin unpacked into DIR, a new directory (sh -c TEXT sh DIR TAR_OPTION...).
# The options after DIR go to tar (onto the controller's machine: the caller's files, not the
# stream's owners').
mkdir -m 700 -- "$1" && cd -- "$1" && shift && exec tar -xf - "$@"
