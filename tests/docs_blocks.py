"""The fenced code blocks of the README files and docs/*.md, for tests/test_docs.py: shell commands (one per
line, backslash continuations joined, trailing comments cut), python snippets, the commands
written inline in the prose (`python -m bench.rebalance`), and the output blocks (fences
without a language)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = (
    "README.md",
    "examples/m6/README.md",
    "examples/hf/README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks(doc: str, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall((ROOT / doc).read_text()) if kind == lang]


def commands(doc: str) -> list[str]:
    """Every shell command line of `doc`'s bash blocks, as a user would paste it."""
    out = []
    for body in blocks(doc, "bash"):
        text = re.sub(r"\\\n\s*", "", body)  # continuation lines
        for line in text.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(" ".join(line.split()))
    return out


PROSE_COMMAND = re.compile(r"`((?:python3? |torchrun |bash |scripts/)[^`]+)`")


def inline_commands(doc: str) -> list[str]:
    """Every command written inline (in backticks) in `doc`'s prose, outside fenced blocks,
    starting with python, python3, torchrun, bash or scripts/; whitespace collapsed."""
    text = FENCE.sub("", (ROOT / doc).read_text())
    return [" ".join(m.group(1).split()) for m in PROSE_COMMAND.finditer(text)]


def outputs(doc: str) -> list[str]:
    """The fenced blocks without a language: what the docs show a command printing."""
    return blocks(doc, "")
