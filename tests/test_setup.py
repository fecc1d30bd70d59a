"""setup/: data preparation from local files (no network), tokenizer training, offline install."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "setup"))

import prepare_data  # noqa: E402
import train_tokenizer  # noqa: E402


def _corpus(folder: Path) -> list[str]:
    folder.mkdir()
    docs = [f"document {i}: " + " ".join(f"w{(i * j) % 37}" for j in range(5 + i % 7)) for i in range(300)]
    with open(folder / "a.jsonl", "w") as f:
        for d in docs[:200]:
            f.write(json.dumps({"text": d}) + "\n")
    (folder / "b.txt").write_text("\n\n".join(docs[200:250]) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs[250:]}), folder / "c.parquet")
    return docs


def _read(folder: Path) -> list[str]:
    return [json.loads(line)["text"] for f in sorted(folder.glob("shard_*.jsonl")) for line in open(f)]


def test_prepare_local_files(tmp_path, capsys):
    docs = _corpus(tmp_path / "raw")
    out = tmp_path / "prepared"
    prepare_data.main([f"input={tmp_path / 'raw'}", f"out={out}", "shards=3", "valid_fraction=0.1",
                       "txt_doc=paragraph", "seed=1"])
    train, valid = _read(out / "train"), _read(out / "valid")
    assert len(list((out / "train").glob("shard_*.jsonl"))) == 3 and not list(out.rglob(".part_*"))
    assert sorted(train + valid) == sorted(docs)  # every document exactly once, in one split
    assert not set(train) & set(valid) and 10 <= len(valid) <= 60
    assert train != [d for d in docs if d in set(train)]  # shuffled, not in input order
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train"] == len(train) and meta["valid"] == len(valid)
    assert "reading" in capsys.readouterr().err  # progress reported
    # Seeded: the same command gives the same shards.
    again = tmp_path / "again"
    prepare_data.main([f"input={tmp_path / 'raw'}", f"out={again}", "shards=3", "valid_fraction=0.1",
                       "txt_doc=paragraph", "seed=1"])
    assert _read(again / "train") == train
    # The trainer's loader reads the result.
    from lingua_zeco.data import DataArgs, build_data_loader

    loader = build_data_loader(DataArgs(root_dir=str(out), sources={"train": 1.0}, seq_len=32, prefetch=0),
                               dp_rank=0, dp_size=1, sp_rank=0, sp_size=1, seed=0)
    assert next(loader)["input_ids"].shape == (1, 32)


def test_prepare_rejects_missing_input(tmp_path):
    with pytest.raises(FileNotFoundError):
        prepare_data.main([f"input={tmp_path / 'nope.jsonl'}", f"out={tmp_path / 'o'}"])


def test_progress_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import fails: plain lines instead
    p = prepare_data.Progress("reading", every=2)
    for _ in range(5):
        p.update()
    p.close()
    err = capsys.readouterr().err
    assert "reading: 2 documents" in err and "reading: 5 documents (done)" in err


def test_train_tokenizer_tiny(tmp_path):
    _corpus(tmp_path / "raw")
    prepare_data.main([f"input={tmp_path / 'raw'}", f"out={tmp_path / 'p'}", "shards=2"])
    model = train_tokenizer.train([str(tmp_path / "p" / "train")], str(tmp_path / "tok"), vocab_size=320, threads=1)
    from lingua_zeco.tokenizer import TokenizerArgs, build_tokenizer

    tok = build_tokenizer(TokenizerArgs(name="sp", path=str(model)))
    assert (tok.bos_id, tok.eos_id) == (1, 2) and 290 <= tok.n_words <= 320
    ids = tok.encode("document 7: w3 w14 ünïcödé")
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids[1:-1]) == "document 7: w3 w14 ünïcödé"
    assert len(tok.encode("document 7: w3 w14", False, False)) < len("document 7: w3 w14") - 4  # merges learned


def _tiny_wheel(folder: Path) -> None:
    folder.mkdir()
    name = "zeco_dummy-1.0"
    with zipfile.ZipFile(folder / "zeco_dummy-1.0-py3-none-any.whl", "w") as z:
        z.writestr("zeco_dummy.py", "VALUE = 42\n")
        z.writestr(f"{name}.dist-info/METADATA", "Metadata-Version: 2.1\nName: zeco-dummy\nVersion: 1.0\n")
        z.writestr(f"{name}.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{name}.dist-info/RECORD", "")


def test_install_offline_from_wheelhouse(tmp_path):
    _tiny_wheel(tmp_path / "wheels")
    req = tmp_path / "req.txt"
    req.write_text("zeco-dummy==1.0\n")
    venv = tmp_path / "venv"
    env = {"PATH": "/usr/bin:/bin", "REQ": str(req), "CHECK": "0", "PYTHON": sys.executable,
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "HOME": str(tmp_path)}
    res = subprocess.run(["bash", str(ROOT / "setup/install_offline.sh"), str(tmp_path / "wheels"), str(venv)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = subprocess.run([str(venv / "bin/python"), "-c", "import zeco_dummy; print(zeco_dummy.VALUE)"],
                         capture_output=True, text=True)
    assert out.stdout.strip() == "42"
    # --no-index: a requirement missing from the wheelhouse fails instead of reaching an index.
    req.write_text("zeco-dummy==2.0\n")
    res = subprocess.run(["bash", str(ROOT / "setup/install_offline.sh"), str(tmp_path / "wheels"), str(venv)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0


def test_setup_scripts_parse():
    for script in ("create_env.sh", "download_wheels.sh", "install_offline.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "setup" / script)], check=True)
    assert (ROOT / "setup/gpu/triton_autotune_h200.tgz").is_file()


def test_train_tokenizer_says_when_the_data_gives_fewer_pieces(tmp_path, capsys):
    """vocab_size is an upper bound: a corpus too small for it gives fewer pieces, said in one warning line
    with both numbers and the text read; enough text for the asked size says nothing."""
    _corpus(tmp_path / "raw")
    prepare_data.main([f"input={tmp_path / 'raw'}", f"out={tmp_path / 'p'}", "shards=2"])
    capsys.readouterr()
    train_tokenizer.main([f"data={tmp_path / 'p' / 'train'}", "vocab_size=32000", f"out={tmp_path / 'big'}",
                          "threads=1"])
    err = capsys.readouterr().err.strip().splitlines()
    warn = [line for line in err if line.startswith("warning:")]
    from lingua_zeco.tokenizer import TokenizerArgs, build_tokenizer

    n = build_tokenizer(TokenizerArgs(name="sp", path=str(tmp_path / "big" / "tokenizer.model"))).n_words
    assert n < 32000 and len(warn) == 1 and "vocab_size=32000" in warn[0], err
    assert f"only enough text for {n} pieces" in warn[0], warn
    assert " documents (" in warn[0] and " characters)" in warn[0], warn
    train_tokenizer.main([f"data={tmp_path / 'p' / 'train'}", "vocab_size=280", f"out={tmp_path / 'small'}",
                          "threads=1"])
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
