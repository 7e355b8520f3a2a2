"""The engine core is plain Python: importing it must not import torch."""

from __future__ import annotations

import subprocess
import sys


def test_engine_core_does_not_import_torch():
    code = (
        "import sys\n"
        "import pagellm, pagellm.config\n"
        "import pagellm.engine.llm_engine, pagellm.engine.scheduler, pagellm.engine.detokenizer\n"
        "import pagellm.engine.async_engine\n"
        "assert 'torch' not in sys.modules, 'engine core imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
