"""Executors (`local`: torchrun, `slurm`: sbatch) and the `nemo nemo_ckpt ...` command line."""

from nemo_ckpt._compat import nemo_run_cli_parse_union_types

# NeMo-Run 0.11 parses `Optional[int]` but not `int | None`: without this, command-line overrides of such options
# (`log.ckpt.every_n_train_steps=5`, `run.executor.partition=batch`) and `--yaml` files setting them fail.
nemo_run_cli_parse_union_types()
