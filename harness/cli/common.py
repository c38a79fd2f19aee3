"""What every ``kvscope`` subcommand module shares: the help formatter and the parser factory."""

from __future__ import annotations

import argparse


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps hand-wrapped descriptions and examples as written; wide enough for the option table."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=100)


def add_parser(sub, name: str, help_: str, description: str | None = None, **kw) -> argparse.ArgumentParser:
    """One subcommand whose description defaults to its one-line help."""
    return sub.add_parser(name, help=help_, description=description or help_, formatter_class=Formatter, **kw)
