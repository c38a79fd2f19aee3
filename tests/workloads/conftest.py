"""Shared fixtures: the project's tiny model (root ``tiny_model_dir``) and the real traces in ../shared/data."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SHARED_DATA as DATA  # ../shared/data, or $KVSCOPE_SHARED_DATA


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir) -> Path:
    """The real tiny model (tokenizer.json, chat template; vocab 8192), built once per test session."""
    return tiny_model_dir


@pytest.fixture(scope="session")
def source(model_dir):
    from kvscope.workloads.tokens import TokenSource

    return TokenSource.from_tokenizer(model_dir)


def need_data(name: str) -> Path:
    p = DATA / name
    if not p.exists():
        pytest.skip(f"real trace {p} not found (expected ../shared/data next to the repo, or KVSCOPE_SHARED_DATA)")
    return p
