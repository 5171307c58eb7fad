"""Programs testbed runs inside a node as `sh -c TEXT sh ARG...`, kept as files so that they can be
read, linted and tested alone (shellcheck: tests/test_hostside.py). POSIX sh and coreutils only, as
a node's image may have nothing more; each says what it is given and what it answers.

- cp_kinds.sh, cp_unpack.sh, cp_place.sh, cp_merge.sh: `testbed cp`'s looks and steps inside a
  node (testbed.node_files).

The .sh files are package data (pyproject.toml).
"""

from __future__ import annotations

from importlib import resources

__all__ = ["text"]


def text(name: str) -> str:
    """The text of the program `name` of this package (e.g. "cp_kinds.sh")."""
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
