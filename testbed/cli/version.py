"""testbed version [--json]"""

import typer


def info() -> dict:
    """`version --json`'s document (also what `part up --check` answers for a controller)."""
    import platform

    from testbed import __version__

    return {"version": __version__, "python": platform.python_version()}


def register(app: typer.Typer) -> None:
    @app.command("version")
    def version(as_json: bool = typer.Option(False, "--json", help="Print JSON: the version and the Python "
                                                                     "that runs testbed.")) -> None:
        """Print testbed's version."""
        from testbed import __version__

        if as_json:
            import json

            typer.echo(json.dumps(info()))
        else:
            typer.echo(__version__)
