# testbed probe: imported by Python at start-up because the launcher puts this
# folder on PYTHONPATH. Keep it tiny: the real work is in _testbed_probe, and
# nothing at all happens unless TESTBED_PROBE_DIR is set.
import os as _os
import sys as _sys


def _chain():
    """Run the sitecustomize this one shadows (a venv's, a distro's), if any."""
    import importlib.machinery
    import importlib.util

    here = _os.path.dirname(_os.path.abspath(__file__))
    rest = [p for p in _sys.path if _os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.origin is None or _os.path.abspath(spec.origin) == _os.path.abspath(__file__):
        return
    mod = importlib.util.module_from_spec(spec)
    _sys.modules["_testbed_chained_sitecustomize"] = mod
    spec.loader.exec_module(mod)


try:
    if _os.environ.get("TESTBED_PROBE_DIR"):
        import _testbed_probe

        _testbed_probe.install()
except Exception as _exc:  # the probe must never break the user's program
    _sys.stderr.write(f"testbed probe: disabled ({_exc!r})\n")

try:
    _chain()
except Exception as _exc:
    _sys.stderr.write(f"testbed probe: chained sitecustomize failed ({_exc!r})\n")
