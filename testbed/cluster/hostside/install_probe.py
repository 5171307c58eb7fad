"""install's look at a host before it does anything there (testbed/cluster/install.py, step a).

Run on the host as ``PYTHON -I -B -c TEXT PREFIX VERSION MARKER``, with the Python the user named
(--python), which may be any Python: so this file uses no syntax newer than Python 3.5 (no
annotations, no f-strings), and a Python it cannot judge fails here with a traceback, which
install reports as "not a Python 3 we can use".

Prints one JSON line:
  version_info  [major, minor, micro] of this Python
  machine       platform.machine() (the wheels' architecture)
  executable    sys.executable
  venv, ensurepip  whether those modules are there (a venv can be made)
  marker        PREFIX/VERSION/MARKER's JSON, or null (no finished install there)
  testbed       whether PREFIX/VERSION/bin/testbed is executable
  link          where PREFIX/bin/testbed points, or null
  unsafe        [path, uid, mode, is_link] of PREFIX and every directory above it that is not
                root's alone: root runs PREFIX/bin/testbed, so nobody else may be able to change
                PREFIX or what leads to it (a sticky directory above PREFIX, like /tmp, aside)
"""

import json
import os
import platform
import sys
from importlib.util import find_spec


def unsafe_paths(prefix):
    """PREFIX and the directories above it that another user could change, as [path, uid, mode, link]."""
    unsafe = []
    path = prefix
    while True:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            sticky_parent = path != prefix and st.st_mode & 0o1000
            if st.st_uid != 0 or (st.st_mode & 0o022 and not sticky_parent) or os.path.islink(path):
                unsafe.append([path, st.st_uid, oct(st.st_mode & 0o7777), os.path.islink(path)])
        if path == "/":
            return unsafe
        path = os.path.dirname(path)


def probe(prefix, version, marker):
    """What install needs to know of this host: the document main() prints."""
    venv = os.path.join(prefix, version)
    try:
        with open(os.path.join(venv, marker)) as f:
            done = json.load(f)
    except (OSError, ValueError):
        done = None
    link = os.path.join(prefix, "bin", "testbed")
    return {"version_info": list(sys.version_info[:3]), "machine": platform.machine(),
            "unsafe": unsafe_paths(prefix), "executable": sys.executable, "venv": find_spec("venv") is not None,
            "ensurepip": find_spec("ensurepip") is not None, "marker": done,
            "testbed": os.access(os.path.join(venv, "bin", "testbed"), os.X_OK),
            "link": os.readlink(link) if os.path.islink(link) else None}


def main(argv):
    prefix, version, marker = argv[:3]
    print(json.dumps(probe(prefix, version, marker)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
