"""Recall accuracy for synthetic recall data (data.synthetic=mqar): the fraction of scored positions
(labels != IGNORE_INDEX) whose arg-max prediction is exactly the label.

Hooks read the labels the trainer passes to the model and the final hidden states, and score only
the answer positions (a few rows of the LM head, never the full [tokens, vocab] logits), so the
trainer's step is unchanged. Counts stay on the device until `reduce()`, a collective over the world
that every rank calls at logging time: each answer is held by exactly one rank (its SP slice), so
the sums count every answer of the step once. Only training-mode forwards are counted; evaluation
scores recall itself (`val_recall_acc`, lingua_zeco/evaluation.py), and `eval.recall_span=P` lays the
pairs on the first and the queries on the last of P SP ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from lingua_zeco.data.mqar import IGNORE_INDEX


class RecallMeter:
    def __init__(self, model):
        self.model = model
        self._labels = None
        self.counts = None  # [correct, total] float64 on the model's device
        model.register_forward_pre_hook(self._take_labels, with_kwargs=True)
        model.model.register_forward_hook(self._score)

    def _take_labels(self, module, args, kwargs):
        self._labels = kwargs["labels"] if "labels" in kwargs else (args[1] if len(args) > 1 else None)

    @torch.no_grad()
    def _score(self, module, args, h_BTD):
        labels, self._labels = self._labels, None
        if labels is None or not module.training:
            return
        mask = labels != IGNORE_INDEX
        w = self.model.lm_head.weight
        pred = (h_BTD[mask].float() @ w.float().t()).argmax(-1)
        step = torch.stack([(pred == labels[mask]).sum(), mask.sum()]).to(torch.float64)
        self.counts = step if self.counts is None else self.counts + step

    def reduce(self, device) -> dict:
        """Collective: accuracy over every rank's answers since the last call, then reset."""
        counts = self.counts if self.counts is not None else torch.zeros(2, dtype=torch.float64, device=device)
        if dist.is_initialized():
            dist.all_reduce(counts)
        self.counts = None
        correct, total = counts.tolist()
        return {"recall_acc": correct / total if total else float("nan"), "recall_answers": int(total)}
