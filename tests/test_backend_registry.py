"""A serving backend is one module: ``harness/serving/<engine>_backend.py`` with ``@Backend.register(name)``. The
registry discovers such modules, and the command line's ``--backend`` choices are the registry's names."""

from __future__ import annotations

import sys

import pytest

import kvscope.harness.serving as serving
from kvscope.harness.cli.main import build_parser
from kvscope.harness.serving.backend import Backend, backend_names

THROWAWAY = '''
from kvscope.harness.serving.openai_backend import OpenAIBackend
from kvscope.harness.serving.backend import Backend


@Backend.register("throwaway")
class ThrowawayBackend(OpenAIBackend):
    """A test's engine: registered by its module alone."""
'''


@pytest.fixture()
def own_registry(monkeypatch):
    """The registry as it is, restored after the test (a throwaway backend must not outlive it)."""
    backend_names()  # the built-in ones first, so the copy holds them
    monkeypatch.setattr(Backend, "_registry", dict(Backend._registry))


def _server_info_backend(argv: list[str]) -> str:
    return build_parser().parse_args(["server-info", "--endpoint", "http://127.0.0.1:9", *argv]).backend


def test_builtin_backends_are_discovered_and_are_the_cli_choices(capsys):
    assert {"vllm", "openai"} <= set(backend_names())
    with pytest.raises(SystemExit):
        build_parser().parse_args(["server-info", "--help"])
    assert "{" + ",".join(backend_names()) + "}" in capsys.readouterr().out
    assert _server_info_backend([]) == "vllm"


def test_a_backend_registered_by_decorator_is_a_cli_choice(own_registry, capsys):
    parser_before = build_parser()  # choices are read when needed, not frozen when the parser is built
    with pytest.raises(SystemExit) as exc:
        parser_before.parse_args(["server-info", "--endpoint", "x", "--backend", "throwaway"])
    assert exc.value.code == 2 and "invalid choice: 'throwaway'" in capsys.readouterr().err

    @Backend.register("throwaway")
    class ThrowawayBackend(Backend):  # noqa: F841 - registered by the decorator
        pass

    assert "throwaway" in backend_names()
    assert parser_before.parse_args(["server-info", "--endpoint", "x", "--backend", "throwaway"]).backend == "throwaway"
    assert _server_info_backend(["--backend", "throwaway"]) == "throwaway"


def test_a_backend_module_in_the_package_is_discovered(own_registry, tmp_path, monkeypatch):
    """The one file a new engine needs: a ``*_backend`` module in the serving package registers itself when the
    registry is first asked, with no list to extend."""
    (tmp_path / "throwaway_backend.py").write_text(THROWAWAY)
    (tmp_path / "throwaway_helpers.py").write_text("raise AssertionError('only *_backend modules are imported')\n")
    monkeypatch.setattr(serving, "__path__", [*serving.__path__, str(tmp_path)])
    try:
        assert "throwaway" in backend_names()
        assert Backend.create("throwaway", endpoint="http://127.0.0.1:9").name == "throwaway"
        assert _server_info_backend(["--backend", "throwaway"]) == "throwaway"
    finally:
        sys.modules.pop("kvscope.harness.serving.throwaway_backend", None)
