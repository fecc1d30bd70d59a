"""Dataclass <-> OmegaConf: defaults, then a YAML file, then CLI `key.sub=value` overrides.

    args = parse_args(TrainArgs, ["config=debug.yaml", "steps=10", "distributed.sp_size=2"])

* `config=NAME` is a path if such a file exists, else `configs/NAME` (".yaml" may be left off);
  a file's top-level `base: OTHER.yaml` merges OTHER under it (its own values win; OTHER is looked up
  beside the file, then in configs/; bases may have bases, a cycle is an error);
  a dataclass with its own `config` field takes `config=` as that key instead (eval, generate: the
  run's config.yaml).
* A list key takes `key=[a,b]` or `key=a,b` (one value: a one-element list).
* A text key declared with `raw_text()` (generate's prompt) takes the characters after `key=` as they
  are: no YAML parsing, so `prompt="Question: what is"`, `prompt="[1, 2]"` or `prompt=true` stay text.
* `--help` (or `-h`) prints the keys with their types, defaults and descriptions, and exits 0. A
  key's description is the comment on its line, else the comment lines right above it.
* A key that the dataclass does not have is an error that lists the valid keys at that level
  (OmegaConf's own message names only the bad key, which is little help for a typo).
* Types are strict: OmegaConf validates every value against the dataclass annotations.
* `dump_config` writes the resolved config, so a run can be repeated from its dump_dir alone.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import logging
import os
import sys
import textwrap
import tokenize
import typing
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

T = TypeVar("T")

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
HELP_FLAGS = ("-h", "--help")


class ConfigError(ValueError):
    pass


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


RAW_TEXT = "raw_text"  # field metadata key: the command-line value is the text as written


def raw_text(default: str = "") -> Any:
    """A str field whose command-line value is taken as written, never parsed as YAML (a prompt is text:
    `a: b` would become a mapping, `[1, 2]` a list, `true` a bool, `# x` nothing)."""
    return dataclasses.field(default=default, metadata={RAW_TEXT: True})


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
        elif key in names and (sub := _dataclass_of(hints[key])) is not None:
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
        sub = _dataclass_of(hints[key])
        if sub is not None and val is not None and not isinstance(val, (dict, DictConfig)):
            raise ConfigError(f"'{path}' is a section, not a value (got {val!r}); set its keys, e.g. "
                              f"{path}.{dataclasses.fields(sub)[0].name}=... (--help lists them)")
        if sub is not None:
            check_keys(sub, val, path)


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


def _yaml_key(cls: type) -> str | None:
    """`config` names a YAML to load, unless `cls` has a field of that name (then it is that key)."""
    return None if "config" in {f.name for f in dataclasses.fields(cls)} else "config"


def _hint(cls: type, dotted: str) -> Any:
    """The annotation of a dotted key (`data.seq_len`), or None when there is no such key."""
    tp: Any = cls
    for part in dotted.split("."):
        sub = _dataclass_of(tp)
        hints = typing.get_type_hints(sub) if sub is not None else {}
        if part not in hints:
            return None
        tp = hints[part]
    return tp


def _is_raw_text(cls: type, dotted: str) -> bool:
    """Whether a dotted key names a field declared with raw_text()."""
    *parents, name = dotted.split(".")
    owner = _dataclass_of(_hint(cls, ".".join(parents))) if parents else cls
    if owner is None:
        return False
    return any(f.name == name and f.metadata.get(RAW_TEXT) for f in dataclasses.fields(owner))


def _set_dotted(obj: Any, dotted: str, value: str) -> None:
    *parents, name = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, name, value)


def _is_list(tp: Any) -> bool:
    return any(typing.get_origin(t) in (list, tuple) or t in (list, tuple) for t in (tp, *typing.get_args(tp)))


def _bracket_lists(cls: type, overrides: list[str]) -> list[str]:
    """`key=a,b` or `key=a` for a list key -> `key=[a,b]` (OmegaConf only parses the bracketed form);
    `key=` for a str key -> the empty string (OmegaConf would read null)."""
    out = []
    for arg in overrides:
        key, value = arg.split("=", 1)
        hint = _hint(cls, key)
        if _is_list(hint) and not value.startswith("["):
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
    config, overrides = split_cli(argv, yaml_key=_yaml_key(cls))
    raw = [a.split("=", 1) for a in overrides if _is_raw_text(cls, a.split("=", 1)[0])]
    overrides = _bracket_lists(cls, [a for a in overrides if not _is_raw_text(cls, a.split("=", 1)[0])])
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
    return args


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


# -- --help ----------------------------------------------------------------------------------------
def exit_with_help(cls: type) -> typing.NoReturn:
    print(help_text(cls))
    sys.exit(0)


def help_text(cls: type) -> str:
    """Usage, the docstring of the module that defines `cls`, then one line per key (nested keys
    dotted): `key: type = default` and its description."""
    rows = list(_help_rows(cls, _instance(cls), ""))
    width = min(max((len(left) for left, _ in rows), default=0), 60)
    yaml = " [config=NAME]" if _yaml_key(cls) else ""
    doc = inspect.getdoc(sys.modules.get(cls.__module__))
    lines = [f"usage: {_prog()}{yaml} [key=value ...]", ""] + ([doc, ""] if doc else []) + ["keys:"]
    lines += [f"  {left:<{width}}  {desc}".rstrip() for left, desc in rows]
    return "\n".join(lines)


def _prog() -> str:
    """How this process was started: `python -m pkg.mod` or `python path/to/script.py`."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return f"python -m {spec.name.removesuffix('.__main__')}"
    path = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv else "")
    return f"python {os.path.relpath(path) if path else '...'}"


def _instance(cls: type) -> Any:
    try:
        return cls()  # the defaults, default_factory included
    except TypeError:  # a required field: fall back to the declared defaults
        return None


def _help_rows(cls: type, obj: Any, prefix: str):
    hints = typing.get_type_hints(cls)
    notes = field_comments(cls)
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name) if obj is not None else f.default
        key = prefix + f.name
        sub = _dataclass_of(hints[f.name])
        if sub is not None and (value is None or dataclasses.is_dataclass(value)):
            if value is None:  # an optional section: its keys, with the defaults they get when set
                yield f"{key}: {_type_name(f.type)} = None", notes.get(f.name, "")
            yield from _help_rows(sub, value if value is not None else _instance(sub), key + ".")
            continue
        shown = "(required)" if value is dataclasses.MISSING else repr(value)
        note = notes.get(f.name, "") + (" (taken as written: no YAML parsing)" if f.metadata.get(RAW_TEXT) else "")
        yield f"{key}: {_type_name(f.type)} = {shown}", note.strip()


def _type_name(tp: Any) -> str:
    if isinstance(tp, str):  # `from __future__ import annotations`: the annotation as written
        return tp
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


@functools.lru_cache(maxsize=None)
def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its description: the comment on the field's line(s), else the comment lines
    right above it, joined into one line; a field a base dataclass declares keeps the base's
    description unless the subclass gives one. Empty when the source is not available."""
    out = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            out.update({k: v for k, v in _own_field_comments(base).items() if v or k not in out})
    return out


def _own_field_comments(cls: type) -> dict[str, str]:
    try:
        src = textwrap.dedent("".join(inspect.getsourcelines(cls)[0]))
    except (OSError, TypeError):
        return {}
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(src).readline) if tok.type == tokenize.COMMENT}
    lines = src.splitlines()
    out = {}
    for node in ast.parse(src).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        own = [comments[r] for r in range(node.lineno, node.end_lineno + 1) if r in comments]
        above, r = [], node.lineno - 1
        while r in comments and lines[r - 1].lstrip().startswith("#"):
            above.insert(0, comments[r])
            r -= 1
        out[node.target.id] = " ".join(own or above)
    return out
