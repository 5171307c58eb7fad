"""Several hosts as one testbed: control over SSH (remote.py) and hosts made out of this machine (emulate.py)."""
