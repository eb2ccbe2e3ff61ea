"""Running the fenced ```bash and ```python blocks of README.md and docs/*.md as written.

Each block runs in its own temporary directory (or the one of the block it follows, see `after` below), with the
installed package and its environment activated (the test's Python environment first on PATH, as
`. .venv/bin/activate` does; `PYTHONPATH` unset; `NEMORUN_HOME` in the temporary directory): bash blocks with
`bash -e` (a failing line stops the block; as in any `set -e` script, a failure before the last `&&` of a line stops
it only on the block's last line, so chain a block's steps on one line or write them one per line), their `nemo`
commands run by a preloaded process (`tests.helpers.preloaded_nemo`: the real `nemo` is started by
`tests/launch/test_stop.py`), Python blocks as
a script (`python snippet.py`, in a preloaded process: `tests.helpers.commands.python_script`). Blocks in other
languages (trees, tables, YAML) are not run. Blocks are named `README.md:LINE-bash`.

Conventions, an HTML comment on the line right before the opening fence:

- `<!-- snippet: skip (why) -->`: illustration only, not run; the test of the block is skipped with `why`, so
  `pytest -rs` (the project's `-ra`) lists every skipped block.
- `<!-- snippet: prepend (CODE) -->`: a Python fragment that needs context (e.g. lines editing `recipe`):
  the one-line `CODE` (statements separated by `;`) runs first, in the same script.
- `<!-- snippet: after (TEXT) -->`: a block that works on what an earlier block of the same document left behind
  (e.g. reads the runs of the set-up command): it runs in the directory of the one earlier block containing `TEXT`,
  after it. Each block runs once per session; one that is selected alone runs the block it follows first.

Bash blocks that install the package start with the set-up commands of a fresh clone (`python3 -m venv .venv`,
`. .venv/bin/activate`, `pip install -c constraints.txt -e .`). The environment they build is the one this
test runs in, so these leading commands (and only these, matched by `SETUP_COMMANDS`) are not run again;
instead the test checks that the environment is theirs: this checkout installed in editable mode, at the
versions `constraints.txt` pins. The rest of the block runs as written.
"""

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from tests.helpers.commands import python_script
from tests.helpers.preloaded_nemo import nemo_bin

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python"}
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
MARKER = re.compile(r"^<!-- snippet: (?P<kind>skip|prepend|after) \((?P<argument>.+)\) -->$")
SETUP_COMMANDS = (
    re.compile(r"python3? -m venv \.venv"),
    re.compile(r"(\.|source) \.venv/bin/activate"),
    re.compile(r"(\.venv/bin/)?pip install (-q )?-c constraints\.txt -e (\.|'\.\[test\]')"),
)
TIMEOUT_S = 600


@dataclass(frozen=True)
class Snippet:
    """A fenced code block: where it is, its language (bash, python or another), its code and its marker."""

    document: str
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    skip: str | None = None
    prepend: str | None = None
    after: str | None = None  # text of the earlier block it follows

    def __str__(self) -> str:
        return f"{self.document}:{self.line}-{self.language}"


def parse_snippets(text: str, document: str) -> list[Snippet]:
    """The fenced code blocks of a Markdown text, with their `<!-- snippet: ... -->` markers."""
    lines = text.splitlines()
    snippets, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        end = index + 1
        while end < len(lines) and not re.fullmatch(rf" *{fence[0]}{{{len(fence)},}}\s*", lines[end]):
            end += 1
        code = "\n".join(line[indent:] for line in lines[index + 1 : end]) + "\n"
        previous = lines[index - 1].strip() if index else ""
        language = LANGUAGES.get(opening["info"].lower(), opening["info"].lower() or "text")
        markers = {}
        if previous.startswith("<!-- snippet:"):
            marker = MARKER.match(previous)
            if not marker:
                raise ValueError(
                    f"{document}:{index}: malformed marker {previous!r}; use `<!-- snippet: skip (why) -->`, "
                    "`<!-- snippet: prepend (python code) -->` or `<!-- snippet: after (text of an earlier block) -->`"
                )
            if marker["kind"] == "prepend" and language != "python":
                raise ValueError(f"{document}:{index}: `prepend` is for python blocks, this one is {language}")
            markers[marker["kind"]] = marker["argument"]
        snippets.append(Snippet(document, index + 1, language, code, **markers))
        if snippets[-1].after:
            followed(snippets[-1], snippets[:-1])
        index = end + 1
    return snippets


def followed(snippet: Snippet, earlier: list[Snippet]) -> Snippet:
    """The one block of `earlier` (same document) whose code contains the text of `snippet`'s `after` marker."""
    runnable = [block for block in earlier if block.language in ("bash", "python") and not block.skip]
    matches = [block for block in runnable if snippet.after in block.code]
    if len(matches) != 1:
        found = ", ".join(map(str, matches)) or "none"
        raise ValueError(f"{snippet}: `after ({snippet.after})` must name one earlier runnable block; found {found}")
    return matches[0]


def documented_snippets() -> list[Snippet]:
    """The bash and Python blocks of README.md and docs/*.md."""
    snippets = []
    for path in DOCUMENTS:
        snippets += parse_snippets(path.read_text(), str(path.relative_to(REPO)))
    return [snippet for snippet in snippets if snippet.language in ("bash", "python")]


def without_setup_commands(code: str) -> tuple[list[str], str]:
    """Split a bash block into its leading set-up commands (`SETUP_COMMANDS`) and the script that follows."""
    setup, rest = [], []
    for line in code.splitlines():
        commands = line.split(" && ")
        while not rest and commands and any(p.fullmatch(commands[0].strip()) for p in SETUP_COMMANDS):
            setup.append(commands.pop(0).strip())
        if commands:
            rest.append(" && ".join(commands))
    return setup, "\n".join(rest) + "\n"


def check_environment_is_the_setup() -> None:
    """The environment the set-up commands build: this checkout, editable, at the pinned versions."""
    installed = [d.read_text("direct_url.json") for d in metadata.distributions(name="nemo-ckpt")]
    origin = json.loads(next(filter(None, installed), "{}"))  # not the checkout's own nemo_ckpt.egg-info
    assert origin.get("dir_info", {}).get("editable") and Path(origin["url"].removeprefix("file://")) == REPO, (
        f"the test environment does not hold this checkout installed with `pip install -e .`: {origin}"
    )
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.split("#")[0].strip():
            pin = Requirement(line.split("#")[0].strip())
            installed = metadata.version(pin.name)
            assert pin.specifier.contains(installed, prereleases=True), f"{pin} pinned, {installed} installed"


def activated_environment(directory: Path) -> dict[str, str]:
    """os.environ as after `. .venv/bin/activate` of the test's environment, with NeMo-Run's home in `directory`."""
    bin_dir = Path(sys.executable).parent
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return env | {
        "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        "VIRTUAL_ENV": str(bin_dir.parent),
        "NEMORUN_HOME": str(directory / ".nemo_run"),
    }


def run_snippet(snippet: Snippet, directory: Path) -> subprocess.CompletedProcess:
    """Run the block in `directory`; stdout and stderr together in the result's stdout."""
    env = activated_environment(directory)
    if snippet.language == "python":
        (directory / "snippet.py").write_text((snippet.prepend + "\n" if snippet.prepend else "") + snippet.code)
        return python_script("snippet.py", directory, env, TIMEOUT_S)
    setup, script = without_setup_commands(snippet.code)
    if setup:
        check_environment_is_the_setup()
    (directory / "snippet.sh").write_text(script)
    return subprocess.run(
        ["bash", "-e", "snippet.sh"],
        cwd=directory,
        env=env | {"PATH": f"{nemo_bin()}{os.pathsep}{env['PATH']}"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S,
    )


SNIPPETS = documented_snippets()


_RUNS: dict[Snippet, tuple[Path, subprocess.CompletedProcess]] = {}
"""Each block's run in this session: its directory and result."""


def run_once(snippet: Snippet, new_directory: Callable[[str], Path]) -> tuple[Path, subprocess.CompletedProcess]:
    """Run `snippet` in a new directory, or after the block it follows in that block's directory, unless it has run
    in this session; return its directory and result."""
    if snippet not in _RUNS:
        if snippet.after:
            earlier = [block for block in SNIPPETS if block.document == snippet.document and block.line < snippet.line]
            before = followed(snippet, earlier)
            directory, result = run_once(before, new_directory)
            assert result.returncode == 0, f"{snippet} follows {before}, which failed"
        else:
            directory = new_directory(re.sub(r"\W", "-", str(snippet)))
        _RUNS[snippet] = directory, run_snippet(snippet, directory)
    return _RUNS[snippet]
