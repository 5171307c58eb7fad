"""Watching a running testbed from outside: live counters (top), packet capture."""
