"""Programs that run inside a host, kept as files so that they can be read, linted and tested alone.

They travel as the text of a command, never by a path on the host: install's run where testbed is
not installed yet (or is another version), and the emulated host's holder runs in namespaces
being made. So the controller reads them from its own package (text(name)) and sends them as
``PYTHON -I -B -c TEXT ARG...`` or ``sh -c TEXT sh ARG...``. Each uses the standard library
(Python) or POSIX sh and coreutils only, and says what it is given and what it answers.

- install_probe.py: what a host's Python is and what PREFIX holds (one JSON line);
- install_receive.py: the wheelhouse from stdin, checked against its size and sha256;
- install_finish.py: the marker of a finished install and the PREFIX/bin/testbed link;
- install.sh: one install of the wheelhouse into PREFIX/VERSION, under PREFIX's lock;
- emulated_holder.sh: the process that keeps an emulated host's mount and UTS namespaces;
- poll_steps.sh: the step records of the ranks on one host since the last poll (the watchdog of a
  scenario across hosts, testbed.cluster.scenario.RemoteSteps).

The .sh files are package data (pyproject.toml); the .py files are modules too, so tests can
import them (their `main(argv)`), and `-c TEXT` runs them as __main__.
"""

from __future__ import annotations

from importlib import resources

__all__ = ["text"]


def text(name: str) -> str:
    """The text of the program `name` of this package (e.g. "install.sh")."""
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
