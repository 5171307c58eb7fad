#!/bin/sh
# testbed cp: what each path is, inside a node (sh -c TEXT sh PATH...).
# Says one letter a line for each PATH (d: a directory, f: something else there, -: nothing); then
# whether the first is a symbolic link (L or -), and where it leads (readlink -f).
for p; do if [ -d "$p" ]; then echo d; elif [ -e "$p" ]; then echo f; else echo -; fi; done
if [ -L "$1" ]; then echo L; else echo -; fi
readlink -f -- "$1" || true
