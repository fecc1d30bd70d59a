import base64

import pytest

from lingua_zeco.tokenizer import TokenizerArgs, build_tokenizer

TEXT = "Héllo, wörld! The thing is 12345 — ünïcode ✓"


def test_bytes_round_trip_and_specials():
    tok = build_tokenizer(TokenizerArgs())
    assert tok.n_words >= 258 and {tok.bos_id, tok.eos_id} == {256, 257}
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert len(ids) == len(TEXT.encode("utf-8")) + 2
    assert all(0 <= i < tok.n_words for i in ids)
    assert tok.decode(ids) == TEXT
    assert tok.encode("ab", add_bos=False, add_eos=False) == [97, 98]


@pytest.mark.parametrize("name", ["sp", "tiktoken"])
def test_missing_model_file_is_one_clear_error(name, tmp_path):
    missing = str(tmp_path / "nope.model")
    with pytest.raises(FileNotFoundError, match="nope.model"):
        build_tokenizer(TokenizerArgs(name=name, path=missing))
    with pytest.raises(FileNotFoundError, match="tokenizer.path"):
        build_tokenizer(TokenizerArgs(name=name, path=None))


def test_unknown_name():
    with pytest.raises(ValueError, match="expected"):
        build_tokenizer(TokenizerArgs(name="gpt9"))


def _write_bpe(path):
    # All 256 bytes, then merges "t"+"h" -> "th", "th"+"e" -> "the", " "+"the" -> " the".
    tokens = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))


def test_tiktoken_from_local_file(tmp_path):
    p = tmp_path / "tiny.tiktoken"
    _write_bpe(p)
    tok = build_tokenizer(TokenizerArgs(name="tiktoken", path=str(p)))
    assert tok.n_words == 259 + 2 and (tok.bos_id, tok.eos_id) == (259, 260)
    ids = tok.encode("the the", add_bos=True, add_eos=True)
    assert ids == [259, 257, 258, 260]  # merges applied: "the", " the"
    assert tok.decode(tok.encode(TEXT)) == TEXT
    # A literal special-token string in the text is ordinary text, not a control id.
    assert tok.eos_id not in tok.encode("<|end_of_text|>", add_eos=False)


def test_tiktoken_bad_file_names_line(tmp_path):
    p = tmp_path / "bad.tiktoken"
    p.write_text("YQ== 0\nnot-a-valid-line\n")
    with pytest.raises(ValueError, match="bad.tiktoken:2"):
        build_tokenizer(TokenizerArgs(name="tiktoken", path=str(p)))


def test_sentencepiece_from_local_file(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    from pydoc_data.topics import topics

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(v for _, v in sorted(topics.items()))[:200_000])
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "m"), vocab_size=400,
        model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2,
    )
    tok = build_tokenizer(TokenizerArgs(name="sp", path=str(tmp_path / "m.model")))
    assert tok.n_words == 400 and (tok.bos_id, tok.eos_id) == (1, 2)
    ids = tok.encode("The for statement is used to iterate")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) < 30
    assert tok.decode(ids) == "The for statement is used to iterate"
