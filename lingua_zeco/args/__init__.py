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
* `given_keys(args)`: the dotted keys the file and the command line set (parse_args records them), for
  a caller that fills the others from elsewhere (the trainer, from a Hugging Face folder's config.json).

One module per job, every name re-exported here (`from lingua_zeco.args import X`): config.py (building a
config: defaults, files, overrides, checks, the dump), keys.py (what a dataclass declares, and --help).
"""
from lingua_zeco.args.config import (BASE_KEY, CONFIG_DIR, CONFIG_NAME, ConfigError, at_least, build, check_keys,
                                     check_sections, check_self_contained, drop_retired, dump_config, given_keys,
                                     load_config, one_line, parse_args, resolve_config_path, split_cli, to_dict)
from lingua_zeco.args.keys import HELP_FLAGS, RAW_TEXT, exit_with_help, field_comments, help_text, raw_text

__all__ = [
    "BASE_KEY", "CONFIG_DIR", "CONFIG_NAME", "ConfigError", "HELP_FLAGS", "RAW_TEXT", "at_least", "build",
    "check_keys", "check_sections", "check_self_contained", "drop_retired", "dump_config", "exit_with_help",
    "field_comments", "given_keys", "help_text", "load_config", "one_line", "parse_args", "raw_text",
    "resolve_config_path", "split_cli", "to_dict",
]
