"""Each VXLAN end of a cut link takes frames from its peer host's underlay address only.

A VXLAN device takes every UDP datagram to its port that carries its VNI, whoever sent it: the
kernel checks no source for a point-to-point device (it looks at the source only to learn, and
learning is off). Anyone who reaches a host's underlay could then put frames on a node's link.
So each end gets a filter, in the namespace its UDP socket lives in (the host's, which holds the
underlay; see testbed.net.tunnels): nftables, one table per testbed, `inet testbed-NAME`:

    chain input     hook input, priority raw: udp dport PORT jump port-PORT   (per port in use)
    chain port-P    IPv6 first fragments dropped; @th,96,24 VNI jump end-P-VNI (per end)
    chain end-P-V   ip saddr PEER accept; drop

Datagrams for VNIs that are not this testbed's pass untouched (the table decides for its own
ends only): two testbeds, or a testbed and another VXLAN user, share a host. IPv4 datagrams are
whole at the input hook (the kernel reassembles before it); IPv6 ones are not, and a first
fragment too short to hold the VNI would pass the VNI match unseen, so first fragments to a port
of ours are dropped: our ends never send fragments (`up` checks the underlay's MTU).

The filter checks the source address, which a sender on the same link layer can forge: it keeps
out whatever else reaches the underlay (other hosts, other tenants' traffic, stray senders); it is
not authentication (that would be IPsec or WireGuard under the tunnel).

Rules are written as nft's JSON (`nft -j -f -`), never as nft program text: a value can only ever
be a value. The chains of a table are regenerated whole from its end chains (whose names carry
port and VNI) in one transaction, so a change is atomic and needs no rule handles.

Ownership: the input chain's rules carry the comment "testbed:NAME:DIGEST" (DIGEST: of the state
root, as a namespace's lo alias names it). A table of our name without it is not ours: nothing is
added to it or removed from it (FilterError names it). Every function acts in the calling thread's
network namespace (a child process inherits it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from testbed import paths
from testbed.errors import TestbedError
from testbed.names import valid_testbed_name

FAMILY = "inet"
TABLE_PREFIX = "testbed-"
PRIORITY_RAW = -300            # before conntrack (-200): junk makes no connection entries
NFT_TIMEOUT_S = 30.0
NFT_OUTPUT_MAX = 1 << 20       # what is kept of nft's stdout/stderr (ours: a table of a few KiB)
_END_RE = re.compile(r"end-([0-9]{1,5})-([0-9]{1,8})\Z")
_PORT_RE = re.compile(r"port-([0-9]{1,5})\Z")
_VNI_BITS = (96, 24)           # in the UDP datagram: 8 bytes of UDP header, 4 of VXLAN flags, then the VNI


class FilterError(TestbedError):
    """The underlay filter of a tunnel end could not be read, installed or removed, or a table of
    our name is not provably ours: the message names the table and why."""


@dataclass(frozen=True)
class End:
    """What the filter knows of one tunnel end: the UDP port, the VNI and the peer's address."""

    port: int
    vni: int
    peer: str

    @property
    def chain(self) -> str:
        return f"end-{self.port}-{self.vni}"


def table_name(testbed: str) -> str:
    if not isinstance(testbed, str) or not valid_testbed_name(testbed):
        raise FilterError(f"no underlay filter for testbed {testbed!r}: not a valid testbed name")
    return f"{TABLE_PREFIX}{testbed}"


def owner(testbed: str) -> str:
    """The label that proves a table ours: the testbed's name and a digest of the state root (an
    nft comment holds 128 bytes at most; a state root can be longer)."""
    digest = hashlib.sha256(str(paths.root()).encode()).hexdigest()[:16]
    return f"testbed:{testbed}:{digest}"


# -- the JSON documents (pure) ------------------------------------------------------------------

def _match(left: dict[str, Any], right: Any) -> dict[str, Any]:
    return {"match": {"op": "==", "left": left, "right": right}}


def _rule(table: str, chain: str, expr: list[dict[str, Any]], comment: str | None = None) -> dict[str, Any]:
    rule: dict[str, Any] = {"family": FAMILY, "table": table, "chain": chain, "expr": expr}
    if comment is not None:
        rule["comment"] = comment
    return {"add": {"rule": rule}}


def _chain(table: str, name: str, verb: str = "add", **base: Any) -> dict[str, Any]:
    return {verb: {"chain": {"family": FAMILY, "table": table, "name": name, **base}}}


def end_rules(table: str, end: End) -> list[dict[str, Any]]:
    """The end's chain: its peer's address accepted, anything else dropped (and counted)."""
    proto = "ip6" if ":" in end.peer else "ip"
    return [_rule(table, end.chain, [_match({"payload": {"protocol": proto, "field": "saddr"}}, end.peer),
                                     {"accept": None}]),
            _rule(table, end.chain, [{"counter": {"packets": 0, "bytes": 0}}, {"drop": None}])]


def dispatch(testbed: str, ends: list[End]) -> list[dict[str, Any]]:
    """The input and port chains for `ends`, made anew (flushed first, in the same transaction)."""
    table, label = table_name(testbed), owner(testbed)
    ports = sorted({e.port for e in ends})
    cmds: list[dict[str, Any]] = [_chain(table, "input", type="filter", hook="input", prio=PRIORITY_RAW,
                                         policy="accept"),
                                  _chain(table, "input", "flush")]
    for port in ports:
        chain = f"port-{port}"
        cmds += [_chain(table, chain), _chain(table, chain, "flush"),
                 _rule(table, chain, [_match({"meta": {"key": "nfproto"}}, "ipv6"),
                                      _match({"exthdr": {"name": "frag"}}, True), {"drop": None}])]
        for e in sorted((e for e in ends if e.port == port), key=lambda e: e.vni):
            cmds.append(_rule(table, chain, [
                _match({"payload": {"base": "th", "offset": _VNI_BITS[0], "len": _VNI_BITS[1]}}, e.vni),
                {"jump": {"target": e.chain}}]))
        cmds.append(_rule(table, "input", [_match({"payload": {"protocol": "udp", "field": "dport"}}, port),
                                           {"jump": {"target": chain}}], comment=label))
    return cmds


# -- nft ------------------------------------------------------------------------------------------

def _nft_binary() -> str:
    found = shutil.which("nft", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if not found:
        raise FilterError("nft is not installed: a tunnel end takes frames from its peer host only through an "
                          "nftables filter (Debian: apt-get install nftables)")
    return found


def _nft(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run([_nft_binary(), *args], input=stdin, capture_output=True, text=True,
                              timeout=NFT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise FilterError(f"`nft {' '.join(args)}` did not finish in {NFT_TIMEOUT_S:g} s") from None
    return done


def _apply(table: str, cmds: list[dict[str, Any]], what: str) -> None:
    done = _nft(["-j", "-f", "-"], json.dumps({"nftables": cmds}))
    if done.returncode != 0:
        said = " ".join(done.stderr.strip().split())[-400:] or f"exit status {done.returncode}"
        raise FilterError(f"nftables table {FAMILY} {table}: cannot {what}: {said}")


@dataclass(frozen=True)
class Table:
    """What a table of ours holds: its end chains, and the owner labels its input rules carry."""

    name: str
    ends: tuple[End, ...]
    labels: frozenset[str]
    chains: frozenset[str]


def read(testbed: str) -> Table | None:
    """The testbed's table in this namespace, or None when there is none."""
    table = table_name(testbed)
    done = _nft(["-j", "list", "table", FAMILY, table])
    if done.returncode != 0:
        if "No such file or directory" in done.stderr:
            return None
        raise FilterError(f"cannot list nftables table {FAMILY} {table}: {done.stderr.strip()[-400:]}")
    try:
        items = json.loads(done.stdout[:NFT_OUTPUT_MAX])["nftables"]
    except (ValueError, KeyError, TypeError) as exc:
        raise FilterError(f"cannot read nft's listing of table {FAMILY} {table}: {exc}") from None
    chains, labels, peers = set(), set(), {}
    for item in items if isinstance(items, list) else []:
        chain, rule = item.get("chain") if isinstance(item, dict) else None, \
            item.get("rule") if isinstance(item, dict) else None
        if isinstance(chain, dict) and isinstance(chain.get("name"), str):
            chains.add(chain["name"])
        if isinstance(rule, dict):
            if rule.get("chain") == "input" and isinstance(rule.get("comment"), str):
                labels.add(rule["comment"])
            peer = _peer_of(rule)
            if peer is not None:
                peers[rule.get("chain")] = peer
    ends = []
    for name in sorted(chains):
        m = _END_RE.match(name)
        if m and name in peers:
            ends.append(End(int(m.group(1)), int(m.group(2)), peers[name]))
    return Table(table, tuple(ends), frozenset(labels), frozenset(chains))


def _peer_of(rule: dict[str, Any]) -> str | None:
    """The address an end chain's accepting rule names, or None for any other rule."""
    expr = rule.get("expr")
    if not isinstance(expr, list) or len(expr) != 2 or expr[1] != {"accept": None}:
        return None
    m = expr[0].get("match") if isinstance(expr[0], dict) else None
    left = m.get("left") if isinstance(m, dict) else None
    payload = left.get("payload") if isinstance(left, dict) else None
    if isinstance(payload, dict) and payload.get("field") == "saddr" and isinstance(m.get("right"), str):
        return m["right"]
    return None


def _ours(testbed: str, found: Table) -> None:
    """FilterError unless the table carries our label and no other (an empty table of our name, with
    no input rule, is not provably ours either)."""
    label = owner(testbed)
    if found.labels != {label}:
        said = ", ".join(sorted(found.labels)) or "no owner label"
        raise FilterError(f"nftables table {FAMILY} {found.name} exists but is not provably this testbed's "
                          f"(its input rules say {said}; ours say {label}): not touched. Remove it "
                          f"(nft delete table {FAMILY} {found.name}) if it is a leftover")


# -- what tunnels and teardown call ------------------------------------------------------------------

def install(testbed: str, end: End) -> None:
    """Let `end`'s VNI on its port in from its peer only (added to the testbed's table, made if
    missing; an end already there for that port and VNI is replaced). Atomic."""
    table = table_name(testbed)
    found = read(testbed)
    if found is not None:
        _ours(testbed, found)
    ends = [e for e in (found.ends if found else ()) if e.chain != end.chain] + [end]
    cmds = [{"add": {"table": {"family": FAMILY, "name": table}}},
            _chain(table, end.chain), _chain(table, end.chain, "flush"), *end_rules(table, end),
            *dispatch(testbed, ends)]
    _apply(table, cmds, f"let VNI {end.vni} on UDP port {end.port} in from {end.peer} only")


def remove(testbed: str, port: int, vni: int) -> None:
    """Take the end of `port` and `vni` out of the testbed's table (the table goes with its last
    end); nothing to do when it is not there. FilterError for a table that is not provably ours."""
    found = read(testbed)
    if found is None:
        return
    _ours(testbed, found)
    chain = End(port, vni, "").chain
    rest = [e for e in found.ends if e.chain != chain]
    if not rest:
        _apply(found.name, [{"delete": {"table": {"family": FAMILY, "name": found.name}}}], "delete it")
        return
    # the chains in use made anew, then the unused ones emptied and deleted: nothing jumps to them then
    cmds = dispatch(testbed, rest)
    ports = {e.port for e in rest}
    unused = [name for name in sorted(found.chains)
              if (m := _PORT_RE.match(name)) is not None and int(m.group(1)) not in ports]
    if chain in found.chains:
        unused.append(chain)
    for name in unused:
        cmds += [_chain(found.name, name, "flush"), _chain(found.name, name, "delete")]
    _apply(found.name, cmds, f"take VNI {vni} on UDP port {port} out")


INSTALL_HINT = "install nftables (Debian/Ubuntu: apt-get install nftables; Fedora/RHEL: dnf install nftables)"


def usable() -> str | None:
    """None when this namespace can hold the filter (nft installed, and, as root, the kernel's
    nf_tables answering); else why not, with how to install it. `doctor` and `up --hosts` ask
    before anything is built: without it no tunnel end can be made."""
    try:
        _nft_binary()
    except FilterError:
        return f"nft is not installed: {INSTALL_HINT}"
    if os.geteuid() != 0:
        return None   # (listing needs CAP_NET_ADMIN: found, not tried)
    done = _nft(["-j", "list", "tables", FAMILY])
    if done.returncode != 0:
        said = " ".join(done.stderr.strip().split())[-300:] or f"exit status {done.returncode}"
        return f"nft is installed but cannot list the {FAMILY} tables ({said}): a kernel with nf_tables is needed"
    return None


def _have_nft() -> bool:
    try:
        _nft_binary()
    except FilterError:
        return False
    return True


def remove_testbed(testbed: str) -> bool:
    """For `down`: delete the testbed's table when it is provably ours (FilterError when a table of
    its name is not); False when there was none (or no nft: then none was ever made)."""
    if not _have_nft():
        return False
    found = read(testbed)
    if found is None:
        return False
    _ours(testbed, found)
    _apply(found.name, [{"delete": {"table": {"family": FAMILY, "name": found.name}}}], "delete it")
    return True


def tables() -> list[str]:
    """The testbeds that have a table of our name in this namespace (whoever made it)."""
    done = _nft(["-j", "list", "tables", FAMILY])
    if done.returncode != 0:
        raise FilterError(f"cannot list the nftables tables: {done.stderr.strip()[-400:]}")
    try:
        items = json.loads(done.stdout[:NFT_OUTPUT_MAX])["nftables"]
    except (ValueError, KeyError, TypeError) as exc:
        raise FilterError(f"cannot read nft's list of tables: {exc}") from None
    out = []
    for item in items if isinstance(items, list) else []:
        t = item.get("table") if isinstance(item, dict) else None
        name = t.get("name") if isinstance(t, dict) else None
        if isinstance(name, str) and name.startswith(TABLE_PREFIX) and valid_testbed_name(name[len(TABLE_PREFIX):]):
            out.append(name[len(TABLE_PREFIX):])
    return sorted(out)


def sweep(keep: set[str]) -> list[tuple[str, str]]:
    """For `cleanup`: delete the tables of testbeds not in `keep` that are provably ours (this state
    root's label); others are left alone. Returns (testbed, what) for each table removed."""
    removed: list[tuple[str, str]] = []
    if not _have_nft():
        return removed
    for testbed in tables():
        if testbed in keep:
            continue
        found = read(testbed)
        if found is None or found.labels != {owner(testbed)}:
            continue
        _apply(found.name, [{"delete": {"table": {"family": FAMILY, "name": found.name}}}], "delete it")
        removed.append((testbed, f"nftables table {FAMILY} {found.name} (its tunnel ends' underlay filter)"))
    return removed
