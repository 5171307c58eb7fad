#!/usr/bin/env python3
"""Where one read-only verb's time goes, inside its own process: prints one JSON object.

    TESTBED_STATE_DIR=... .venv/bin/python bench/verb_breakdown.py status --json NAME

Run by bench/perf_verbs.py as a process of its own (a fresh interpreter, as a user's `testbed`
is). It times, with perf_counter from the interpreter's start (time.perf_counter at the first
line of this file, which Python reaches after its own start-up):

- cli imports: `testbed.cli`, the verb's module (testbed.cli.status) and what its body imports
  first (testbed.handle), so that the next part holds none of them;
- argument parsing: typer and the CLI's own start (testbed.cli.common.run_app), until the verb's
  body reaches its first call (open_testbed); typer >= 0.2x builds a pydantic TypeAdapter per
  parameter, and imports pydantic the first time;
- state read: store.load_unchecked (the file and its JSON);
- state validation: store._checked (behind store.load and store.validate), including the import
  of testbed.state_schema (the schema's build happens there);
- the verb's own work and output: the rest.

Measured through wrappers around those functions: the verb runs unchanged. Only `status` is
broken down (its body's first call is known).
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import contextlib  # noqa: E402 - after the clock starts
import importlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402


def main(argv: list[str]) -> int:
    import testbed.cli as cli
    importlib.import_module("testbed.cli.status")   # the verb's module, before the clock for parsing
    from testbed import store

    handle = importlib.import_module("testbed.handle")   # what the verb's body imports before its first call

    t_imports = time.perf_counter()
    spent = {"state read": 0.0, "state validation": 0.0}
    body: list[float] = []
    opener = handle.open_testbed

    def open_testbed(*a, **kw):
        body.append(time.perf_counter())
        return opener(*a, **kw)

    handle.open_testbed = open_testbed   # the body imports it from testbed.handle when it runs

    def timed(label: str, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[label] += time.perf_counter() - t
        return wrapper

    store.load_unchecked = timed("state read", store.load_unchecked)
    store._checked = timed("state validation", store._checked)   # (what load and validate both call)
    sys.argv = ["testbed", *argv]
    rc = 0
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            cli.main()
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
    end = time.perf_counter()
    if argv[:1] != ["status"] or not body:
        print(json.dumps({"rc": 2, "error": "only `status` is broken down"}))
        return 2
    parsing = body[0] - t_imports
    verb = end - body[0] - spent["state read"] - spent["state validation"]
    print(json.dumps({"rc": rc, "cli imports": t_imports - T0, "argument parsing (typer) and the CLI's start": parsing,
                      **spent,
                      "the verb's own work and output": verb, "in process": end - T0}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
