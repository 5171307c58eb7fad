"""Phantom ranks of an NCCL job: 8 workers on one shared GPU, all real against w0 real + 7 phantoms.

Run on a machine with an NVIDIA GPU and CUDA torch, as root:

    PYTHONPATH=. .venv/bin/python tests/gpu/check_phantoms_nccl.py      (or with pytest)

It brings up a star of 8 workers (gpus: 1 each, GPU sharing allowed, GPU 0 only unless
CUDA_VISIBLE_DEVICES says otherwise; 1 Gbit/s links, no time dilation) and runs
examples/train_ddp.py through `testbed run` (backend nccl, an MLP with ~38 MiB of gradients,
20 steps) twice: every rank real, then `--real w0` with TESTBED_PHANTOM_NCCL=1 (the
experimental NCCL path of the phantoms). It prints both runs' iteration p50 (from the probe, as
`testbed report` computes it) and their ratio, and passes when the phantom run completes and
its iteration is within 10% of the all-real run's. Without a GPU, CUDA torch or root it says
SKIP and exits 0 (pytest: skipped). Every run has a hard timeout and the whole check an alarm
(about 8 minutes); the testbed goes down whatever happens.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WORKERS = 8
TOLERANCE = 0.10
RUN_TIMEOUT_S = 200      # each testbed run; its ranks are killed after it
CHECK_ALARM_S = 470      # the whole check
TRAIN = [sys.executable, str(REPO / "examples" / "train_ddp.py"), "--backend", "nccl", "--model", "mlp",
         "--hidden", "2048", "--layers", "3", "--steps", "20", "--log-every", "10", "--no-check"]


class Overtime(Exception):
    pass


def why_skip() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    from testbed.runtime import gpu

    if not gpu.discover():
        return "no NVIDIA GPU (nvidia-smi finds none)"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
        return "torch has no CUDA/NCCL here"
    return None


def star(name: str):
    from testbed.topology.model import Link, LinkProfile, Node, Topology

    nodes = {f"w{i}": Node(f"w{i}", "worker", gpus=1) for i in range(WORKERS)}
    nodes["s0"] = Node("s0", "switch")
    # 1 Gbit/s: the step is the network's (~0.5 s of ring all_reduce), not the shared GPU's
    prof = LinkProfile(bandwidth_bps=1_000_000_000)
    links = [Link(f"w{i}", "s0", "edge", prof, prof) for i in range(WORKERS)]
    return Topology(name, nodes, links).validate()


def _iteration_s(run_dir: Path) -> float | None:
    """The median over the real ranks of their iteration p50 (what `testbed report` shows)."""
    from testbed.report.analyze import analyze

    p50s = [r["iter_p50_s"] for r in analyze(run_dir)["ranks"] if r.get("iter_p50_s")]
    return statistics.median(p50s) if p50s else None


def _log_tail(run_dir: Path, n: int = 4000) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("*.log")))[-n:]


def _link_bytes(summary: dict) -> int:
    return sum(lk["bytes_ab"] + lk["bytes_ba"] for lk in summary.get("links") or [])


def run_check() -> None:
    from testbed import lifecycle
    from testbed.jobs.run import run
    from testbed.jobs.target import cluster_from_state

    def overtime(signum, frame):
        raise Overtime(f"the check ran past {CHECK_ALARM_S} s")

    old_alarm = signal.signal(signal.SIGALRM, overtime)
    signal.alarm(CHECK_ALARM_S)
    set_visible = "CUDA_VISIBLE_DEVICES" not in os.environ
    if set_visible:
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"   # discovery sees GPU 0 only: all 8 workers share it
    name = "gph" + uuid.uuid4().hex[:6]
    base = tempfile.mkdtemp(prefix="testbed-gpu-phantoms-", dir="/var/tmp")
    results = {}
    st = None
    try:
        st = lifecycle.up(star(name), name, allow_gpu_sharing=True, time_dilation="none")   # all or nothing
        used = {u for us in (st["gpu"].get("assignment") or {}).values() for u in us}
        print(f"testbed {name}: {WORKERS} workers on {len(used)} GPU(s); runs under {base}", flush=True)
        cl = cluster_from_state(name)
        common = dict(echo=False, base_dir=base, workdir=str(REPO), monitor=False, timeout=RUN_TIMEOUT_S)
        for mode, real, env in (("all-real", None, {}), ("phantoms", ["w0"], {"TESTBED_PHANTOM_NCCL": "1"})):
            print(f"{mode}: running ...", flush=True)
            res = run(cl, TRAIN, real=real, env={"NCCL_DEBUG": "WARN", **env}, **common)
            results[mode] = res
            it = _iteration_s(res.run_dir) if res.rc == 0 else None
            print(f"{mode}: rc {res.rc} ({res.summary.get('status')}), iteration p50 "
                  f"{'-' if it is None else f'{it * 1e3:.1f} ms'}, {_link_bytes(res.summary) / 2 ** 20:.0f} MiB "
                  f"on the links, {res.summary.get('duration_s', 0):.0f} s, run dir {res.run_dir}", flush=True)
            if res.rc != 0:
                raise AssertionError(f"{mode} run failed (rc {res.rc}):\n{_log_tail(res.run_dir)}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_alarm)
        if set_visible:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        if st is not None:
            lifecycle.down(name)
    full, ph = results["all-real"], results["phantoms"]
    info = ph.summary["phantoms"] or {}
    late = info.get("announce_late_p50_s")
    print(f"phantoms: real ranks {info.get('real_ranks')}, phantom ranks {info.get('phantom_ranks')}, "
          f"ops mirrored {info.get('ops_mirrored')}, announcements read {'-' if late is None else f'{late * 1e3:.1f} ms'} "
          f"late (p50), errors {info.get('errors')}; the real worker's CPU cap {ph.summary.get('real_cpu_cap')}")
    a, p = _iteration_s(full.run_dir), _iteration_s(ph.run_dir)
    assert a and p, f"no iteration time (all-real {a}, phantoms {p}): the probe recorded no steps"
    bytes_ratio = _link_bytes(ph.summary) / max(1, _link_bytes(full.summary))
    print(f"iteration p50: all-real {a * 1e3:.1f} ms, w0 + {WORKERS - 1} phantoms {p * 1e3:.1f} ms, "
          f"ratio {p / a:.3f} (link bytes ratio {bytes_ratio:.3f})")
    assert not info.get("errors"), f"phantoms reported errors: {info.get('errors')}"
    assert abs(p / a - 1) <= TOLERANCE, \
        f"phantom run's iteration {p * 1e3:.1f} ms is {100 * (p / a - 1):+.1f}% of the all-real {a * 1e3:.1f} ms"
    print(f"OK: NCCL phantoms within {TOLERANCE:.0%} of the all-real run ({100 * (p / a - 1):+.1f}%)")


def test_phantoms_nccl():
    import pytest

    reason = why_skip()
    if reason:
        pytest.skip(reason)
    run_check()


if __name__ == "__main__":
    reason = why_skip()
    if reason:
        print(f"SKIP: {reason}")
        sys.exit(0)
    run_check()
