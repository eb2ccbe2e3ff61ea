from nemo_ckpt.data.mock import MockDataModule

__all__ = ["MockDataModule"]
