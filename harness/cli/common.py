"""What every ``kvscope`` subcommand module shares: the help formatter and the parser factory."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Iterator, Sequence


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps hand-wrapped descriptions and examples as written; wide enough for the option table."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=100)


def add_parser(sub, name: str, help_: str, description: str | None = None, **kw) -> argparse.ArgumentParser:
    """One subcommand whose description defaults to its one-line help."""
    return sub.add_parser(name, help=help_, description=description or help_, formatter_class=Formatter, **kw)


class LazyChoices(Sequence[str]):
    """An option's ``choices`` taken from a registry when argparse first needs them (to check a value or print
    help), not when the parser is built: the registry's modules (the serving backends) then load only for the
    command that uses them, and whatever registered by then is a choice."""

    def __init__(self, names: Callable[[], Iterable[str]]) -> None:
        self._names = names

    def _list(self) -> list[str]:
        return list(self._names())

    def __contains__(self, value: object) -> bool:
        return value in self._list()

    def __iter__(self) -> Iterator[str]:
        return iter(self._list())

    def __len__(self) -> int:
        return len(self._list())

    def __getitem__(self, index):  # type: ignore[override]
        return self._list()[index]
