"""Where MegatronStrategy orders training's CUDA stream after an async save's device-to-host copies, which with
`ckpt_async_overlap_staging` it does not wait for at the save (see `DeviceToHostCopies`): after the next forward and
backward, before the optimizer's update; before a load writes into the live tensors. Recorded here on CPU, where the
ordering is a no-op; the GPU tests (tests/gpu) check the saved values themselves while training goes on."""

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from nemo_ckpt.strategy import checkpoint_io
from nemo_ckpt.strategy.checkpoint_io import DistCheckpointIO
from tests.helpers.trainer import fit

SAVE_AT = 2
OVERLAPPED = {"ckpt_async_save": True, "ckpt_async_overlap_staging": True}


class RecordEvents(pl.Callback):
    """Appends "forward", "update" (just before the optimizer's update) and "save" (after a save at `save_at`)."""

    def __init__(self, events: list[str], save_at: int | None = None, path: Path | None = None) -> None:
        self.events = events
        self.save_at = save_at
        self.path = path

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.module.register_forward_pre_hook(lambda *_: self.events.append("forward"))

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.events.append("update")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.save_at:
            trainer.save_checkpoint(self.path)
            self.events.append("save")


@pytest.fixture
def events(monkeypatch) -> list[str]:
    """Appends "order" whenever the strategy orders the stream after the deferred copies, "load" at a load."""
    recorded: list[str] = []
    order, load = DistCheckpointIO.order_after_staging, checkpoint_io.dist_checkpointing.load

    def record_order(self: DistCheckpointIO) -> None:
        recorded.append("order")
        order(self)

    def record_load(*args: Any, **kwargs: Any) -> Any:
        recorded.append("load")
        return load(*args, **kwargs)

    monkeypatch.setattr(DistCheckpointIO, "order_after_staging", record_order)
    monkeypatch.setattr(checkpoint_io.dist_checkpointing, "load", record_load)
    return recorded


def test_the_update_after_a_save_is_ordered_after_its_copies_and_forward_is_not(tmp_path, events):
    fit(1, {}, 4, callbacks=[RecordEvents(events, SAVE_AT, tmp_path / "step")], **OVERLAPPED)
    after_save = events[events.index("save") + 1 :]
    assert after_save[:3] == ["forward", "order", "update"]
    assert all(events[i - 1] == "order" for i, event in enumerate(events) if event == "update")


def test_a_resume_orders_before_it_loads(tmp_path, events):
    fit(1, {}, SAVE_AT, callbacks=[RecordEvents([], SAVE_AT, tmp_path / "step")], **OVERLAPPED)
    events.clear()
    fit(1, {}, SAVE_AT + 1, ckpt_path=tmp_path / "step", **OVERLAPPED)
    assert events.index("order") < events.index("load")
