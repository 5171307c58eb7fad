"""What this machine's kernel and userland can do, probed for real.

`probe()` creates a temporary namespace (tbprobe-<pid>), adds a veth pair in
it and tries each qdisc/classifier through netlink, catching the kernel's
refusal; the namespace is removed afterwards. The result is cached for the
process. It also measures the latency floor: the one-way delay of an
unshaped hop (worker namespace -> veth -> bridge in a switch namespace),
below which asking for a delay is meaningless (shaping gives such links no
delay element at all).

Nothing here changes the root namespace.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import threading
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from testbed import procs
from testbed.errors import CapabilityError
from testbed.net.netns import run_in_netns  # noqa: F401  (also used by delayline)

# -- the result ------------------------------------------------------------------

@dataclass
class Capabilities:
    netem: bool = False          # sch_netem: delay, jitter, loss in the kernel
    htb: bool = False            # sch_htb: bandwidth
    tbf: bool = False            # sch_tbf
    bpf: bool = False            # clsact + cls_bpf (direct action) + bpf(2): loss without netem
    gact_random: bool = False    # act_gact with a random verdict (CONFIG_GACT_PROB)
    nftables: bool = False       # nft works inside a namespace
    tun: bool = False            # /dev/net/tun, TAP with IFF_VNET_HDR: the userspace delay line
    ifb: bool = False            # ifb devices (ingress shaping)
    docker: bool = False         # a Docker daemon answers
    gpus: list[str] = field(default_factory=list)
    cgroup: str = "none"         # "v1" | "v2" | "hybrid" | "none"
    latency_floor_s: float | None = None   # one-way, unshaped hop; None when not measured
    is_root: bool = False
    kernel: str = ""
    notes: dict[str, str] = field(default_factory=dict)   # why a probe failed

    @property
    def delay_line(self) -> bool:
        """Delay/jitter can be emulated without netem (userspace delay line over TAPs)."""
        return self.tun

    @property
    def can_delay(self) -> bool:
        return self.netem or self.tun

    @property
    def can_lose(self) -> bool:
        return self.netem or self.bpf

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["delay_line"] = self.delay_line
        return d

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Capabilities":
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in names})

    def rows(self) -> list[tuple[str, bool, str]]:
        """(capability, found, what it enables / what to install) for `testbed doctor`."""
        floor = ("not measured" if self.latency_floor_s is None
                 else f"{self.latency_floor_s * 1e6:.0f} us one-way")
        gpu_text = (", ".join(self.gpus) if self.gpus else "no NVIDIA GPU (nvidia-smi -L found none): CPU/gloo only")
        rows = [
            ("root", self.is_root, "namespaces and tc need root: run with sudo"),
            ("htb", self.htb, "link bandwidth (sch_htb; CONFIG_NET_SCH_HTB)"),
            ("netem", self.netem,
             "delay, jitter and loss in the kernel (sch_netem; CONFIG_NET_SCH_NETEM, "
             "package linux-modules-extra on Ubuntu)" if not self.netem else
             "delay, jitter and loss in the kernel (sch_netem)"),
            ("tun", self.tun, "userspace delay line when netem is missing (/dev/net/tun, TAP + IFF_VNET_HDR)"),
            ("bpf", self.bpf, "loss without netem (clsact + cls_bpf; CONFIG_NET_CLS_BPF, CONFIG_BPF_SYSCALL)"),
            ("gact_random", self.gact_random, "alternative loss action (CONFIG_GACT_PROB); not required"),
            ("tbf", self.tbf, "token bucket (sch_tbf); not required"),
            ("ifb", self.ifb, "ingress shaping through IFB; not required"),
            ("nftables", self.nftables, "packet filters inside namespaces (nft); not required"),
            ("docker", self.docker, "the docker runtime (a daemon at DOCKER_HOST or /var/run/docker.sock)"),
            ("gpus", bool(self.gpus), gpu_text),
            ("cgroup", self.cgroup != "none", f"cgroup {self.cgroup}: worker CPU/memory limits"),
            ("latency_floor", self.latency_floor_s is not None,
             f"{floor}: delays at or below it get no delay element"),
        ]
        off = turned_off(self)
        return [(name, found, off[name] if not found and name in off else what) for name, found, what in rows]


_CACHE: Capabilities | None = None
_LOCK = threading.Lock()


def probe(measure_floor: bool = True, refresh: bool = False) -> Capabilities:
    """Probe once per process (cached). measure_floor adds ~0.3 s (two namespaces and a ping).

    The kernel's answers (and the floor) are also kept on disk for the current boot, so
    that every `testbed up` does not pay ~1 s for them; refresh=True (doctor) probes anew.
    """
    global _CACHE
    with _LOCK:
        if _CACHE is None and not refresh:
            _CACHE = _load_boot_cache()
            if _CACHE is not None:  # what may change within a boot is probed again (cheap)
                _CACHE.gpus, _CACHE.docker, _CACHE.cgroup = _gpus(), _docker_answers(), _cgroup_mode()
        if _CACHE is None or refresh:
            _CACHE = _probe_all()
        if measure_floor and _CACHE.latency_floor_s is None and _CACHE.is_root:
            try:
                _CACHE.latency_floor_s = measure_latency_floor()
            except Exception as exc:  # a floor we cannot measure is not fatal
                _CACHE.notes["latency_floor"] = str(exc)
        # Keep only a probe that worked: HTB is in every kernel we run on, so a probe without it
        # failed (a loaded machine) and must not be believed for the rest of the boot.
        if _CACHE.is_root and _CACHE.htb and "kernel" not in _CACHE.notes:
            _save_boot_cache(_CACHE)
        return without(_CACHE, os.environ.get(WITHOUT_VAR, ""))


# What a user may ask testbed to do without (WITHOUT_VAR="netem,bpf"): the kernel features the data
# plane has a fallback or a refusal for (testbed.net.shaping), so that a machine whose kernel has them
# can run, test and time the paths of one that does not (`TESTBED_WITHOUT=netem`: every delayed link
# on a delay line; `netem,bpf`: loss refused; `netem,tun`: delays refused).
WITHOUT_VAR = "TESTBED_WITHOUT"
OPTIONAL = ("netem", "bpf", "tun")
TURNED_OFF = "turned off by "   # how a note of without() begins


def without(caps: Capabilities, text: str) -> Capabilities:
    """caps with the features named in `text` (comma-separated, from WITHOUT_VAR) turned off, each with
    a note saying so; caps itself when it names none. The probe's own answers (and its cache on disk)
    are not changed."""
    wanted = [w.strip() for w in text.split(",") if w.strip()]
    if not wanted:
        return caps
    unknown = [w for w in wanted if w not in OPTIONAL]
    if unknown:
        raise CapabilityError(f"{WITHOUT_VAR}={text!r}: {', '.join(map(repr, unknown))} is not a kernel feature "
                              f"testbed can do without (one of: {', '.join(OPTIONAL)})")
    notes = dict(caps.notes)
    for w in wanted:
        notes[w] = f"{TURNED_OFF}{WITHOUT_VAR}={text}" + ("" if getattr(caps, w) else " (the kernel lacks it too)")
    return replace(caps, **{w: False for w in wanted}, notes=notes, gpus=list(caps.gpus))


def turned_off(caps: Any) -> dict[str, str]:
    """feature -> why, for the features WITHOUT_VAR turned off (notes of any shape: they may come from
    a cache file or a state)."""
    notes = getattr(caps, "notes", None)
    if not isinstance(notes, dict):
        return {}
    return {k: v for k, v in notes.items() if isinstance(v, str) and v.startswith(TURNED_OFF)}


def boot_id() -> str:
    """This boot's id: what per-boot caches (capabilities, calibration) are keyed on."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _cache_path() -> Path:
    from testbed import paths

    return paths.root() / ".capabilities.json"


def _load_boot_cache() -> Capabilities | None:
    try:
        path = _cache_path()
        text = path.read_text()
        data = json.loads(text)
        _ON_DISK[str(path)] = text
        if data.get("boot_id") != boot_id() or data.get("kernel") != os.uname().release \
                or os.geteuid() != 0 or data.get("latency_floor_s") is None:
            return None
        data.pop("boot_id", None)
        return Capabilities.from_json(data)
    except (OSError, ValueError, TypeError):
        return None


_ON_DISK: dict[str, str] = {}   # cache file -> its text as this process last read or wrote it


def _save_boot_cache(caps: Capabilities) -> None:
    text = json.dumps({**caps.to_json(), "boot_id": boot_id()})
    p = _cache_path()
    if _ON_DISK.get(str(p)) == text:
        return   # unchanged: every `up` rewrote it (an os.replace on /run is a journal commit where /run is a disk)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".capabilities.json.{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, p)
        _ON_DISK[str(p)] = text
    except OSError:
        pass  # a cache we cannot write only costs time


def capabilities() -> Capabilities:
    """The cached probe (with the latency floor)."""
    return probe(measure_floor=True)


# -- the probes --------------------------------------------------------------------

def _probe_all() -> Capabilities:
    caps = Capabilities(is_root=os.geteuid() == 0, kernel=os.uname().release)
    caps.cgroup = _cgroup_mode()
    caps.gpus = _gpus()
    caps.docker = _docker_answers()
    if caps.is_root:
        sweep_stale_probes()
        try:
            _probe_kernel(caps)
        except Exception as exc:
            caps.notes["kernel"] = f"kernel probe failed: {exc}"
    else:
        caps.notes["kernel"] = "not root: kernel features not probed"
    return caps


PROBE_PREFIX = "tbprobe-"   # not "tb-": no testbed's namespace (tb-NAME-NODE) can look like a probe's


def _probe_ns_name(suffix: str = "") -> str:
    return f"{PROBE_PREFIX}{os.getpid()}{suffix}"


def sweep_stale_probes() -> list[str]:
    """Remove probe namespaces (tbprobe-<pid>[-w|-s]) whose process is gone (killed mid-probe)."""
    removed = []
    try:
        names = os.listdir("/run/netns")
    except OSError:
        return removed
    for name in names:
        m = re.fullmatch(r"tbprobe-(\d+)(-[ws])?", name)
        if not m or procs.exists(int(m.group(1))):
            continue
        try:
            from pyroute2 import netns

            netns.remove(name)
            removed.append(name)
        except Exception:
            pass
    return removed


def _probe_kernel(caps: Capabilities) -> None:
    from pyroute2 import IPRoute, netns
    from pyroute2.netlink.exceptions import NetlinkError

    ns = _probe_ns_name()
    netns.create(ns)
    try:
        def work() -> None:
            with IPRoute() as ipr:
                ipr.link("add", ifname="tbp0", kind="veth", peer={"ifname": "tbp1"})
                idx = ipr.link_lookup(ifname="tbp0")[0]
                ipr.link("set", index=idx, state="up")

                def attempt(name: str, fn: Callable[[], Any]) -> bool:
                    try:
                        fn()
                        return True
                    except NetlinkError as exc:
                        caps.notes[name] = f"netlink error {exc.code}: {os.strerror(exc.code)}"
                        return False
                    except Exception as exc:
                        caps.notes[name] = str(exc)
                        return False

                def root_qdisc(kind: str, **kw: Any) -> Callable[[], None]:
                    def fn() -> None:
                        ipr.tc("add", kind, idx, 0x10000, **kw)
                        ipr.tc("del", index=idx, handle=0x10000, parent=0xFFFFFFFF)
                    return fn

                caps.netem = attempt("netem", root_qdisc("netem", delay=1000))
                caps.htb = attempt("htb", root_qdisc("htb", default=1))
                caps.tbf = attempt("tbf", root_qdisc("tbf", rate="1mbit", burst=10000, latency=50000))

                def bpf() -> None:
                    from testbed.net import lossfilter
                    lossfilter.install(ipr, idx, 0.5)
                    lossfilter.remove(ipr, idx)
                caps.bpf = attempt("bpf", bpf)
                try:
                    caps.ifb = attempt("ifb", lambda: ipr.link("add", ifname="tbpifb", kind="ifb"))
                except Exception:
                    caps.ifb = False

        run_in_netns(ns, work)
        caps.tun = _probe_tun(ns, caps)
        caps.gact_random = _probe_gact_random(ns, caps)
        caps.nftables = _probe_nft(ns, caps)
    finally:
        try:
            netns.remove(ns)
        except Exception:
            pass


def _probe_tun(ns: str, caps: Capabilities) -> bool:
    from testbed.net import delayline

    def work() -> bool:
        fd = delayline.open_tap("tbptap0")
        os.close(fd)
        return True

    try:
        return run_in_netns(ns, work)
    except Exception as exc:
        caps.notes["tun"] = str(exc)
        return False


def _probe_gact_random(ns: str, caps: Capabilities) -> bool:
    # tc CLI as a last resort: pyroute2 0.9.7 cannot encode TCA_GACT_PROB, and
    # this probe only informs `doctor` (loss without netem uses cls_bpf).
    if not shutil.which("tc"):
        caps.notes["gact_random"] = "tc not installed"
        return False
    cmds = [
        ["tc", "qdisc", "add", "dev", "tbp0", "clsact"],
        ["tc", "filter", "add", "dev", "tbp0", "egress", "protocol", "all", "prio", "1", "u32",
         "match", "u32", "0", "0", "action", "gact", "ok", "random", "netrand", "drop", "10"],
    ]
    for cmd in cmds:
        r = subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, timeout=10)
        if r.returncode != 0:
            caps.notes["gact_random"] = (r.stderr or r.stdout).strip()
            return False
    return True


def _probe_nft(ns: str, caps: Capabilities) -> bool:
    if not shutil.which("nft"):
        caps.notes["nftables"] = "nft not installed"
        return False
    r = subprocess.run(["ip", "netns", "exec", ns, "nft", "add", "table", "inet", "tbprobe"],
                       capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        caps.notes["nftables"] = r.stderr.strip()
    return r.returncode == 0


def _cgroup_mode() -> str:
    try:
        mounts = [line.split() for line in open("/proc/mounts")]
    except OSError:
        return "none"
    v1 = any(m[2] == "cgroup" for m in mounts if len(m) > 2)
    v2 = any(m[2] == "cgroup2" for m in mounts if len(m) > 2)
    if v1 and v2:
        return "hybrid"
    if v2:
        return "v2"
    if v1:
        return "v1"
    return "none"


def _gpus() -> list[str]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        r = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    if r.returncode != 0:
        return []
    return [line.strip() for line in r.stdout.splitlines() if line.strip().startswith("GPU")]


def _docker_answers(timeout: float = 1.0) -> bool:
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        if host.startswith("unix://"):
            path = host[len("unix://"):]
            if not os.path.exists(path):
                return False
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout)
            s.connect(path)
        elif host.startswith("tcp://"):
            hostport = host[len("tcp://"):].split("/")[0]
            h, _, p = hostport.rpartition(":")
            s = socket.create_connection((h or "localhost", int(p or 2375)), timeout=timeout)
        else:
            return False
        with s:
            s.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            data = s.recv(4096)
        return data.startswith(b"HTTP/") and b" 200 " in data.split(b"\r\n", 1)[0]
    except (OSError, ValueError):
        return False


# -- the latency floor --------------------------------------------------------------

_RTT_RE = re.compile(rb"time=([0-9.]+) ms")


def measure_latency_floor(count: int = 20) -> float:
    """One-way latency of an unshaped hop: worker netns -veth- bridge in a switch netns.

    median(ping RTT) / 2, in seconds (tens of microseconds on a typical box).
    """
    from pyroute2 import IPRoute, netns

    if not shutil.which("ping"):
        raise RuntimeError("ping not installed (iputils-ping)")
    w, s = _probe_ns_name("-w"), _probe_ns_name("-s")
    netns.create(w)
    try:
        netns.create(s)
        try:
            def in_switch() -> None:
                with IPRoute() as ipr:
                    ipr.link("add", ifname="br0", kind="bridge")
                    br = ipr.link_lookup(ifname="br0")[0]
                    ipr.addr("add", index=br, address="10.255.255.1", prefixlen=24)
                    ipr.link("add", ifname="eth0", kind="veth", peer={"ifname": "eth0", "net_ns_fd": w})
                    port = ipr.link_lookup(ifname="eth0")[0]
                    ipr.link("set", index=port, master=br, state="up")
                    ipr.link("set", index=br, state="up")

            def in_worker() -> None:
                with IPRoute() as ipr:
                    idx = ipr.link_lookup(ifname="eth0")[0]
                    ipr.addr("add", index=idx, address="10.255.255.2", prefixlen=24)
                    ipr.link("set", index=idx, state="up")
                    lo = ipr.link_lookup(ifname="lo")[0]
                    ipr.link("set", index=lo, state="up")

            run_in_netns(s, in_switch)
            run_in_netns(w, in_worker)
            # the first packets resolve ARP and warm caches: not part of the floor
            subprocess.run(["ip", "netns", "exec", w, "ping", "-c", "3", "-i", "0.01", "-W", "1",
                            "10.255.255.1"], capture_output=True, timeout=10)
            r = subprocess.run(["ip", "netns", "exec", w, "ping", "-c", str(count), "-i", "0.01", "-W", "1",
                                "10.255.255.1"], capture_output=True, timeout=30)
            rtts = [float(x) / 1000.0 for x in _RTT_RE.findall(r.stdout)]
            if not rtts:
                raise RuntimeError(f"ping got no replies: {r.stdout.decode(errors='replace')[-200:]}")
            return statistics.median(rtts) / 2.0
        finally:
            netns.remove(s)
    finally:
        netns.remove(w)


def to_json_text(caps: Capabilities) -> str:
    return json.dumps(caps.to_json(), indent=2, sort_keys=True)


# -- what the capabilities imply for shaping (testbed.net.shaping re-exports these) ---------

# When the floor could not be measured: what a veth + bridge hop costs on any machine
# (DESIGN.md: tens of microseconds), so a 2 us datacenter link never goes through userspace.
DEFAULT_FLOOR_S = 20e-6


# What one pass through the userspace delay line adds on top of the delay it holds a frame for
# (TAP read, the helper's wake-up, TAP write), measured here: ping over two 50 us, 200 us and
# 1 ms delay-line links gave RTTs 400-470 us above 4x the delay, i.e. ~100-120 us per pass.
DELAY_LINE_OVERHEAD_S = 100e-6


def floor_of(caps: Any) -> float:
    f = getattr(caps, "latency_floor_s", None)
    return float(f) if f else DEFAULT_FLOOR_S


def delay_threshold(caps: Any) -> float:
    """Delay+jitter at or below this gets no delay element: the unshaped hop already costs the
    floor, and without netem the delay line would add its own ~100 us on top of what it holds,
    further from the asked-for delay than no element at all (time dilation multiplies small
    datacenter delays into this range)."""
    floor = floor_of(caps)
    return floor if getattr(caps, "netem", False) else floor + DELAY_LINE_OVERHEAD_S
