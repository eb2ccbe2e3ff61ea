"""benchmarks/RESULTS.md: each benchmark script owns one `## ...` section and rewrites only that one."""

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(section: str, path: Path = RESULTS) -> None:
    """Replace the section headed by `section`'s first line, or append it; the other sections stay as they are."""
    heading = section.splitlines()[0]
    text = path.read_text() if path.exists() else "# Benchmark results\n\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section.rstrip("\n") + "\n\n", text).rstrip("\n") + "\n"
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)
