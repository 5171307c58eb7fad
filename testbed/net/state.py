"""The state of running testbeds: one small JSON document per testbed.

`up` writes /run/testbed/NAME/state.json (atomically, and again as it goes,
so that `cleanup` can undo a half-built testbed), every other command reads
it, `down` removes the directory. Override the root with TESTBED_STATE_DIR
(tests do, to stay out of a user's way).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from testbed.errors import StateError

SCHEMA_VERSION = 1


def root() -> Path:
    return Path(os.environ.get("TESTBED_STATE_DIR", "/run/testbed"))


def directory(name: str) -> Path:
    return root() / name


def path(name: str) -> Path:
    return directory(name) / "state.json"


def exists(name: str) -> bool:
    return path(name).is_file()


def list_names() -> list[str]:
    base = root()
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if (p / "state.json").is_file())


def load(name: str) -> dict[str, Any]:
    p = path(name)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise StateError(f"no testbed named {name!r} is up") from None
    except json.JSONDecodeError as exc:
        raise StateError(f"state of testbed {name!r} is corrupt ({p}: {exc}); run `testbed cleanup`") from None


def save(name: str, data: dict[str, Any]) -> None:
    """Write atomically: a reader never sees half a document."""
    d = directory(name)
    d.mkdir(parents=True, exist_ok=True)
    data = {"schema": SCHEMA_VERSION, **data}
    tmp = d / f".state.json.{os.getpid()}"
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False))
    os.replace(tmp, path(name))


def update(name: str, **fields: Any) -> dict[str, Any]:
    data = load(name)
    data.update(fields)
    save(name, data)
    return data


def remove(name: str) -> None:
    import shutil

    shutil.rmtree(directory(name), ignore_errors=True)
