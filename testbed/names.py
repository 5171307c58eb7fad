"""Names of the kernel resources a testbed owns (a leaf: every layer, the state's schema included,
names things the same way).

Every resource carries the testbed's name, so two testbeds coexist and
cleanup can tell ours from everyone else's. Interface names live inside our
own namespaces, so they only need to fit IFNAMSIZ (15 chars), not be unique.
"""

from __future__ import annotations

import hashlib
import re

PREFIX = "tb-"
IFNAMSIZ = 15
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,39}\Z", re.IGNORECASE)


def valid_testbed_name(name: str) -> bool:
    return bool(_NAME_RE.match(name))


def mac_for(testbed: str, key: str) -> str:
    """A stable, locally administered unicast MAC for interface `key` of testbed `testbed` (the same
    on every host of a testbed over several hosts)."""
    h = hashlib.blake2b(f"{testbed}/{key}".encode(), digest_size=5).digest()
    return "02:" + ":".join(f"{b:02x}" for b in h)


def netns(testbed: str, node: str) -> str:
    """Network namespace of a node: tb-<testbed>-<node>."""
    return f"{PREFIX}{testbed}-{node}"


def netns_prefix(testbed: str) -> str:
    return f"{PREFIX}{testbed}-"


CUT_MARK = "~"   # never in a node's name ([A-Za-z0-9_-]): a link's namespace cannot be a node's


def cut_netns(testbed: str, link_index: int) -> str:
    """The namespace of this host's end of a delayed cut link on a kernel without sch_netem (the
    node's port's other end, the delay line's TAPs, the VXLAN device): tb-<testbed>-~l<index>."""
    return f"{PREFIX}{testbed}-{CUT_MARK}l{link_index}"
