"""checkpoint.init_ckpt_path=<Hugging Face folder> (apps/gla/hf_import.py): the model's keys come from config.json,
the weights from safetensors; our own exports come back bit for bit, fla's folders (written by fla's
save_pretrained) give fla's logits and train; a key that disagrees with the folder is one error line."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from apps.gla import export_hf, hf_import
from apps.gla.hf_format import from_fla
from apps.gla.model import GLAArgs, GLAForCausalLM
from apps.gla.train import Trainer, TrainArgs, build_model, train
from fla_cpu import fla_model_on_cpu
from lingua_zeco import distributed, evaluation
from lingua_zeco.args import ConfigError, parse_args
from lingua_zeco.data import build_data_loader
from local_ranks import run_on_ranks
from test_entry_points import assert_one_error_line, run_cases

RUN = ["data.seq_len=32", "data.batch_size=2", "data.prefetch=0", "logging.freq=1", "checkpoint.dump.every=0"]


def _fla_folder(path, kind="gla", **overrides):
    """fla's own model (tiny, random weights moved off fla's init so that a mix-up shows) saved by fla."""
    models = export_hf.fla_models()
    torch.manual_seed(0)
    common = dict(hidden_size=32, num_hidden_layers=2, num_heads=2, vocab_size=258)
    if kind == "gla":
        model = models.GLAForCausalLM(models.GLAConfig(**common, **overrides))
    else:
        cfg = dict(head_dim=16, expand_v=2.0, use_short_conv=False, **common)
        model = models.GatedDeltaNetForCausalLM(models.GatedDeltaNetConfig(**{**cfg, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return model.eval()


def _args(tmp_path, folder, *extra) -> TrainArgs:
    return parse_args(TrainArgs, [f"dump_dir={tmp_path / 'run'}", f"checkpoint.init_ckpt_path={folder}", *RUN, *extra])


def _loaded(folder, *extra) -> GLAForCausalLM:
    """Our model as the trainer shapes it from the folder, with the folder's weights (no process group)."""
    args = hf_import.resolve(parse_args(TrainArgs, [f"checkpoint.init_ckpt_path={folder}", *extra]))
    model = GLAForCausalLM(args.model)
    hf_import.load_hf(str(folder), model)
    return model.eval()


@pytest.mark.parametrize("variant", ["gla", "gated_deltanet"])
def test_an_export_starts_training_with_the_same_logits_bit_for_bit(tmp_path, variant):
    ours = GLAForCausalLM(GLAArgs(dim=32, n_layers=2, n_heads=2, ffn_hidden=64, vocab_size=258, attn_variant=variant))
    ours.init_weights(5)
    with torch.no_grad():
        for p in ours.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.3)
    out = export_hf.export(ours, str(tmp_path / "hf"), dtype="fp32")
    args = hf_import.resolve(_args(tmp_path, out, "steps=1", "model.n_heads=2",  # a given key that agrees is fine
                                             "distributed.fsdp=true"))
    assert (args.model.dim, args.model.ffn_hidden, args.model.attn_variant) == (32, 64, variant)
    env = distributed.setup(args.distributed, args.model.gla_options())
    try:
        trainer = Trainer(args, env)  # FSDP over this one rank: the weights land in DTensor shards
        assert isinstance(trainer.model.lm_head.weight, DTensor)
        x = torch.randint(0, 258, (2, 40))
        with torch.no_grad():
            assert torch.equal(trainer.model(x), ours.eval()(x))
        trainer.metrics.close()
        trainer.data.close()
    finally:
        distributed.teardown(env)


def _first_batch(args: TrainArgs) -> dict:
    """The trainer's first batch on one rank (the same loader, the same seed)."""
    data = build_data_loader(evaluation.training_data_args(args.data, args.eval), dp_rank=0, dp_size=1, sp_rank=0,
                             sp_size=1, seed=args.seed, segment_len=0)
    try:
        return next(data)
    finally:
        data.close()


def test_an_fla_folder_trains_from_fla_s_loss(tmp_path, monkeypatch):
    fla = _fla_folder(tmp_path / "fla")
    args = _args(tmp_path, tmp_path / "fla", "steps=3", "optim.warmup=1", "optim.lr=1e-2")
    out = train(args)
    assert out["step"] == 3 and sorted(out["losses"]) == [1, 2, 3]
    batch = _first_batch(hf_import.resolve(args))
    ids, labels = batch["input_ids"], batch["labels"]
    with torch.no_grad():
        loss_sum, n = _loaded(tmp_path / "fla")(ids, labels=labels)
        logits = fla_model_on_cpu(fla, monkeypatch)(ids).logits
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).item()
    assert out["losses"][1] == pytest.approx(loss_sum.item() / n.item(), rel=1e-6)  # our model, loaded alike
    assert out["losses"][1] == pytest.approx(ce, rel=1e-5)  # fla's own model on the same batch
    assert all(torch.isfinite(torch.tensor(v)) for v in out["losses"].values())
    saved = (tmp_path / "run" / "config.yaml").read_text()  # the run records the shape it took
    assert "dim: 32" in saved and "expand_k: 0.5" in saved and "ffn_hidden: 256" in saved


@pytest.mark.parametrize("kind,overrides,want", [
    ("gla", {}, {"attn_variant": "gla", "expand_k": 0.5, "expand_v": 1.0, "ffn_hidden": 256}),
    # fla without its fused norm-and-gate: the output norm is named g_norm there
    ("gla", {"fuse_norm": False, "tie_word_embeddings": True, "intermediate_size": 96}, {"tie_embeddings": True}),
    ("gated_deltanet", {"tie_word_embeddings": True}, {"attn_variant": "gated_deltanet", "expand_v": 2.0}),
])
def test_fla_folders_map_to_this_model_with_fla_s_logits(tmp_path, monkeypatch, kind, overrides, want):
    fla = fla_model_on_cpu(_fla_folder(tmp_path, kind, **overrides), monkeypatch)
    for layer in fla.model.layers:  # fla's unfused output gate is a Triton swish
        if getattr(layer.attn, "fuse_norm_and_gate", True) is False:
            monkeypatch.setattr(layer.attn, "gate_fn", F.silu)
    model = _loaded(tmp_path)
    for key, value in want.items():
        assert getattr(model.args, key) == value, key
    x = torch.randint(0, 258, (2, 80))
    with torch.no_grad():
        got, ref = model(x), fla(x).logits
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        model.model.layers[1].mlp_norm.weight.add_(0.5)  # the comparison can fail
        assert (model(x) - ref).abs().max() > 1e-3


def _config_only(path, kind="gla", **overrides):
    models = export_hf.fla_models()
    cls = models.GLAConfig if kind == "gla" else models.GatedDeltaNetConfig
    cls(hidden_size=32, num_hidden_layers=2, num_heads=2, vocab_size=258, **overrides).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("kind,overrides,match", [
    ("gated_deltanet", {}, "use_short_conv=true cannot be trained by this model"),  # fla's default for GDN
    ("gated_deltanet", {"use_short_conv": False, "allow_neg_eigval": True}, "allow_neg_eigval=true"),
    ("gla", {"feature_map": "relu"}, 'feature_map="relu"'),
    ("gla", {"use_gv": True}, "use_gv=true cannot be trained by this model"),
    ("gla", {"attn": {"layers": [1], "num_heads": 2, "qkv_bias": True}}, "qkv bias"),
])
def test_fla_options_this_model_lacks_are_named(tmp_path, kind, overrides, match):
    folder = _config_only(tmp_path / "hf", kind, **overrides)
    with pytest.raises(ConfigError, match=match):
        hf_import.resolve(_args(tmp_path, folder))


def test_given_keys_must_agree_and_the_rest_is_filled_in(tmp_path):
    folder = _config_only(tmp_path / "hf", attn={"layers": [1], "num_heads": 2, "window_size": 16})
    args = hf_import.resolve(_args(tmp_path, folder, "model.vocab_size=0", "model.ffn_hidden=0", "model.dim=32"))
    assert (args.model.vocab_size, args.model.ffn_hidden, args.model.n_layers) == (258, 256, 2)
    assert (args.model.softmax_layers, args.model.softmax_window) == ([1], 16)
    assert hf_import.resolve(args) == args  # resolving twice (the trainer does) changes nothing
    # a key given with its default value still counts as given
    with pytest.raises(ConfigError, match=r"model.expand_k=1.0 is set, but .*config.json makes it 0.5"):
        hf_import.resolve(_args(tmp_path, folder, "model.expand_k=1.0"))
    with pytest.raises(ConfigError, match=r"model.softmax_layers=\[\] is set"):
        hf_import.resolve(_args(tmp_path, folder, "model.softmax_layers=[]"))
    # built in code (no record of what was given): a value other than the default counts as given
    coded = dataclasses.replace(TrainArgs(), checkpoint=dataclasses.replace(TrainArgs().checkpoint,
                                                                            init_ckpt_path=str(folder)))
    assert hf_import.resolve(coded).model.dim == 32
    with pytest.raises(ConfigError, match="model.n_layers=3"):
        hf_import.resolve(dataclasses.replace(coded, model=dataclasses.replace(coded.model, n_layers=3)))


def test_the_folder_s_tokenizer_is_used_unless_one_is_set(tmp_path):
    folder = _config_only(tmp_path / "hf")
    (folder / "tokenizer.tiktoken").write_text("")  # found by name; never read here
    assert hf_import.resolve(_args(tmp_path, folder)).data.tokenizer.path == str(folder / "tokenizer.tiktoken")
    assert hf_import.resolve(_args(tmp_path, folder, "data.tokenizer.name=bytes")).data.tokenizer.name == "bytes"
    (folder / "tokenizer.tiktoken").unlink()
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="tokenizer.json, which lingua_zeco.tokenizer does not read"):
        hf_import.resolve(_args(tmp_path, folder))
    meta = {"tokenizer": {"name": "sp", "file": "../elsewhere.model"}}
    (folder / export_hf.META).write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="not a file of that folder"):
        hf_import.resolve(_args(tmp_path, folder))
    (folder / export_hf.META).unlink()
    (folder / "tokenizer.json").unlink()
    (tmp_path / "elsewhere.model").write_text("")
    (folder / "tokenizer.model").symlink_to(tmp_path / "elsewhere.model")  # neither read nor taken for absent
    with pytest.raises(ConfigError, match="tokenizer.model is a link out of its folder"):
        hf_import.resolve(_args(tmp_path, folder))


def test_shards_load_and_weights_that_do_not_fit_or_stray_shards_are_refused(tmp_path):
    from safetensors.torch import save_file

    fla = _fla_folder(tmp_path / "hf")
    fla.save_pretrained(str(tmp_path / "shards"), max_shard_size="40KB")
    assert len(list((tmp_path / "shards").glob("model-*.safetensors"))) > 1
    want = _loaded(tmp_path / "hf").state_dict()
    got = _loaded(tmp_path / "shards").state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    model = GLAForCausalLM(hf_import.resolve(_args(tmp_path, tmp_path / "hf")).model)
    wrong = {k: torch.zeros(3) if k.endswith("mlp_norm.weight") else v for k, v in model.state_dict().items()}
    save_file({k: v.contiguous() for k, v in wrong.items()}, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"do not fit .*mlp_norm.weight: folder \[3\], model \[32\]"):
        hf_import.load_hf(str(tmp_path / "hf"), model)
    (tmp_path / "hf" / "model.safetensors").unlink()
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    with pytest.raises(ConfigError, match="not a .safetensors file of that folder"):
        hf_import.load_hf(str(tmp_path / "hf"), model)


def _hub_snapshot(folder, cache):
    """`folder` laid out as the Hugging Face hub cache keeps a download: the files in blobs/, the snapshot links."""
    repo = cache / "models--org--gla"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(folder.iterdir())):
        f.rename(repo / "blobs" / f"{i:040x}")
        (snapshot / f.name).symlink_to(f"../../blobs/{i:040x}")
    return snapshot


def test_a_hub_cache_snapshot_is_read_in_place_and_links_elsewhere_are_not(tmp_path):
    _fla_folder(tmp_path / "hf")
    want = _loaded(tmp_path / "hf").state_dict()
    snapshot = _hub_snapshot(tmp_path / "hf", tmp_path / "cache")
    assert hf_import.is_hf_folder(str(snapshot))
    got = _loaded(snapshot).state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    (tmp_path / "cache" / "models--org--gla" / "elsewhere").write_text("")  # in the repo, not among its blobs
    (snapshot / "tokenizer.model").symlink_to("../../elsewhere")
    with pytest.raises(ConfigError, match="tokenizer.model is a link out of its folder"):
        hf_import.resolve(_args(tmp_path, snapshot))
    plain = tmp_path / "not_hub" / "snapshots" / "0123abcd"  # the same layout outside a models--* folder
    (tmp_path / "cache" / "models--org--gla").rename(tmp_path / "not_hub")
    with pytest.raises(ConfigError, match="config.json is a link out of its folder"):
        hf_import.resolve(_args(tmp_path, plain))


def test_a_disagreeing_key_or_an_unreadable_tokenizer_is_one_error_line(tmp_path):
    _fla_folder(tmp_path / "fla")
    (_config_only(tmp_path / "tok") / "tokenizer.json").write_text("{}")
    (tmp_path / "plain.yaml").write_text("steps: 1\n")  # no model or tokenizer keys: all from the folder
    run, init = f"dump_dir={tmp_path / 'run'}", "checkpoint.init_ckpt_path="
    (code, err), (code2, err2) = run_cases([
        ("apps.gla.train", ["config=debug.yaml", run, f"{init}{tmp_path / 'fla'}", "model.dim=64"]),
        ("apps.gla.train", [f"config={tmp_path / 'plain.yaml'}", run, f"{init}{tmp_path / 'tok'}"])])
    assert_one_error_line(code, err, "model.dim=64 is set, but checkpoint.init_ckpt_path's")
    assert "makes it 32" in err and "remove model.dim" in err
    assert_one_error_line(code2, err2, "tokenizer.json, which lingua_zeco.tokenizer does not read; set data.tokenizer")
    assert not (tmp_path / "run").exists()  # refused before any file is made


def _full_weights_match(folder, extra):
    from safetensors.torch import load_file

    args = hf_import.resolve(parse_args(TrainArgs, ["config=debug.yaml", "model.dim=32", "model.n_layers=2",
                                                    "model.n_heads=2", "model.ffn_hidden=256", "model.vocab_size=0",
                                                    f"checkpoint.init_ckpt_path={folder}", *extra]))
    env = distributed.setup(args.distributed)
    try:
        model = build_model(args, env)
        hf_import.load_hf(folder, model)
        want = from_fla(load_file(f"{folder}/model.safetensors"), hf_import.read_config(folder))
        full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.state_dict().items()}
        return sorted(n for n in full if not torch.equal(full[n], want[n])), len(full)
    finally:
        distributed.teardown(env)


def _rank_zero_fails(folder):
    """Rank 0's read failing in a way no check foresaw: every rank stops with it, none waits for rank 0."""
    def no_memory(*_):
        raise MemoryError("no room")

    model = GLAForCausalLM(hf_import.resolve(parse_args(TrainArgs, [f"checkpoint.init_ckpt_path={folder}"])).model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_import, "read_weights", no_memory)
        try:
            hf_import.load_hf(folder, model)
        except (MemoryError, RuntimeError) as e:
            return type(e).__name__, str(e)
    return None


def _on_rank(rank, world, folder, cases):
    torch.set_num_threads(1)
    return [_full_weights_match(folder, extra) for extra in cases], _rank_zero_fails(folder)


def test_two_ranks_load_the_folder_into_their_shards(tmp_path):
    """FSDP over dp, FSDP over sp (tied head), no FSDP: rank 0 reads, every rank holds the folder's weights;
    a failed read stops every rank."""
    _fla_folder(tmp_path / "hf", tie_word_embeddings=True)
    cases = [["distributed.fsdp=true", "distributed.sp_size=1", "distributed.sp_method=none"],
             ["distributed.fsdp=true", "distributed.sp_size=2"],
             ["distributed.fsdp=false", "distributed.sp_size=1", "distributed.sp_method=none"]]
    got = run_on_ranks(_on_rank, 2, str(tmp_path / "hf"), cases)
    for rank_results, _ in got:
        for extra, (differ, n) in zip(cases, rank_results, strict=True):
            assert differ == [] and n > 10, (extra, differ)
    assert [failed for _, failed in got] == [("MemoryError", "no room"),
                                             ("RuntimeError", f"rank 0 failed to read {tmp_path / 'hf'}: no room")]
