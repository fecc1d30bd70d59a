"""distributed.meta_init (lingua_zeco/meta_init.py): the model built on the meta device, sharded, then
allocated and initialised holds bit for bit the weights of the full-model path (init on every rank, then
sharding), on 1 rank and on 2 gloo ranks (FSDP over dp, FSDP over sp, no FSDP), tied embeddings included.
The vocabulary (65 rows) does not split evenly over 2 ranks: FSDP2's padded last shard is covered."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor import DTensor

from apps.gla.train import TrainArgs, build_model
from lingua_zeco import distributed
from lingua_zeco.args import parse_args
from local_ranks import run_on_ranks

TINY = ["config=debug.yaml", "model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.ffn_hidden=64",
        "model.vocab_size=65"]


def _weights(model) -> dict:
    """name -> (the full tensor, this rank's local part), tied parameters once."""
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = (full.detach().clone(), local.detach().clone())
    return out


def _compare(extra: list[str]) -> dict:
    """Both paths on this rank's group: names whose full or local weights differ, and the tying kept."""
    args = parse_args(TrainArgs, [*TINY, *extra])
    env = distributed.setup(args.distributed)
    try:
        built = {}
        for meta in (False, True):
            torch.manual_seed(args.seed)  # as the trainer does before build_model
            run_args = dataclasses.replace(args, distributed=dataclasses.replace(args.distributed, meta_init=meta))
            model = build_model(run_args, env)
            assert not any(p.is_meta for p in model.parameters())
            tied = model.lm_head.weight is model.model.embeddings.weight
            built[meta] = (_weights(model), tied, [type(p).__name__ for p in model.parameters()])
        (old, old_tied, old_types), (new, new_tied, new_types) = built[False], built[True]
        return dict(names=(list(old), list(new)), tied=(old_tied, new_tied), types=(old_types, new_types),
                    differ=[n for n in old if n not in new or not (torch.equal(old[n][0], new[n][0])
                                                               and torch.equal(old[n][1], new[n][1]))],
                    n_params=len(old))
    finally:
        distributed.teardown(env)


def _check(res: dict, tied: bool) -> None:
    assert res["names"][0] == res["names"][1] and res["types"][0] == res["types"][1], res
    assert res["n_params"] > 5 and res["differ"] == [], res["differ"]
    assert res["tied"] == (tied, tied)


@pytest.mark.parametrize("extra", [["distributed.fsdp=true"], ["distributed.fsdp=true", "model.tie_embeddings=true"],
                                   ["distributed.fsdp=false"],
                                   ["distributed.fsdp=false", "model.tie_embeddings=true"],
                                   ["distributed.fsdp=true", "model.float8=tensorwise"],
                                   ["distributed.fsdp=true", "model.softmax_layers=[1]"]])
def test_one_rank_meta_init_gives_the_same_weights(extra):
    _check(_compare(extra), tied="model.tie_embeddings=true" in extra)


def _on_rank(rank, world, cases):
    torch.set_num_threads(1)
    return [_compare(extra) for extra in cases]


def test_two_ranks_fsdp_over_dp_and_sp_and_no_fsdp_same_weights():
    cases = [["distributed.fsdp=true", "distributed.sp_size=1", "distributed.sp_method=none"],
             ["distributed.fsdp=true", "distributed.sp_size=2", "model.tie_embeddings=true"],
             ["distributed.fsdp=true", "distributed.sp_size=2"],
             ["distributed.fsdp=false", "distributed.sp_size=1", "distributed.sp_method=none",
              "model.tie_embeddings=true"]]
    for rank_results in run_on_ranks(_on_rank, 2, cases):
        for extra, res in zip(cases, rank_results, strict=True):
            _check(res, tied="model.tie_embeddings=true" in extra)


def test_a_meta_init_run_trains_as_the_full_model_run(tmp_path):
    from apps.gla.train import train

    base = [*TINY, "model.vocab_size=259", "steps=3", "logging.freq=1", "data.batch_size=1", "data.seq_len=32",
            "data.prefetch=0", "checkpoint.dump.every=0"]
    losses = [train(parse_args(TrainArgs, [*base, f"dump_dir={tmp_path / str(meta)}",
                                           f"distributed.meta_init={meta}"]))["losses"] for meta in (False, True)]
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_one_process_trains_the_plain_module_by_default_with_fsdps_losses(tmp_path, caplog):
    """distributed.fsdp=auto on one process: the decision in the log, config.yaml keeps auto, and the same
    losses as FSDP over that one rank (a run may resume under either)."""
    from apps.gla.train import train

    base = [*TINY, "model.vocab_size=259", "steps=3", "logging.freq=1", "data.batch_size=1", "data.seq_len=32",
            "data.prefetch=0", "checkpoint.dump.every=0"]
    with caplog.at_level("INFO", logger="train"):
        auto = train(parse_args(TrainArgs, [*base, f"dump_dir={tmp_path / 'auto'}"]))
    assert "distributed.fsdp=false (auto: one process" in caplog.text
    assert "fsdp: null" in (tmp_path / "auto" / "config.yaml").read_text()
    sharded = train(parse_args(TrainArgs, [*base, f"dump_dir={tmp_path / 'fsdp'}", "distributed.fsdp=true"]))
    assert len(auto["losses"]) == 3 and auto["losses"] == sharded["losses"]
