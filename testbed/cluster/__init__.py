"""Several hosts as one testbed: the hosts file (hosts.py) and where each node runs (placement.py),
one host's part (part.py), control over SSH (remote.py, controller.py), hosts made out of this
machine (emulate.py), and the verbs whose controller fans out to every host: a scenario played
across hosts (scenario.py), top and the graph page across hosts (top.py, graph.py)."""
