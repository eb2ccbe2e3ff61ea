"""Every fenced ```bash and ```python block of README.md and docs/*.md runs as written (`tests/helpers/snippets.py`,
which also describes the `<!-- snippet: ... -->` markers), one test per block in document order
(`README.md:LINE-bash`), and leaves behind what the documentation says (`CLAIMS`)."""

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from nemo_ckpt.checkpoint.manifest import Manifest
from tests.helpers.snippets import SNIPPETS, Snippet, followed, parse_snippets, run_once, without_setup_commands


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


def runs_lists_both_versions_and_plots_them(directory: Path, output: str) -> None:
    runs = re.compile(r"^tiny \(\S+\): 2 version\(s\), last logged step 29, last checkpoint \S+step=30$", re.M)
    assert runs.search(output) and "reduced_train_loss: 30 points, steps 0-29" in output, output
    assert (directory / "curves.png").read_bytes()[:4] == b"\x89PNG"


def dryrun_prints_config_and_runs_nothing(directory: Path, output: str) -> None:
    assert "num_layers=4" in output and "LocalExecutor" in output and "ntasks_per_node=2" in output, output
    assert not (directory / "nemo_experiments").exists()


def daily_loop_extends_the_finished_run(directory: Path, output: str) -> None:
    assert complete_steps(directory / "runs" / "tiny" / "checkpoints") == [10, 15], output[-3000:]
    assert re.search(r"resuming from runs/tiny/checkpoints/\S+step=10 at step 10, consumed_samples 80", output), output


def daily_loop_generates_and_scores(directory: Path, output: str) -> None:
    for prompt in ("echo abcde", "echo hhhhh"):
        assert re.search(rf"^\[\d\] {prompt}$", output, re.M), output[-3000:]
    scores = re.findall(r"^  loss (\d+\.\d+), perplexity (\d+\.\d+) \(([\d,]+) tokens", output, re.M)
    assert len(scores) == 3, output[-3000:]
    for loss, perplexity, _ in scores:
        assert abs(math.exp(float(loss)) - float(perplexity)) < 1e-3 * float(perplexity)


@dataclass(frozen=True)
class Claim:
    """What the documentation says a block leaves behind, checked after the block that contains `text`."""

    text: str
    check: Callable[[Path, str], None]


CLAIMS = (
    Claim("pretrain --factory tiny trainer.max_steps=30 run.executor=local --yes", set_up_trains_then_resumes),
    Claim("run.run(recipe, executor=local_executor(ntasks_per_node=2))", use_trains_demo_to_50_steps),
    Claim(
        "python -m nemo_ckpt runs nemo_experiments && python -m nemo_ckpt plot", runs_lists_both_versions_and_plots_them
    ),
    Claim("tokenizer='tok')\" trainer.max_steps=15 run.executor=local --yes", daily_loop_extends_the_finished_run),
    Claim("data=$PWD/data/corpus_text_document", daily_loop_generates_and_scores),
    Claim(
        "model.config.num_layers=4 run.executor=local run.executor.ntasks_per_node=2 --dryrun",
        dryrun_prints_config_and_runs_nothing,
    ),
)


@pytest.mark.parametrize("snippet", SNIPPETS, ids=str)
def test_snippet_runs_as_written(snippet: Snippet, tmp_path_factory: pytest.TempPathFactory) -> None:
    if snippet.skip:
        pytest.skip(f"{snippet}: {snippet.skip}")
    directory, result = run_once(snippet, tmp_path_factory.mktemp)
    assert result.returncode == 0, f"{snippet} failed (exit {result.returncode}):\n{result.stdout[-6000:]}"
    for claim in CLAIMS:
        if claim.text in snippet.code:
            claim.check(directory, result.stdout)


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

    first, second = parse_snippets(
        "```bash\nnemo a\n```\n<!-- snippet: after (nemo a) -->\n```bash\nnemo b\n```\n", "doc.md"
    )
    assert second.after == "nemo a" and followed(second, [first]) is first
    with pytest.raises(
        ValueError, match="doc.md:5-bash: `after \\(nemo c\\)` must name one earlier runnable block; found"
    ):
        parse_snippets("```bash\nnemo a\n```\n<!-- snippet: after (nemo c) -->\n```bash\nnemo b\n```\n", "doc.md")

    setup, script = without_setup_commands(
        "python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints.txt -e . && nemo a && nemo b\n"
        "pip install -c constraints.txt -e .\n"
    )
    assert setup == ["python3 -m venv .venv", ". .venv/bin/activate", "pip install -c constraints.txt -e ."]
    assert script == "nemo a && nemo b\npip install -c constraints.txt -e .\n", "only the leading set-up is dropped"
