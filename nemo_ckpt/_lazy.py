"""Names a package exports, imported on first use (PEP 562): importing the package itself stays cheap, e.g. the
`python -m nemo_ckpt runs|plot` readers and `dist_checkpointing` do not load Lightning."""

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str | None]) -> Callable[[str], Any]:
    """A module-level `__getattr__` for `package`: `exports[name]` is the module that defines `name`, or None where
    `name` is the submodule `package.name` itself."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if exports[name] is None:
            return importlib.import_module(f"{package}.{name}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
