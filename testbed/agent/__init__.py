"""What one host answers about the part of a testbed it holds.

`ops` are the operations themselves, plain functions on this host's state (a testbed's handle calls
them in process when the testbed lives here); `protocol` is their typed form on the wire (one JSON
request a line in, one JSON reply a line out); `serve` is the loop `testbed agent` runs on a host
for a controller (testbed.cluster.agents is the controller's end)."""
