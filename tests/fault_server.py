"""``pagellm serve`` whose model forward raises once a trigger file exists (for the fault test).

Both forward paths raise: the eager module forward and a captured decode step.

Run as ``python tests/fault_server.py TRIGGER_PATH serve ...``: the first argument is the file
whose appearance makes every later forward raise; the rest are the CLI's arguments.
"""

import os
import sys

from pagellm.cli import main
from pagellm.models.llama import LlamaForCausalLM
from pagellm.runner.captured import CapturedDecoder


class InjectedFault(RuntimeError):
    pass


def _faulty(forward, trigger: str):
    def faulty_forward(self, *args, **kwargs):
        if os.path.exists(trigger):
            raise InjectedFault("injected fault in the model's forward")
        return forward(self, *args, **kwargs)

    return faulty_forward


def _install(trigger: str) -> None:
    LlamaForCausalLM.forward = _faulty(LlamaForCausalLM.forward, trigger)
    CapturedDecoder.forward = _faulty(CapturedDecoder.forward, trigger)


if __name__ == "__main__":
    _install(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
