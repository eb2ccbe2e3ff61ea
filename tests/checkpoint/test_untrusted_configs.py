"""A stored config is data, not code (issue 45, item 1).

The registry (`nemo_ckpt.checkpoint.registry`) names every class a stored config may construct; each is a class whose
construction does no file, network or process access (checked under an audit hook in a child process), and whose
parameters take plain values or other entries. A corpus of attack payloads, each written as a checkpoint's
`context/model.json` with a marker file it would create if it ran, goes through every entry point that reads a
checkpoint: those that read the stored config refuse it with `UntrustedConfigError`, and none of them runs it (no
marker, no new file). Each payload marked live does run with `trust_code=True`, the explicit way out, so the corpus
holds real attacks.
"""

import base64
import functools
import io
import json
import os
import pickle
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import typing
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import fiddle as fdl
import numpy as np
import pytest
import torch
from fiddle._src import building
from fiddle.experimental import serialization
from lightning.fabric.utilities import cloud_io
from lightning.pytorch.callbacks import ModelSummary

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.__main__ import main as nemo_ckpt_cli
from nemo_ckpt.api import resolve_start
from nemo_ckpt.checkpoint import AutoResume, context, registry
from nemo_ckpt.checkpoint.hf_tokenizer import save_tokenizer
from nemo_ckpt.checkpoint.layout import hf_artifacts_dir, weights_dir
from nemo_ckpt.checkpoint.manifest import CheckpointRecord, Manifest
from nemo_ckpt.checkpoint.resume import RestoreConfig, restore_artifacts
from nemo_ckpt.conversion import export_ckpt, import_ckpt
from nemo_ckpt.data import MockDataModule
from nemo_ckpt.data.sft import FineTuningDataModule
from nemo_ckpt.data.tokenizer import ByteLevelTokenizer
from nemo_ckpt.dist_checkpointing import ShardedTensor
from nemo_ckpt.dist_checkpointing.cli import consolidate
from nemo_ckpt.dist_checkpointing.core import write_durably
from nemo_ckpt.dist_checkpointing.integrity import write_directory_checksums
from nemo_ckpt.dist_checkpointing.safe_globals import safe_torch_load
from nemo_ckpt.logger import NeMoLogger
from nemo_ckpt.models import GPTConfig, GPTModel, gpt_config
from nemo_ckpt.models.gpt.convert.hf import export_hf
from nemo_ckpt.optim import OptimizerConfig
from nemo_ckpt.peft import LoRA
from nemo_ckpt.peft.merge import merge
from recipes.finetune import finetune_recipe

# --- the registry ------------------------------------------------------------------------------------------------

PLAIN = (bool, int, float, str, type(None))


def _holds_only_data(annotation: typing.Any) -> bool:
    """Whether `annotation` is built of plain types, lists/tuples of them, unions and registry classes."""
    args = typing.get_args(annotation)
    if args:
        return all(arg is ... or _holds_only_data(arg) for arg in args)
    return annotation in PLAIN or annotation in {entry.cls for entry in registry.ENTRIES.values()}


@pytest.mark.parametrize("name", list(registry.ENTRIES))
def test_registry_entries_are_classes_taking_only_data(name):
    entry = registry.ENTRIES[name]
    assert isinstance(entry.cls, type) and entry.cls.__name__ == name
    assert registry.find(entry.module, name) is entry
    for old in entry.old_modules:
        assert registry.find(old, name) is entry
    parameters = entry.parameters()
    assert parameters, f"{name} takes no arguments"
    for parameter in parameters.values():
        assert _holds_only_data(parameter.annotation), f"{name}.{parameter.name}: {parameter.annotation}"


def test_registry_holds_exactly_the_stored_classes():
    assert {name: (e.module, e.old_modules) for name, e in registry.ENTRIES.items()} == {
        "GPTModel": ("nemo_ckpt.models.gpt.lightning", ("nemo_ckpt.models.lightning",)),
        "GPTConfig": ("nemo_ckpt.models.gpt.model", ("nemo_ckpt.models.gpt",)),
        "OptimizerConfig": ("nemo_ckpt.optim", ()),
        "LoRA": ("nemo_ckpt.peft.lora", ()),
    }
    assert registry.find("subprocess", "run") is None and registry.find("nemo_ckpt.models.gpt.lightning", "GPT") is None


_AUDITED_CONSTRUCTION = """
import json, os, sys
import fiddle as fdl
from nemo_ckpt.checkpoint import registry
classes = {name: entry.cls for name, entry in registry.ENTRIES.items()}  # imports happen here, before the hook
typical = fdl.Config(
    classes["GPTModel"],
    config=fdl.Config(classes["GPTConfig"], num_layers=1, moe_layer_freq=[1]),
    optim=fdl.Config(classes["OptimizerConfig"], lr=0.5, optimizer="sgd"),
    peft=fdl.Config(classes["LoRA"], target_modules=["q_proj"], base_checkpoint="/nonexistent/base"),
)
def construct():
    fdl.build(typical)
    [cls(classes["GPTConfig"]()) if name == "GPTModel" else cls() for name, cls in classes.items()]
WATCHED = ("open", "os.", "subprocess.", "socket.", "shutil.", "urllib.", "ctypes.", "import", "exec", "compile")
events = []
sys.addaudithook(lambda event, args: events.append(event) if event.startswith(WATCHED) else None)
construct()
constructed = list(events)
os.close(os.open(os.devnull, os.O_RDONLY))  # the control: the hook sees what a constructor would do
print(json.dumps({"construction": constructed, "control": events[len(constructed):]}))
"""


def test_constructing_every_registry_entry_does_no_io():
    """Each entry, with its defaults and with the arguments a stored config typically holds, under an audit hook:
    no file opened, no process started, no socket, no import, no code compiled."""
    result = subprocess.run(
        [sys.executable, "-c", _AUDITED_CONSTRUCTION], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    events = json.loads(result.stdout.strip().splitlines()[-1])
    assert events["construction"] == [] and events["control"] == ["open"]


# --- checkpoints -------------------------------------------------------------------------------------------------


def _model(**overrides: typing.Any) -> fdl.Config:
    """The config of the tiny model the checkpoints of this module hold, with `overrides`."""
    return fdl.Config(
        GPTModel, **{"config": fdl.Config(GPTConfig, **vars(gpt_config("tiny", num_layers=1)))} | overrides
    )


@pytest.fixture(scope="module")
def clean_checkpoint(tmp_path_factory) -> Path:
    """A complete checkpoint of the tiny model, weights and its own (honest) config, and its Megatron-Core export
    (`megatron/`)."""
    checkpoint = tmp_path_factory.mktemp("clean") / "ckpt"
    model = fdl.build(_model())
    model.configure_model()
    state = {key: ShardedTensor.from_rank_offsets(key, t, replica_id=0) for key, t in model.state_dict().items()}
    weights_dir(checkpoint).mkdir(parents=True)
    dist_checkpointing.save({"state_dict": state}, weights_dir(checkpoint))
    context.save_context(checkpoint, model=model)
    export_ckpt(str(checkpoint), str(checkpoint.parent / "megatron"), "megatron")
    return checkpoint


@dataclass(frozen=True)
class Setting:
    """Where a payload is tried: its checkpoint and a Megatron-Core export, both holding it as their model config,
    the marker it would create, a clean checkpoint."""

    checkpoint: Path
    megatron: Path
    marker: Path
    clean: Path

    @property
    def command(self) -> str:
        return f"touch {shlex.quote(str(self.marker))}"

    def attack(self, name: str) -> str:
        return str(self.checkpoint / "attack" / name)


def _torch_pickle(marker: Path) -> bytes:
    """A `torch.save` file that touches `marker` when `torch.load(weights_only=False)` reads it."""
    buffer = io.BytesIO()
    torch.save(_Touch(marker), buffer)
    return buffer.getvalue()


class _Touch:
    """Unpickled, runs `touch <path>`: the payload of the pickles below."""

    def __init__(self, path: Path) -> None:
        self.command = f"touch {shlex.quote(str(path))}"

    def __reduce__(self) -> tuple[Callable[[str], int], tuple[str]]:
        return os.system, (self.command,)


def _write_attack_files(setting: Setting) -> None:
    """The files the payloads load: pickles that touch the marker, a hubconf.py and a script that do."""
    attack = setting.checkpoint / "attack"
    (attack / "hub").mkdir(parents=True)
    torch.save(_Touch(setting.marker), attack / "payload.pt")
    (attack / "payload.pkl").write_bytes(pickle.dumps(_Touch(setting.marker)))
    np.save(attack / "payload.npy", np.array([_Touch(setting.marker)], dtype=object), allow_pickle=True)
    script = f"import pathlib\npathlib.Path({str(setting.marker)!r}).touch()\n"
    (attack / "run.py").write_text(script)
    (attack / "hub" / "hubconf.py").write_text(script + "def model():\n    return None\n")
    shutil.copytree(weights_dir(setting.clean), attack / "weights")
    torch.save(_Touch(setting.marker), attack / "weights" / "common.pt")


# --- the corpus --------------------------------------------------------------------------------------------------


def _dump(config: typing.Any) -> str:
    return serialization.dump_json(config)


def _raw(config: typing.Any) -> dict[str, typing.Any]:
    return json.loads(_dump(config))


def _key_of(raw: dict[str, typing.Any], name: str) -> str:
    """The key of the object holding the `Config` of the class `name` in the Fiddle JSON `raw`."""
    for key, obj in raw["objects"].items():
        if obj["type"].get("name") == "Config":
            metadata = raw["objects"][obj["metadata"]["key"]]
            if metadata["items"][0][1]["name"] == name:
                return key
    raise KeyError(name)


def _metadata_key(raw: dict[str, typing.Any], name: str) -> str:
    return raw["objects"][_key_of(raw, name)]["metadata"]["key"]


def _stand_in(*args: typing.Any, **kwargs: typing.Any) -> None:
    """Stands in, in a config Fiddle dumps, for a symbol it cannot dump (builtins, bound methods); `_named` renames."""


def _other_stand_in(*args: typing.Any, **kwargs: typing.Any) -> None:
    """A second stand-in, for payloads naming two such symbols."""


def _named(config: typing.Any, target: str, other: str = "") -> str:
    """Fiddle's JSON of `config`, with `_stand_in` renamed to `target` and `_other_stand_in` to `other`
    ("module:name" each)."""
    raw = _raw(config)
    for obj in raw["objects"].values():
        for _, item in obj["items"]:
            if isinstance(item, dict) and item.get("type") == "pyref" and item["module"] == _stand_in.__module__:
                module, name = (target if item["name"] == _stand_in.__name__ else other).split(":")
                item.update(module=module, name=name)
    return json.dumps(raw)


def _touch(s: Setting) -> fdl.Config:
    """A config running `touch <marker>` (`subprocess.run`: Fiddle's own loader, unlike for builtins, builds it)."""
    return fdl.Config(subprocess.run, ["touch", str(s.marker)])


def _with_hidden(place: Callable[[dict[str, typing.Any], dict[str, typing.Any]], None]) -> Callable[[Setting], str]:
    """A payload: the honest model config, with a config running `touch` placed by `place(raw, payload_raw)`."""

    def write(s: Setting) -> str:
        raw, payload = _raw(_model()), _raw(_touch(s))
        place(raw, payload)
        return json.dumps(raw)

    return write


def _graft(raw: dict[str, typing.Any], payload: dict[str, typing.Any]) -> dict[str, typing.Any]:
    """Add the objects of `payload` to `raw` under keys of their own; return the reference to its root."""
    text = json.dumps(payload)
    for key in payload["objects"]:
        text = text.replace(f'"key": "{key}"', f'"key": "evil_{key}"')
    renamed = json.loads(text)
    raw["objects"] |= {f"evil_{key}": obj for key, obj in renamed["objects"].items()}
    return renamed["root"]


def _argument_names(raw: dict[str, typing.Any], name: str) -> list[list[typing.Any]]:
    """The items of the argument names tuple of the `Config` of the class `name`."""
    return raw["objects"][raw["objects"][_metadata_key(raw, name)]["items"][1][1]["key"]]["items"]


def _add_argument(raw: dict[str, typing.Any], name: str, argument: str, value: typing.Any) -> None:
    raw["objects"][_key_of(raw, name)]["items"].append([f"Attr(name='{argument}')", value])
    names = _argument_names(raw, name)
    names.append([f"Index(index={len(names)})", argument])


def _unused(raw: dict[str, typing.Any], payload: dict[str, typing.Any]) -> None:
    _graft(raw, payload)


def _tag(raw: dict[str, typing.Any], payload: dict[str, typing.Any]) -> None:
    tags = raw["objects"][_metadata_key(raw, "GPTConfig")]["items"][2][1]
    pyref = {"type": "pyref", "module": "subprocess", "name": "run"}
    raw["objects"][tags["key"]]["items"] = [["Key(key='num_layers')", pyref]]


def _history(raw: dict[str, typing.Any], payload: dict[str, typing.Any]) -> None:
    history = raw["objects"][_metadata_key(raw, "GPTConfig")]["items"][3][1]
    raw["objects"][history["key"]]["items"] = [["Key(key='num_layers')", _graft(raw, payload)]]


def _refcounts(raw: dict[str, typing.Any], payload: dict[str, typing.Any]) -> None:
    raw["refcounts"]["evil"] = payload


def _top_level(raw: dict[str, typing.Any], payload: dict[str, typing.Any]) -> None:
    raw["evil"] = payload


def _paths(raw: dict[str, typing.Any], payload: dict[str, typing.Any]) -> None:
    raw["objects"][_key_of(raw, "GPTConfig")]["paths"].append(_graft(raw, payload))


def _unknown_argument(raw: dict[str, typing.Any], payload: dict[str, typing.Any]) -> None:
    _add_argument(raw, "GPTConfig", "evil", _graft(raw, payload))


def _argument_names_hide_one(raw: dict[str, typing.Any], payload: dict[str, typing.Any]) -> None:
    _add_argument(raw, "GPTConfig", "evil", _graft(raw, payload))
    _argument_names(raw, "GPTConfig").pop()


def _leaf(raw: dict[str, typing.Any], payload: dict[str, typing.Any]) -> None:
    item = raw["objects"][_key_of(raw, "GPTConfig")]["items"][0]
    item[1] = {"type": "leaf", "value": _graft(raw, payload), "paths": ["<root>.config.num_layers"]}


def _object_typed_as_function(raw: dict[str, typing.Any], payload: dict[str, typing.Any]) -> None:
    raw["objects"][_key_of(raw, "GPTConfig")]["type"] = {"type": "pyref", "module": "subprocess", "name": "run"}


def _shared(raw: dict[str, typing.Any], payload: dict[str, typing.Any]) -> None:
    _add_argument(raw, "GPTModel", "optim", raw["objects"][_key_of(raw, "GPTModel")]["items"][0][1])


def _moe_layer_freq(raw: dict[str, typing.Any], value: typing.Any) -> None:
    raw["objects"][_key_of(raw, "GPTConfig")]["items"][17][1] = value


def _cycle(raw: dict[str, typing.Any], payload: dict[str, typing.Any]) -> None:
    raw["objects"]["loop"] = {
        "type": {"type": "pyref", "module": "builtins", "name": "list"},
        "items": [["Index(index=0)", {"type": "ref", "key": "loop"}]],
        "metadata": None,
    }
    _moe_layer_freq(raw, {"type": "ref", "key": "loop"})


def _deep(raw: dict[str, typing.Any], payload: dict[str, typing.Any]) -> None:
    value: typing.Any = 1
    for depth in range(100):
        raw["objects"][f"nest_{depth}"] = {
            "type": {"type": "pyref", "module": "builtins", "name": "list"},
            "items": [["Index(index=0)", value]],
            "metadata": None,
        }
        value = {"type": "ref", "key": f"nest_{depth}"}
    _moe_layer_freq(raw, value)


def _duplicate_key(s: Setting) -> str:
    raw = _raw(_model())
    evil = _graft(raw, _raw(_touch(s)))["key"]
    honest = json.dumps(raw["root"])
    return json.dumps(raw).replace(f'"root": {honest}', f'"root": {{"key": "{evil}", {honest[1:]}')


def _huge(s: Setting) -> str:
    raw = _raw(_model())
    raw["objects"][_key_of(raw, "GPTConfig")]["items"][20][1]["value"] = "x" * (context.MAX_CONFIG_BYTES + 1)
    return json.dumps(raw)


def _dunder(s: Setting) -> str:
    return _named(fdl.Config(_stand_in, s.command), "nemo_ckpt.models.gpt.lightning:GPTModel.__init__.__globals__")


@dataclass(frozen=True)
class Payload:
    """A `context/model.json` that attacks (`write(setting)` returns its text); `live`: `trust_code=True` runs it."""

    name: str
    write: Callable[[Setting], str]
    live: bool


PAYLOADS = [
    # code named at the root, or nested in the fields of an otherwise honest model config
    Payload("subprocess.run", lambda s: _dump(_touch(s)), True),
    Payload("subprocess.getoutput", lambda s: _dump(fdl.Config(subprocess.getoutput, s.command)), True),
    Payload(
        "optim=check_call (a working model)",
        lambda s: _dump(_model(optim=fdl.Config(subprocess.check_call, ["touch", str(s.marker)]))),
        True,
    ),
    Payload("peft=subprocess.run", lambda s: _dump(_model(peft=_touch(s))), True),
    Payload(
        "GPTConfig.num_layers=subprocess.run",
        lambda s: _dump(_model(config=fdl.Config(GPTConfig, num_layers=_touch(s)))),
        True,
    ),
    Payload(
        "LoRA.base_checkpoint=subprocess.run",
        lambda s: _dump(_model(peft=fdl.Config(LoRA, base_checkpoint=_touch(s)))),
        True,
    ),
    # builtins (Fiddle's own loader refuses these; ours must too)
    Payload("os.system", lambda s: _named(fdl.Config(_stand_in, s.command), "os:system"), False),
    Payload("eval", lambda s: _named(fdl.Config(_stand_in, f"open({str(s.marker)!r}, 'w')"), "builtins:eval"), False),
    Payload("exec", lambda s: _named(fdl.Config(_stand_in, f"open({str(s.marker)!r}, 'w')"), "builtins:exec"), False),
    Payload("open(w)", lambda s: _named(fdl.Config(_stand_in, str(s.marker), "w"), "builtins:open"), False),
    Payload(
        "pickle.load(open(...))",
        lambda s: _named(
            fdl.Config(_stand_in, fdl.Config(_other_stand_in, s.attack("payload.pkl"), "rb")),
            "pickle:load",
            "builtins:open",
        ),
        False,
    ),
    # file writers: pathlib, torch, numpy, shutil, Lightning, ours
    Payload("Path.touch", lambda s: _dump(fdl.Config(Path.touch, fdl.Config(Path, str(s.marker)))), True),
    Payload(
        "Path.write_text", lambda s: _dump(fdl.Config(Path.write_text, fdl.Config(Path, str(s.marker)), "x")), True
    ),
    Payload("torch.save", lambda s: _dump(fdl.Config(torch.save, [1], str(s.marker))), True),
    Payload(
        "numpy.savetxt", lambda s: _named(fdl.Config(_stand_in, fname=str(s.marker), X=[1.0]), "numpy:savetxt"), True
    ),
    Payload("shutil.copyfile", lambda s: _dump(fdl.Config(shutil.copyfile, s.attack("run.py"), str(s.marker))), True),
    Payload("Lightning _atomic_save", lambda s: _dump(fdl.Config(cloud_io._atomic_save, {}, str(s.marker))), True),
    Payload(
        "our write_durably",
        lambda s: _dump(fdl.Config(write_durably, str(s.marker), fdl.Partial(torch.save, [1]))),
        True,
    ),
    Payload("our save_context", lambda s: _dump(fdl.Config(context.save_context, str(s.marker), model=_model())), True),
    Payload("our export_hf", lambda s: _dump(fdl.Config(export_hf, str(s.clean), str(s.marker))), False),
    Payload(
        "our consolidate", lambda s: _dump(fdl.Config(consolidate, str(weights_dir(s.clean)), str(s.marker))), True
    ),
    # loaders of pickles with weights_only=False or an unsafe flag, files and data: URLs
    Payload(
        "torch.load(weights_only=False)",
        lambda s: _dump(fdl.Config(torch.load, s.attack("payload.pt"), weights_only=False)),
        True,
    ),
    Payload(
        "Lightning cloud_io._load(weights_only=False)",
        lambda s: _dump(fdl.Config(cloud_io._load, s.attack("payload.pt"), weights_only=False)),
        True,
    ),
    Payload(
        "GPTModel.load_from_checkpoint(weights_only=False)",
        lambda s: _named(
            fdl.Config(_stand_in, checkpoint_path=s.attack("payload.pt"), weights_only=False),
            "nemo_ckpt.models.gpt.lightning:GPTModel.load_from_checkpoint",
        ),
        True,
    ),
    Payload(
        "our safe_torch_load(allow_unsafe_pickle=True)",
        lambda s: _dump(fdl.Config(safe_torch_load, s.attack("payload.pt"), "x", allow_unsafe_pickle=True)),
        True,
    ),
    Payload(
        "our load_common_state_dict(allow_unsafe_pickle=True)",
        lambda s: _dump(
            fdl.Config(
                dist_checkpointing.load_common_state_dict, s.attack("weights"), allow_unsafe_pickle=True, verify=False
            )
        ),
        True,
    ),
    Payload(
        "numpy.load(allow_pickle=True)",
        lambda s: _named(fdl.Config(_stand_in, file=s.attack("payload.npy"), allow_pickle=True), "numpy:load"),
        True,
    ),
    Payload(
        "torch.hub.load(local hubconf.py)",
        lambda s: _dump(fdl.Config(torch.hub.load, s.attack("hub"), "model", source="local", trust_repo=True)),
        True,
    ),
    Payload("runpy.run_path", lambda s: _dump(fdl.Config(runpy.run_path, s.attack("run.py"))), True),
    Payload(
        "urlretrieve(data: URL)",
        lambda s: _dump(fdl.Config(urllib.request.urlretrieve, "data:,owned", str(s.marker))),
        True,
    ),
    Payload(
        "torch.hub.load_state_dict_from_url(data: URL, weights_only=False)",
        lambda s: _dump(
            fdl.Config(
                torch.hub.load_state_dict_from_url,
                "data:application/octet-stream;base64," + base64.b64encode(_torch_pickle(s.marker)).decode(),
                model_dir=s.attack("hub_cache"),
                file_name="state.pt",
                weights_only=False,
            )
        ),
        True,
    ),
    # nested builds past Fiddle's guard
    Payload(
        "call_buildable(load_json(...))",
        lambda s: _dump(
            fdl.Config(
                building.call_buildable,
                fdl.Config(serialization.load_json, _dump(fdl.Config(subprocess.run))),
                {"args": ["touch", str(s.marker)]},
                current_path=(),
            )
        ),
        True,
    ),
    Payload(
        "fdl.build(load_json(...))",
        lambda s: _dump(fdl.Config(fdl.build, fdl.Config(serialization.load_json, _dump(_touch(s))))),
        False,
    ),
    # Fiddle internals and non-callables where data belongs
    Payload("peft=fdl.Partial(subprocess.run)", lambda s: _dump(_model(peft=fdl.Partial(subprocess.run))), False),
    Payload("fdl.Partial(GPTModel)", lambda s: _dump(fdl.Partial(GPTModel, config=_model().config)), False),
    Payload(
        "functools.partial(subprocess.run)",
        lambda s: _dump(fdl.Config(functools.partial, subprocess.run, ["touch", str(s.marker)])),
        False,
    ),
    Payload(
        "function as a value",
        lambda s: _dump(_model(config=fdl.Config(GPTConfig, recompute_granularity=subprocess.run))),
        False,
    ),
    Payload(
        "enum as a value",
        lambda s: _dump(_model(config=fdl.Config(GPTConfig, recompute_granularity=signal.Signals.SIGTERM))),
        False,
    ),
    Payload("optim=fdl.Partial(AdamW)", lambda s: _dump(_model(optim=fdl.Partial(torch.optim.AdamW, lr=0.1))), False),
    Payload("Lightning ModelSummary", lambda s: _dump(fdl.Config(ModelSummary, 2)), False),
    Payload("torch.nn.Linear", lambda s: _dump(fdl.Config(torch.nn.Linear, 2, 2)), False),
    Payload("dunder traversal of a registry class", _dunder, False),
    Payload(
        "re-exported module attribute",
        lambda s: _named(fdl.Config(_stand_in, s.command), "nemo_ckpt.checkpoint.context:json.loads"),
        False,
    ),
    # registry classes given what they do not take
    Payload("GPTModel(config=LoRA)", lambda s: _dump(fdl.Config(GPTModel, config=fdl.Config(LoRA))), False),
    Payload(
        "GPTConfig(num_layers=str)", lambda s: _dump(_model(config=fdl.Config(GPTConfig, num_layers=s.command))), False
    ),
    Payload(
        "GPTModel() without config", lambda s: _dump(fdl.Config(GPTModel, optim=fdl.Config(OptimizerConfig))), False
    ),
    Payload("optim=dict", lambda s: _dump(_model(optim={"command": s.command})), False),
    Payload("GPTConfig as the root", lambda s: _dump(_model().config), False),
    # payloads hidden where a reader might not look
    Payload("unused object", _with_hidden(_unused), False),
    Payload("argument tags", _with_hidden(_tag), False),
    Payload("argument history", _with_hidden(_history), False),
    Payload("refcounts", _with_hidden(_refcounts), False),
    Payload("top-level key", _with_hidden(_top_level), False),
    Payload("paths", _with_hidden(_paths), False),
    Payload("unknown argument", _with_hidden(_unknown_argument), False),
    Payload("argument names hide an item", _with_hidden(_argument_names_hide_one), False),
    Payload("leaf holding a node", _with_hidden(_leaf), False),
    Payload("object typed as a function", _with_hidden(_object_typed_as_function), False),
    Payload("duplicate JSON key", _duplicate_key, False),
    # shapes a reader must bound
    Payload("shared object", _with_hidden(_shared), False),
    Payload("cycle", _with_hidden(_cycle), False),
    Payload("100 nested lists", _with_hidden(_deep), False),
    Payload("JSON nested 100000 deep", lambda s: "[" * 100_000 + "]" * 100_000, False),
    Payload("over MAX_CONFIG_BYTES", _huge, False),
    Payload("a pickle instead of JSON", lambda s: pickle.dumps(_Touch(s.marker)).decode("latin-1"), False),
]


# --- the entry points --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EntryPoint:
    """A way a checkpoint is read: `run(setting, out)` (`out`: a directory for its outputs). `reads_config`: it reads
    the stored config, so it must refuse every payload; the others must only never run it."""

    name: str
    run: Callable[[Setting, Path], typing.Any]
    reads_config: bool = True


def _resolve_start(resume: AutoResume, out: Path) -> typing.Any:
    """What every rank of `pretrain` runs before training (so a real launch's ranks read the config here)."""
    return resolve_start(fdl.build(_model()), MockDataModule(seq_length=8), NeMoLogger(log_dir=str(out)), resume)


ENTRY_POINTS = [
    EntryPoint("load_context", lambda s, out: context.load_context(s.checkpoint)),
    EntryPoint("load_model", lambda s, out: context.load_model(s.checkpoint)),
    EntryPoint(
        "AutoResume(restore_config=True).restore_model",
        lambda s, out: AutoResume(restore_config=True).restore_model(s.checkpoint, fdl.build(_model())),
    ),
    EntryPoint(
        "pretrain's resolve_start(resume_from_path, restore_config=True)",
        lambda s, out: _resolve_start(AutoResume(resume_from_path=str(s.checkpoint), restore_config=True), out),
    ),
    EntryPoint(
        "pretrain's resolve_start(resume_if_exists, restore_config=True)",
        lambda s, out: _resolve_start(
            AutoResume(resume_if_exists=True, resume_from_directory=str(s.checkpoint.parent), restore_config=True), out
        ),
    ),
    EntryPoint("export_ckpt(target=hf)", lambda s, out: export_ckpt(str(s.checkpoint), str(out / "hf"), "hf")),
    EntryPoint(
        "export_ckpt(target=megatron)", lambda s, out: export_ckpt(str(s.checkpoint), str(out / "mc"), "megatron")
    ),
    EntryPoint(
        "finetune_recipe (checkpoint_gpt_config)",
        lambda s, out: finetune_recipe(restore_path=str(s.checkpoint), dataset_root=str(out)),
    ),
    EntryPoint("peft merge", lambda s, out: merge(s.checkpoint, out / "merged")),
    EntryPoint(
        "import_ckpt(megatron://)",
        lambda s, out: import_ckpt(f"megatron://{s.megatron}", str(out / "in"), gpt_config("tiny", num_layers=1)),
        reads_config=False,
    ),
    EntryPoint("python -m nemo_ckpt inspect", lambda s, out: nemo_ckpt_cli(["inspect", str(s.checkpoint)]), False),
    EntryPoint("python -m nemo_ckpt verify", lambda s, out: nemo_ckpt_cli(["verify", str(s.checkpoint)]), False),
    EntryPoint(
        "python -m nemo_ckpt consolidate",
        lambda s, out: nemo_ckpt_cli(["consolidate", str(s.checkpoint), str(out / "all.pt")]),
        False,
    ),
]


@pytest.fixture
def setting(tmp_path, clean_checkpoint) -> Setting:
    """A complete checkpoint (the clean one's weights, no config yet) in a directory whose manifest lists it."""
    checkpoint = tmp_path / "run" / "ckpt"
    shutil.copytree(weights_dir(clean_checkpoint), weights_dir(checkpoint))
    (checkpoint / "context").mkdir()
    Manifest([CheckpointRecord(checkpoint.name, 2, 0, state="complete")]).write(checkpoint.parent)
    shutil.copytree(clean_checkpoint.parent / "megatron", tmp_path / "megatron")
    setting = Setting(checkpoint, tmp_path / "megatron", tmp_path / "MARKER", clean_checkpoint)
    _write_attack_files(setting)
    return setting


def _store(setting: Setting, payload: Payload) -> Path:
    """Write `payload` as the model config of the setting's checkpoints; return the checkpoint's."""
    text = payload.write(setting)
    for checkpoint in (setting.megatron, setting.checkpoint):
        path = checkpoint / "context" / "model.json"
        path.write_text(text, encoding="latin-1")  # the JSON is ASCII; a pickle's bytes stay as they are
        write_directory_checksums(path.parent)  # a CRC is no signature: an attacker writes matching checksums
    return path


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def test_the_corpus_covers_every_vector():
    assert len(PAYLOADS) >= 60 and len({p.name for p in PAYLOADS}) == len(PAYLOADS)
    assert sum(p.live for p in PAYLOADS) >= 25
    assert len(ENTRY_POINTS) == 13


@pytest.mark.parametrize("payload", PAYLOADS, ids=[p.name for p in PAYLOADS])
def test_every_entry_point_refuses_the_payload_and_never_runs_it(setting, tmp_path, payload):
    stored = _store(setting, payload)
    problems = []
    for entry in ENTRY_POINTS:
        out = tmp_path / "out" / entry.name
        out.mkdir(parents=True)
        before = _files(tmp_path)
        try:
            entry.run(setting, out)
            if entry.reads_config:
                problems.append(f"{entry.name}: not refused")
        except context.UntrustedConfigError as error:
            if not (entry.reads_config and str(error).startswith(str(stored))):
                problems.append(f"{entry.name}: {error}")
            elif _files(tmp_path) != before:
                problems.append(f"{entry.name}: refused, but wrote {sorted(map(str, _files(tmp_path) - before))}")
        except Exception as error:  # reported below, with the entry point
            problems.append(f"{entry.name}: {type(error).__name__}: {error}")
        if setting.marker.exists():
            problems.append(f"{entry.name}: the payload ran")
            shutil.rmtree(setting.marker) if setting.marker.is_dir() else setting.marker.unlink()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("payload", [p for p in PAYLOADS if p.live], ids=[p.name for p in PAYLOADS if p.live])
def test_live_payloads_run_with_trust_code(setting, payload):
    """The corpus holds real attacks: `trust_code=True` (Fiddle's own loader, the old behaviour) runs each."""
    _store(setting, payload)
    try:
        fdl.build(context.load_context(setting.checkpoint, trust_code=True))
    except Exception:  # a payload may fail after its side effect
        pass
    assert setting.marker.exists()


def test_a_stored_tokenizer_naming_code_loads_without_running_it(setting):
    """The tokenizer a checkpoint stores (`context/hf`, what `RestoreConfig(load_artifacts=True)` makes fine-tuning
    tokenize with) is read as data too: an `auto_map` naming a module beside it is not imported."""
    pytest.importorskip("transformers")
    stored = hf_artifacts_dir(setting.checkpoint)
    save_tokenizer(ByteLevelTokenizer(), stored)
    config = json.loads((stored / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}
    (stored / "tokenizer_config.json").write_text(json.dumps(config))
    (stored / "evil.py").write_text(f"import pathlib\npathlib.Path({str(setting.marker)!r}).touch()\n")
    (setting.checkpoint / "training.jsonl").write_text('{"input": "a", "output": "b"}\n')
    data = FineTuningDataModule(dataset_root=str(setting.checkpoint), tokenizer=None)
    restore_artifacts(RestoreConfig(str(setting.checkpoint)), data)
    assert data.tokenizer.text_to_ids("abc") == ByteLevelTokenizer().text_to_ids("abc")
    assert not setting.marker.exists()
