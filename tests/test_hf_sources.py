"""Hugging Face `datasets` sources: save_to_disk folders, streamed parquet / jsonl, cached Hub ids.

Token streams are compared exactly (bytes tokenizer: a document is BOS + its UTF-8 bytes + EOS).
"""
import gzip
import io
import json
import random
import shutil
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

datasets = pytest.importorskip("datasets")
datasets.disable_progress_bars()

from lingua_zeco.data import DataArgs, build_data_loader  # noqa: E402
from lingua_zeco.data.permutation import Permutation  # noqa: E402

BOS, EOS = 256, 257


def _docs(tag: str, n: int, seed: int = 0) -> list[str]:
    rng = random.Random(f"{tag}{seed}")
    return [f"<{tag}{i:03d}>" + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(0, 40))) for i in range(n)]


SAVED, STREAM_A, STREAM_B, JSONL, HUB = (_docs(t, n) for t, n in
                                          (("s", 23), ("p", 9), ("q", 8), ("j", 30), ("h", 11)))


@pytest.fixture
def root(tmp_path):
    """saved/: a save_to_disk folder (with a second column); crawl/: a parquet (3 row groups) and a
    jsonl file for streaming; plain/: a jsonl file read directly."""
    r = tmp_path / "data"
    datasets.Dataset.from_dict({"text": SAVED, "n": list(range(len(SAVED)))}).save_to_disk(str(r / "saved"))
    (r / "crawl").mkdir()
    pq.write_table(pa.table({"text": STREAM_A}), r / "crawl" / "0.parquet", row_group_size=4)
    (r / "crawl" / "1.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in STREAM_B))
    (r / "plain").mkdir()
    (r / "plain" / "x.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in JSONL))
    return r


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """An HF_HOME whose datasets cache holds "org/tiny" as load_dataset leaves it on a machine with
    internet: <cache>/org___tiny/<config>/<version>/<hash>/{dataset_info.json, tiny-train.arrow}."""
    from datasets.packaged_modules.json.json import Json

    home = tmp_path / "hf_home"
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps({"text": d}) + "\n" for d in HUB))
    Json(cache_dir=str(tmp_path / "build"), dataset_name="tiny", config_id="default", hash="0123abcd",
         data_files={"train": [str(raw)]}).download_and_prepare()
    (home / "datasets").mkdir(parents=True)
    shutil.move(str(tmp_path / "build" / "tiny"), str(home / "datasets" / "org___tiny"))
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    return home


@pytest.fixture
def no_network(monkeypatch):
    """Record (and refuse) every attempt to open a connection."""
    attempts = []

    def refuse(*a, **k):
        attempts.append(a)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def _loader(root, sources, *, seed=0, dp_rank=0, dp_size=1, seq_len=16, batch_size=2, **kw):
    args = DataArgs(root_dir=str(root) if root else None, sources=sources, seq_len=seq_len,
                    batch_size=batch_size, prefetch=kw.pop("prefetch", 0), **kw)
    return build_data_loader(args, dp_rank=dp_rank, dp_size=dp_size, sp_rank=0, sp_size=1, seed=seed)


def _tokens(loader, n_batches) -> list[int]:
    """The token stream: consecutive global sequences share one token, so the inputs tile it."""
    return torch.cat([next(loader)["input_ids"].reshape(-1) for _ in range(n_batches)]).tolist()


def _encode(docs) -> list[int]:
    return [t for d in docs for t in [BOS, *d.encode(), EOS]]


def _decode(tokens) -> list[str]:
    """Whole documents in a token stream (a trailing cut-off one is dropped)."""
    out, cur = [], None
    for t in tokens:
        if t == BOS:
            cur = []
        elif t == EOS and cur is not None:
            out.append(bytes(cur).decode())
            cur = None
        elif cur is not None:
            cur.append(t)
    return out


def _n_batches(docs, seq_len=16, batch_size=2) -> int:
    return len(_encode(docs)) // (seq_len * batch_size)


# -- each kind yields its documents ------------------------------------------------------------------

def test_saved_dataset_in_stored_order_without_shuffle(root):
    n = _n_batches(SAVED * 2)
    got = _tokens(_loader(root, {"saved": 1.0}, shuffle_files=False), n)
    assert got == _encode(SAVED * 2)[:len(got)]  # two epochs, in order


def test_saved_dataset_shuffled_per_epoch(root):
    got = _decode(_tokens(_loader(root, {"saved": 1.0}), _n_batches(SAVED * 3)))
    epochs = [got[i * len(SAVED):(i + 1) * len(SAVED)] for i in range(2)]
    for e in epochs:
        assert sorted(e) == sorted(SAVED)  # every row exactly once per epoch
        assert e != SAVED
    assert epochs[0] != epochs[1]  # a new order each epoch


def test_stream_folder_reads_parquet_and_jsonl_through_datasets(root):
    got = _tokens(_loader(root, {"stream:crawl": 1.0}, shuffle_files=False), _n_batches((STREAM_A + STREAM_B) * 2))
    assert got == _encode((STREAM_A + STREAM_B) * 2)[:len(got)]  # files sorted by name, rows in order


def test_stream_reads_gzipped_jsonl(tmp_path):
    (tmp_path / "gz").mkdir()
    with gzip.open(tmp_path / "gz" / "a.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in STREAM_B)
    got = _tokens(_loader(tmp_path, {"stream:gz": 1.0}), _n_batches(STREAM_B))
    assert got == _encode(STREAM_B)[:len(got)]


def test_stream_files_shuffled_per_epoch(root):
    got = _decode(_tokens(_loader(root, {"stream:crawl": 1.0}, seed=1), _n_batches((STREAM_A + STREAM_B) * 6)))
    orders = {tuple(got[i * 17:(i + 1) * 17]) for i in range(5)}
    assert orders == {tuple(STREAM_A + STREAM_B), tuple(STREAM_B + STREAM_A)}


def test_hub_id_from_the_local_cache(root, hf_home, no_network):
    got = _tokens(_loader(None, {"hf:org/tiny": 1.0}, shuffle_files=False), _n_batches(HUB))
    assert got == _encode(HUB)[:len(got)]
    assert not no_network
    import datasets.config
    import huggingface_hub.constants

    assert not datasets.config.HF_HUB_OFFLINE and not huggingface_hub.constants.HF_HUB_OFFLINE  # restored


def test_hub_id_not_cached_is_one_clear_error_without_network(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty_hf_home"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    with pytest.raises(FileNotFoundError) as e:
        _loader(None, {"hf:org/missing?config=en": 1.0})
    msg = str(e.value)
    assert "'org/missing'" in msg and "config en" in msg and "never downloads" in msg and "save_to_disk" in msg
    assert str(tmp_path / "empty_hf_home") in msg
    assert not no_network


def test_per_source_options(root, tmp_path):
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"body": ["x" * 5]}),
        "validation": datasets.Dataset.from_dict({"body": SAVED}),
    }).save_to_disk(str(root / "dd"))
    got = _tokens(_loader(root, {"dd?split=validation&text_key=body": 1.0}, shuffle_files=False), 2)
    assert got == _encode(SAVED)[:len(got)]
    with pytest.raises(ValueError, match="no column 'body'"):
        _loader(root, {"saved?text_key=body": 1.0})
    with pytest.raises(ValueError, match=r"splits \['train', 'validation'\], not 'test'"):
        _loader(root, {"dd?split=test": 1.0})
    with pytest.raises(ValueError, match=r"option\(s\) \['split'\] do not apply to a stream source"):
        _loader(root, {"stream:crawl?split=train": 1.0})
    with pytest.raises(ValueError, match="Hub dataset id"):
        _loader(root, {"hf:/abs/path": 1.0})


def test_missing_stream_folder_is_listed_with_the_others(root):
    with pytest.raises(FileNotFoundError, match=r"(?s)nothere \(missing; no .jsonl.*crawl2 \(missing; no .parquet"):
        _loader(root, {"stream:crawl2": 1.0, "nothere": 1.0, "saved": 1.0})


# -- mixing, determinism, DP split -------------------------------------------------------------------

def test_hf_and_jsonl_sources_mix_by_weight(root):
    shares = []
    for w_saved, w_plain in ((1.0, 3.0), (3.0, 1.0)):
        got = _decode(_tokens(_loader(root, {"saved": w_saved, "plain": w_plain}, shuffle_files=False), 200))
        saved = [d for d in got if d.startswith("<s")]
        plain = [d for d in got if d.startswith("<j")]
        assert len(saved) + len(plain) == len(got) > 200
        assert saved == (SAVED * 12)[:len(saved)] and plain == (JSONL * 12)[:len(plain)]  # each in its own order
        shares.append(len(saved) / len(got))
    assert shares[0] < 0.35 and shares[1] > 0.65  # about 1/4 and 3/4


def test_same_seed_same_batches_other_seed_other_batches(root):
    sources = {"saved": 1.0, "stream:crawl": 1.0, "plain": 1.0}
    a, b, c = (_tokens(_loader(root, sources, seed=s), 30) for s in (5, 5, 6))
    assert a == b and a != c


@pytest.mark.parametrize("source", ["saved", "stream:crawl"])
def test_dp_ranks_read_disjoint_rows_covering_the_epoch(root, source):
    docs = SAVED if source == "saved" else STREAM_A + STREAM_B
    per_rank = [_decode(_tokens(_loader(root, {source: 1.0}, dp_rank=r, dp_size=3, seed=2), 10))[:len(docs) // 3]
                for r in range(3)]
    seen = [d for part in per_rank for d in part]
    assert len(set(seen)) == len(seen) == 3 * (len(docs) // 3) and set(seen) <= set(docs)


# -- exact resume ------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("sources", [{"saved": 1.0}, {"stream:crawl": 1.0},
                                     {"saved": 1.0, "stream:crawl": 2.0, "plain": 1.0}])
def test_exact_resume(root, sources, prefetch):
    kw = dict(dp_rank=1, dp_size=2, seed=4, prefetch=prefetch)
    first = _loader(root, sources, **kw)
    for cut in (3, 7):  # the second cut falls after a file / row-group / epoch boundary
        _tokens(first, cut - (3 if cut == 7 else 0))
        buf = io.BytesIO()
        torch.save(first.state_dict(), buf)
        buf.seek(0)
        second = _loader(root, sources, **kw)
        second.load_state_dict(torch.load(buf, weights_only=True))
        assert _tokens(second, 12) == _tokens(first, 12)
        second.close()
    assert first.epoch >= 1  # the batches compared ran past the end of an epoch
    first.close()


def test_resume_refuses_a_dataset_of_another_size(root):
    state = _loader(root, {"saved": 1.0}).state_dict()
    shutil.rmtree(root / "saved")
    datasets.Dataset.from_dict({"text": SAVED[:-1]}).save_to_disk(str(root / "saved"))
    with pytest.raises(ValueError, match="had 23 rows when the state was saved and has 22 now"):
        _loader(root, {"saved": 1.0}).load_state_dict(state)


# -- bad rows ----------------------------------------------------------------------------------------

def test_bad_rows_are_counted_exactly(root):
    datasets.Dataset.from_dict({"text": ["<aa>", None, "<b>", None, None]}).save_to_disk(str(root / "nulls"))
    (root / "odd").mkdir()
    (root / "odd" / "x.jsonl").write_text('{"text": "<ok>"}\n{"id": 1}\n{"text": 5}\n{"text": "<fine>"}\n')
    # A global sequence is 6 tokens: exactly the first document; the second reads past the bad rows.
    for source, docs, bad in (("nulls", ["<aa>", "<b>"], 1), ("stream:odd", ["<ok>", "<fine>"], 2)):
        loader = _loader(root, {source: 1.0}, shuffle_files=False, seq_len=5, batch_size=1)
        first = _tokens(loader, 1)
        assert loader.stats["bad_lines"] == 0
        assert first + _tokens(loader, 1) == _encode(docs)[:10]
        assert loader.stats["bad_lines"] == bad


def test_bad_row_with_on_bad_line_error_names_it(root):
    datasets.Dataset.from_dict({"text": ["<a>", None]}).save_to_disk(str(root / "nulls"))
    (root / "odd").mkdir()
    (root / "odd" / "x.jsonl").write_text('{"text": "<ok>"}\n{"id": 1}\n{"text": 5}\n{"text": "<fine>"}\n')
    with pytest.raises(ValueError, match=r"nulls row 1: bad record: 'text' is missing"):
        _tokens(_loader(root, {"nulls": 1.0}, shuffle_files=False, on_bad_line="error"), 2)
    with pytest.raises(ValueError, match=r"x.jsonl:row 2: bad record: 'text' is missing"):
        _tokens(_loader(root, {"stream:odd": 1.0}, on_bad_line="error"), 2)
    # DP rank 0 of 2 owns rows 1 and 3 only: the missing field on row 2 is rank 1's to report.
    with pytest.raises(ValueError, match=r"x.jsonl:row 3: bad record: 'text' is int, not a string"):
        _tokens(_loader(root, {"stream:odd": 1.0}, on_bad_line="error", dp_rank=0, dp_size=2), 2)


def test_source_with_no_usable_row_fails_loudly(root):
    features = datasets.Features({"text": datasets.Value("string")})
    datasets.Dataset.from_dict({"text": [None, None]}, features=features).save_to_disk(str(root / "empty"))
    with pytest.raises(ValueError, match="'empty' has no usable document for data-parallel rank 0"):
        _tokens(_loader(root, {"empty": 1.0}), 1)
    datasets.Dataset.from_dict({"text": [1, 2]}).save_to_disk(str(root / "ints"))
    with pytest.raises(ValueError, match="column 'text' holds Value.'int64'., not strings"):
        _loader(root, {"ints": 1.0})


# -- the permutation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_permutation_is_a_seeded_bijection(n):
    p = Permutation(n, "key")
    assert sorted(p[i] for i in range(n)) == list(range(n))
    if n >= 7:
        assert [p[i] for i in range(n)] != list(range(n))
        assert [p[i] for i in range(n)] != [Permutation(n, "other")[i] for i in range(n)]


# -- evaluation --------------------------------------------------------------------------------------

def test_evaluation_sees_hf_sources(root):
    from lingua_zeco.evaluation import EvalArgs, validation_data_args

    with pytest.raises(FileNotFoundError, match="set eval.root_dir"):
        validation_data_args(DataArgs(sources={"hf:org/tiny": 1.0}), EvalArgs(every=1))
    train = DataArgs(root_dir=str(root), sources={"saved": 1.0})
    with pytest.raises(ValueError, match="overlaps the training data"):  # the same .arrow file
        validation_data_args(train, EvalArgs(every=1, root_dir=str(root / "saved")))
    datasets.Dataset.from_dict({"text": JSONL}).save_to_disk(str(root / "held_out"))
    valid = validation_data_args(train, EvalArgs(every=1, root_dir=str(root / "held_out")))
    got = _decode(_tokens(build_data_loader(valid, dp_rank=0, dp_size=1, sp_rank=0, sp_size=1, seed=0), 4))
    assert got and set(got) <= set(JSONL)  # a save_to_disk folder as eval.root_dir
