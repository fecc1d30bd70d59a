"""Every command a user runs: `--help` (keys, types, defaults, one line each; exit 0) and bad input
(one `error: ...` line on stderr, exit code 2), each run as the user would run it."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (command after `python`, one key that --help must print with its type and default, and a description)
HELP = [
    (["-m", "apps.gla.train"], "model.dim: int = 2048"),
    (["-m", "apps.gla.eval"], "eval.steps: int"),
    (["-m", "apps.gla.generate"], "temperature: float = 1.0"),
    (["-m", "apps.gla.export_hf"], "dtype: str = 'bf16'"),
    (["-m", "lingua_zeco.stool"], "nodes: int = 1"),
    (["-m", "apps.gla.plot_metrics"], "dump_dir: str = ''"),
    (["-m", "apps.gla.plot_positions"], "steps: list[int] = []"),
    (["-m", "lingua_zeco.perf_model"], "what: str = 'all'"),
    (["setup/prepare_data.py"], "shards: int = 8"),
    (["setup/train_tokenizer.py"], "vocab_size: int = 32000"),
]


@pytest.fixture(scope="module")
def module_help():
    """{module: [exit code, stderr, stdout]} of `python -m module --help`, all in one interpreter (DRIVER)."""
    modules = [cmd[1] for cmd, _ in HELP if cmd[0] == "-m"]
    return dict(zip(modules, run_cases([(m, ["--help"]) for m in modules], stdout=True)))


@pytest.mark.parametrize("cmd,key_line", HELP, ids=[c[-1] for c, _ in HELP])
def test_help(cmd, key_line, module_help):
    if cmd[0] == "-m":
        code, err, out = module_help[cmd[1]]
    else:  # a script keeps its own process: its folder, not the checkout, is first on sys.path
        res = subprocess.run([sys.executable, *cmd, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        code, err, out = res.returncode, res.stderr, res.stdout
    assert code == 0, err[-2000:]
    assert out.startswith("usage: python "), out[:300]
    keys = out.split("\nkeys:\n", 1)[1].splitlines()
    described = [line for line in keys if re.search(r"\S {2,}\S", line)]  # `key: type = default  description`
    assert [line for line in described if line.startswith(f"  {key_line} ")], out
    if cmd[-1] not in ("apps.gla.train", "apps.gla.eval"):  # their nested *Args live in many files
        assert described == keys, f"undocumented: {sorted(set(keys) - set(described))}"


# Several commands in one interpreter (imports cost seconds here): each case runs the module as
# `python -m` does (runpy, run_name="__main__", sys.argv set) and records the exit code, stderr (with
# the traceback of an exception that escaped, which `python -m` would exit 1 with) and stdout.
DRIVER = r"""
import contextlib, io, json, logging, runpy, sys, traceback
out = []
for module, argv in json.loads(sys.argv[1]):
    sys.argv, err, std, code = [module, *argv], io.StringIO(), io.StringIO(), 0
    logging.root.handlers.clear()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:  # sys.exit(None) is 0; sys.exit("message") prints it and is 1
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            code = 1
            err.write(traceback.format_exc())
    out.append([code, err.getvalue(), std.getvalue()])
print(json.dumps(out))
"""


def run_cases(cases: list, stdout: bool = False) -> list[list]:
    """[exit code, stderr] (and stdout with `stdout`) of each (module, argv), all run by DRIVER in one subprocess."""
    res = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(cases)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return [r if stdout else r[:2] for r in json.loads(res.stdout.strip().splitlines()[-1])]


def assert_one_error_line(code: int, err: str, expected: str = "") -> None:
    """Exit 2, no traceback, exactly one `error...` line, last on stderr, holding `expected`."""
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, f"exit {code}, stderr:\n{err[-2000:]}"
    assert err.strip().splitlines()[-1] == errors[0] and expected in errors[0], errors[0]


def _bad_cases(tmp: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (module, argv). tmp/nothing does not exist; tmp/run is a run folder without checkpoints."""
    nothing, empty = tmp / "nothing", tmp / "run"
    cases = {}
    for mod, extra in (("apps.gla.eval", []), ("apps.gla.generate", []), ("apps.gla.export_hf", [f"out={tmp}/hf"])):
        short = mod.split(".")[-1]
        cases[f"{short}-no-dump_dir"] = (mod, extra)
        cases[f"{short}-missing-dump_dir"] = (mod, [f"dump_dir={nothing}", *extra])
        cases[f"{short}-no-checkpoint"] = (mod, [f"dump_dir={empty}", *extra])
        cases[f"{short}-unknown-key"] = (mod, [f"dump_dir={empty}", "temprature=0.5", *extra])
    cases["plot_metrics-no-dump_dir"] = ("apps.gla.plot_metrics", [])
    cases["plot_metrics-missing-dump_dir"] = ("apps.gla.plot_metrics", [f"dump_dir={nothing}"])
    cases["plot_metrics-no-metrics"] = ("apps.gla.plot_metrics", [f"dump_dir={empty}"])
    cases["plot_metrics-unknown-key"] = ("apps.gla.plot_metrics", [f"dump_dir={empty}", "outt=x.png"])
    cases["plot_positions-no-metrics"] = ("apps.gla.plot_positions", [f"dump_dir={empty}"])
    dry = [f"dump_dir={tmp}/job", "dry_run=true"]
    cases["stool-unknown-key"] = ("lingua_zeco.stool", ["config=debug.yaml", "optim.lrr=1", *dry])
    cases["stool-missing-config"] = ("lingua_zeco.stool", ["config=no_such_config", *dry])
    cases["stool-bad-launcher"] = ("lingua_zeco.stool", ["config=debug.yaml", "launcher=mpirun", *dry])
    cases["perf_model-unknown-key"] = ("lingua_zeco.perf_model", ["what=op", "op.no_such_field=1"])
    # train: values that used to run (a 1.2B model with no config=, steps=0, a 0-token "validation loss") or
    # ended in a traceback deep in the model, the tokenizer or the YAML parser
    run = ["config=debug.yaml", f"dump_dir={tmp}/train", "steps=2"]
    cases["train-no-config"] = ("apps.gla.train", [f"dump_dir={tmp}/train", "steps=2"])
    for bad in ("model.dim=0", "model.n_heads=0", "model.n_layers=0", "model.ffn_hidden=-4", "model.vocab_size=10",
                "model.gla_bwd_intra=triton", "steps=0", "steps=-3", "model=5", "data.sources={train: 1.0"):
        cases[f"train-{bad}"] = ("apps.gla.train", [*run, bad])
    cases["train-eval.steps=0"] = ("apps.gla.train", [*run, "eval.every=1", "eval.steps=0"])
    cases["train-tokenizer-not-sentencepiece"] = ("apps.gla.train", [*run, "data.tokenizer.name=sp",
                                                                      f"data.tokenizer.path={tmp}/run/config.yaml"])
    cases["train-yaml-syntax"] = ("apps.gla.train", [f"config={tmp}/broken.yaml", f"dump_dir={tmp}/train"])
    cases["train-yaml-list"] = ("apps.gla.train", [f"config={tmp}/list.yaml", f"dump_dir={tmp}/train"])
    cases["stool-bad-time"] = ("lingua_zeco.stool", ["config=debug.yaml", "time=forever", *dry])
    cases["stool-bad-script"] = ("lingua_zeco.stool", ["config=debug.yaml", "script=apps.gla.nonexist", *dry])
    cases["stool-sp-not-dividing"] = ("lingua_zeco.stool", ["config=debug.yaml", "distributed.sp_size=3", "ngpus=8",
                                                            *dry])
    return cases


@pytest.fixture(scope="module")
def bad_input_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "run").mkdir()
    # a tiny model: eval, generate and export_hf build it before they look for a checkpoint (the default
    # model took 10 s a command to build here)
    (tmp / "run" / "config.yaml").write_text(f"name: t\ndump_dir: {tmp / 'run'}\n"
                                             "model: {dim: 32, n_layers: 1, n_heads: 2, ffn_hidden: 64}\n")
    (tmp / "broken.yaml").write_text("model:\n  dim: [1, 2\n")
    (tmp / "list.yaml").write_text("- a\n- b\n")
    cases = _bad_cases(tmp)
    return dict(zip(cases, run_cases(list(cases.values()))))


BAD = sorted(_bad_cases(Path("/unused")))


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_error_line_and_exit_2(bad_input_results, case):
    assert_one_error_line(*bad_input_results[case])
