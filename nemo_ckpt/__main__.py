"""Command line: `python -m nemo_ckpt inspect CKPT` / `consolidate CKPT OUT` / `verify CKPT` (checkpoints),
`python -m nemo_ckpt plot RUN_DIR` / `runs LOG_DIR` (training logs)."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] and sys.argv[1] in ("plot", "runs"):
        from nemo_ckpt.logger.cli import main
    else:
        from nemo_ckpt.dist_checkpointing.cli import main
    sys.exit(main())
