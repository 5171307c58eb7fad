"""Time dilation: re-exported from testbed.topology.dilation (the lower layer).

Kept so `from testbed.jobs.dilation import ...` keeps working; the functions
live in testbed/topology/dilation.py.
"""

from __future__ import annotations

from testbed.topology.dilation import auto_factor, dilate, dilate_topology, resolve, undilate

__all__ = ["auto_factor", "dilate", "dilate_topology", "resolve", "undilate"]
