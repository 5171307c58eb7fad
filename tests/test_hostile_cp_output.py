"""testbed cp reads what a node's commands print only up to a bound (#23).

cp looks at paths in a node (sh, readlink), reads a file out of it (tar) and moves a copy into
place (mv) by running commands there, whose programs are the node's: a Docker worker's root owns its
image, and a netns worker's mount namespace is its own. Here the test, as root, binds a program that
prints 100 MB over one of them in w0's mount namespace (what root in a container does by writing
/usr/bin). cp must neither keep all of it nor pass it on in its error: it stops at OUTPUT_MAX and
says so.
"""

from __future__ import annotations

import subprocess

import pytest

from test_hostile_cp import TOPO, _tb

pytestmark = pytest.mark.root

LOUD = 100_000_000   # bytes the node's program prints: far past cp.OUTPUT_MAX


@pytest.fixture
def loud_node(testbed, shared_tmp):
    """(testbed name, bind(program, stream)): bind puts a program printing LOUD bytes on stream
    (1: stdout, then exit 0; 2: stderr, then exit 1) over /usr/bin/PROGRAM in w0 only."""
    from testbed import lifecycle
    from testbed.node_exec import node_target
    from testbed.topology.loader import load_topology_text

    st = testbed(load_topology_text(TOPO, "<test>"), runtime="netns")
    rt, rec, _ = node_target(lifecycle.load(st["name"]), "w0")
    pid = rt.pid("w0", rec)

    def bind(program: str, stream: int) -> None:
        fake = shared_tmp / f"loud-{program}"
        fake.write_text(f"#!/bin/sh\nhead -c {LOUD} /dev/zero | tr '\\0' x >&{stream}\nexit {stream - 1}\n")
        fake.chmod(0o755)
        # (in w0's mount namespace only: it is rslave, nothing propagates back here)
        subprocess.run(["nsenter", "-t", str(pid), "-m", "mount", "--bind", str(fake), f"/usr/bin/{program}"],
                       check=True)
    yield st["name"], bind


CASES = {   # the step: (the program faked, the stream it prints on, cp's arguments, cp's error)
    "kinds": ("readlink", 1, ["w0:/etc/hostname", "{tmp}/h"], "cannot look at w0:/etc/hostname"),
    "place": ("mv", 2, ["{tmp}/f", "w0:/tmp/f"], "writing w0:/tmp/f failed"),
    "send": ("tar", 2, ["w0:/etc/hostname", "-"], "reading w0:/etc/hostname failed"),
    # a copy on this host: the node's tar read on a pipe, its stderr never kept whole (nor on disk)
    "copy": ("tar", 2, ["w0:/etc/hostname", "{tmp}/h"], "reading w0:/etc/hostname failed"),
    "unpack": ("tar", 2, ["{tmp}/f", "w0:/tmp/g"], "writing w0:/tmp/g failed"),
}


@pytest.mark.parametrize("step", list(CASES))
def test_what_a_node_prints_is_read_up_to_a_bound(loud_node, shared_tmp, step):
    from testbed import node_files as cp

    assert cp.OUTPUT_MAX == 4 << 20 < LOUD
    name, bind = loud_node
    program, stream, args, error = CASES[step]
    (shared_tmp / "f").write_text("data\n")
    bind(program, stream)
    r = _tb("cp", "--name", name, *(a.format(tmp=shared_tmp) for a in args))
    assert r.returncode != 0, r.stderr[-500:]
    assert len(r.stderr) < 1 << 20, f"cp passed on {len(r.stderr)} bytes of the node's output"
    assert f"{error}: its command printed more than 4 MiB on {'stdout' if stream == 1 else 'stderr'}" \
        in r.stderr, r.stderr[-500:]
    assert not (shared_tmp / "h").exists()
