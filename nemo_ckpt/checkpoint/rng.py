"""`RNGStateCallback`: every rank's random generator states in the checkpoint, restored on resume."""

import logging
import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

log = logging.getLogger(__name__)


def capture_rng_state() -> dict[str, Any]:
    """This process's Python, NumPy and torch (CPU and, if present, CUDA) generator states, in plain types."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (kind, keys.tolist(), position, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set this process's generators to a state from `capture_rng_state`."""
    random.setstate(state["python"])
    kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


class RNGStateCallback(Callback):
    """Save every rank's generator states with each checkpoint; on resume, set them again right before the first
    training step, so random ops (dropout, sampling) continue as in an uninterrupted run.

    The states of all ranks are gathered into the checkpoint's common part; a run resumed on a different number
    of ranks keeps its freshly seeded generators (with a warning).
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        state = capture_rng_state()
        if not (dist.is_available() and dist.is_initialized()):
            return {"ranks": [state]}
        states = [None] * dist.get_world_size()
        dist.all_gather_object(states, state)
        return {"ranks": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict["ranks"]
        world_size, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        if len(states) != world_size:
            log.warning(
                "RNGStateCallback: the checkpoint holds generator states of %d ranks, this run has %d; "
                "keeping the seeded generators",
                len(states),
                world_size,
            )
            return
        self._pending = states[rank]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._pending is not None:
            restore_rng_state(self._pending)
            self._pending = None
