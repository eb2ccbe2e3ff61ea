"""Command line: ``python -m nemo_ckpt inspect CKPT`` / ``python -m nemo_ckpt consolidate CKPT OUT``."""

import sys

from nemo_ckpt.dist_checkpointing.cli import main

if __name__ == "__main__":
    sys.exit(main())
