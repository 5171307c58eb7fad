#!/bin/sh
# The step records of the ranks on one host, read since the last poll (testbed/cluster/scenario.py's
# RemoteSteps, the watchdog of a scenario across hosts). Sent as text, never run from a path:
#   sh -c TEXT sh RUN_DIR [FILE=OFFSET ...]
# RUN_DIR: the run directory on this host; FILE=OFFSET: how far each rank file was read before (0
# when not named). Prints the host's clock (date +%s.%N) first, then, for every regular file
# RUN_DIR/probe/rank-*.jsonl (links skipped), one line: its name, the offset read from, and what
# follows that offset, at most 4 MiB of it, in base64 (a rank writes its file while this reads it:
# RemoteSteps keeps only what ends with a newline, and asks from there the next time).
d=$1
shift
date +%s.%N
[ -d "$d/probe" ] || exit 0
for f in "$d"/probe/rank-*.jsonl; do
  if [ ! -f "$f" ] || [ -L "$f" ]; then continue; fi
  b=${f##*/}
  off=0
  for a in "$@"; do
    case $a in "$b="*) off=${a#*=} ;; esac
  done
  printf '%s %s ' "$b" "$off"
  tail -c +$((off + 1)) -- "$f" | head -c 4194304 | base64 -w0
  echo
done
