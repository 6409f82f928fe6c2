"""A model's chat template rendered in a child process, under a time and a memory limit, in jinja2's immutable sandbox.

A chat template is code that comes with a model directory. transformers renders it in jinja2's sandbox (no access
to Python's internals) but with no limit: a template with a loop of 10^10 steps hangs whatever renders it, and
``'x' * 10**10`` allocates 10 GB. The pre-flight renders the first rows here first: a child process can be stopped,
a thread cannot. What the child finds wrong otherwise (a template error) is left to the caller's own rendering,
which says it in the words the ranks would.

Run as a script (``python -I template_sandbox.py``), this file is the child: it imports jinja2 and nothing of
grpo_core, reads the template and the conversations as JSON on stdin, and writes one line per conversation rendered.
"""

import json
import subprocess
import sys
from pathlib import Path

RENDER_TIMEOUT_S = 10.0  # for the first rows of a file; a real template renders them in milliseconds
MEMORY_LIMIT_BYTES = 2 << 30  # the child's address space; a real template's output is kilobytes
DONE, FAILED, OUT_OF_MEMORY = "done", "failed", "out of memory"


def render_problem(
    template: str, conversations: list, variables: dict, timeout_s: float | None = None
) -> tuple[int, str] | None:
    """(index of the conversation, why) when rendering ``conversations`` with ``template`` does not finish within
    ``timeout_s`` (RENDER_TIMEOUT_S) or within MEMORY_LIMIT_BYTES; None when each renders, or fails as a template
    may (the caller's rendering reports that)."""
    timeout_s = RENDER_TIMEOUT_S if timeout_s is None else timeout_s
    payload = json.dumps({"template": template, "conversations": conversations, "variables": variables}, default=str)
    command = [sys.executable, "-I", str(Path(__file__).resolve())]
    try:
        proc = subprocess.run(command, input=payload, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:  # run() has killed the child
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        return len(out.splitlines()), f"did not finish rendering it within {timeout_s:g} s (a loop without end?)"
    lines = proc.stdout.splitlines()
    if lines and lines[-1] == OUT_OF_MEMORY:
        return len(lines) - 1, f"needs more than {MEMORY_LIMIT_BYTES >> 30} GiB to render it"
    if proc.returncode < 0:  # killed by a signal while rendering (the kernel's OOM killer, a segfault)
        return len(lines), f"ended its renderer with signal {-proc.returncode}"
    return None  # rendered, or failed as transformers will (and say why)


def _environment():
    """An environment as transformers' (trim_blocks, lstrip_blocks, loop controls, tojson without HTML escapes,
    raise_exception, strftime_now, ``{% generation %}`` blocks), in jinja2's immutable sandbox."""
    from datetime import datetime

    from jinja2 import TemplateError, nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """transformers' ``{% generation %}`` marks the assistant's tokens; here its body is rendered as is."""

        tags = {"generation"}

        def parse(self, parser) -> list[nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", Generation]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env


def _child() -> None:
    """Render each conversation; one line per conversation (DONE or FAILED), OUT_OF_MEMORY ends the output."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    limit = MEMORY_LIMIT_BYTES if hard == resource.RLIM_INFINITY else min(hard, MEMORY_LIMIT_BYTES)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    request = json.load(sys.stdin)
    try:
        template = _environment().from_string(request["template"])
    except Exception:  # a syntax error: the caller's own rendering says which
        print(FAILED, flush=True)
        return
    for messages in request["conversations"]:
        try:
            template.render(
                messages=messages, tools=None, documents=None, add_generation_prompt=True, **request["variables"]
            )
            print(DONE, flush=True)
        except MemoryError:
            print(OUT_OF_MEMORY, flush=True)
            return
        except Exception:
            print(FAILED, flush=True)


if __name__ == "__main__":
    _child()
