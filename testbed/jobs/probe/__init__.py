"""The measurement probe injected into every rank (see sitecustomize.py in this folder).

The launcher puts this folder first on PYTHONPATH; Python then imports its
`sitecustomize`, which chains to any other sitecustomize on the path and
patches torch lazily, only if and when the user's script imports it.
"""

from pathlib import Path

PROBE_PATH = str(Path(__file__).resolve().parent)
