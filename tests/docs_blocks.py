"""The fenced code blocks of the README files, for tests/test_docs.py: shell commands (one per
line, backslash continuations joined, trailing comments cut) and python snippets."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "examples/m6/README.md", "examples/hf/README.md")
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
