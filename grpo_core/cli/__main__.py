"""``python -m grpo_core.cli ARGS``: the ``grpo`` command without its console script (tests, bench scripts)."""

import sys

from grpo_core.cli import main

sys.exit(main())
