"""``pagellm serve`` whose model forward raises once a trigger file exists (for the fault test).

Run as ``python tests/fault_server.py TRIGGER_PATH serve ...``: the first argument is the file
whose appearance makes every later forward raise; the rest are the CLI's arguments.
"""

import os
import sys

from pagellm.cli import main
from pagellm.models.llama import LlamaForCausalLM


class InjectedFault(RuntimeError):
    pass


def _install(trigger: str) -> None:
    forward = LlamaForCausalLM.forward

    def faulty_forward(self, *args, **kwargs):
        if os.path.exists(trigger):
            raise InjectedFault("injected fault in the model's forward")
        return forward(self, *args, **kwargs)

    LlamaForCausalLM.forward = faulty_forward


if __name__ == "__main__":
    _install(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
