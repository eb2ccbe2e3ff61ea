"""The `nemo nemo_ckpt ...` command line: registers the entry point, recipes and executors with NeMo-Run.

    nemo nemo_ckpt pretrain --factory tiny trainer.max_steps=20 run.executor=local --yes
"""

import launch.local  # noqa: F401  (registers the `local` executor factory)
import launch.slurm  # noqa: F401  (registers the `slurm` executor factory)
import recipes  # noqa: F401  (registers the `pretrain` entry point and its recipe factories)
