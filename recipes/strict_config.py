"""`StrictConfig`: the recipes' `run.Config`, which refuses an option its class does not take when it is set from
Python, with the message the command line gives (`nemo_ckpt.options.check_override`): a misspelt name gets the
closest one (`unknown option ckpt_async_sav; did you mean ckpt_async_save?`), a NeMo option not implemented here
says what it means in NeMo. Fiddle's own error names neither. To NeMo-Run (its dry run, `--to-yaml`, the cast of a
launched task's configs, without Fiddle's warning) it shows as the `run.Config` it is."""

from typing import Any

import fiddle as fdl
import nemo_run as run
import yaml

from nemo_ckpt._compat import register_fiddle_cast
from nemo_ckpt.options import check_override


class StrictConfig(run.Config):
    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("__"):  # Fiddle's own attributes
            check_override(self, name)
        super().__setattr__(name, value)

    def __repr__(self) -> str:
        return super().__repr__().replace(f"<{type(self).__name__}[", "<Config[", 1)


register_fiddle_cast(StrictConfig, run.Config)
yaml.SafeDumper.add_representer(StrictConfig, lambda dumper, data: dumper.represent_data(fdl.cast(run.Config, data)))
