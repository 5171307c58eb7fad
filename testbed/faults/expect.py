"""Scenario expectations: what a scenario file says should happen, judged after the run.

    expect:
      - outcome: completed                       # completed | failed | hung
      - recovers: {after: cut, within: 20s}      # a step completes within 20 s after `cut` ends
      - slowdown: {during: cut, at_most: 3}      # median step time during `cut` / before it
      - hang_detected: {within: 60s}             # hung, and the watchdog said so within 60 s

Three stages, kept apart so the first and the last are pure:

1. `parse_expectations`: the `expect:` list, item by item (a mapping with exactly one key), event
   references resolved to the file's events (`name:`, or "event N", 1-based in file order). Bad
   input raises ExpectError naming the file, the field path (`expect[2].recovers.after`) and the
   value, before anything starts;
2. `run_facts`: what the run directory holds, in the events' clock (emulated seconds since the first
   training step, as `at:` counts): every rank's step ends (its probe records, read through the
   bounded reader), each event's window (events.jsonl's applied times, kept in scenario.json), the
   outcome, when the watchdog declared the hang;
3. `judge`: each expectation against the facts: met (True), not met (False) or not judged (None, with
   the reason; it counts as not met), with the measured number and one line saying it.

`junit_xml` renders verdicts as JUnit XML (one testcase per expectation) for CI systems.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Sequence
from xml.etree import ElementTree as ET

from testbed import safeio
from testbed.errors import TopologyError
from testbed.topology.units import parse_time

__all__ = ["ExpectError", "EventInfo", "Expectation", "Verdict", "RunFacts", "StepEnd", "Window",
           "KINDS", "OUTCOMES", "parse_expectations", "event_label", "run_facts", "judge", "verdict_line",
           "junit_xml", "all_met"]

KINDS = ("outcome", "recovers", "slowdown", "hang_detected")
OUTCOMES = ("completed", "failed", "hung")
FIELDS = {"recovers": ("after", "within", "workers"), "slowdown": ("during", "at_most", "at_least", "workers"),
          "hang_detected": ("within",)}
PROBE_READ_MAX = 512 << 20   # a rank's probe file: as much as testbed.jobs.run lets it grow
PROBE_CHUNK = 4 << 20        # ... read a chunk at a time (only its step records are kept)
MAX_RANK_FILES = 4096        # rank files judged (a job cannot make the judge read without end)
_EVENT_N = re.compile(r"^\s*event\s+(\d+)\s*$", re.IGNORECASE)


class ExpectError(TopologyError):
    """An `expect:` item is malformed: exit status 2, naming file, field path and value."""

    exit_code = 2


class EventInfo(NamedTuple):
    """What parsing needs to know of one event of the file."""

    name: str | None      # its `name:` (None: it is "event N")
    lasts: bool           # it has a duration (for:, or a flap): slowdown can be measured during it


@dataclass(frozen=True)
class Expectation:
    kind: str                              # outcome | recovers | slowdown | hang_detected
    written: str                           # the item as written: "recovers: {after: cut, within: 20s}"
    path: str                              # "expect[1]"
    outcome: str | None = None             # outcome
    event: int | None = None               # recovers, slowdown: the event's index (0-based)
    event_label: str | None = None         # ... as the file names it ("cut", "event 2")
    within_s: float | None = None          # recovers, hang_detected (emulated seconds)
    at_most: float | None = None           # slowdown
    at_least: float | None = None          # slowdown
    workers: tuple[str, ...] | None = None  # recovers, slowdown: only steps of ranks on these workers

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "written": self.written}
        for key in ("outcome", "event", "event_label", "within_s", "at_most", "at_least"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.workers is not None:
            out["workers"] = list(self.workers)
        return out


# -- parsing (pure) -----------------------------------------------------------------------------------------


def event_label(index: int, name: str | None) -> str:
    """How expectations and messages name an event: its name, else "event N" (1-based)."""
    return name if name else f"event {index + 1}"


def _flow(value: Any) -> str:
    """A value as YAML flow text, the way a user writes it in an `expect:` item."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if value is True or value is False:
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def parse_expectations(raw: Any, events: Sequence[EventInfo], *, file: str | None = None,
                       path: str = "expect") -> tuple[Expectation, ...]:
    """The `expect:` list of a scenario file (None: no expectations)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ExpectError("expect must be a list of expectations (- outcome: completed, ...)", file=file,
                          path=path, value=raw)
    names = {info.name: i for i, info in enumerate(events) if info.name}
    return tuple(_item(item, f"{path}[{i}]", events, names, file) for i, item in enumerate(raw))


def _item(item: Any, path: str, events: Sequence[EventInfo], names: dict[str, int],
          file: str | None) -> Expectation:
    def err(message: str, where: str, *value: Any) -> ExpectError:
        return ExpectError(message, file=file, path=where, **({"value": value[0]} if value else {}))

    if not isinstance(item, dict) or len(item) != 1:
        raise err(f"an expectation is a mapping with exactly one key, one of {', '.join(KINDS)}", path, item)
    (kind, body), = item.items()
    if kind not in KINDS:
        raise err(f"unknown expectation; expectations: {', '.join(KINDS)}", f"{path}.{kind}", kind)
    written = f"{kind}: {_flow(body)}"
    here = f"{path}.{kind}"
    if kind == "outcome":
        if body not in OUTCOMES:
            raise err(f"outcome must be one of {', '.join(OUTCOMES)}", here, body)
        return Expectation(kind, written, path, outcome=body)
    if not isinstance(body, dict):
        raise err(f"{kind} takes a mapping: {{{', '.join(f + ': ..' for f in FIELDS[kind][:2])}}}", here, body)
    for key in body:
        if key not in FIELDS[kind]:
            raise err(f"unknown field; {kind} takes {', '.join(FIELDS[kind])}", f"{here}.{key}", key)

    def duration(key: str) -> float:
        if key not in body:
            raise err(f"{kind} needs {key}: (a duration, e.g. 20s)", f"{here}.{key}")
        try:
            value = parse_time(body[key])
        except ValueError as e:
            raise err(str(e), f"{here}.{key}", body[key]) from None
        if not 0 < value < math.inf:
            raise err("must be a positive duration", f"{here}.{key}", body[key])
        return value

    def ratio(key: str) -> float | None:
        if key not in body:
            return None
        value = body[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise err("must be a positive number (a ratio of step times, e.g. 3)", f"{here}.{key}", value)
        return float(value)

    def event(key: str) -> tuple[int, str]:
        if key not in body:
            raise err(f"{kind} needs {key}: an event's name, or 'event N' (1-based, in file order)",
                      f"{here}.{key}")
        ref = body[key]
        if isinstance(ref, str) and ref in names:
            i = names[ref]
        elif isinstance(ref, str) and (m := _EVENT_N.match(ref)) and 1 <= int(m.group(1)) <= len(events):
            i = int(m.group(1)) - 1
        else:
            known = [event_label(i, e.name) for i, e in enumerate(events)]
            raise err("no such event; name one of " + (", ".join(known) if known else "(the file has no events)"),
                      f"{here}.{key}", ref)
        return i, event_label(i, events[i].name)

    workers = None
    if "workers" in body:
        w = body["workers"]
        items = [x.strip() for x in w.split(",") if x.strip()] if isinstance(w, str) else w
        if not isinstance(items, list) or not items or not all(isinstance(x, str) and x for x in items):
            raise err("workers must be a list of worker names (or 'w0,w1')", f"{here}.workers", w)
        workers = tuple(items)
    if kind == "recovers":
        i, label = event("after")
        return Expectation(kind, written, path, event=i, event_label=label, within_s=duration("within"),
                           workers=workers)
    if kind == "slowdown":
        i, label = event("during")
        if not events[i].lasts:
            raise err(f"{label} has no duration (no for:, not a flap): there is no 'during' to measure",
                      f"{here}.during", body["during"])
        at_most, at_least = ratio("at_most"), ratio("at_least")
        if at_most is None and at_least is None:
            raise err("slowdown needs at_most: (and/or at_least:), a ratio of median step times", f"{here}.at_most")
        if at_most is not None and at_least is not None and at_least > at_most:
            raise err(f"at_least is above at_most ({at_most:g}): nothing can meet both", f"{here}.at_least",
                      at_least)
        return Expectation(kind, written, path, event=i, event_label=label, at_most=at_most, at_least=at_least,
                           workers=workers)
    return Expectation(kind, written, path, within_s=duration("within"))


# -- the facts of a run (read from its directory) -----------------------------------------------------------


class StepEnd(NamedTuple):
    """One optimizer step of one rank, in the events' clock (emulated s since the first training step)."""

    rank: str
    worker: str | None
    end_s: float
    start_s: float | None     # the previous step's end (None: the rank's first step, start-up included)

    @property
    def duration_s(self) -> float | None:
        return None if self.start_s is None else self.end_s - self.start_s


class Window(NamedTuple):
    """What became of one event in the run: its steps as applied, in the events' clock."""

    planned: int               # steps the plan made of it
    applied: int               # ... that the run applied (its end came before the run's)
    start_s: float | None      # its first step's applied time
    end_s: float | None        # its last step's (a revert's, or the event's own when it has no duration)
    errors: tuple[str, ...] = ()


@dataclass
class RunFacts:
    outcome: str
    error: str | None = None
    dilation: float = 1.0
    steps: list[StepEnd] = field(default_factory=list)
    windows: dict[int, Window] = field(default_factory=dict)
    watchdog_s: float | None = None        # when the watchdog declared the hang (None: it did not)
    started_s: float | None = None         # when the job started (before the first step: negative)
    hang_after_s: float | None = None
    workers: dict[str, str] = field(default_factory=dict)   # rank -> worker (from the probe's start records)


def _windows(doc: dict[str, Any]) -> dict[int, Window]:
    planned: dict[int, int] = {}
    for st in (doc.get("plan") or {}).get("steps") or []:
        planned[int(st.get("event", -1))] = planned.get(int(st.get("event", -1)), 0) + 1
    applied: dict[int, list[dict[str, Any]]] = {}
    for rec in doc.get("events") or []:
        applied.setdefault(int(rec.get("event", -1)), []).append(rec)
    out = {}
    for i, n in planned.items():
        recs = applied.get(i, [])
        times = [float(r["applied_s"]) for r in recs if isinstance(r.get("applied_s"), (int, float))]
        errors = tuple(str(r["error"]) for r in recs if r.get("error"))
        out[i] = Window(n, len(recs), min(times, default=None), max(times, default=None), errors)
    return out


def read_steps(run_dir: Path, t0_wall: float, dilation: float) -> tuple[list[StepEnd], dict[str, str]]:
    """Every rank's step ends from the probe records (probe/rank-*.jsonl), in the events' clock. A rank's
    file is the job's: read through the bounded reader (never a link, never a FIFO), a chunk at a time;
    what is not a step or start record is passed over."""
    steps: list[StepEnd] = []
    workers: dict[str, str] = {}
    probe = Path(run_dir) / "probe"
    files = sorted(probe.glob("rank-*.jsonl"))[:MAX_RANK_FILES] if probe.is_dir() else []
    for f in files:
        rank = f.stem.split("-", 1)[1]
        prev: float | None = None
        ends: list[float] = []
        for line in _lines(f):
            try:
                ev = json.loads(line)
                kind = ev.get("ev")
                if kind == "start" and isinstance(ev.get("worker"), str):
                    workers[rank] = ev["worker"]
                elif kind == "step":
                    t = float(ev["t"])
                    if math.isfinite(t):
                        ends.append(t)
            except (ValueError, TypeError, KeyError, AttributeError):
                continue
        for t in sorted(ends):
            end = (t - t0_wall) / dilation
            steps.append(StepEnd(rank, None, end, prev))
            prev = end
    return [s._replace(worker=workers.get(s.rank)) for s in steps], workers


def _lines(path: Path):
    """The complete lines of a file, at most PROBE_READ_MAX bytes of it, PROBE_CHUNK at a time."""
    off, rest = 0, b""
    while off < PROBE_READ_MAX:
        try:
            data = safeio.read_regular(path, min(PROBE_CHUNK, PROBE_READ_MAX - off), off)
        except (OSError, safeio.Unsafe):
            return
        if not data:
            return
        off += len(data)
        *whole, rest = (rest + data).split(b"\n")
        if len(rest) > PROBE_CHUNK:   # no line is that long: what is not a record is dropped
            rest = b""
        yield from whole


def run_facts(run_dir: Path, doc: dict[str, Any]) -> RunFacts:
    """The facts expectations are judged on: `doc` is the run's scenario.json (as the player writes it),
    the step records come from the run directory's probe files."""
    s = float(doc.get("dilation") or 1.0)
    t0 = doc.get("t0_wall")
    started = doc.get("started_wall")
    origin = t0 if isinstance(t0, (int, float)) else started if isinstance(started, (int, float)) else None
    facts = RunFacts(outcome=str(doc.get("outcome")), error=doc.get("error"), dilation=s,
                     windows=_windows(doc), hang_after_s=doc.get("hang_after_s"))
    if origin is None:
        return facts
    facts.steps, facts.workers = read_steps(run_dir, float(origin), s)
    wd = doc.get("watchdog") or {}
    if isinstance(wd.get("detected_wall"), (int, float)):
        facts.watchdog_s = (float(wd["detected_wall"]) - origin) / s
    if isinstance(started, (int, float)):
        facts.started_s = (float(started) - origin) / s
    return facts


# -- judging (pure) -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    expect: str                 # the item as written
    ok: bool | None             # met, not met, not judged (counts as not met)
    measured: float | None
    detail: str
    path: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"expect": self.expect, "ok": self.ok, "measured": self.measured, "detail": self.detail}


def all_met(verdicts: Sequence[Verdict]) -> bool:
    return all(v.ok is True for v in verdicts)


def _s(t: float) -> str:
    return f"{t:.2f}s"


def _ms(t: float) -> str:
    return f"{t * 1e3:.0f} ms" if t < 10 else f"{t:.1f} s"


def judge(expectations: Sequence[Expectation], facts: RunFacts) -> list[Verdict]:
    out = []
    for e in expectations:
        try:
            ok, measured, detail = _JUDGES[e.kind](e, facts)
        except Exception as exc:  # noqa: BLE001 - one expectation that cannot be judged says why; the rest go on
            ok, measured, detail = None, None, f"could not be judged: {type(exc).__name__}: {exc}"
        if measured is not None and not math.isfinite(measured):
            measured = None
        out.append(Verdict(e.written, ok, measured, detail, e.path))
    return out


def _outcome(e: Expectation, f: RunFacts) -> tuple[bool | None, float | None, str]:
    got = f"outcome {f.outcome}" + (f" ({f.error})" if f.error else "")
    return f.outcome == e.outcome, None, got if f.outcome == e.outcome else f"{got}, not {e.outcome}"


def _window(e: Expectation, f: RunFacts) -> tuple[Window | None, str]:
    """The event's window, or why it cannot be judged."""
    w = f.windows.get(e.event if e.event is not None else -1)
    label = e.event_label
    if w is None or w.planned == 0:
        return None, f"could not be judged: {label} is not in the run's plan"
    if w.errors:
        return None, f"could not be judged: {label} could not be applied: {w.errors[0]}"
    if w.applied < w.planned or w.start_s is None or w.end_s is None:
        return None, (f"could not be judged: the run ended ({f.outcome}) before {label} did "
                      f"({w.applied} of its {w.planned} steps applied)")
    return w, ""


def _steps_of(e: Expectation, f: RunFacts) -> tuple[list[StepEnd], str]:
    if e.workers is None:
        return f.steps, "a step"
    return [s for s in f.steps if s.worker in e.workers], f"a step on {', '.join(e.workers)}"


def _recovers(e: Expectation, f: RunFacts) -> tuple[bool | None, float | None, str]:
    w, why = _window(e, f)
    if w is None:
        return None, None, why
    steps, which = _steps_of(e, f)
    if not steps:
        return None, None, f"could not be judged: no step records{'' if e.workers is None else ' of ranks on ' + ', '.join(e.workers)}"
    end = w.end_s
    after = [s.end_s for s in steps if s.end_s > end]
    if not after:
        last = max(s.end_s for s in steps)
        return False, None, (f"no step completed after {e.event_label} ended at {_s(end)} (the last at {_s(last)}; "
                             f"outcome {f.outcome})")
    took = min(after) - end
    return took <= e.within_s, took, (f"{which} completed {took:.2f}s after {e.event_label} ended at {_s(end)} "
                                      f"(within {e.within_s:g}s)")


def _slowdown(e: Expectation, f: RunFacts) -> tuple[bool | None, float | None, str]:
    w, why = _window(e, f)
    if w is None:
        return None, None, why
    steps, _ = _steps_of(e, f)
    timed = [s for s in steps if s.start_s is not None]
    before = [s.duration_s for s in timed if s.end_s <= w.start_s]
    # a step runs during the event when its span overlaps the event's (a step stalled through it counts)
    during = [s.duration_s for s in timed if s.end_s > w.start_s and s.start_s < w.end_s]
    if not before:
        return None, None, f"could not be judged: no step completed before {e.event_label} began at {_s(w.start_s)}"
    if not during:
        return None, None, f"could not be judged: no step ran during {e.event_label} ({_s(w.start_s)}-{_s(w.end_s)})"
    base, slow = statistics.median(before), statistics.median(during)
    if base <= 0:
        return None, None, "could not be judged: the median step time before the event is 0"
    ratio = slow / base
    bounds = []
    ok = True
    if e.at_least is not None:
        bounds.append(f"at least {e.at_least:g}")
        ok = ok and ratio >= e.at_least
    if e.at_most is not None:
        bounds.append(f"at most {e.at_most:g}")
        ok = ok and ratio <= e.at_most
    return ok, ratio, (f"{ratio:.2f}x: median step {_ms(slow)} during {e.event_label} ({len(during)} steps), "
                       f"{_ms(base)} before ({len(before)} steps); {' and '.join(bounds)}")


def _hang_detected(e: Expectation, f: RunFacts) -> tuple[bool | None, float | None, str]:
    if f.outcome != "hung":
        return False, None, f"outcome {f.outcome}: no hang to detect"
    if f.watchdog_s is None:
        return False, None, f"hung by the run's timeout, not the watchdog ({f.error})"
    if f.steps:
        since, what = max(s.end_s for s in f.steps), "the last step"
    elif f.started_s is not None:
        since, what = f.started_s, "the job's start (no step at all)"
    else:
        return None, None, "could not be judged: neither a step nor the job's start is recorded"
    took = f.watchdog_s - since
    hang = f" (hang_after {f.hang_after_s:g}s)" if isinstance(f.hang_after_s, (int, float)) else ""
    return took <= e.within_s, took, (f"the watchdog said so {took:.2f}s after {what}{hang} "
                                      f"(within {e.within_s:g}s)")


_JUDGES = {"outcome": _outcome, "recovers": _recovers, "slowdown": _slowdown, "hang_detected": _hang_detected}


# -- output (pure) ------------------------------------------------------------------------------------------


MARKS = {True: "met", False: "NOT MET", None: "NOT JUDGED"}


def verdict_line(v: Verdict) -> str:
    """One console line: `met         recovers: {after: cut, within: 20s}: a step completed 1.20s after ...`."""
    return f"{MARKS[v.ok]:<10}  {v.expect}  ->  {v.detail}"


def junit_xml(scenario: str, verdicts: Sequence[Verdict], *, time_s: float = 0.0,
              properties: dict[str, Any] | None = None) -> bytes:
    """JUnit XML: one testsuite (the scenario), one testcase per expectation; a failure for one not met,
    an error for one that could not be judged."""
    failures = sum(v.ok is False for v in verdicts)
    errors = sum(v.ok is None for v in verdicts)
    suites = ET.Element("testsuites", name="testbed scenario", tests=str(len(verdicts)), failures=str(failures),
                        errors=str(errors), time=f"{time_s:.3f}")
    suite = ET.SubElement(suites, "testsuite", name=f"scenario {scenario}", tests=str(len(verdicts)),
                          failures=str(failures), errors=str(errors), skipped="0", time=f"{time_s:.3f}")
    if properties:
        props = ET.SubElement(suite, "properties")
        for k, v in properties.items():
            ET.SubElement(props, "property", name=str(k), value="" if v is None else str(v))
    for v in verdicts:
        case = ET.SubElement(suite, "testcase", classname=f"scenario.{scenario}", name=_xml_text(v.expect),
                             time="0")
        if v.ok is False:
            ET.SubElement(case, "failure", message=_xml_text(v.detail), type="not met").text = _xml_text(v.detail)
        elif v.ok is None:
            ET.SubElement(case, "error", message=_xml_text(v.detail), type="not judged").text = _xml_text(v.detail)
        ET.SubElement(case, "system-out").text = _xml_text(
            f"measured: {'null' if v.measured is None else f'{v.measured:g}'}\n{v.detail}")
    ET.indent(suites)
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True) + b"\n"


_XML_BAD = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_text(text: str) -> str:
    """Text XML 1.0 can carry (an error line from a rank may hold control characters)."""
    return _XML_BAD.sub("\ufffd", str(text))
