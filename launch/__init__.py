"""Executors (`local`: torchrun, `slurm`: sbatch) and the `nemo nemo_ckpt ...` command line."""

from launch import overrides

# NeMo-Run 0.11 parses `Optional[int]` but not `int | None`, and a union's first member `str` takes a list written on
# the command line as one string: `launch.overrides` parses PEP 604 unions, lists and dicts included.
overrides.register()
