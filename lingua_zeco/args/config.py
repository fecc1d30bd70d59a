"""Building a config object: the dataclass's defaults, then a YAML file (with its base: files), then the
command-line overrides, every key checked against the dataclass; each section's own checks; the dump of
the resolved config."""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import typing
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

from .keys import HELP_FLAGS, dataclass_of, exit_with_help, is_list, is_raw_text, key_hint, yaml_file_key

T = TypeVar("T")


CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


class ConfigError(ValueError):
    pass


def one_line(e: BaseException) -> str:
    """An exception's message on one line, for an `error:` line (safetensors', fla's, pyarrow's and torch's
    messages span several)."""
    return " ".join(str(e).split())


def check_sections(cfg) -> None:
    """Every section of a config (each *Args dataclass, nested ones too) checks its own values in its `check()`
    method, beside its fields; the first problem ends here as one ConfigError naming the key."""
    for section in _sections(cfg):
        try:
            section.check()
        except ConfigError:
            raise
        except ValueError as e:  # the low layers (comm, kernels' users) raise ValueError: one type for the caller
            raise ConfigError(str(e)) from e


def _sections(obj):
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if callable(getattr(obj, "check", None)):
            yield obj
        for f in dataclasses.fields(obj):
            yield from _sections(getattr(obj, f.name))


def at_least(values: dict, least: int = 1, meaning: dict | None = None) -> None:
    """{key: value}: the first value below `least` as a ConfigError naming its key, and what the key's
    smallest values mean where `meaning` ({key: text}) says."""
    for key, value in values.items():
        if value < least:
            note = f" ({meaning[key]})" if meaning and key in meaning else ""
            raise ConfigError(f"{key}={value} must be >= {least}{note}")


def resolve_config_path(name: str) -> Path:
    """An existing path wins; otherwise look the name up in configs/ (with or without .yaml)."""
    if os.path.isfile(name):
        return Path(name)
    for candidate in (CONFIG_DIR / name, CONFIG_DIR / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    known = sorted(p.name for p in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []
    raise ConfigError(f"config {name!r} is neither a file nor in {CONFIG_DIR} (known: {', '.join(known) or 'none'})")


def _retired(cls: type) -> dict:
    """{key: why}: keys a dataclass no longer has (its RETIRED class attribute), which older run folders hold."""
    return getattr(cls, "RETIRED", {})


def drop_retired(cls: type, values: Any, source: str, where: str = "") -> None:
    """Remove the retired keys from a config file's values (recursively), one warning line each: a run folder
    written before a key went away still loads (eval, generate, export)."""
    if not isinstance(values, DictConfig):
        return
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in list(values.keys()):
        path = f"{where}.{key}" if where else str(key)
        if key in _retired(cls):
            logging.getLogger(__name__).warning(f"{source}: config key '{path}' is ignored: {_retired(cls)[key]}")
            del values[key]
        elif key in names and (sub := dataclass_of(hints[key])) is not None:
            drop_retired(sub, values[key], source, path)


def check_keys(cls: type, values: Any, where: str = "") -> None:
    """Raise ConfigError naming the valid keys when `values` has a key `cls` lacks (recursively)."""
    if not isinstance(values, (dict, DictConfig)):
        return
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, val in values.items():
        path = f"{where}.{key}" if where else str(key)
        if key in _retired(cls):
            raise ConfigError(f"config key '{path}' no longer exists: {_retired(cls)[key]}")
        if key not in names:
            level = f"under '{where}'" if where else "at the top level"
            raise ConfigError(f"unknown config key '{path}'; valid keys {level}: {', '.join(names)}")
        sub = dataclass_of(hints[key])
        if sub is not None and val is not None and not isinstance(val, (dict, DictConfig)):
            raise ConfigError(f"'{path}' is a section, not a value (got {val!r}); set its keys, e.g. "
                              f"{path}.{dataclasses.fields(sub)[0].name}=... (--help lists them)")
        if sub is not None:
            check_keys(sub, val, path)
        _check_mapping(hints[key], val, path)


def _check_mapping(hint: Any, values: Any, path: str) -> None:
    """A mapping key (`data.sources`) whose entries lack values. On the command line `{short:1.0}` is YAML
    for one name `short:1.0` with no value (a flow mapping needs a space after the colon), which OmegaConf
    reports only as `field 'data.sources.short:1.0' is not Optional`."""
    mapping = next((t for t in (hint, *typing.get_args(hint)) if typing.get_origin(t) is dict), None)
    if mapping is None or not isinstance(values, (dict, DictConfig)):
        return
    value_type = typing.get_args(mapping)[1] if typing.get_args(mapping) else Any
    if value_type is Any or type(None) in typing.get_args(value_type):
        return  # null is a valid value there
    empty = [str(k) for k, v in values.items() if v is None]
    if not empty:
        return
    fixed = ", ".join(_entry(str(k), v) for k, v in values.items())
    raise ConfigError(f"{path}: {', '.join(repr(k) for k in empty)} has no value; {path} needs `name: value` "
                      f"entries with a space after each colon, e.g. {path}='{{{fixed}}}'")


def _entry(key: str, value: Any) -> str:
    """One mapping entry as it should have been written: `short:1.0` (no value) -> `short: 1.0`."""
    if value is not None:
        return f"{key}: {value}"
    name, _, tail = key.rpartition(":")
    try:
        float(tail)
    except ValueError:
        return f"{name or key}: VALUE" if not tail else f"{key}: VALUE"
    return f"{name}: {tail}" if name else f"{key}: VALUE"


def split_cli(argv: list[str], yaml_key: str | None = "config") -> tuple[str | None, list[str]]:
    """Separate `config=NAME` (the YAML to load) from the `key=value` overrides; reject anything else."""
    config, overrides = None, []
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"command-line argument {arg!r} is not of the form key=value (--help lists the keys)")
        key, value = arg.split("=", 1)
        if key == yaml_key:
            config = value
        else:
            overrides.append(arg)
    return config, overrides


def _set_dotted(obj: Any, dotted: str, value: str) -> None:
    *parents, name = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, name, value)


def _bracket_lists(cls: type, overrides: list[str]) -> list[str]:
    """`key=a,b` or `key=a` for a list key -> `key=[a,b]` (OmegaConf only parses the bracketed form);
    `key=` for a str key -> the empty string (OmegaConf would read null)."""
    out = []
    for arg in overrides:
        key, value = arg.split("=", 1)
        hint = key_hint(cls, key)
        if is_list(hint) and not value.startswith("["):
            arg = f"{key}=[{value}]"
        elif hint is str and not value:
            arg = f"{key}=''"
        out.append(arg)
    return out


def parse_args(cls: type[T], argv: list[str] | None = None) -> T:
    """Build `cls` from its defaults, the YAML named by `config=...`, then the other CLI overrides."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in HELP_FLAGS for a in argv):
        exit_with_help(cls)
    config, overrides = split_cli(argv, yaml_key=yaml_file_key(cls))
    raw = [a.split("=", 1) for a in overrides if is_raw_text(cls, a.split("=", 1)[0])]
    overrides = _bracket_lists(cls, [a for a in overrides if not is_raw_text(cls, a.split("=", 1)[0])])
    layers = []
    if config is not None:
        path = resolve_config_path(config)
        layers.append(load_config(path))
        drop_retired(cls, layers[0], str(path))
    for arg in overrides:  # one at a time, so that a bad one is named
        try:
            layers.append(OmegaConf.from_dotlist([arg]))
        except Exception as e:  # yaml's parser errors: the value is not valid YAML (an unclosed bracket...)
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"command-line argument {arg!r}: its value is not valid YAML ({what})") from e
    args = build(cls, *layers)  # which checks every layer's keys, the YAML's first
    for key, value in raw:  # text as written, after the YAML layers (the command line wins)
        _set_dotted(args, key, value)
    given = {k for layer in layers for k in _dotted_keys(OmegaConf.to_container(layer))} | {k for k, _ in raw}
    object.__setattr__(args, GIVEN_KEYS, frozenset(given))
    return args


GIVEN_KEYS = "_given_keys"  # the attribute parse_args records the keys it was given in


def given_keys(args: Any) -> frozenset[str] | None:
    """The dotted keys a config file (with its bases) or the command line set, as parse_args recorded them on
    `args`; None for an object it did not build (a dataclasses.replace copy, one built in code): the caller then
    has only the values to go by."""
    return getattr(args, GIVEN_KEYS, None)


def _dotted_keys(values: Any, prefix: str = "") -> set[str]:
    """{"model.dim", ...}: every key of a nested mapping, sections included."""
    keys = set()
    for key, value in (values.items() if isinstance(values, dict) else ()):
        keys.add(f"{prefix}{key}")
        keys |= _dotted_keys(value, f"{prefix}{key}.")
    return keys


BASE_KEY = "base"  # a config file's key: the file it extends


def load_config(path: Path, chain: tuple[Path, ...] = ()) -> DictConfig:
    """A config file with its `base:` file merged under it (recursively; `chain`: the files that include it)."""
    real = Path(path).resolve()
    if real in chain:
        cycle = " -> ".join(str(p) for p in (*chain, real))
        raise ConfigError(f"config {str(path)!r}: the base: chain is a cycle ({cycle}); remove one of its base: keys")
    loaded = _load_yaml(path)
    if BASE_KEY not in loaded:
        return loaded
    base = loaded.pop(BASE_KEY)
    if not isinstance(base, str) or not base:
        raise ConfigError(f"config {str(path)!r}: base: must name one config file (e.g. base: gla_1b_base.yaml), "
                          f"not {base!r}")
    return OmegaConf.merge(load_config(_base_path(base, Path(path)), (*chain, real)), loaded)


def _base_path(name: str, including: Path) -> Path:
    """`base: NAME` of the file `including`: beside that file, else in configs/ (".yaml" may be left off)."""
    tried = []
    for folder in (including.parent, CONFIG_DIR):
        for candidate in (folder / name, folder / f"{name}.yaml"):
            if candidate.is_file():
                return candidate
        tried.append(str(folder / name))
    raise ConfigError(f"config {str(including)!r}: its base {name!r} does not exist "
                      f"(looked for {' and '.join(tried)}); "
                      f"fix the base: line, or copy the base file beside it")


def check_self_contained(path: str | os.PathLike) -> None:
    """A config file dump_config wrote (a run's config.yaml) is resolved and stands alone: a `base:` key or an
    interpolation (`${...}`: another key, the environment) in it was put there by someone else. A run folder
    may come from anyone, so reading its config must not open other files nor print the environment: one
    ConfigError naming the file and the key."""
    def references(value, key: str):
        if isinstance(value, dict):
            return next((r for k, v in value.items() if (r := references(v, f"{key}{k}."))), None)
        if isinstance(value, list):
            return next((r for i, v in enumerate(value) if (r := references(v, f"{key}{i}."))), None)
        return key[:-1] if isinstance(value, str) and "${" in value else None

    loaded = OmegaConf.to_container(_load_yaml(Path(path)), resolve=False)
    found = BASE_KEY if BASE_KEY in loaded else references(loaded, "")
    if found:
        raise ConfigError(f"{path}: its key {found} reads {'another file' if found == BASE_KEY else 'other values'}, "
                          f"which a run's config.yaml never does (it is written resolved); refused: use the run's "
                          f"own config.yaml, or give config=<a config file of yours>")


def _load_yaml(path: Path) -> DictConfig:
    """A config file as a mapping, or one error naming the file (and the line, for a YAML error)."""
    try:
        loaded = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError and OmegaConf's own: the first line and where yaml says it is
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{at}: {what}") from e
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {str(path)!r} must be a mapping of keys (key: value lines), "
                          f"not a {type(loaded).__name__}")
    if not loaded:  # an empty file would silently mean every default (for train: a 1.2B model)
        raise ConfigError(f"config file {str(path)!r} is empty: name a config with keys (e.g. config=debug.yaml); "
                          f"--help lists the keys")
    return loaded


def build(cls: type[T], *layers: Any) -> T:
    """Merge dict/DictConfig layers onto the defaults of `cls`, type-checked, into a `cls` instance."""
    if any(isinstance(layer, (dict, DictConfig)) and any(k in HELP_FLAGS for k in layer) for layer in layers):
        exit_with_help(cls)  # a layer made by OmegaConf.from_dotlist(sys.argv[1:])
    for layer in layers:
        check_keys(cls, OmegaConf.to_container(layer) if isinstance(layer, DictConfig) else layer)
    base = OmegaConf.structured(cls)
    try:
        merged = OmegaConf.merge(base, *layers)
    except Exception as e:  # omegaconf ValidationError and friends: its first line, after the key it is about
        key, msg = getattr(e, "full_key", ""), str(e).splitlines()[0]
        raise ConfigError(f"{key}: {msg}" if key else msg) from e
    return OmegaConf.to_object(merged)


def to_dict(args: Any) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(args))


CONFIG_NAME = "config.yaml"  # the resolved config in a run's dump_dir (train writes it, eval/stool read it)


def dump_config(args: Any, dump_dir: str | os.PathLike, name: str = CONFIG_NAME) -> Path:
    path = Path(dump_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.structured(args)))
    os.replace(tmp, path)  # atomic: a reader never sees half a config
    return path
