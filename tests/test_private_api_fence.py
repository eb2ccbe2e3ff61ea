"""The private-API fence: private names of torch, Lightning, NeMo-Run, Fiddle or any other third-party library are
used in `nemo_ckpt/_compat.py` only (each behind a named function with a canary in `tests/test_compat.py`).

A module outside `_compat.py` may not import from a third-party module path with a private component
(`torch.distributed.tensor._utils`), import a private name from a third-party module (`_optimizers_to_device`),
or read a private attribute through a name bound to a third-party import (`torch._dynamo`, `dist._something`).
Private: a leading underscore, not a dunder. The attributes of our own objects (`self._x`) are not checked."""

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCANNED = ["nemo_ckpt", "recipes", "launch", "benchmarks"]
COMPAT = REPO / "nemo_ckpt" / "_compat.py"
# the benchmark scripts import each other as top-level modules (`from results import ...`)
FIRST_PARTY = {"nemo_ckpt", "recipes", "launch", "benchmarks", "tests"} | {
    path.stem for path in (REPO / "benchmarks").glob("*.py")
}


def is_private(name: str) -> bool:
    """`_name` or `__name`, not `__name__`."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def is_third_party(module: str) -> bool:
    """Neither ours nor the standard library's."""
    top = module.split(".")[0]
    return top not in FIRST_PARTY and top not in sys.stdlib_module_names


def third_party_names(tree: ast.Module) -> set[str]:
    """The names the module's imports (at any depth) bind to third-party modules or their members."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names if is_third_party(alias.name)}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and is_third_party(node.module):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def root_name(node: ast.Attribute) -> str | None:
    """`a` of an attribute chain `a.b.c`; None when the chain starts at a call, subscript or other expression."""
    value = node.value
    while isinstance(value, ast.Attribute):
        value = value.value
    return value.id if isinstance(value, ast.Name) else None


def private_uses(path: Path) -> list[str]:
    """`file:line: name` for each use of a third-party private API in the module at `path`."""
    return private_uses_in(path.read_text(), str(path.relative_to(REPO)))


def private_uses_in(source: str, where: str) -> list[str]:
    """`where:line: name` for each use of a third-party private API in `source`, in line order."""
    tree = ast.parse(source, where)
    return [f"{where}:{line}: {use}" for line, use in sorted(uses(tree, third_party_names(tree)))]


def uses(tree: ast.Module, imported: set[str]) -> Iterator[tuple[int, str]]:
    """(line, name) of the private imports from third-party modules and private attributes of `imported` names."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if is_third_party(alias.name) and any(map(is_private, alias.name.split("."))):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and is_third_party(node.module):
            if any(map(is_private, node.module.split("."))):
                yield node.lineno, f"from {node.module} import ..."
            for alias in node.names:
                if is_private(alias.name):
                    yield node.lineno, f"from {node.module} import {alias.name}"
        elif isinstance(node, ast.Attribute) and is_private(node.attr) and root_name(node) in imported:
            yield node.lineno, ast.unparse(node)


def scanned_files() -> list[Path]:
    """Every module of `SCANNED` but `_compat.py`."""
    return sorted(path for directory in SCANNED for path in (REPO / directory).rglob("*.py") if path != COMPAT)


def test_private_apis_of_other_libraries_are_used_in_compat_only():
    files = scanned_files()
    assert len(files) > 50 and REPO / "nemo_ckpt" / "api.py" in files
    violations = [use for path in files for use in private_uses(path)]
    assert not violations, "move these behind a function of nemo_ckpt/_compat.py:\n" + "\n".join(violations)


def test_the_fence_sees_compat_s_private_uses():
    found = private_uses(COMPAT)
    assert any("torch.distributed.tensor._utils" in use for use in found)
    assert any("_optimizers_to_device" in use for use in found)
    assert any("torch._C" in use for use in found)


def test_the_fence_flags_each_kind_of_private_use_and_nothing_else():
    source = """
import os
import torch._dynamo
import fiddle._src as fiddle_src
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor import DTensor
from nemo_ckpt._compat import flatten_mesh_dims
from . import _private_of_ours

def body(self, mesh):
    dist._something()
    DTensor._op_dispatcher
    torch.distributed._functional_collectives
    self._x, mesh._flatten, os._exit, torch.__version__, dist.group.WORLD
"""
    assert [use.split(": ", 1)[1] for use in private_uses_in(source, "example.py")] == [
        "import torch._dynamo",
        "import fiddle._src",
        "from lightning.fabric.utilities.optimizer import _optimizers_to_device",
        "from torch.distributed.tensor._utils import ...",
        "dist._something",
        "DTensor._op_dispatcher",
        "torch.distributed._functional_collectives",
    ]
