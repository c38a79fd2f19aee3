"""The house rules that CI enforces: layer contracts, no import cycles, every package installed, engine names
behind the serving seam, test doubles outside the installed package."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is a dev dependency (pip install -e .[dev])"
    out = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles_between_modules():
    g = grimp.build_graph("kvscope.harness", "kvscope.workloads", exclude_type_checking_imports=True)
    graph = {m: set(g.find_modules_directly_imported_by(m)) for m in g.modules}
    # A package's __init__ re-exporting its modules is not a cycle of meaning.
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_package_folder_is_installed():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for folder, root in (("harness", "kvscope.harness"), ("workloads", "kvscope.workloads")):
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((root, *rel)))
    assert found == listed


#: The vLLM modules of the serving layer: the only source that may name vLLM's metrics (and read its facts).
VLLM_MODULES = {"harness/serving/server.py", "harness/serving/metrics.py", "harness/serving/vllm_backend.py"}
_VLLM_METRIC = re.compile(r"vllm:[a-z]")


def _installed_sources() -> list[Path]:
    return sorted(p for folder in ("harness", "workloads") for p in (REPO / folder).rglob("*.py"))


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string literal (docstrings and f-string parts included; comments are not code)."""
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_vllm_metric_names_appear_only_in_the_vllm_backend_modules():
    """Engine specifics stay behind `Backend`: a layer that matched `vllm:num_preemptions_total` itself would
    silently read nothing from another engine (and from a vLLM that renames the metric)."""
    leaks = [f"{p.relative_to(REPO)}:{line}: {text[:60]!r}"
             for p in _installed_sources() if p.relative_to(REPO).as_posix() not in VLLM_MODULES
             for line, text in _strings(ast.parse(p.read_text())) if _VLLM_METRIC.search(text)]
    assert leaks == []


def test_the_scan_finds_a_planted_vllm_metric_name():
    planted = ast.parse('def f(text):\n    return re.findall(r"^vllm:num_preemptions_total (\\S+)$", text)\n')
    assert any(_VLLM_METRIC.search(text) for _, text in _strings(planted))


def test_installed_package_imports_no_test_doubles():
    """Test doubles live in tests/doubles, outside the wheel; nothing installed may import them."""
    offenders = []
    for p in _installed_sources():
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{p.relative_to(REPO)}: {n}" for n in names if n == "tests" or n.startswith("tests.")]
    assert offenders == []
    assert not (REPO / "harness" / "testing").exists()
