"""GPUs: discover them, share few among many workers, and the MPS daemon.

Each worker asks for ``gpus: N`` in the topology. ``plan()`` gives every
worker N distinct physical GPUs of this machine:

- while the topology asks for no more GPUs than exist, every GPU goes to at
  most one worker (exclusive), whatever the policy;
- when it asks for more (16 workers, 2 GPUs), GPUs are time-shared, which
  must be asked for: ``testbed up --allow-gpu-sharing`` (or
  ``gpu_sharing: mps`` in the topology, which implies it). Otherwise ``up``
  refuses with a message saying so. Sharing slows every worker's compute,
  which is why it is opt-in (see time dilation in DESIGN.md);
- ``gpu_policy: round-robin`` (default) deals shared GPUs out in turn
  (w0->g0, w1->g1, w2->g0, ...); ``packed`` fills one GPU with its share of
  workers before the next (w0,w1->g0; w2,w3->g1), which keeps neighbours in
  the worker list (usually a rack) on one GPU.

Workers with ``gpus: 0`` get ``CUDA_VISIBLE_DEVICES=""``: they see no GPU.

Devices are named by UUID in CUDA_VISIBLE_DEVICES (indices depend on
CUDA_DEVICE_ORDER; UUIDs do not). The machine's own CUDA_VISIBLE_DEVICES, when
set, restricts which GPUs the testbed uses.

NCCL and shared GPUs: a distinct NCCL_HOSTID per worker (testbed/runtime/env.py)
keeps NCCL from "Duplicate GPU detected" and from SHM/P2P between workers, so
their traffic crosses the emulated links (NET/Socket).

With ``gpu_sharing: mps`` the testbed starts its own nvidia-cuda-mps-control
(PID in the state, pipe and log dirs under /run/testbed/NAME/mps/) and gives
each worker CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / (workers on its GPU)
and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT = GPU memory / (workers on it).

Everything above ``discover()`` is pure and unit-tested against fake device lists.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from testbed import procs
from testbed.errors import CapabilityError, TestbedError

POLICIES = ("round-robin", "packed")


class GpuError(TestbedError):
    """The topology asks for GPUs this machine cannot give (exit 3, like a capability)."""

    exit_code = 3


@dataclass(frozen=True)
class Gpu:
    index: int                      # nvidia-smi's index (PCI order)
    uuid: str                       # GPU-xxxxxxxx-...
    name: str = ""
    memory_mib: int | None = None
    pci_bus_id: str = ""

    @property
    def cuda_id(self) -> str:
        """How CUDA_VISIBLE_DEVICES names it."""
        return self.uuid or str(self.index)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "name": self.name, "memory_mib": self.memory_mib,
                "pci_bus_id": self.pci_bus_id}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Gpu":
        return cls(**{k: d[k] for k in ("index", "uuid", "name", "memory_mib", "pci_bus_id") if k in d})


# -- parsing nvidia-smi --------------------------------------------------------

QUERY_ARGS = ["--query-gpu=index,uuid,name,memory.total,pci.bus_id", "--format=csv,noheader,nounits"]
_L_RE = re.compile(r"^GPU\s+(\d+):\s*(.*?)\s*\(UUID:\s*([^)]+)\)\s*$")


def parse_query(text: str) -> list[Gpu]:
    """Parse `nvidia-smi --query-gpu=index,uuid,name,memory.total,pci.bus_id --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2 or not parts[0].isdigit():
            continue
        mem: int | None
        try:
            mem = int(float(parts[3])) if len(parts) > 3 else None
        except ValueError:
            mem = None
        gpus.append(Gpu(index=int(parts[0]), uuid=parts[1], name=parts[2] if len(parts) > 2 else "",
                        memory_mib=mem, pci_bus_id=parts[4] if len(parts) > 4 else ""))
    return sorted(gpus, key=lambda g: g.index)


def parse_list(text: str) -> list[Gpu]:
    """Parse `nvidia-smi -L` ("GPU 0: NVIDIA H100 (UUID: GPU-...)"); MIG lines are skipped."""
    gpus = []
    for line in text.splitlines():
        m = _L_RE.match(line.strip())
        if m:
            gpus.append(Gpu(index=int(m.group(1)), uuid=m.group(3).strip(), name=m.group(2)))
    return gpus


def restrict_visible(gpus: Sequence[Gpu], visible: str | None) -> list[Gpu]:
    """The GPUs a CUDA_VISIBLE_DEVICES value (indices or UUIDs, or prefixes of them) leaves, in its order."""
    if visible is None:
        return list(gpus)
    out: list[Gpu] = []
    for tok in (t.strip() for t in visible.split(",")):
        if not tok:
            continue
        match = None
        if tok.isdigit():
            match = next((g for g in gpus if g.index == int(tok)), None)
            if match is None:
                break        # CUDA stops at the first invalid entry
        else:
            cands = [g for g in gpus if g.uuid.startswith(tok) or g.uuid.startswith("GPU-" + tok)]
            if len(cands) != 1:
                break
            match = cands[0]
        if match not in out:
            out.append(match)
    return out


def discover(run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
             environ: Mapping[str, str] | None = None) -> list[Gpu]:
    """The NVIDIA GPUs of this machine ([] when there is none or no driver)."""
    environ = os.environ if environ is None else environ
    gpus: list[Gpu] = []
    smi = shutil.which("nvidia-smi") if run is subprocess.run else "nvidia-smi"
    if smi:
        try:
            r = run([smi, *QUERY_ARGS], capture_output=True, text=True, timeout=20)
            if r.returncode == 0:
                gpus = parse_query(r.stdout)
            if not gpus:
                r = run([smi, "-L"], capture_output=True, text=True, timeout=20)
                if r.returncode == 0:
                    gpus = parse_list(r.stdout)
        except (OSError, subprocess.TimeoutExpired):
            gpus = []
    if not gpus and run is subprocess.run:
        gpus = _discover_nvml()
    return restrict_visible(gpus, environ.get("CUDA_VISIBLE_DEVICES"))


def _discover_nvml() -> list[Gpu]:
    try:
        import pynvml  # type: ignore
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total // (1 << 20)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            name = name.decode() if isinstance(name, bytes) else name
            out.append(Gpu(index=i, uuid=uuid, name=name, memory_mib=int(mem)))
        return out
    except Exception:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


# -- assignment (pure) ---------------------------------------------------------

def assign(requests: Mapping[str, int], devices: Sequence[Gpu], policy: str = "round-robin",
           allow_sharing: bool = False) -> dict[str, list[Gpu]]:
    """Give each worker (in the mapping's order) as many distinct GPUs as it asks for.

    Raises GpuError when there are no GPUs, when one worker asks for more GPUs
    than exist, or when the total asked for exceeds the GPUs and sharing is not allowed.
    """
    if policy not in POLICIES:
        raise GpuError(f"gpu_policy must be one of {', '.join(POLICIES)} (got {policy!r})")
    total = sum(max(0, n) for n in requests.values())
    out: dict[str, list[Gpu]] = {w: [] for w in requests}
    if total == 0:
        return out
    n = len(devices)
    if n == 0:
        raise GpuError(f"the topology asks for {total} GPU(s) but this machine has no NVIDIA GPU "
                       "(nvidia-smi finds none); set gpus: 0 on the workers to run on CPUs")
    for w, k in requests.items():
        if k > n:
            raise GpuError(f"worker {w} asks for {k} GPUs but this machine has {n}: a worker's GPUs "
                           "must be distinct devices")
    if total > n and not allow_sharing:
        raise GpuError(f"the topology asks for {total} GPUs but this machine has {n}: pass "
                       "--allow-gpu-sharing to time-share them among workers (or set gpu_sharing: mps "
                       "in the topology), or lower the workers' gpus")
    load = [0] * n
    cap = math.ceil(total / n)
    cursor = 0
    for w, k in requests.items():
        if k <= 0:
            continue
        if policy == "round-robin":
            picks = [(cursor + j) % n for j in range(k)]
            cursor = (cursor + k) % n
        else:
            picks = [i for i in range(n) if load[i] < cap][:k]
            if len(picks) < k:   # distinctness wins over the cap
                rest = sorted((i for i in range(n) if i not in picks), key=lambda i: (load[i], i))
                picks += rest[:k - len(picks)]
        for i in picks:
            load[i] += 1
        out[w] = [devices[i] for i in picks]
    return out


def sharers(assignment: Mapping[str, Sequence[Gpu]]) -> dict[str, list[str]]:
    """GPU uuid -> the workers on it, in order."""
    out: dict[str, list[str]] = {}
    for w, gpus in assignment.items():
        for g in gpus:
            out.setdefault(g.uuid, []).append(w)
    return out


def mps_limits(worker_gpus: Sequence[Gpu], share: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT for one worker."""
    if not worker_gpus:
        return {}
    most = max(len(share.get(g.uuid, ())) or 1 for g in worker_gpus)
    env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, 100 // most))}
    limits = []
    for pos, g in enumerate(worker_gpus):     # device ordinals as the worker sees them
        if g.memory_mib:
            limits.append(f"{pos}={g.memory_mib // max(1, len(share.get(g.uuid, ())))}M")
    if limits:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(limits)
    return env


@dataclass
class GpuPlan:
    """Who gets which GPU, and the environment that says so."""

    devices: list[Gpu]
    assignment: dict[str, list[Gpu]]
    policy: str = "round-robin"
    mps: bool = False
    share: dict[str, list[str]] = field(default_factory=dict)

    @property
    def oversubscribed(self) -> bool:
        return any(len(ws) > 1 for ws in self.share.values())

    @property
    def used(self) -> list[Gpu]:
        seen = {g.uuid for gs in self.assignment.values() for g in gs}
        return [g for g in self.devices if g.uuid in seen]

    def env(self, worker: str, mps: Mapping[str, Any] | None = None) -> dict[str, str]:
        """GPU environment of a worker; `mps` is the record of start_mps() when MPS runs."""
        gpus = self.assignment.get(worker, [])
        env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(g.cuda_id for g in gpus)}
        if gpus and self.mps and mps:
            env["CUDA_MPS_PIPE_DIRECTORY"] = str(mps["pipe_dir"])
            env["CUDA_MPS_LOG_DIRECTORY"] = str(mps["log_dir"])
            env.update(mps_limits(gpus, self.share))
        return env

    def summary(self) -> list[str]:
        """One line per used GPU: 'GPU 0 NVIDIA H200 (GPU-1234): w0 w1'."""
        lines = []
        for g in self.used:
            lines.append(f"GPU {g.index} {g.name} ({g.uuid}): {' '.join(self.share.get(g.uuid, []))}".replace("  ", " "))
        return lines

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "mps": self.mps, "devices": [g.to_json() for g in self.devices],
                "assignment": {w: [g.uuid for g in gs] for w, gs in self.assignment.items()}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "GpuPlan":
        devices = [Gpu.from_json(x) for x in d.get("devices", [])]
        by = {g.uuid: g for g in devices}
        assignment = {w: [by[u] for u in us if u in by] for w, us in (d.get("assignment") or {}).items()}
        return cls(devices, assignment, d.get("policy", "round-robin"), bool(d.get("mps")), sharers(assignment))


def plan(requests: Mapping[str, int], *, policy: str = "round-robin", sharing: str | None = None,
         allow_sharing: bool = False, devices: Sequence[Gpu] | None = None) -> GpuPlan:
    """Plan GPUs for workers {name: gpus} (discovering devices only if some worker asks for one)."""
    if devices is None:
        devices = discover() if any(n > 0 for n in requests.values()) else []
    mps = sharing == "mps"
    a = assign(requests, devices, policy, allow_sharing or mps)
    return GpuPlan(list(devices), a, policy, mps and any(a.values()), sharers(a))


def plan_topology(topology: Any, *, allow_sharing: bool = False, devices: Sequence[Gpu] | None = None,
                  only: set[str] | None = None) -> GpuPlan:
    """plan() for a Topology's workers (those in `only`: one host's part), its gpu_policy and gpu_sharing."""
    req = {n.name: n.gpus for n in topology.nodes.values() if n.is_worker and (only is None or n.name in only)}
    return plan(req, policy=topology.gpu_policy, sharing=topology.gpu_sharing, allow_sharing=allow_sharing,
                devices=devices)


# -- the MPS control daemon the testbed owns ------------------------------------

def start_mps(state_dir: str | Path, env: Mapping[str, str] | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """Start nvidia-cuda-mps-control (foreground, our child in its own session); return its record.

    Pipe and log directories are under `state_dir`/mps (the host filesystem,
    which netns workers share). The daemon sees every GPU; workers pick theirs
    by UUID in CUDA_VISIBLE_DEVICES.
    """
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        raise CapabilityError("gpu_sharing: mps needs nvidia-cuda-mps-control (NVIDIA's driver utilities)")
    base = Path(state_dir) / "mps"
    pipe, log = base / "pipe", base / "log"
    pipe.mkdir(parents=True, exist_ok=True)
    log.mkdir(parents=True, exist_ok=True)
    denv = dict(os.environ if env is None else env)
    denv.update(CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(log))
    denv.pop("CUDA_VISIBLE_DEVICES", None)
    with open(log / "daemon.out", "ab") as out:
        proc = subprocess.Popen([exe, "-f"], env=denv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True)
    rec = {"pid": proc.pid, "starttime": procs.start_ticks(proc.pid), "pipe_dir": str(pipe), "log_dir": str(log)}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CapabilityError(f"nvidia-cuda-mps-control exited with status {proc.returncode} "
                                  f"(see {log}/daemon.out and {log}/control.log)")
        if (pipe / "control").exists():
            return rec
        time.sleep(0.02)
    stop_mps(rec)
    raise CapabilityError(f"nvidia-cuda-mps-control did not create its pipe in {pipe} within {timeout:.0f} s")


class NotOurs(TestbedError):
    """A record names a process that the second proof says testbed did not start."""


def stop_mps(rec: Mapping[str, Any], timeout: float = 10.0) -> None:
    """Quit the daemon politely (`quit` on its control pipe), then by signal. Idempotent."""
    pid = rec.get("pid")
    if not pid or procs.start_ticks(pid) != rec.get("starttime"):
        return
    ref = procs.ProcRef(int(pid), int(rec["starttime"]))
    if not procs.has_env(ref, "CUDA_MPS_PIPE_DIRECTORY", str(rec["pipe_dir"])):
        raise NotOurs(f"pid {pid} recorded as the MPS daemon was not started with its pipe directory: "
                      "not signalled")
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe:
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(rec["pipe_dir"]),
                   CUDA_MPS_LOG_DIRECTORY=str(rec["log_dir"]))
        try:
            subprocess.run([exe], input="quit\n", text=True, env=env, timeout=timeout,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            pass
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None and procs.start_ticks(pid) == rec.get("starttime"):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout / 3
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            except ChildProcessError:
                pass
            if procs.start_ticks(pid) != rec.get("starttime"):
                return
            time.sleep(0.02)
