"""configs/demo_long_context.yaml and setup/demo_long_context.sh (docs/long_context.md, section 4): the
config parses through the trainer's strict args parser and asks for what the demonstration shows;
the script is valid bash and writes where the config reads. The demo itself is not run here (~6 min)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from apps.gla.train import TrainArgs
from lingua_zeco.args import check_sections, parse_args
from lingua_zeco.evaluation import training_data_args

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "setup" / "demo_long_context.sh"


def demo_args(*overrides: str) -> TrainArgs:
    return parse_args(TrainArgs, ["config=demo_long_context.yaml", *overrides])


def test_demo_config_parses_and_shows_what_the_doc_says():
    a = demo_args()
    check_sections(a)
    assert a.distributed.sp_size == 2 and a.distributed.sp_method == "zeco"
    assert a.data.varlen and a.data.batch_size == 1  # packed documents (varlen needs one sequence per rank)
    assert a.data.seq_len * a.distributed.sp_size == 2048  # one 2048-token context per step
    assert a.data.tokenizer.name == "sp" and a.data.tokenizer.path.endswith("tok/tokenizer.model")
    assert a.data.sources == {"train": 1.0}  # prep/valid stays held out for the evaluation
    assert training_data_args(a.data, a.eval) is a.data
    assert a.checkpoint.async_save is True  # off by default without CUDA
    assert a.checkpoint.dump.every > 0 and a.eval.every > 0 and a.eval.by_position
    assert a.model.vocab_size == 0  # taken from the SentencePiece model
    # the kill in the script lands after a periodic (async) checkpoint and before the end
    kill = int(re.search(r"SIGKILL@(\d+)", SCRIPT.read_text())[1])
    assert a.checkpoint.dump.every <= kill < a.steps and kill % a.checkpoint.dump.every != 0


def test_demo_config_keys_stay_strict():
    from lingua_zeco.args import ConfigError

    with pytest.raises(ConfigError):
        demo_args("checkpoint.async_saves=true")  # a misspelt key is refused, not ignored


def test_demo_script_paths_match_the_config():
    a = demo_args()
    text = SCRIPT.read_text()
    work = re.search(r"^W=(\S+)$", text, re.M)[1]
    assert a.data.root_dir == f"{work}/prep"
    assert a.data.tokenizer.path == f"{work}/tok/tokenizer.model"
    assert a.dump_dir == f"{work}/run"
    assert "config=demo_long_context.yaml" in text
    if shutil.which("bash"):
        subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
