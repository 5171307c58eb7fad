"""MLCommons Chakra execution traces as a replay for phantom ranks (`testbed run --replay DIR`).

A Chakra execution trace (ET) is one file per rank, `<prefix>.<rank>.et`: a length-prefixed
protobuf stream of a GlobalMetadata message, then Node messages. MLCommons' own package reads
them (`pip install mlc-chakra`: its et_def_pb2 schema and protolib's decodeMessage); this module
only walks the nodes and turns rank 0's collectives into the operation records the phantoms
replay (what testbed's mirror announces, testbed.jobs.probe._testbed_mirror), with the gaps the
trace gives between them. So a job traced on real hardware, with PyTorch's execution trace
observer and Chakra's converter, puts its communication on an emulated fabric without the job.

What is read from each node: its type, `start_time_micros` and `duration_micros`, and for a
COMM_COLL_NODE the attributes `comm_type` (CollectiveCommType) and `comm_size` (the bytes of
the rank's input, as Chakra's PyTorch converter computes it). Collectives become:

  ALL_REDUCE -> all_reduce of comm_size         ALL_GATHER -> all_gather_into_tensor of comm_size
  REDUCE_SCATTER(_BLOCK) -> reduce_scatter_tensor whose input is comm_size
  BROADCAST -> broadcast from rank 0            ALL_TO_ALL -> all_to_all_single, even splits
  REDUCE -> reduce to rank 0                    BARRIER -> barrier

as float32 elements (the trace's attributes carry bytes, not a dtype), all on the whole world (a
Chakra node's process group name says nothing of its members). Send/receive nodes, GATHER and
SCATTER cannot be replayed to phantoms (a phantom does not know its peer's side): they are
counted and reported, not silently dropped. Times: a node's own start time when the trace has
them, else the running sum of the durations of the nodes before it (in id order).
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_BYTES = 512 << 20          # a trace file larger than this is refused (it is read whole)
MAX_NODES = 5_000_000
_RANK_FILE = re.compile(r"^(?P<prefix>.+)\.(?P<rank>\d+)\.et(\.gz)?$")


class ChakraError(ValueError):
    """A Chakra trace that cannot be replayed; the message names the file and why."""


@dataclass
class Converted:
    source: Path                     # rank 0's file
    world: int
    lines: list[bytes]               # operation records, as testbed.jobs.phantom_ranks.Trace holds them
    times: list[float]               # each record's time (s)
    skipped: dict[str, int] = field(default_factory=dict)   # what could not be replayed, by kind


def _schema() -> tuple[Any, Any]:
    try:
        from chakra.schema.protobuf import et_def_pb2
        from chakra.src.third_party.utils import protolib
    except ImportError as exc:
        raise ChakraError("reading Chakra traces needs MLCommons' package: pip install mlc-chakra "
                          f"(or `pip install -e '.[chakra]'`); import failed: {exc}") from None
    return et_def_pb2, protolib


def rank_files(path: Path) -> dict[int, Path]:
    """rank -> file of a directory of `<prefix>.<rank>.et` files (one prefix)."""
    found: dict[str, dict[int, Path]] = {}
    for p in sorted(path.iterdir()):
        m = _RANK_FILE.match(p.name)
        if m and p.is_file() and not p.is_symlink():
            found.setdefault(m["prefix"], {})[int(m["rank"])] = p
    if not found:
        raise ChakraError(f"{path}: no Chakra trace files (<prefix>.<rank>.et)")
    if len(found) > 1:
        raise ChakraError(f"{path}: traces of several jobs ({', '.join(sorted(found))}): keep one prefix per directory")
    return next(iter(found.values()))


def is_chakra(path: Path) -> bool:
    """A directory of Chakra rank files, or one such file (the replay's other format is JSONL)."""
    if path.is_dir():
        return any(_RANK_FILE.match(p.name) for p in path.iterdir())
    return bool(_RANK_FILE.match(path.name))


def _open(path: Path) -> Any:
    if path.stat().st_size > MAX_BYTES:
        raise ChakraError(f"{path}: larger than {MAX_BYTES >> 20} MiB")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
        if len(raw) > 4 * MAX_BYTES:
            raise ChakraError(f"{path}: more than {4 * MAX_BYTES >> 20} MiB once decompressed")
    import io

    return io.BytesIO(raw)


def _attrs(node: Any) -> dict[str, Any]:
    out = {}
    for a in node.attr:
        which = a.WhichOneof("value")
        if which is not None and not which.endswith("_list"):
            out[a.name] = getattr(a, which)
    return out


def read_nodes(path: Path) -> list[Any]:
    """The Node messages of one rank's trace, in id order."""
    et, protolib = _schema()
    f = _open(path)
    meta = et.GlobalMetadata()
    try:
        if not protolib.decodeMessage(f, meta):
            raise ChakraError(f"{path}: empty, or not a Chakra trace (no global metadata)")
        nodes = []
        while True:
            node = et.Node()
            if not protolib.decodeMessage(f, node):
                break
            nodes.append(node)
            if len(nodes) > MAX_NODES:
                raise ChakraError(f"{path}: more than {MAX_NODES} nodes")
    except ChakraError:
        raise
    except Exception as exc:   # protobuf's DecodeError and friends: a damaged or foreign file
        raise ChakraError(f"{path}: not a Chakra trace ({type(exc).__name__}: {exc})") from None
    return sorted(nodes, key=lambda n: n.id)


def convert(path: Path) -> Converted:
    """Rank 0's collectives of the Chakra trace at `path` (a directory of rank files) as
    operation records; the world size is the number of rank files."""
    et, _protolib = _schema()
    files = rank_files(path) if path.is_dir() else {0: path}
    if sorted(files) != list(range(len(files))):
        raise ChakraError(f"{path}: rank files {sorted(files)}: expected ranks 0..{len(files) - 1}")
    world = len(files)
    if world < 2:
        raise ChakraError(f"{path}: one rank's trace: a replay needs the directory of every rank's file "
                          "(the world size is their number)")
    kinds = {v: k for k, v in et.CollectiveCommType.items()}
    as_op = {"ALL_REDUCE": "allreduce", "ALL_GATHER": "allgather_single", "REDUCE_SCATTER": "reduce_scatter_single",
             "REDUCE_SCATTER_BLOCK": "reduce_scatter_single", "BROADCAST": "broadcast", "ALL_TO_ALL": "alltoall_base",
             "REDUCE": "reduce", "BARRIER": "barrier"}
    nodes = read_nodes(files[0])
    lines = [json.dumps({"ev": "init", "backend": "gloo", "t": 0.0, "world": world, "rank": 0}).encode()]
    times, skipped = [0.0], {}
    clock = 0.0
    own_times = any(n.start_time_micros for n in nodes)
    t0 = min((n.start_time_micros for n in nodes if n.start_time_micros), default=0)
    for n in nodes:
        t = (n.start_time_micros - t0) / 1e6 if own_times else clock
        t = max(t, times[-1])   # played in id order: never back in time
        clock += n.duration_micros / 1e6
        if n.type in (et.COMM_SEND_NODE, et.COMM_RECV_NODE):
            skipped["send/recv"] = skipped.get("send/recv", 0) + 1
            continue
        if n.type != et.COMM_COLL_NODE:
            continue
        a = _attrs(n)
        kind = kinds.get(a.get("comm_type"), f"comm_type {a.get('comm_type')!r}")
        op = as_op.get(kind)
        if op is None:
            skipped[kind] = skipped.get(kind, 0) + 1
            continue
        size = a.get("comm_size", 0)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or (op != "barrier" and size == 0):
            raise ChakraError(f"{files[0]}: node {n.id} ({n.name}): comm_size {size!r} is not a byte count")
        elems = max(1, -(-size // 4))   # float32
        rec: dict[str, Any] = {"ev": "op", "op": op, "g": 0, "t": t}
        if op == "reduce_scatter_single":
            if elems % world:
                elems += world - elems % world   # the input splits evenly across the ranks
            rec.update(dtype="float32", n=[elems // world], red="SUM")
        elif op == "alltoall_base":
            elems += (world - elems % world) % world
            rec.update(dtype="float32", n=[elems], out_n=elems, in_splits=[], out_splits=[])
        elif op != "barrier":
            rec.update(dtype="float32", n=[elems])
            if op in ("allreduce", "reduce"):
                rec["red"] = "SUM"
            if op in ("broadcast", "reduce"):
                rec["root"] = 0
        lines.append(json.dumps(rec, separators=(",", ":")).encode())
        times.append(t)
    if len(lines) == 1:
        raise ChakraError(f"{files[0]}: no collective this replay can play"
                          + (f" (skipped: {', '.join(f'{v} {k}' for k, v in skipped.items())})" if skipped else ""))
    return Converted(files[0], world, lines, times, skipped)
