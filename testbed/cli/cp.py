"""testbed cp SRC DST: copy files between the host and nodes (or node to node).

A path inside a node is written NODE:PATH (`w3:/tmp/out.txt`); anything else
is a path on the host. Semantics follow `docker cp` / `cp -r`:

- a file to an existing directory lands inside it; otherwise it is written
  to DST itself;
- a directory to an existing directory lands inside it (DST/NAME); to a path
  that does not exist yet, DST becomes the copy.

`-` as one side is a tar stream, as with `docker cp`: `testbed cp NODE:PATH -`
writes one to stdout whose single top entry is PATH under its own name (a
symbolic link named as PATH is followed); `testbed cp - NODE:DST` reads one
from stdin and puts its single top entry at DST with the rules above. What
comes in is checked member by member (testbed.tarstream) and written anew
before any of it reaches the node's tar: a stream with more than one top
entry, an absolute path, `..`, a device, or a path through one of its own
symbolic links is refused (exit 2, naming the member); one that stops before
the end of the archive is an error. It is unpacked into a hidden directory
next to its place (`.tbcp-*`) and moved there once whole, so an interrupted
copy never leaves something that looks complete; a directory copied into one
that exists is merged file by file after that, which a failure (a full disk)
can leave half done. Wherever it lands, the files carry no owner of the
stream's (root's, or the caller's: tar's --no-same-owner) and no setuid or setgid
bits. A copy between a node and this machine, or two nodes of one host, takes the
same way: the source is read as a tar stream and passes the same gate.

Copying goes through the node's runtime (`exec` of cat/tar inside it), so it
sees what the node sees: its private /tmp, its /etc/hosts; with the netns
runtime that is `nsenter -t PID -a` into its mount namespace.

A testbed over several hosts: a copy between two nodes of one host runs on
that host; anything else streams through the controller's SSH connections
to the hosts: the side that reads runs `testbed cp NODE:PATH -` on its node's
host (or tar here, for this machine's files), the side that writes runs
`testbed cp - NODE:DST` on its node's host (or the same checked unpacking
here), and the controller passes the tar stream from one to the other, so
nothing stops on a host's disk on the way. A failure names the side (reading
or writing, the node and its host) and what it said.
"""

from __future__ import annotations

from typing import Optional

import typer

from testbed.cli.common import NameOption, require_root


def register(app: typer.Typer) -> None:
    @app.command(help="Copy files or directories between the host and nodes: "
                      "`testbed cp w3:/tmp/out.txt .`, `testbed cp ./data w0:/tmp/`, `testbed cp w0:/a w1:/b`.\n\n"
                      "`-` is a tar stream with one top entry, as with docker cp: `testbed cp w3:/tmp/out -` "
                      "writes one to stdout, `testbed cp - w3:/tmp/` reads one from stdin (checked: more than one "
                      "top entry, absolute paths or `..` are refused). Across hosts it streams through the "
                      "controller's SSH connections.")
    def cp(src: str = typer.Argument(..., help="NODE:PATH, a host path, or - (a tar stream on stdin)."),
           dst: str = typer.Argument(..., help="NODE:PATH, a host path, or - (a tar stream on stdout)."),
           name: Optional[str] = NameOption) -> None:
        from testbed.handle import open_testbed
        from testbed.tarstream import Refused

        require_root("cp")
        if src == "-" and dst == "-":
            raise Refused("SRC and DST are both -: one of them must be NODE:PATH")
        raise typer.Exit(open_testbed(name).cp(src, dst))
