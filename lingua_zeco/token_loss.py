"""Per-token losses of a causal LM's ordinary forward, for evaluation by token position.

The model returns only the sum of its token losses (fused on CUDA: no [tokens, vocab] logits). While a
`TokenLosses` is open, hooks read the labels passed to the model and its final hidden states and
score the labelled rows against the LM head in chunks, so the forward itself (and its SP exchange)
stays the one that training runs. The model must follow fla's layout: `model.model` returns the
final hidden states, `model.lm_head` is the output projection. Under FSDP the root's parameters
(lm_head among them) are unsharded while the root's forward runs, which is when the hook reads them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lingua_zeco.data.mqar import IGNORE_INDEX
from lingua_zeco.kernels.common import acc_dtype

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
