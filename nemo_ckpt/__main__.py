"""`python -m nemo_ckpt COMMAND ...`: checkpoints (`inspect`, `consolidate`, `verify`) and training logs (`plot`,
`runs`); `python -m nemo_ckpt COMMAND --help` for a command's arguments."""

import importlib
import sys

# command -> (the module whose `main(argv)` runs it, what it does)
COMMANDS = {
    "inspect": ("nemo_ckpt.dist_checkpointing.cli", "list a checkpoint's keys, shapes, dtypes, bytes and backend"),
    "consolidate": (
        "nemo_ckpt.dist_checkpointing.cli",
        "write a checkpoint's tensors, unsharded, to one torch or safetensors file (--weights-only: no optimizer)",
    ),
    "verify": ("nemo_ckpt.dist_checkpointing.cli", "check a checkpoint's files against the checksums stored at save"),
    "plot": ("nemo_ckpt.logger.cli", "plot the logged metrics of every version of a run, joined by step"),
    "runs": ("nemo_ckpt.logger.cli", "list the runs under a log directory: versions, last step, last checkpoint"),
}


def usage() -> str:
    """The commands, one line each."""
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {description}" for name, (_, description) in COMMANDS.items()]
    return "\n".join(["usage: python -m nemo_ckpt COMMAND [ARGS ...]", "", "commands:", *lines])


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv[0]`; `--help` lists the commands (exit 0), an unknown one exits 2 with the list."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{__doc__}\n\n{usage()}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = f"unknown command {argv[0]!r}" if argv else "a command is required"
        print(f"{usage()}\n\npython -m nemo_ckpt: error: {problem}", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv)


if __name__ == "__main__":
    sys.exit(main())
