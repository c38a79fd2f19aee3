"""Bundled workload presets (YAML files next to this module)."""

from __future__ import annotations

from pathlib import Path

PRESET_DIR = Path(__file__).parent


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path | None:
    p = PRESET_DIR / f"{name}.yaml"
    return p if p.exists() else None
