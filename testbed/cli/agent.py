"""testbed agent: answer a controller's requests on stdin (testbed.agent).

What a controller runs on each host of a testbed over several hosts, over SSH: a user does not
need it. It says hello, then answers each request line with one reply line (testbed.agent.protocol)
until stdin ends."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("agent")
    def agent(name: str = typer.Argument(..., help="The testbed this session is about (shown by ps on the host); "
                                                   "a request about another is refused.")) -> None:
        """Answer a controller's requests about this host's part of a testbed, on stdin (run by the controller over SSH).

        One JSON request a line on stdin, one JSON reply a line on stdout, until stdin ends
        (testbed.agent.protocol)."""
        from testbed.agent.serve import serve

        serve(only=name)
