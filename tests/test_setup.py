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


# Bad input to prepare_data: one `error:` line naming the file and line / row group, exit 2, nothing written.
def _docs_jsonl(n: int) -> list[bytes]:
    return [json.dumps({"text": f"document {i} of the corpus"}).encode() + b"\n" for i in range(1, n + 1)]


def _broken_inputs(raw: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (input arguments, what the error line must hold). raw/ is created here."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw.mkdir()
    lines = _docs_jsonl(400)
    (raw / "blank.jsonl").write_bytes(b"\n  \n" + json.dumps({"text": "   "}).encode() + b"\n")
    (raw / "empty.txt").write_bytes(b"")
    utf = list(lines)
    utf[299] = b'{"text": "\xff\xfe"}\n'  # line 300
    (raw / "utf.jsonl").write_bytes(b"".join(utf))
    (raw / "cut.jsonl").write_bytes(b"".join(lines[:300])[:-7])  # line 300 ends mid-string
    (raw / "latin.txt").write_bytes(b"first line\nsecond line\ncaf\xe9 au lait\n")
    pq.write_table(pa.table({"text": [d.decode() for d in lines[:300]]}), raw / "ok.parquet", row_group_size=100)
    data = (raw / "ok.parquet").read_bytes()
    (raw / "half.parquet").write_bytes(data[:len(data) // 2])
    chunk = pq.ParquetFile(raw / "ok.parquet").metadata.row_group(1).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    zeroed = bytearray(data)
    zeroed[start:start + chunk.total_compressed_size] = bytes(chunk.total_compressed_size)  # row group 1's pages
    (raw / "group.parquet").write_bytes(bytes(zeroed))
    strict = "on_bad_line=error"
    return {
        "no-documents": ([f"input={raw / 'blank.jsonl'}"], f"no documents in {raw / 'blank.jsonl'}"),
        "empty-txt": ([f"input={raw / 'empty.txt'}"], f"no documents in {raw / 'empty.txt'}"),
        "invalid-utf8": ([f"input={raw / 'utf.jsonl'}", strict], f"{raw / 'utf.jsonl'}:300: bad record: not valid UTF"),
        "cut-jsonl": ([f"input={raw / 'cut.jsonl'}", strict], f"{raw / 'cut.jsonl'}:300: bad record: invalid JSON"),
        "txt-not-utf8": ([f"input={raw / 'latin.txt'}"], f"{raw / 'latin.txt'}:3: not valid UTF-8"),
        "truncated-parquet": ([f"input={raw / 'half.parquet'}"], f"{raw / 'half.parquet'}: not a readable parquet"),
        "corrupt-row-group": ([f"input={raw / 'ok.parquet'},{raw / 'group.parquet'}"],
                              f"{raw / 'group.parquet'}: row group 1 (of 3) cannot be read"),
    }


@pytest.fixture(scope="module")
def prepare_failures(tmp_path_factory):
    """Each broken input through the script's entry point (clean_exit), all in one interpreter."""
    from test_entry_points import run_cases

    tmp = tmp_path_factory.mktemp("prepare_bad")
    cases = _broken_inputs(tmp / "raw")
    got = run_cases([("setup.prepare_data", [*argv, f"out={tmp / name / 'out'}"]) for name, (argv, _) in cases.items()])
    return tmp, cases, dict(zip(cases, got))


@pytest.mark.parametrize("case", ["no-documents", "empty-txt", "invalid-utf8", "cut-jsonl", "txt-not-utf8",
                                  "truncated-parquet", "corrupt-row-group"])
def test_prepare_bad_input_is_one_error_line_and_no_output(prepare_failures, case):
    from test_entry_points import assert_one_error_line

    tmp, cases, got = prepare_failures
    assert_one_error_line(*got[case], cases[case][1])
    assert not (tmp / case).exists()  # the folders it made are gone again


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_failed_prepare_keeps_the_earlier_output(tmp_path):
    cases = _broken_inputs(tmp_path / "raw")
    out = tmp_path / "prepared"
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "a.jsonl").write_bytes(b"".join(_docs_jsonl(50)))
    prepare_data.main([f"input={tmp_path / 'good'}", f"out={out}", "shards=2", "valid_fraction=0.1"])
    (out / "train" / "notes.md").write_text("not ours")  # a file of the user's beside the shards
    before = _snapshot(out)
    assert len([k for k in before if k.endswith(".jsonl")]) == 3
    for name, (argv, expected) in cases.items():
        with pytest.raises(ValueError) as e:
            prepare_data.main([*argv, f"out={out}", "shards=4"])
        assert expected in str(e.value), name
        assert _snapshot(out) == before, name
        assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train", "valid"], name  # no temporary left
    # a good rerun replaces the shards (4 now, not 2) and keeps the user's file
    prepare_data.main([f"input={tmp_path / 'good'}", f"out={out}", "shards=4", "valid_fraction=0.1"])
    assert len(list((out / "train").glob("shard_*.jsonl"))) == 4 and (out / "train" / "notes.md").exists()
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train", "valid"]


def test_prepare_skips_and_counts_bad_records_like_the_loader(tmp_path, capsys):
    """The trainer's loader skips and counts a bad jsonl line by default (data.on_bad_line=skip): so does
    prepare_data, naming the first in a warning; every good document is kept."""
    _broken_inputs(tmp_path / "raw")
    raw, out = tmp_path / "raw", tmp_path / "out"
    prepare_data.main([f"input={raw / 'utf.jsonl'},{raw / 'cut.jsonl'}", f"out={out}", "valid_fraction=0.1"])
    err = capsys.readouterr().err
    kept = sorted(_read(out / "train") + _read(out / "valid"))
    want = sorted(json.loads(d)["text"] for d in _docs_jsonl(400) if b"document 300 " not in d)  # utf.jsonl
    want += sorted(json.loads(d)["text"] for d in _docs_jsonl(299))  # cut.jsonl before its cut line 300
    assert kept == sorted(want)
    assert json.loads((out / "meta.json").read_text())["bad_records"] == 2
    assert f"warning: {raw / 'utf.jsonl'}:300: bad record skipped: not valid UTF-8" in err, err
    assert "skipped 2 bad record(s)" in err, err


@pytest.mark.parametrize("bad", ["shards=0", "max_docs=-1", "valid_fraction=1", "txt_doc=page"])
def test_prepare_bad_keys_are_named_before_reading(tmp_path, bad):
    from lingua_zeco.args import ConfigError

    key, value = bad.split("=")
    with pytest.raises(ConfigError, match=rf"{key}='?{value}'?"):
        prepare_data.main([f"input={tmp_path}", f"out={tmp_path / 'out'}", bad])
    assert not (tmp_path / "out").exists()


def test_prepare_reads_a_file_named_twice_once(tmp_path):
    docs = _corpus(tmp_path / "raw")
    raw = tmp_path / "raw"
    prepare_data.main([f"input={raw},{raw / 'a.jsonl'},{raw}/*.parquet", f"out={tmp_path / 'out'}",
                       "txt_doc=paragraph", "valid_fraction=0"])
    assert sorted(_read(tmp_path / "out" / "train")) == sorted(docs)


def test_prepare_out_under_a_file_is_one_error(tmp_path):
    from lingua_zeco.args import ConfigError

    _corpus(tmp_path / "raw")
    (tmp_path / "file").write_text("kept\n")
    with pytest.raises(ConfigError, match=r"out=.*file/out: cannot create a folder there \(Not a directory\)"):
        prepare_data.main([f"input={tmp_path / 'raw'}", f"out={tmp_path / 'file' / 'out'}"])
    assert (tmp_path / "file").read_text() == "kept\n"
