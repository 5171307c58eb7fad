"""The last step of an install on a host: the marker, then the PREFIX/bin/testbed link.

Run as ``PREFIX/VERSION/bin/python -I -c TEXT PREFIX VERSION [MARKER MARKER_TEXT]`` (by install.sh
once pip is done, and by install alone to point the link at a version already installed).
With MARKER: writes MARKER_TEXT to PREFIX/VERSION/MARKER (a temporary file renamed over it: the
marker says the install is complete, so it is never seen half written). Then points
PREFIX/bin/testbed at ../VERSION/bin/testbed: a symlink made under a temporary name and renamed
over the old one, so PREFIX/bin/testbed always runs one version or the other.
"""

import os
import sys


def write_marker(prefix, version, name, text):
    marker = os.path.join(prefix, version, name)
    with open(marker + ".tmp", "w") as f:
        f.write(text)
    os.replace(marker + ".tmp", marker)


def point_link(prefix, version):
    bindir = os.path.join(prefix, "bin")
    os.makedirs(bindir, mode=0o755, exist_ok=True)
    tmp = os.path.join(bindir, ".testbed.%d" % os.getpid())
    os.symlink(os.path.join("..", version, "bin", "testbed"), tmp)
    os.replace(tmp, os.path.join(bindir, "testbed"))


def main(argv):
    prefix, version = argv[:2]
    if len(argv) > 2:
        write_marker(prefix, version, argv[2], argv[3])
    point_link(prefix, version)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
