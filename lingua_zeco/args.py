"""Dataclass <-> OmegaConf: defaults, then a YAML file, then CLI `key.sub=value` overrides.

    args = parse_args(TrainArgs, ["config=debug.yaml", "steps=10", "distributed.sp_size=2"])

* `config=NAME` is a path if such a file exists, else `configs/NAME` (".yaml" may be left off).
* A key that the dataclass does not have is an error that lists the valid keys at that level
  (OmegaConf's own message names only the bad key, which is little help for a typo).
* Types are strict: OmegaConf validates every value against the dataclass annotations.
* `dump_config` writes the resolved config, so a run can be repeated from its dump_dir alone.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

T = TypeVar("T")

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    pass


def resolve_config_path(name: str) -> Path:
    """An existing path wins; otherwise look the name up in configs/ (with or without .yaml)."""
    if os.path.isfile(name):
        return Path(name)
    for candidate in (CONFIG_DIR / name, CONFIG_DIR / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    known = sorted(p.name for p in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []
    raise ConfigError(f"config {name!r} is neither a file nor in {CONFIG_DIR} (known: {', '.join(known) or 'none'})")


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass inside an annotation such as `Foo` or `Foo | None`, else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def check_keys(cls: type, values: Any, where: str = "") -> None:
    """Raise ConfigError naming the valid keys when `values` has a key `cls` lacks (recursively)."""
    if not isinstance(values, (dict, DictConfig)):
        return
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, val in values.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            level = f"under '{where}'" if where else "at the top level"
            raise ConfigError(f"unknown config key '{path}'; valid keys {level}: {', '.join(names)}")
        sub = _dataclass_of(hints[key])
        if sub is not None:
            check_keys(sub, val, path)


def split_cli(argv: list[str]) -> tuple[str | None, list[str]]:
    """Separate `config=NAME` from the `key=value` overrides; reject anything else."""
    config, overrides = None, []
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"command-line argument {arg!r} is not of the form key=value")
        key, value = arg.split("=", 1)
        if key == "config":
            config = value
        else:
            overrides.append(arg)
    return config, overrides


def parse_args(cls: type[T], argv: list[str] | None = None) -> T:
    """Build `cls` from its defaults, the YAML named by `config=...`, then the other CLI overrides."""
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    config, overrides = split_cli(argv)
    layers = []
    if config is not None:
        yaml_cfg = OmegaConf.load(resolve_config_path(config))
        check_keys(cls, OmegaConf.to_container(yaml_cfg))
        layers.append(yaml_cfg)
    if overrides:
        cli_cfg = OmegaConf.from_dotlist(overrides)
        check_keys(cls, OmegaConf.to_container(cli_cfg))
        layers.append(cli_cfg)
    return build(cls, *layers)


def build(cls: type[T], *layers: Any) -> T:
    """Merge dict/DictConfig layers onto the defaults of `cls`, type-checked, into a `cls` instance."""
    for layer in layers:
        check_keys(cls, OmegaConf.to_container(layer) if isinstance(layer, DictConfig) else layer)
    base = OmegaConf.structured(cls)
    try:
        merged = OmegaConf.merge(base, *layers)
    except Exception as e:  # omegaconf ValidationError and friends: keep its message, which names the key
        raise ConfigError(str(e)) from e
    return OmegaConf.to_object(merged)


def to_dict(args: Any) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(args))


def dump_config(args: Any, dump_dir: str | os.PathLike, name: str = "config.yaml") -> Path:
    path = Path(dump_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.structured(args)))
    os.replace(tmp, path)  # atomic: a reader never sees half a config
    return path
