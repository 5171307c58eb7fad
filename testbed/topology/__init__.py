"""The pure topology model: nodes, links, profiles, generators, plans. No I/O here."""

from testbed.topology.model import Link, LinkProfile, Node, Topology
from testbed.topology.plan import NetworkPlan, plan_network

__all__ = ["Link", "LinkProfile", "Node", "Topology", "NetworkPlan", "plan_network"]
