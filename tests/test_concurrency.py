"""`down` racing fault operations: every mutation holds the testbed's lock, and a testbed that was
removed never comes back (a fault that loses the race fails; it does not write the state again)."""

from __future__ import annotations

import random
import threading
import uuid

import pytest

from testbed import lifecycle, paths, store
from testbed.cleanup import cleanup
from testbed import errors as tb_errors
from testbed.net import names, netns
from testbed.topology.loader import load_topology_text

STAR = "name: cc\ngenerator: star\nparams: {n: 2}\ntiers:\n  host: {bandwidth: 1gbit}\n"
ROUNDS = 20
SCENARIO = {"name": "race", "job": {"command": "true"},
            "events": [{"at": "0s", "link": ["w0", "s0"], "action": "flap", "every": "10ms", "count": 2},
                       {"at": "0s", "link": ["w1", "s0"], "set": {"loss": "1%", "bandwidth": "200mbit"}},
                       {"at": "0s", "partition": [["w0"], ["w1"]]}]}


@pytest.mark.slow
def test_down_racing_link_changes_and_scenario_events(root, state_dir):
    from testbed.faults import control, player
    from testbed.faults.scenario_loader import scenario_from_data

    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"seed {seed}")
    applied = 0
    for r in range(ROUNDS):
        name = f"cc{uuid.uuid4().hex[:5]}"
        lifecycle.up(load_topology_text(STAR, "<race>"), name, time_dilation="none")
        # the steps a scenario file plans, applied as `testbed scenario run`'s player applies them
        steps = player.plan_for(name, scenario_from_data(SCENARIO, "<race>")).steps
        errors: list[BaseException] = []
        done = threading.Event()
        count = [0]

        def faults() -> None:
            # link flaps and a node change, as `testbed link` and a scenario event make them
            ops = [lambda: control.link_down(name, "w0", "s0"), lambda: control.link_up(name, "w0", "s0"),
                   lambda: control.link_set(name, "w1", "s0", {"bandwidth_bps": 100_000_000}),
                   lambda: control.node_slow(name, "w1", 0.5), lambda: control.node_restore(name, "w1"),
                   lambda: control.apply_step(name, rng.choice(steps)), lambda: control.restore_all(name)]
            while not done.is_set():
                try:
                    rng.choice(ops)()
                    count[0] += 1
                except tb_errors.TestbedError:
                    return   # the testbed is gone (or going): the fault says so and stops
                except BaseException as exc:   # anything else is a bug
                    errors.append(exc)
                    return

        t = threading.Thread(target=faults)
        t.start()
        # the race itself, not a wait: `down` lands at a random moment among the faults
        threading.Event().wait(rng.uniform(0.0, 0.3))
        try:
            lifecycle.down(name)
        finally:
            done.set()
            t.join(30)
        assert not errors, errors
        assert not t.is_alive()
        # removed, and it stays removed: no state, no namespace, nothing a late fault recreated
        assert not store.exists(name) and not paths.directory(name).exists(), f"round {r} (seed {seed})"
        assert not netns.list_names(names.netns_prefix(name)), f"round {r} (seed {seed})"
        applied += count[0]
    print(f"{ROUNDS} rounds, {applied} fault operations applied before the testbeds went")
    assert applied > 0   # the faults did run against the live testbeds, not only against gone ones
    assert cleanup() == []
