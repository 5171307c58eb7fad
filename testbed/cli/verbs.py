"""The verbs of the `testbed` command line: each one's module and the summary `testbed --help` shows,
and the root's help printed from them (no CLI library needed: testbed/cli/__init__.py)."""

from __future__ import annotations

from typing import NamedTuple

SUMMARY = ("A cluster in a box for distributed training: emulated datacenter networks, "
           "containers and real training jobs on one machine.")
VERSION_HELP = "Print testbed's version and exit (as `testbed version`)."


class Verb(NamedTuple):
    module: str   # testbed.cli.<module>, whose register(app) registers this verb
    summary: str  # the line `testbed --help` shows


# Adding a verb: a module with register(app), and one line here.
VERBS: dict[str, Verb] = {
    "agent": Verb("agent", "Answer a controller's requests about this host's part of a testbed, on stdin "
                           "(run by the controller over SSH)."),
    "attach": Verb("attach", "Open an interactive shell inside NODE (a worker or a switch). "
                             "Exiting the shell leaves the node running."),
    "calibrate": Verb("calibrate", "Measure (or show) the reference model's constants for this machine "
                                   "(kept per boot)."),
    "capture": Verb("capture", "Capture the packets of one link end in pcap format, to a file or to stdout."),
    "cleanup": Verb("cleanup", "Remove what dead testbeds left behind (half-built or half-gone); "
                               "healthy testbeds are kept."),
    "cp": Verb("cp", "Copy files or directories between the host and nodes: `testbed cp w3:/tmp/out.txt .`, "
                     "`testbed cp ./data w0:/tmp/`, `testbed cp w0:/a w1:/b`."),
    "doctor": Verb("doctor", "Probe the kernel and machine: netem, HTB, TAP delay line, BPF loss, Docker, GPUs, "
                             "latency floor."),
    "down": Verb("down", "Bring a testbed down and remove everything it made."),
    "events": Verb("events", "Print the testbed's events from the start: up, link and node changes, partitions, "
                             "scenario steps, runs and their verdicts (-f: keep following)."),
    "exec": Verb("exec", "Run CMD inside NODE with stdin/stdout/stderr passed through; exit with its status."),
    "install": Verb("install", "Install this controller's testbed (its version, its dependencies' versions) on "
                               "the hosts of a hosts file, over SSH."),
    "logs": Verb("logs", "Show the output of the jobs started in NODE (-f: keep following it)."),
    "ls": Verb("ls", "List the testbeds that are up."),
    "part": Verb("part", "One host's side of a testbed over several hosts (run by the controller over SSH)."),
    "partition": Verb("partition", "Split the workers into groups that cannot reach each other."),
    "heal": Verb("partition", "Undo `testbed partition`."),
    "ps": Verb("ps", "List the processes running in each worker (or the NODEs named)."),
    "report": Verb("report", "Iteration times, throughput, bytes per link tier, the collectives against the "
                             "model, the verdict."),
    "run": Verb("run", "Start CMD on every selected worker the torchrun way; logs and probe data go to "
                       "runs/<time>-<testbed>/."),
    "stacks": Verb("stacks", "Show the Python stack of every rank of the running job, grouped by identical "
                             "stacks (py-spy)."),
    "status": Verb("status", "Show a running testbed: nodes with addresses, links with their shaping and state."),
    "sweep": Verb("sweep", "Run a what-if experiment: one judged run per point of a grid or list of topology, "
                           "link, dilation, scenario and job settings; a table and plots."),
    "topo": Verb("topo", "Validate a topology and describe it (counts, tiers, bisection, oversubscription); "
                         "builds nothing."),
    "up": Verb("up", "Build a testbed from TOPOLOGY and leave it running."),
    "version": Verb("version", "Print testbed's version."),
    "link": Verb("link", "Show and change the links of a running testbed (takes effect at once)."),
    "node": Verb("node", "Fail, restart or slow down a node of a running testbed."),
    "scenario": Verb("scenario", "Scenario files: a timeline of faults played against a running job."),
    "top": Verb("top", "Watch a running testbed live: per link direction rate, utilisation, queue and drops; "
                       "workers' CPU and memory; the running job's step."),
    "graph": Verb("graph", "Serve a live web page of a testbed: link utilisation, what is down, step times, events."),
}


def root_help(width: int | None = None) -> str:
    """`testbed --help`: usage, what testbed is, the root options and every verb's summary."""
    import shutil
    import textwrap

    width = max(40, min(width or shutil.get_terminal_size((100, 24)).columns, 120))
    out = ["Usage: testbed [OPTIONS] COMMAND [ARGS]...", ""]
    out += textwrap.wrap(SUMMARY, width, initial_indent="  ", subsequent_indent="  ") + [""]
    rows = [("Options:", [("-V, --version", VERSION_HELP), ("-h, --help", "Show this message and exit.")]),
            ("Commands:", sorted((name, verb.summary) for name, verb in VERBS.items()))]
    for title, items in rows:
        out.append(title)
        col = max(len(k) for k, _ in items) + 4
        for key, text in items:
            lines = textwrap.wrap(text, max(20, width - col)) or [""]
            out.append(f"  {key:<{col - 2}}{lines[0]}")
            out += [" " * col + line for line in lines[1:]]
        out.append("")
    return "\n".join(out).rstrip() + "\n"
