"""Which checkpoints `ModelCheckpoint` keeps (spec FAQ 5 and 6), and the options it refuses."""

from datetime import timedelta

import pytest

from nemo_ckpt.checkpoint.manifest import CheckpointRecord, Manifest
from nemo_ckpt.checkpoint.model_checkpoint import ModelCheckpoint


def manifest(*losses: float, weights_only_last: bool = False) -> Manifest:
    """Complete checkpoints of steps 1, 2, ... with these losses, oldest first; the newest is `last`."""
    records = [
        CheckpointRecord(f"step={step}", step, 0, {"loss": loss}, "complete")
        for step, loss in enumerate(losses, start=1)
    ]
    records[-1].weights_only = weights_only_last
    return Manifest(records, records[-1].name)


def kept(callback: ModelCheckpoint, checkpoints: Manifest) -> list[int]:
    stale = callback.stale_checkpoints(checkpoints)
    return [record.step for record in checkpoints.checkpoints if record not in stale]


def test_top_k_by_metric_plus_last():
    checkpoints = manifest(3.0, 1.0, 2.0, 5.0, 4.0)
    assert kept(ModelCheckpoint(monitor="loss", save_top_k=2), checkpoints) == [2, 3, 5]
    assert kept(ModelCheckpoint(monitor="loss", mode="max", save_top_k=2), checkpoints) == [4, 5]
    assert kept(ModelCheckpoint(monitor="loss", save_top_k=2, save_last=False), checkpoints) == [2, 3]
    assert kept(ModelCheckpoint(monitor="loss", save_top_k=-1), checkpoints) == [1, 2, 3, 4, 5]


def test_last_in_top_k_is_kept_once():
    assert kept(ModelCheckpoint(monitor="loss", save_top_k=1), manifest(3.0, 2.0, 1.0)) == [3]


def test_without_monitor_the_newest_are_kept():
    assert kept(ModelCheckpoint(monitor=None, save_top_k=2, save_last=False), manifest(1.0, 2.0, 3.0)) == [2, 3]


def test_save_best_model_keeps_the_best_whatever_save_top_k():
    checkpoints = manifest(3.0, 1.0, 2.0, 4.0)
    # FAQ 6: save_top_k=1 with save_best_model keeps only the best (and, with save_last, the newest)
    assert kept(ModelCheckpoint(monitor="loss", save_top_k=1, save_best_model=True, save_last=False), checkpoints) == [
        2
    ]
    assert kept(ModelCheckpoint(monitor="loss", save_top_k=0, save_best_model=True), checkpoints) == [2, 4]
    assert kept(ModelCheckpoint(monitor="loss", save_top_k=0, save_last=True), checkpoints) == [4]


def test_nan_ranks_worst_and_unmonitored_checkpoints_are_only_kept_as_last():
    checkpoints = manifest(float("nan"), 2.0, 1.0, 3.0)
    assert kept(ModelCheckpoint(monitor="loss", save_top_k=2, save_last=False), checkpoints) == [2, 3]
    checkpoints.checkpoints[-1].metrics = {}
    assert kept(ModelCheckpoint(monitor="loss", save_top_k=1), checkpoints) == [3, 4]


def test_a_weights_only_last_keeps_the_newest_resumable_checkpoint():
    checkpoints = manifest(3.0, 2.0, 1.0, weights_only_last=True)
    assert kept(ModelCheckpoint(monitor="loss", save_top_k=1), checkpoints) == [2, 3]


def test_only_complete_checkpoints_are_ranked_or_deleted():
    checkpoints = manifest(1.0, 2.0, 3.0)
    checkpoints.checkpoints[0].state = "saving"
    stale = ModelCheckpoint(monitor="loss", save_top_k=1).stale_checkpoints(checkpoints)
    assert [record.step for record in stale] == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "lowest"}, "mode='lowest'"),
        ({"save_top_k": -2}, "save_top_k=-2"),
        ({"save_top_k": 0, "save_last": False}, "keeps no checkpoint"),
        ({"save_best_model": True, "monitor": None}, "save_best_model=True"),
        ({"every_n_train_steps": -1}, "every_n_train_steps=-1"),
        ({"filename": "model-{epoch}"}, "must contain the field {step}"),
        ({"filename": "runs/{step}"}, "has no '/'"),
        ({"filename": ".hidden-{step}"}, "does not start with '.'"),
    ],
)
def test_bad_options_are_refused_with_the_option_named(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("(", r"\(")):
        ModelCheckpoint(**kwargs)


def test_train_time_interval_is_a_timedelta():
    with pytest.raises(TypeError, match="train_time_interval=30"):
        ModelCheckpoint(train_time_interval=30)
    assert ModelCheckpoint(train_time_interval=timedelta(minutes=30)).train_time_interval.total_seconds() == 1800
