"""Faults: runtime control of a running testbed (links, nodes, partitions) and scenario timelines."""
