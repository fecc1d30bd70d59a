"""Validation loss by token position: power-of-two buckets of the global position in the sequence, or,
with packed documents, of the position inside the token's document (the model's state restarts at
every document start, so that is the context the token was predicted from).

Bucket b holds positions [0, 1) for b = 0 and [2^(b-1), 2^b) for b >= 1, the last one cut at the
context N = sp_size · seq_len: bit_length(N - 1) + 1 buckets. SP rank p holds positions
[p·seq_len, (p+1)·seq_len) of every sequence (the loader's slice), so its local token t is at
p·seq_len + t. Every rank adds its labelled tokens' loss sum, count and arg-max hits per bucket in
float64; one all-reduce over the world sums them over DP and SP ranks (counts are exact in float64).

The per-token losses come from the model's ordinary forward (`TokenLosses`): it returns only the sum of
its token losses (fused on CUDA: no [tokens, vocab] logits), so while a `TokenLosses` is open, hooks read
the labels passed to the model and its final hidden states and score the labelled rows against the LM
head in chunks; the forward itself (and its SP exchange) stays the one that training runs. The model
must follow fla's layout: `model.model` returns the final hidden states, `model.lm_head` is the output
projection. Under FSDP the root's parameters (lm_head among them) are unsharded while the root's
forward runs, which is when the hook reads them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lingua_zeco.data.mqar import IGNORE_INDEX
from lingua_zeco.kernels.common import acc_dtype, doc_offsets

ROW_CHUNK_ELEMS = 2**26  # logits per chunk (256 MiB in fp32): bounded memory at any vocab size


class TokenLosses:
    """`with TokenLosses(model) as tl: model(x, labels=y); loss_N, hit_N, mask_BT = tl.take()`."""

    def __init__(self, model):
        if not (hasattr(model, "model") and hasattr(model, "lm_head")):
            raise TypeError(f"{type(model).__name__} has no .model / .lm_head (fla layout): cannot score tokens")
        self.model = model
        self._labels = self._last = None
        self._handles = []

    def __enter__(self) -> "TokenLosses":
        self._handles = [self.model.register_forward_pre_hook(self._take_labels, with_kwargs=True),
                         self.model.model.register_forward_hook(self._score)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._labels, self._last = [], None, None

    def _take_labels(self, module, args, kwargs):
        self._labels = kwargs["labels"] if "labels" in kwargs else (args[1] if len(args) > 1 else None)

    @torch.no_grad()
    def _score(self, module, args, h_BTD):
        labels_BT, self._labels = self._labels, None
        if labels_BT is None:
            return
        mask_BT = labels_BT != IGNORE_INDEX
        h_ND, y_N = h_BTD[mask_BT], labels_BT[mask_BT]
        acc = acc_dtype(h_BTD.dtype)  # fp32 at least, fp64 stays fp64
        w_VD = self.model.lm_head.weight.to(acc)
        loss_N = torch.empty(y_N.shape, dtype=torch.float64, device=h_BTD.device)
        hit_N = torch.empty(y_N.shape, dtype=torch.bool, device=h_BTD.device)
        rows = max(1, ROW_CHUNK_ELEMS // w_VD.shape[0])
        with torch.autocast(h_BTD.device.type, enabled=False):  # bf16 autocast would round the logits
            for s in range(0, y_N.numel(), rows):
                logits = h_ND[s:s + rows].to(acc) @ w_VD.t()
                loss_N[s:s + rows] = F.cross_entropy(logits, y_N[s:s + rows], reduction="none")
                hit_N[s:s + rows] = logits.argmax(-1) == y_N[s:s + rows]
        self._last = (loss_N, hit_N, mask_BT)

    def take(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The last forward's (loss_N float64, hit_N bool) of its labelled tokens, in row-major order of
        mask_BT (labels != IGNORE_INDEX)."""
        if self._last is None:
            raise RuntimeError("no forward with labels ran since the last take()")
        out, self._last = self._last, None
        return out


def position_offset(sp_rank: int, seq_len: int) -> int:
    """Global position of this SP rank's first token."""
    return sp_rank * seq_len


def n_buckets(context: int) -> int:
    return max(context - 1, 0).bit_length() + 1


def bucket_bounds(context: int) -> list[tuple[int, int]]:
    """[(lo, hi)] of every bucket: [0, 1), [1, 2), [2, 4), ..., [2^k, context)."""
    return [(0, 1)] + [(1 << (b - 1), min(1 << b, context)) for b in range(1, n_buckets(context))]


def bucket_of(pos: torch.Tensor) -> torch.Tensor:
    """Bucket index of each position: frexp's exponent is bit_length (0 -> 0, [2^(b-1), 2^b) -> b)."""
    return torch.frexp(pos.to(torch.float64)).exponent.long()


class PositionLoss:
    """Per-bucket [loss sum, tokens, arg-max hits] of one evaluation, float64 on the device."""

    def __init__(self, context: int, device):
        self.context = context
        self.sums_3B = torch.zeros(3, n_buckets(context), dtype=torch.float64, device=device)

    def add(self, loss_N: torch.Tensor, hit_N: torch.Tensor, mask_BT: torch.Tensor, offset: int,
            cu_seqlens: torch.Tensor | None = None) -> None:
        """One batch of this rank: loss_N / hit_N of the tokens where mask_BT is set (row-major).
        cu_seqlens: the packed documents' global boundaries (B = 1): positions count from each
        token's document start."""
        T_local = mask_BT.shape[-1]
        if offset + T_local > self.context:
            raise ValueError(f"positions [{offset}, {offset + T_local}) run past the context {self.context}")
        pos_T = (torch.arange(offset, offset + T_local, device=mask_BT.device) if cu_seqlens is None
                 else doc_offsets(cu_seqlens, offset, T_local, mask_BT.device))
        b_N = bucket_of(pos_T.expand_as(mask_BT)[mask_BT])
        self.sums_3B[0].index_add_(0, b_N, loss_N.to(torch.float64))
        self.sums_3B[1].index_add_(0, b_N, torch.ones_like(loss_N, dtype=torch.float64))
        self.sums_3B[2].index_add_(0, b_N, hit_N.to(torch.float64))

    def reduce(self) -> "PositionLoss":
        """Collective over the world when a process group exists: every rank's tokens counted once."""
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.sums_3B)
        return self

    def totals(self) -> tuple[float, int, int]:
        loss, n, hits = self.sums_3B.sum(1).tolist()
        return loss, int(n), int(hits)

    def metrics(self, prefix: str = "val") -> dict:
        """{prefix}_pos{lo}_loss (mean over the bucket's tokens) and {prefix}_pos{lo}_tokens for every
        bucket that holds a labelled token, and {prefix}_context."""
        out = {f"{prefix}_context": self.context}
        loss, n, _ = self.sums_3B.tolist()
        for (lo, _), s, c in zip(bucket_bounds(self.context), loss, n):
            if c > 0:
                out[f"{prefix}_pos{lo}_loss"] = s / c
                out[f"{prefix}_pos{lo}_tokens"] = int(c)
        return out

    def table(self, prefix: str = "val") -> str:
        """Three rows: bucket upper ends, tokens, mean loss ('-' where a bucket has no labelled token)."""
        loss, n, _ = self.sums_3B.tolist()
        cols = [(_short(hi), str(int(c)), f"{s / c:.4f}" if c else "-")
                for (_, hi), s, c in zip(bucket_bounds(self.context), loss, n)]
        w = max(7, *(len(x) + 1 for col in cols for x in col))
        rows = [f"  {name:<7}" + "".join(col[i].rjust(w) for col in cols)
                for i, name in enumerate(("pos <", "tokens", "loss"))]
        return f"{prefix} loss by token position (context {self.context}):\n" + "\n".join(rows)


def _short(n: int) -> str:
    for shift, unit in ((20, "M"), (10, "K")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)
