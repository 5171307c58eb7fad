"""testbed: a cluster in a box for distributed deep-learning training."""

__version__ = "0.1.0"
