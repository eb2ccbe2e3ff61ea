"""The life of checkpoint directories: where things are (`layout`), the manifest, `ModelCheckpoint` (save, commit,
retain, recover), `AutoResume`, the stored configs (`context`), RNG states and Slurm preemption.

Names are imported on first use: `layout` and `manifest` are read without loading Lightning."""

from nemo_ckpt._lazy import lazy_exports

_EXPORTS: dict[str, str | None] = {
    "AutoResume": "nemo_ckpt.checkpoint.resume",
    "IOMixin": "nemo_ckpt.checkpoint.context",
    "ModelCheckpoint": "nemo_ckpt.checkpoint.model_checkpoint",
    "PreemptionCallback": "nemo_ckpt.checkpoint.preemption",
    "RNGStateCallback": "nemo_ckpt.checkpoint.rng",
    "load_context": "nemo_ckpt.checkpoint.context",
    "load_model": "nemo_ckpt.checkpoint.context",
}

__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
