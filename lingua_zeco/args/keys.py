"""What a config dataclass declares: its keys (nested sections, list keys, keys taken as raw text), their
types, defaults and descriptions, and the --help text made of them. A key's description is the comment on
its line, else the comment lines right above it."""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import os
import sys
import textwrap
import tokenize
import typing
from typing import Any

HELP_FLAGS = ("-h", "--help")


RAW_TEXT = "raw_text"  # field metadata key: the command-line value is the text as written


def raw_text(default: str = "") -> Any:
    """A str field whose command-line value is taken as written, never parsed as YAML (a prompt is text:
    `a: b` would become a mapping, `[1, 2]` a list, `true` a bool, `# x` nothing)."""
    return dataclasses.field(default=default, metadata={RAW_TEXT: True})


def dataclass_of(tp: Any) -> type | None:
    """The dataclass inside an annotation such as `Foo` or `Foo | None`, else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def yaml_file_key(cls: type) -> str | None:
    """`config` names a YAML to load, unless `cls` has a field of that name (then it is that key)."""
    return None if "config" in {f.name for f in dataclasses.fields(cls)} else "config"


def key_hint(cls: type, dotted: str) -> Any:
    """The annotation of a dotted key (`data.seq_len`), or None when there is no such key."""
    tp: Any = cls
    for part in dotted.split("."):
        sub = dataclass_of(tp)
        hints = typing.get_type_hints(sub) if sub is not None else {}
        if part not in hints:
            return None
        tp = hints[part]
    return tp


def is_raw_text(cls: type, dotted: str) -> bool:
    """Whether a dotted key names a field declared with raw_text()."""
    *parents, name = dotted.split(".")
    owner = dataclass_of(key_hint(cls, ".".join(parents))) if parents else cls
    if owner is None:
        return False
    return any(f.name == name and f.metadata.get(RAW_TEXT) for f in dataclasses.fields(owner))


def is_list(tp: Any) -> bool:
    return any(typing.get_origin(t) in (list, tuple) or t in (list, tuple) for t in (tp, *typing.get_args(tp)))


def exit_with_help(cls: type) -> typing.NoReturn:
    print(help_text(cls))
    sys.exit(0)


def help_text(cls: type) -> str:
    """Usage, the docstring of the module that defines `cls`, then one line per key (nested keys
    dotted): `key: type = default` and its description."""
    rows = list(_help_rows(cls, _instance(cls), ""))
    width = min(max((len(left) for left, _ in rows), default=0), 60)
    yaml = " [config=NAME]" if yaml_file_key(cls) else ""
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
        sub = dataclass_of(hints[f.name])
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
