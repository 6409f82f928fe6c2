"""GRPO on megatron-core.

Importing the package makes every ``torch.load`` of the process, and of the processes it starts, weights-only
with torch's own switch, whatever the caller asked: megatron's loaders and torch's checkpoint planner unpickle
with ``weights_only=False``, and a checkpoint, however it was made, must not run code here
(checkpoint/contents.py checks what one holds before it is loaded).
"""

import os

os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)  # torch refuses the two at once; this one wins
os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
