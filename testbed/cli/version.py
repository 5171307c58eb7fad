"""testbed version"""

import typer


def register(app: typer.Typer) -> None:
    @app.command("version")
    def version() -> None:
        """Print testbed's version."""
        from testbed import __version__

        typer.echo(__version__)
