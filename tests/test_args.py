"""Config system: precedence defaults < YAML < CLI, strict keys and types, config name resolution."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from apps.gla.train import TrainArgs
from lingua_zeco.args import (CONFIG_DIR, ConfigError, build, dump_config, help_text, parse_args, raw_text,
                              resolve_config_path)


@dataclass
class Inner:
    size: int = 1
    name: str = "a"


@dataclass
class Outer:
    steps: int = 10
    lr: float = 0.1
    mode: int | str = 1
    inner: Inner = field(default_factory=Inner)


def test_precedence_defaults_yaml_cli(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("steps: 20\nlr: 0.5\ninner:\n  size: 3\n")
    args = parse_args(Outer, [f"config={cfg}", "steps=30", "inner.name=b"])
    assert args.steps == 30  # CLI beats YAML
    assert args.lr == 0.5  # YAML beats default
    assert args.inner.size == 3 and args.inner.name == "b"
    assert isinstance(args.inner, Inner)
    assert parse_args(Outer, []) == Outer()


def test_union_int_or_auto():
    assert parse_args(Outer, ["mode=auto"]).mode == "auto"
    assert parse_args(Outer, ["mode=4"]).mode == 4


def test_unknown_key_lists_valid_keys(tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_args(Outer, ["inner.sise=3"])
    msg = str(e.value)
    assert "inner.sise" in msg and "size" in msg and "name" in msg
    with pytest.raises(ConfigError, match="valid keys at the top level: steps, lr, mode, inner"):
        parse_args(Outer, ["stpes=3"])
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("inner:\n  colour: red\n")
    with pytest.raises(ConfigError, match="inner.colour"):
        parse_args(Outer, [f"config={cfg}"])


def test_strict_types():
    with pytest.raises(ConfigError):
        parse_args(Outer, ["steps=many"])
    with pytest.raises(ConfigError):
        build(Outer, {"inner": {"size": "big"}})
    with pytest.raises(ConfigError, match="key=value"):
        parse_args(Outer, ["steps"])


def test_config_name_resolution(tmp_path, monkeypatch):
    assert resolve_config_path("debug.yaml") == CONFIG_DIR / "debug.yaml"
    assert resolve_config_path("debug") == CONFIG_DIR / "debug.yaml"
    local = tmp_path / "debug.yaml"  # an existing path wins over configs/
    local.write_text("steps: 7\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_config_path("debug.yaml") == local.relative_to(tmp_path)
    with pytest.raises(ConfigError, match="known:.*debug.yaml"):
        resolve_config_path("no_such_config.yaml")


@pytest.mark.parametrize("name", ["debug.yaml", "gla_1b_zeco.yaml", "gla_1b_lasp1.yaml", "gla_1b_lasp2.yaml",
                                  "gla_1b_dp.yaml"])
def test_shipped_configs_parse(name):
    args = parse_args(TrainArgs, [f"config={name}"])
    assert args.steps > 0 and args.data.seq_len > 0
    if name.startswith("gla_1b"):
        assert (args.model.dim, args.model.n_layers, args.model.n_heads) == (2048, 20, 16)
        assert args.data.seq_len == 16384
    if name == "gla_1b_dp.yaml":
        assert args.distributed.sp_size == 1 and args.distributed.sp_method == "none"


def test_contract_keys_and_dump(tmp_path):
    args = parse_args(TrainArgs, ["config=debug.yaml", f"dump_dir={tmp_path}", "steps=3", "seed=5",
                                  "data.seq_len=64", "data.batch_size=2", "distributed.sp_size=auto",
                                  "distributed.sp_method=lasp2", "checkpoint.dump.every=2", "logging.freq=1"])
    assert (args.steps, args.seed, args.data.seq_len, args.data.batch_size) == (3, 5, 64, 2)
    assert args.distributed.sp_size == "auto" and args.distributed.sp_method == "lasp2"
    assert args.checkpoint.dump.every == 2 and args.logging.freq == 1
    path = dump_config(args, tmp_path)
    again = build(TrainArgs, OmegaConf.load(path))  # the dump alone reproduces the config
    assert again == args


@dataclass
class Documented:
    steps: int = 10  # optimizer steps
    # a description on the lines above,
    # in two parts
    mode: str = "a"
    paths: list[str] = field(default_factory=list)
    inner: Inner = field(default_factory=lambda: Inner(size=5))  # nested keys get dots


def test_help_lists_keys_types_defaults_and_comments(capsys):
    text = help_text(Documented)
    lines = {line.split(":")[0].strip(): line for line in text.splitlines() if line.startswith("  ")}
    assert "int = 10" in lines["steps"] and lines["steps"].endswith("optimizer steps")
    assert "str = 'a'" in lines["mode"] and lines["mode"].endswith("a description on the lines above, in two parts")
    assert "list[str] = []" in lines["paths"]
    assert "int = 5" in lines["inner.size"] and "str = 'a'" in lines["inner.name"]  # the factory's defaults
    assert text.startswith("usage: ") and "Config system" in text  # the defining module's docstring
    for argv in (["--help"], ["steps=3", "-h"]):
        with pytest.raises(SystemExit) as e:
            parse_args(Documented, argv)
        assert e.value.code == 0 and capsys.readouterr().out.strip() == text.strip()
    with pytest.raises(SystemExit) as e:  # entry points that build from OmegaConf.from_dotlist(argv)
        build(Documented, OmegaConf.from_dotlist(["--help"]))
    assert e.value.code == 0 and "inner.size" in capsys.readouterr().out


def test_list_keys_take_commas_and_own_config_key():
    assert parse_args(Documented, ["paths=a/*.jsonl,b"]).paths == ["a/*.jsonl", "b"]
    assert parse_args(Documented, ["paths=/data/raw"]).paths == ["/data/raw"]
    assert parse_args(Documented, ["paths=[x,y]"]).paths == ["x", "y"]

    @dataclass
    class WithConfig:  # a `config` field is the entry point's own key, not a YAML to merge
        config: str = ""
        steps: int = 1

    assert parse_args(WithConfig, ["config=run/config.yaml", "steps=2"]) == WithConfig("run/config.yaml", 2)


@dataclass
class _Texts:
    label: str = "x"
    note: str = raw_text("n")


@dataclass
class _WithTexts:
    texts: _Texts = field(default_factory=_Texts)
    prompt: str = raw_text()


def test_raw_text_keys_take_the_value_as_written(tmp_path):
    """A raw_text() key (top level or nested) gets the characters after `key=` verbatim, after the YAML
    layer; the other str keys keep YAML parsing (`label=[1, 2]` stays a type error)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("prompt: from yaml\ntexts:\n  note: yaml note\n")
    got = parse_args(_WithTexts, [f"config={cfg}", "prompt=Question: what is", "texts.note=[1, 2]"])
    assert got.prompt == "Question: what is" and got.texts.note == "[1, 2]"
    assert parse_args(_WithTexts, [f"config={cfg}"]).prompt == "from yaml"
    assert parse_args(_WithTexts, ["prompt=true", "prompt=# h"]).prompt == "# h"  # the last one wins
    assert parse_args(_WithTexts, ["prompt="]).prompt == ""
    with pytest.raises(ConfigError):
        parse_args(_WithTexts, ["texts.label=[1, 2]"])


BEFORE_BASE = Path(__file__).parent / "data" / "gla_1b_before_base"  # the gla_1b files as they were, in full


@pytest.mark.parametrize("name", sorted(p.name for p in BEFORE_BASE.glob("*.yaml")))
def test_configs_on_a_base_resolve_as_the_full_files_did(name, tmp_path):
    new = parse_args(TrainArgs, [f"config={name}"])
    assert "base" in OmegaConf.load(CONFIG_DIR / name)  # the file itself says only what differs
    assert new == build(TrainArgs, OmegaConf.load(BEFORE_BASE / name))
    assert dump_config(new, tmp_path / "new").read_text() == \
        dump_config(build(TrainArgs, OmegaConf.load(BEFORE_BASE / name)), tmp_path / "old").read_text()


def test_base_chain_own_values_win_cycles_and_missing_bases_refused(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "root.yaml").write_text("steps: 5\nseed: 1\nmodel:\n  dim: 64\n  n_layers: 2\n")
    (tmp_path / "sub" / "mid.yaml").write_text("base: ../root.yaml\nseed: 2\nmodel:\n  n_layers: 3\n")
    (tmp_path / "sub" / "leaf.yaml").write_text("base: mid\nmodel:\n  n_heads: 2\n")  # beside it, .yaml left off
    args = parse_args(TrainArgs, [f"config={tmp_path / 'sub' / 'leaf.yaml'}", "steps=9"])
    assert (args.steps, args.seed, args.model.dim, args.model.n_layers, args.model.n_heads) == (9, 2, 64, 3, 2)
    (tmp_path / "inc.yaml").write_text("base: gla_1b_base.yaml\nsteps: 3\n")  # not beside it: from configs/
    assert parse_args(TrainArgs, [f"config={tmp_path / 'inc.yaml'}"]).model.dim == 2048
    (tmp_path / "a.yaml").write_text("base: b.yaml\nsteps: 1\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nsteps: 2\n")
    with pytest.raises(ConfigError, match=r"cycle \(.*a\.yaml -> .*b\.yaml -> .*a\.yaml\)"):
        parse_args(TrainArgs, [f"config={tmp_path / 'a.yaml'}"])
    (tmp_path / "self.yaml").write_text("base: self.yaml\nsteps: 1\n")
    with pytest.raises(ConfigError, match="cycle"):
        parse_args(TrainArgs, [f"config={tmp_path / 'self.yaml'}"])
    (tmp_path / "lost.yaml").write_text("base: nowhere.yaml\nsteps: 1\n")
    with pytest.raises(ConfigError, match="its base 'nowhere.yaml' does not exist.*fix the base: line"):
        parse_args(TrainArgs, [f"config={tmp_path / 'lost.yaml'}"])
    (tmp_path / "list.yaml").write_text("base: [a.yaml]\nsteps: 1\n")
    with pytest.raises(ConfigError, match="must name one config file"):
        parse_args(TrainArgs, [f"config={tmp_path / 'list.yaml'}"])


@pytest.mark.parametrize("key,value,words", [
    ("distributed.all_scan.algorithm", "spiral", "all_scan.algorithm='spiral'"),  # comm raises ValueError
    ("model.dim", "0", "model.dim=0"),
    ("checkpoint.dump.keep", "-1", "checkpoint.dump.keep=-1"),
    ("data.seq_len", "0", "data.seq_len=0"),
    ("gc.every", "-2", "gc.every=-2"),
    ("steps", "0", "steps=0"),
])
def test_every_section_checks_itself_into_one_error_type(key, value, words):
    """Each *Args checks its own values (its check(), beside its fields); check_sections walks the nested
    sections and turns a low layer's ValueError into the one ConfigError the entry points report."""
    from apps.gla.train import TrainArgs
    from lingua_zeco.args import ConfigError, check_sections, parse_args

    args = parse_args(TrainArgs, ["config=debug.yaml", f"{key}={value}"])
    with pytest.raises(ConfigError, match=re.escape(words)):
        check_sections(args)
    check_sections(parse_args(TrainArgs, ["config=debug.yaml"]))  # the shipped config passes
