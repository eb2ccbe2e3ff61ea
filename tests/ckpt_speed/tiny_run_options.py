"""Train the tiny recipe (under torchrun) with MegatronStrategy checkpoint options, optionally SIGKILLed at a step.

    python -m torch.distributed.run --nproc-per-node 2 -m tests.ckpt_speed.tiny_run_options DIR MAX_STEPS OPTIONS_JSON [KILL_AT_STEP]
"""

import json
import sys

import fiddle as fdl

from tests.tiny_run import tiny_recipe

if __name__ == "__main__":
    directory, max_steps, options, *kill = sys.argv[1:]
    recipe = tiny_recipe(directory, int(max_steps), int(kill[0]) if kill else None)
    for name, value in json.loads(options).items():
        setattr(recipe.trainer.strategy, name, value)
    fdl.build(recipe)()
