import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lingua_zeco.data import DataArgs, build_data_loader

BOS, EOS = 256, 257


def _doc(tag: str, i: int, rng: random.Random) -> str:
    return f"<{tag}{i:04d}>" + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(0, 90)))


@pytest.fixture
def root(tmp_path):
    """Source a: two jsonl files (one with a blank line); source b: parquet with several row groups."""
    rng = random.Random(0)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for f in range(2):
        lines = [json.dumps({"text": _doc("a", f * 30 + i, rng), "id": i}) for i in range(30)]
        lines.insert(5, "")
        (tmp_path / "a" / f"part{f}.jsonl").write_text("\n".join(lines) + "\n")
    table = pa.table({"text": [_doc("b", i, rng) for i in range(25)]})
    pq.write_table(table, tmp_path / "b" / "x.parquet", row_group_size=7)
    return tmp_path


def _args(root=None, **kw):
    base = dict(root_dir=str(root) if root else None, sources={"a": 2.0, "b": 1.0} if root else {},
                seq_len=32, batch_size=2, prefetch=0)
    base.update(kw)
    return DataArgs(**base)


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _global_stream(root, dp_rank, dp_size, n_batches, **kw):
    loader = build_data_loader(_args(root, **kw), dp_rank=dp_rank, dp_size=dp_size, sp_rank=0, sp_size=1, seed=3)
    return torch.cat([b["input_ids"].reshape(-1) for b in _take(loader, n_batches)])


def _doc_tags(tokens: torch.Tensor) -> list[str]:
    text = bytes(t for t in tokens.tolist() if t < 256).decode()
    return [t[:5] for t in text.split("<")[1:] if len(t) >= 6 and t[5] == ">"]


def test_shapes_shift_and_overlap(root):
    loader = build_data_loader(_args(root), dp_rank=0, dp_size=1, sp_rank=0, sp_size=1, seed=0)
    b1, b2 = _take(loader, 2)
    assert b1["input_ids"].shape == b1["labels"].shape == (2, 32) and b1["input_ids"].dtype == torch.long
    assert torch.equal(b1["labels"][:, :-1], b1["input_ids"][:, 1:])
    # Consecutive global sequences overlap by one token: each token is a target exactly once.
    assert b1["labels"][0, -1] == b1["input_ids"][1, 0]
    assert b1["labels"][1, -1] == b2["input_ids"][0, 0]
    assert b1["input_ids"][0, 0] == BOS


@pytest.mark.parametrize("varlen", [False, True])
def test_sp_slices_match_single_rank_with_longer_seq(root, varlen):
    bs = 1 if varlen else 2
    full = build_data_loader(_args(root, seq_len=64, batch_size=bs, varlen=varlen),
                             dp_rank=1, dp_size=2, sp_rank=0, sp_size=1, seed=7)
    parts = [build_data_loader(_args(root, seq_len=16, batch_size=bs, varlen=varlen, prefetch=2),
                               dp_rank=1, dp_size=2, sp_rank=p, sp_size=4, seed=7) for p in range(4)]
    for _ in range(6):
        f = next(full)
        ps = [next(x) for x in parts]
        assert torch.equal(torch.cat([p["input_ids"] for p in ps], 1), f["input_ids"])
        assert torch.equal(torch.cat([p["labels"] for p in ps], 1), f["labels"])
        assert ps[0]["labels"][0, -1] == ps[1]["input_ids"][0, 0]
        if varlen:
            for p in ps:
                assert torch.equal(p["cu_seqlens"], f["cu_seqlens"])
    for x in parts:
        x.close()


def test_cu_seqlens_mark_document_starts(root):
    loader = build_data_loader(_args(root, batch_size=1, varlen=True, seq_len=16),
                               dp_rank=0, dp_size=1, sp_rank=1, sp_size=4, seed=1)
    full = build_data_loader(_args(root, batch_size=1, seq_len=64), dp_rank=0, dp_size=1, sp_rank=0, sp_size=1, seed=1)
    n_multi = 0
    for _ in range(20):
        cu, x = next(loader)["cu_seqlens"], next(full)["input_ids"][0]
        bos = (x == BOS).nonzero().flatten().tolist()
        assert cu.tolist() == sorted({0, *bos, 64})
        n_multi += len(cu) > 2
    assert n_multi > 5  # the check above really saw packed documents


def test_dp_ranks_disjoint_and_cover_epoch(root):
    # Single source of 60 records (even): each DP rank sees its own 30, epoch after epoch.
    seen = [set(_doc_tags(_global_stream(root, r, 2, 40, sources={"a": 1.0}))) for r in range(2)]
    assert seen[0] and seen[1] and not (seen[0] & seen[1])
    assert seen[0] | seen[1] == {f"a{i:04d}" for i in range(60)}


def test_seed_controls_mixture(root):
    a = _global_stream(root, 0, 1, 8)
    assert torch.equal(a, _global_stream(root, 0, 1, 8))
    assert not torch.equal(a, build_data_loader(_args(root), dp_rank=0, dp_size=1, sp_rank=0, sp_size=1,
                                                seed=4).__next__()["input_ids"].reshape(-1)[: len(a)])
    tags = _doc_tags(_global_stream(root, 0, 1, 60))
    frac_a = sum(t[0] == "a" for t in tags) / len(tags)
    assert 0.55 < frac_a < 0.8  # weights 2:1


@pytest.mark.parametrize("prefetch", [0, 2])
def test_exact_resume(root, prefetch, tmp_path):
    def make():
        return build_data_loader(_args(root, prefetch=prefetch, varlen=True, batch_size=1),
                                 dp_rank=1, dp_size=3, sp_rank=1, sp_size=2, seed=5)

    ref = make()
    _take(ref, 37)  # past file, row-group and epoch boundaries of the small sources
    sd = ref.state_dict()
    torch.save(sd, tmp_path / "sd.pt")
    expected = _take(ref, 25)
    resumed = make()
    resumed.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
    for want in expected:
        got = next(resumed)
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert resumed.stats == ref.stats
    # Loading into a loader that already ran ahead also rewinds exactly.
    ref.load_state_dict(sd)
    assert torch.equal(next(ref)["input_ids"], expected[0]["input_ids"])
    ref.close()
    resumed.close()


@pytest.mark.parametrize("change", [dict(dp_size=4), dict(sp_size=4), dict(seq_len=16)])
def test_resume_with_other_layout_is_refused(root, change):
    layout = dict(dp_rank=0, dp_size=2, sp_rank=0, sp_size=2)
    sd = build_data_loader(_args(root), seed=0, **layout).state_dict()
    seq_len = change.pop("seq_len", 32)
    other = build_data_loader(_args(root, seq_len=seq_len), seed=0, **{**layout, **change})
    with pytest.raises(ValueError, match="data-parallel / sequence-parallel layout"):
        other.load_state_dict(sd)


def test_bad_lines_skip_and_error(tmp_path):
    (tmp_path / "s").mkdir()
    lines = ['{"text": "good one"}', '{"text": broken', '["not a dict"]', '{"body": "x"}', '{"text": "good two"}']
    (tmp_path / "s" / "f.jsonl").write_text("\n".join(lines) + "\n")
    args = DataArgs(root_dir=str(tmp_path), sources={"s": 1.0}, seq_len=8, prefetch=0)
    loader = build_data_loader(args, dp_rank=0, dp_size=1, sp_rank=0, sp_size=1, seed=0)
    text = bytes(t for t in torch.cat([next(loader)["input_ids"][0] for _ in range(3)]).tolist() if t < 256)
    assert text.startswith(b"good onegood two")
    assert loader.stats["bad_lines"] == 3
    args.on_bad_line = "error"
    loader = build_data_loader(args, dp_rank=0, dp_size=1, sp_rank=0, sp_size=1, seed=0)
    with pytest.raises(ValueError, match=r"f\.jsonl:2"):
        _take(loader, 3)


@pytest.mark.parametrize("bad", [b'{"text": "caf\xe9 latin-1"}', b'\xff\xfe{"text": "x"}', b'{"text": "\xed\xa0\x80"}',
                                 b'{"text": "lone \\ud800 escape"}'])
def test_line_that_is_not_utf8_is_a_bad_line(tmp_path, caplog, bad):
    """Invalid UTF-8 (latin-1 text, a UTF-16 byte-order mark, an encoded surrogate) or a JSON escape of a
    lone surrogate (no UTF-8 form, so no tokenizer can take it): skipped and counted, or one ValueError
    line naming file:line, like any other bad record."""
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "f.jsonl").write_bytes(b'{"text": "good one"}\n' + bad + b'\n{"text": "good two"}\n')
    args = DataArgs(root_dir=str(tmp_path), sources={"s": 1.0}, seq_len=8, prefetch=0)
    loader = build_data_loader(args, dp_rank=0, dp_size=1, sp_rank=0, sp_size=1, seed=0)
    with caplog.at_level("WARNING"):
        text = bytes(t for t in torch.cat([next(loader)["input_ids"][0] for _ in range(3)]).tolist() if t < 256)
    assert text.startswith(b"good onegood two") and loader.stats["bad_lines"] == 1
    assert "f.jsonl:2" in caplog.text and "UTF-8" in caplog.text
    args.on_bad_line = "error"
    loader = build_data_loader(args, dp_rank=0, dp_size=1, sp_rank=0, sp_size=1, seed=0)
    with pytest.raises(ValueError, match=r"f\.jsonl:2: bad record: not valid UTF-8") as e:
        _take(loader, 3)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("bad", [b'{"text": "x", "n": ' + b"1" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000])
def test_json_failures_other_than_syntax_are_bad_lines(tmp_path, bad):
    """json.loads also fails with errors that are no JSONDecodeError (an int over Python's digit limit,
    nesting deeper than the recursion limit): the same bad-record handling, not a crash."""
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "f.jsonl").write_bytes(b'{"text": "good one"}\n' + bad + b'\n{"text": "good two"}\n')
    args = DataArgs(root_dir=str(tmp_path), sources={"s": 1.0}, seq_len=8, prefetch=0)
    loader = build_data_loader(args, dp_rank=0, dp_size=1, sp_rank=0, sp_size=1, seed=0)
    text = bytes(t for t in torch.cat([next(loader)["input_ids"][0] for _ in range(3)]).tolist() if t < 256)
    assert text.startswith(b"good onegood two") and loader.stats["bad_lines"] == 1
    args.on_bad_line = "error"
    loader = build_data_loader(args, dp_rank=0, dp_size=1, sp_rank=0, sp_size=1, seed=0)
    with pytest.raises(ValueError, match=r"f\.jsonl:2: bad record: invalid JSON") as e:
        _take(loader, 3)
    assert "\n" not in str(e.value)


def test_missing_data_is_one_clear_error(root):
    with pytest.raises(FileNotFoundError) as e:
        build_data_loader(_args(root, sources={"a": 1.0, "nope": 1.0, "zzz": 1.0}),
                          dp_rank=0, dp_size=1, sp_rank=0, sp_size=1, seed=0)
    assert "nope" in str(e.value) and "zzz" in str(e.value) and "/a " not in str(e.value)
    with pytest.raises(FileNotFoundError, match="root_dir"):
        build_data_loader(_args(root / "missing"), dp_rank=0, dp_size=1, sp_rank=0, sp_size=1, seed=0)


def test_builtin_corpus_default_and_varlen_batch_check():
    loader = build_data_loader(DataArgs(seq_len=128, batch_size=2), dp_rank=0, dp_size=2, sp_rank=0, sp_size=1, seed=0)
    b = next(loader)
    assert b["input_ids"].shape == (2, 128) and int(b["input_ids"].max()) < 258
    text = bytes(t for t in b["input_ids"].reshape(-1).tolist() if t < 256).decode(errors="replace")
    assert "statement" in text or "expression" in text or "The" in text
    loader.close()
    with pytest.raises(ValueError, match="batch_size=1"):
        build_data_loader(DataArgs(varlen=True, batch_size=2), dp_rank=0, dp_size=1, sp_rank=0, sp_size=1, seed=0)


def test_source_with_no_data_for_a_rank_fails_loudly(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "f.jsonl").write_text('{"text": "only one"}\n')
    loader = build_data_loader(DataArgs(root_dir=str(tmp_path), seq_len=8, prefetch=0),
                               dp_rank=1, dp_size=2, sp_rank=0, sp_size=1, seed=0)
    with pytest.raises(ValueError, match="no usable document"):
        next(loader)
