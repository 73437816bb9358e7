"""``causal_lm``: causal chat SFT with the Marin/Levanter recipe's loss (shared/spec/recipe.md).

* labels (item 7): position i of a pack predicts token i+1 where that token is an assistant token; the collator
  (``titan_sft.data.collator``) builds them;
* loss groups (item 6): the B packed examples of a step are cut, in order, into G groups; the step loss is the
  mean over groups of (group CE sum / group target count). Every token carries the weight 1 / (G * N_group), with
  N_group all-reduced over ranks, so summing the weighted CE over all microbatches and ranks gives exactly that
  number, and its gradient, whatever the number of ranks or microbatches (gradients are summed across ranks:
  FSDP's divide factor is 1, item 10);
* the output head is applied here, ``training.loss_chunk_size`` tokens at a time with the gradient computed in
  place (``titan_sft.loss``), so [tokens, vocab] logits never exist at once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from titan_sft.config import JobConfig
from titan_sft.constants import IGNORE_INDEX
from titan_sft.data.collator import Microbatch, collate
from titan_sft.log import logger
from titan_sft.loss import chunked_cross_entropy_sum
from titan_sft.objectives import Objective, Validator
from titan_sft.registry import register_objective
from titan_sft.startup_checks import StartupCheckError


def group_weights(labels: torch.Tensor, groups: torch.Tensor, counts: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Per-token loss weight 1 / (G * N_group) on loss-carrying positions, 0 elsewhere (fp32)."""
    w = 1.0 / (n_groups * counts.double())
    return torch.where(labels != IGNORE_INDEX, w.to(labels.device)[groups], 0.0).float()


class CausalLM(Objective):
    causal = True

    def __init__(self, cfg: JobConfig):
        super().__init__(cfg)
        t = cfg.training
        self.n_groups, self.global_batch, self.chunk = t.loss_groups, t.global_batch_size, t.loss_chunk_size
        self.reset_positions = cfg.model.reset_positions_per_document
        self.counts = torch.zeros(self.n_groups, dtype=torch.float64)

    def collate(self, packs: list, groups: list[int]) -> Microbatch:
        return collate(packs, groups, self.reset_positions)

    def begin_step(self, batch, dataset, first: bool) -> None:
        """All-reduces the loss-carrying targets of each group (the denominators N_group); on the first step
        checks them against the dataset's ``assistant_counts`` (recipe item 10)."""
        G, B = self.n_groups, self.global_batch
        counts = torch.zeros(G, dtype=torch.float64)
        for mb in batch.microbatches:
            counts += torch.bincount(mb.groups[mb.labels != IGNORE_INDEX], minlength=G).double()
        dist.all_reduce(counts, group=self.dp_group)
        if first and not self.cfg.training.skip_startup_checks:
            derived = np.bincount(np.arange(B) // (B // G), weights=dataset.assistant_counts[batch.global_ids],
                                  minlength=G)
            if not np.array_equal(counts.numpy(), derived):
                raise StartupCheckError(f"loss denominators {counts.tolist()} differ from the dataset's "
                                        f"assistant_counts {derived.tolist()} (recipe item 10)")
        if (counts == 0).any():
            raise RuntimeError(f"step {batch.step}: loss group(s) {torch.nonzero(counts == 0).flatten().tolist()} "
                               "have no loss-carrying target (recipe item 6)")
        self.counts = counts

    def loss(self, model: torch.nn.Module, mb: Microbatch) -> torch.Tensor:
        hidden = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, positions=mb.positions, hidden_only=True)
        weights = group_weights(mb.labels, mb.groups, self.counts, self.n_groups)
        # model.output.weight is the unsharded head here (FSDP does not reshard the root after forward); under
        # tensor parallel it is vocab-sharded and the loss runs on vocab slices (loss parallel).
        return chunked_cross_entropy_sum(hidden, model.output.weight, mb.labels, self.chunk, weights)

    def step_metrics(self) -> dict:
        return {"n_loss_tokens": int(self.counts.sum().item())}

    def build_validator(self) -> Validator | None:
        v = self.cfg.validation
        return ExactMatchValidator(v.generation_eval_path, v.max_new_tokens, v.max_examples) if v.generation_eval_path else None


class ExactMatchValidator(Validator):
    """After the final HF export, rank 0 greedily decodes the held-out prompts with transformers and reports the
    exact-match accuracy of the last assistant turn (``titan_sft.evaluate``)."""

    def __init__(self, path: str, max_new_tokens: int, max_examples: int):
        self.path, self.max_new_tokens, self.max_examples = path, max_new_tokens, max_examples

    def maybe_validate(self, step: int, total_steps: int, model, last_export: Path | None) -> list[dict]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if step != total_steps or last_export is None or rank != 0:
            return []
        from titan_sft.evaluate import evaluate_exact_match

        acc, n = evaluate_exact_match(last_export, self.path, self.max_new_tokens, self.max_examples)
        logger.info(f"[eval] exact-match accuracy of {last_export} on {n} held-out prompts: {acc:.1%}")
        return [{"split": "validation", "step": step, "exact_match": acc, "n_examples": n}]


register_objective("causal_lm", CausalLM)
