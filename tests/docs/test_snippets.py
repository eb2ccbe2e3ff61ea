"""Every fenced ```bash and ```python block of README.md and docs/*.md runs as written.

Each block runs in its own temporary directory, with the installed package and its environment activated
(the test's Python environment first on PATH, as `. .venv/bin/activate` does; `PYTHONPATH` unset;
`NEMORUN_HOME` in the temporary directory): bash blocks with `bash -e` (a failing line stops the block; as in
any `set -e` script, a failure before the last `&&` of a line stops it only on the block's last line, so chain a
block's steps on one line or write them one per line), Python blocks as a script (`python snippet.py`). A block
passes when it exits with 0 and what the documentation says it leaves behind is there (`CLAIMS` below). Python
blocks run in a child of the test session's forkserver, whose server imported torch, Lightning and NeMo-Run once
(`tests.helpers.distributed`): `python snippet.py` without the seconds a fresh interpreter spends importing them;
the child takes the block's environment and working directory first (and NeMo-Run's home, which NeMo-Run reads
once at import). Blocks in other languages (trees, tables, YAML) are not run. One test per block, in document
order (`README.md:LINE-bash`).

Conventions, an HTML comment on the line right before the opening fence:

- `<!-- snippet: skip (why) -->`: illustration only, not run; the test of the block is skipped with `why`, so
  `pytest -rs` (the project's `-ra`) lists every skipped block.
- `<!-- snippet: prepend (CODE) -->`: a Python fragment that needs context (e.g. lines editing `recipe`):
  the one-line `CODE` (statements separated by `;`) runs first, in the same script.

Bash blocks that install the package start with the set-up commands of a fresh clone (`python3 -m venv .venv`,
`. .venv/bin/activate`, `pip install -c constraints.txt -e .`). The environment they build is the one this
test runs in, so these leading commands (and only these, matched by `SETUP_COMMANDS`) are not run again;
instead the test checks that the environment is theirs: this checkout installed in editable mode, at the
versions `constraints.txt` pins. The rest of the block runs as written.
"""

import json
import os
import re
import runpy
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import nemo_run
import pytest
from packaging.requirements import Requirement

from nemo_ckpt.checkpoint.manifest import Manifest
from tests.helpers.distributed import forkserver

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python"}
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
MARKER = re.compile(r"^<!-- snippet: (?P<kind>skip|prepend) \((?P<argument>.+)\) -->$")
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
                    f"{document}:{index}: malformed marker {previous!r}; use `<!-- snippet: skip (why) -->` or "
                    "`<!-- snippet: prepend (python code) -->`"
                )
            if marker["kind"] == "prepend" and language != "python":
                raise ValueError(f"{document}:{index}: `prepend` is for python blocks, this one is {language}")
            markers[marker["kind"]] = marker["argument"]
        snippets.append(Snippet(document, index + 1, language, code, **markers))
        index = end + 1
    return snippets


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


def _python_script(directory: Path, env: dict[str, str]) -> None:
    """`python snippet.py` in `directory` with `env`, output into `directory/output.txt` (a forkserver child)."""
    with open(directory / "output.txt", "wb") as output:
        os.dup2(output.fileno(), 1)
        os.dup2(output.fileno(), 2)
    os.chdir(directory)
    os.environ.clear()
    os.environ.update(env)
    nemo_run.config.set_nemorun_home(env["NEMORUN_HOME"])
    sys.argv = ["snippet.py"]
    sys.path.insert(0, str(directory))
    runpy.run_path("snippet.py", run_name="__main__")


def run_snippet(snippet: Snippet, directory: Path) -> subprocess.CompletedProcess:
    """Run the block in `directory`; stdout and stderr together in the result's stdout."""
    env = activated_environment(directory)
    if snippet.language == "python":
        (directory / "snippet.py").write_text((snippet.prepend + "\n" if snippet.prepend else "") + snippet.code)
        process = forkserver().Process(target=_python_script, args=(directory, env))
        process.start()
        process.join(TIMEOUT_S)
        if process.exitcode is None:
            process.kill()
            raise TimeoutError(f"{snippet} still running after {TIMEOUT_S} s")
        output = (directory / "output.txt").read_text()
        return subprocess.CompletedProcess(["python", "snippet.py"], process.exitcode, output)
    setup, script = without_setup_commands(snippet.code)
    if setup:
        check_environment_is_the_setup()
    (directory / "snippet.sh").write_text(script)
    return subprocess.run(
        ["bash", "-e", "snippet.sh"],
        cwd=directory,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S,
    )


def complete_steps(checkpoint_dir: Path) -> list[int]:
    """The steps of the complete checkpoints in the manifest, oldest first; the last is `-last`'s."""
    manifest = Manifest.read(checkpoint_dir)
    assert manifest.newest() and manifest.last == manifest.newest().name, f"{checkpoint_dir}: {manifest}"
    return [record.step for record in manifest.complete()]


def set_up_trains_then_resumes(directory: Path, output: str) -> None:
    steps = complete_steps(directory / "nemo_experiments" / "tiny" / "checkpoints")
    assert steps[-1] == 30 and 20 in steps, f"30 steps, resumed from the step-20 checkpoint: {steps}"


def use_trains_demo_to_50_steps(directory: Path, output: str) -> None:
    assert complete_steps(Path("/tmp/runs/demo/checkpoints"))[-1] == 50


def dryrun_prints_config_and_runs_nothing(directory: Path, output: str) -> None:
    assert "num_layers=4" in output and "LocalExecutor" in output and "ntasks_per_node=2" in output, output
    assert not (directory / "nemo_experiments").exists()


@dataclass(frozen=True)
class Claim:
    """What the documentation says a block leaves behind, checked after the block that contains `text`."""

    text: str
    check: Callable[[Path, str], None]


CLAIMS = (
    Claim("pretrain --factory tiny trainer.max_steps=30 run.executor=local --yes", set_up_trains_then_resumes),
    Claim("run.run(recipe, executor=local_executor(ntasks_per_node=2))", use_trains_demo_to_50_steps),
    Claim(
        "model.config.num_layers=4 run.executor=local run.executor.ntasks_per_node=2 --dryrun",
        dryrun_prints_config_and_runs_nothing,
    ),
)
SNIPPETS = documented_snippets()


@pytest.mark.parametrize("snippet", SNIPPETS, ids=str)
def test_snippet_runs_as_written(snippet: Snippet, tmp_path: Path) -> None:
    if snippet.skip:
        pytest.skip(f"{snippet}: {snippet.skip}")
    result = run_snippet(snippet, tmp_path)
    assert result.returncode == 0, f"{snippet} failed (exit {result.returncode}):\n{result.stdout[-6000:]}"
    for claim in CLAIMS:
        if claim.text in snippet.code:
            claim.check(tmp_path, result.stdout)


def test_every_claim_names_one_snippet() -> None:
    for claim in CLAIMS:
        matches = [str(snippet) for snippet in SNIPPETS if claim.text in snippet.code and not snippet.skip]
        assert len(matches) == 1, f"claim about {claim.text!r} matches {matches or 'no block'}"


def test_markers_and_setup_commands() -> None:
    text = "\n".join(
        [
            "<!-- snippet: skip (needs a cluster) -->",
            "```bash",
            "sbatch job.sh",
            "```",
            "",
            "<!-- snippet: prepend (x = 1; y = 2) -->",
            "```python",
            "print(x + y)",
            "```",
            "- item:",
            "  ```py",
            "  z = 3",
            "  ```",
            "```",
            "tree/",
            "```",
        ]
    )
    snippets = parse_snippets(text, "doc.md")
    assert [(s.line, s.language, s.code, s.skip, s.prepend) for s in snippets] == [
        (2, "bash", "sbatch job.sh\n", "needs a cluster", None),
        (7, "python", "print(x + y)\n", None, "x = 1; y = 2"),
        (11, "python", "z = 3\n", None, None),
        (14, "text", "tree/\n", None, None),
    ]
    with pytest.raises(ValueError, match="doc.md:1: malformed marker"):
        parse_snippets("<!-- snippet: skipped -->\n```bash\ntrue\n```\n", "doc.md")
    with pytest.raises(ValueError, match="`prepend` is for python blocks"):
        parse_snippets("<!-- snippet: prepend (x = 1) -->\n```bash\ntrue\n```\n", "doc.md")

    setup, script = without_setup_commands(
        "python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints.txt -e . && nemo a && nemo b\n"
        "pip install -c constraints.txt -e .\n"
    )
    assert setup == ["python3 -m venv .venv", ". .venv/bin/activate", "pip install -c constraints.txt -e ."]
    assert script == "nemo a && nemo b\npip install -c constraints.txt -e .\n", "only the leading set-up is dropped"
