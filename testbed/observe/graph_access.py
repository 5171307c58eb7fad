"""Who may ask `testbed graph`'s server what: the address it binds (loopback unless told), the token
a page must carry off loopback, and the control actions a POST may ask for."""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any, Mapping

from testbed.errors import TestbedError

MAX_BODY = 4096
CONTROL_ACTIONS = ("link_down", "link_up", "node_down", "node_up")
CONTROL_HEADER = "X-Testbed-Graph"


class GraphError(TestbedError):
    """A flag of `testbed graph` that cannot be honoured (a --bind that is not an address): exit 2."""

    exit_code = 2


class GraphRequestError(Exception):
    """A request the server answers with `status` and `message` (a malformed query or body)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def parse_control(body: Any) -> tuple[str, list[str]]:
    """(action, its node names) of a /api/control body; GraphRequestError(400) when malformed."""
    if not isinstance(body, dict) or body.get("action") not in CONTROL_ACTIONS:
        raise GraphRequestError(400, f"action: one of {', '.join(CONTROL_ACTIONS)}")
    action = body["action"]
    values = []
    for key in (("a", "b") if action.startswith("link_") else ("node",)):
        v = body.get(key)
        if not isinstance(v, str) or not v or len(v) > 64:
            raise GraphRequestError(400, f"{key}: a node name")
        values.append(v)
    return action, values


def is_loopback(bind: str) -> bool:
    try:
        return ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return bind == "localhost"


def check_bind(bind: str) -> str:
    """The address to bind: an IP address (or localhost); GraphError otherwise."""
    if bind == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(bind))
    except ValueError:
        raise GraphError(f"--bind {bind!r}: not an IP address (127.0.0.1, ::1, 0.0.0.0, or one of this "
                         "machine's addresses)") from None


class Access:
    """Who may ask: a token (when one is required) and, without one, a Host header naming loopback."""

    def __init__(self, bind: str, port: int, token: str | None):
        self.token = token
        self.port = port
        if token is None:
            names_ = {"127.0.0.1", "localhost", "[::1]", bind if ":" not in bind else f"[{bind}]"}
            self.hosts: frozenset[str] | None = frozenset(f"{h}:{port}" for h in names_)
        else:
            self.hosts = None

    def _token_ok(self, given: str | None) -> bool:
        return given is not None and self.token is not None and hmac.compare_digest(
            given.encode("utf-8", "replace"), self.token.encode())

    def check(self, headers: Mapping[str, str], query: Mapping[str, list[str]],
              page: bool = False) -> tuple[bool, bool, str]:
        """(allowed, False, why not). page: one of the page's own files (no token needed: no data)."""
        host = (headers.get("Host") or "").strip().lower()
        if self.hosts is not None and host not in self.hosts:
            return False, False, f"Host {host!r} is not this server's loopback address"
        if self.token is None or page:
            return True, False, ""
        auth = headers.get("Authorization") or ""
        if auth.startswith("Bearer ") and self._token_ok(auth[7:].strip()):
            return True, False, ""
        return False, False, ("a token is required (Authorization: Bearer): open the URL `testbed graph` printed "
                              "(it carries #token=)")
