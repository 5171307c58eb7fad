"""Errors a user can cause, each with the exit status the CLI returns for it.

Every error that reaches the CLI is one of these: it prints the message and
exits with `exit_code`, never a traceback.
"""

from __future__ import annotations

from typing import Any


class TestbedError(Exception):
    """Base of all user-facing errors."""

    exit_code = 1


class TopologyError(TestbedError):
    """A topology file (or an override) is malformed: exit status 2.

    The message names the file, the field path (dotted, list indices in
    brackets: ``links[2].bandwidth``) and the offending value.
    """

    exit_code = 2
    _MISSING = object()

    def __init__(self, message: str, *, file: str | None = None, path: str | None = None,
                 value: Any = _MISSING):
        self.reason = message
        self.file = file
        self.path = path
        self.value = value
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.file:
            where.append(str(self.file))
        if self.path:
            where.append(self.path)
        text = ": ".join(where + [self.reason]) if where else self.reason
        if self.value is not self._MISSING:
            text += f" (got {self.value!r})"
        return text

    def with_file(self, file: str) -> "TopologyError":
        """The same error, now naming the file it came from."""
        if self.file:
            return self
        return TopologyError(self.reason, file=file, path=self.path, value=self.value)


class CapabilityError(TestbedError):
    """The running kernel or machine cannot do what was asked (checked before anything is created)."""

    exit_code = 3


class StateError(TestbedError):
    """A testbed that should exist does not, or one that should not exists."""

    exit_code = 4


class RunError(TestbedError):
    """A job cannot be run as asked (its command, workers, options): exit status 2."""

    exit_code = 2


class InstallRefused(TestbedError):
    """`testbed install` cannot do what was asked (a relative PREFIX, no source tree, ...): exit 2.
    A host's own problems are never raised: they are in its outcome (testbed.cluster.install)."""

    exit_code = 2


class WheelhouseError(TestbedError):
    """The wheelhouse `testbed install` ships could not be built (pip wheel failed: no network, a
    dependency without a wheel)."""
