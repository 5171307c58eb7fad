"""testbed version [--json]"""

import typer


def register(app: typer.Typer) -> None:
    @app.command("version")
    def version(as_json: bool = typer.Option(False, "--json", help="Print JSON: the version and the Python "
                                                                     "that runs testbed.")) -> None:
        """Print testbed's version."""
        from testbed import __version__

        if as_json:
            import json
            import platform

            typer.echo(json.dumps({"version": __version__, "python": platform.python_version()}))
        else:
            typer.echo(__version__)
