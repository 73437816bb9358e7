"""``causal_lm``: causal chat SFT with the Marin/Levanter recipe's loss (docs/recipe.md).

* labels (item 7): position i of a pack predicts token i+1 where that token is an assistant token; the collator
  (``titan_sft.data.collator``) builds them;
* loss groups (item 6): the B packed examples of a step are cut, in order, into G groups; the step loss is the
  mean over groups of (group CE sum / group target count). Every token carries the weight 1 / (G * N_group), with
  N_group all-reduced over ranks, so summing the weighted CE over all microbatches and ranks gives exactly that
  number, and its gradient, whatever the number of ranks or microbatches (gradients are summed across ranks:
  FSDP's divide factor is 1, item 10);
* the output head is applied here, at the positions that carry a target only (``Microbatch.rows``), and
  ``training.loss_chunk_size`` of them at a time with the gradient computed in place (``titan_sft.loss``), so
  [tokens, vocab] logits never exist at once.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from titan_sft.config import ConfigError, JobConfig
from titan_sft.constants import IGNORE_INDEX
from titan_sft.data.collator import Microbatch, collate, target_rows
from titan_sft.log import logger
from titan_sft.loss import chunked_cross_entropy_sum
from titan_sft.objectives import (BatchError, Objective, Validator, Validators, forward_hidden, sum_over_stages,
                                  validation_records)
from titan_sft.parallel import comm
from titan_sft.registry import register_objective
from titan_sft.startup_checks import StartupCheckError


class EmptyLossGroupError(BatchError):
    """A step's loss group has no loss-carrying token: its mean is undefined."""


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
        self.compile_loss = t.compile_loss
        self.counts = torch.zeros(self.n_groups, dtype=torch.float64)

    def check_dataset(self, dataset) -> None:
        """A prompt/answer dataset whose history is drawn per batch holds every example with all its history; the
        draw belongs to masked diffusion's collator, so causal training would silently keep it all."""
        if "history_draw" in dataset.manifest:
            raise ConfigError(f"config key 'objective.name': causal_lm does not draw the per-batch history of "
                              f"{dataset.path} (prepare_diffusion --history-draw batch); prepare it with "
                              f"--history-draw prepare, or train it with masked_diffusion")

    def collate(self, packs: list, groups: list[int], keys: list[int] | None = None) -> Microbatch:
        return collate(packs, groups, self.reset_positions)

    def begin_step(self, batch, dataset, first: bool) -> str | None:
        """All-reduces the loss-carrying targets of each group (the denominators N_group); on the first step
        checks them against the dataset's ``assistant_counts`` (recipe item 10). A group without any target
        stops the run, naming its packs and their source rows, or skips the step (``skip_empty_loss_groups``)."""
        G, B = self.n_groups, self.global_batch
        counts = torch.zeros(G, dtype=torch.float64)
        for mb in batch.microbatches:
            counts += torch.bincount(mb.groups[mb.labels != IGNORE_INDEX], minlength=G).double()
        counts = comm.all_reduce(counts.to(comm.device()), group=self.dp_group, what="loss denominators").cpu()
        if first:  # always: a wrong denominator silently changes every gradient
            derived = np.bincount(np.arange(B) // (B // G), weights=dataset.assistant_counts[batch.global_ids],
                                  minlength=G)
            if not np.array_equal(counts.numpy(), derived):
                raise StartupCheckError(f"loss denominators {counts.tolist()} differ from the dataset's "
                                        f"assistant_counts {derived.tolist()} (recipe item 10)")
            logger.info(f"[init] denominator check passed: the first step's {G} loss groups hold "
                        f"{[int(c) for c in counts.tolist()]} loss targets, as the dataset's assistant_counts say")
        self.counts = counts
        if (counts == 0).any():
            empty = torch.nonzero(counts == 0).flatten().tolist()
            size = B // G
            packs = [int(p) for g in empty for p in batch.global_ids[g * size : (g + 1) * size]]
            why = (f"step {batch.step + 1}: loss group(s) {empty} have no loss-carrying target (recipe item 6); "
                   f"their packs: {dataset.describe_sources(packs)}")
            if not self.cfg.training.skip_empty_loss_groups:
                raise EmptyLossGroupError(why + " (--training.skip_empty_loss_groups true skips such steps)")
            return why
        return None

    def head_positions(self, mb: Microbatch) -> int:
        return mb.n_loss_tokens  # the head runs where a target is, only

    def loss(self, model: torch.nn.Module, mb: Microbatch) -> torch.Tensor:
        mb = self.local(mb)
        hidden = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, positions=mb.positions, hidden_only=True)
        labels, groups = (x.reshape(-1).index_select(0, mb.rows) for x in (mb.labels, mb.groups))
        weights = group_weights(labels, groups, self.counts, self.n_groups)
        # The head and the cross-entropy run at the positions with a target only (chat SFT supervises the
        # assistant turns: about 40% of the debug data's tokens); the others would contribute weight 0.
        # model.output.weight is the unsharded head here (FSDP does not reshard the root after forward); under
        # tensor parallel it is vocab-sharded and the loss runs on vocab slices (loss parallel).
        loss = chunked_cross_entropy_sum(hidden, model.output.weight, labels, self.chunk, weights, rows=mb.rows,
                                         compiled=self.compile_loss)
        return self.router_loss(model, loss)

    def step_metrics(self, sums=()) -> dict:
        return {"n_loss_tokens": int(self.counts.sum().item()), **super().step_metrics(sums)}

    def build_validator(self, model: torch.nn.Module) -> Validator | None:
        v = self.cfg.validation
        validators: list[Validator] = []
        if v.path or v.holdout_fraction or v.sources:
            validators.append(HeldOutLoss(self.cfg, self.collate, self.dp_group, self.local, self.loss_group))
        if v.generation_eval_path:
            validators.append(ExactMatchValidator(v.generation_eval_path, v.max_new_tokens, v.max_examples))
        return Validators(validators) if validators else None


class HeldOutLoss(Validator):
    """Cross-entropy per loss-carrying token over a held-out packed dataset (``validation.path``), several
    (``validation.sources``: a record per source and their weighted mean) or the packs
    ``validation.holdout_fraction`` kept out of training, every ``validation.interval`` steps and after the last.

    The held-out loss is the token mean over the whole set (not the training step's mean of group means, which
    depends on how packs fall into groups). Every data-parallel rank evaluates its share (packs r, r + W, ...) and
    the sums are all-reduced; ranks with one pack fewer run a masked copy so that all run the same forwards.
    With ``validation.keep_best`` the checkpoint of the lowest loss is kept in ``checkpoints-best/``. Under
    context parallel every cp rank evaluates its part of the rows (``local``) and the sums run over
    ``loss_group``; under pipeline parallel the stages run forward only and the last one counts
    (``objectives.forward_hidden``).
    """

    def __init__(self, cfg: JobConfig, collate_fn, dp_group, local=lambda mb: mb, loss_group=None):
        from titan_sft.config import validation_sets
        from titan_sft.data.dataset import PackedDataset
        from titan_sft.data.sampler import holdout_split

        v = cfg.validation
        self.sets = []  # (source name or None, dataset, pack ids, weight)
        for name, path, weight in validation_sets(cfg):
            ds = PackedDataset(path)
            self.sets.append((name, ds, np.arange(len(ds)), weight))
        if not self.sets:
            ds = PackedDataset(cfg.data.path)
            self.sets.append((None, ds, holdout_split(len(ds), v.holdout_fraction, v.holdout_seed)[1], 1.0))
        if v.max_packs:
            self.sets = [(n, ds, ids[: v.max_packs], w) for n, ds, ids, w in self.sets]
        self.collate, self.dp_group, self.local = collate_fn, dp_group, local
        self.loss_group = dp_group if loss_group is None else loss_group
        self.interval, self.keep_best, self.best_source = v.interval, v.keep_best, v.best_source
        self.per_device, self.chunk = v.batch_size or cfg.training.per_device_batch, cfg.training.loss_chunk_size

    def maybe_validate(self, step, total_steps, model, checkpointer) -> list[dict]:
        if not (step == total_steps or (self.interval and step % self.interval == 0)):
            return []
        results = []
        for name, ds, ids, weight in self.sets:
            loss, n_tokens = self.evaluate(model, ds, ids)
            results.append((name, weight, {"loss": loss, "n_loss_tokens": n_tokens, "n_packs": len(ids)}))
        records, loss = validation_records(step, results, self.best_source)
        if self.keep_best and checkpointer.keep_if_best(step, loss):
            records[-1]["best"] = True
        return records

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, dataset, ids: np.ndarray) -> tuple[float, int]:
        rank, world = dist.get_rank(self.dp_group), dist.get_world_size(self.dp_group)
        mine = ids[rank::world]
        per_rank = -(-len(ids) // world)
        device = next(model.parameters()).device

        def batches():
            for start in range(0, per_rank, self.per_device):
                picks = range(start, min(start + self.per_device, per_rank))
                packs = [dataset[int(mine[j] if j < len(mine) else ids[0])] for j in picks]
                mb = self.collate(packs, [0] * len(packs))
                for row, j in enumerate(picks):
                    if j >= len(mine):  # padding forward: same shapes, no loss
                        mb.labels[row] = IGNORE_INDEX
                mb = dataclasses.replace(mb, rows=target_rows(mb.labels))
                yield (self.local(mb).to(device),)

        sums = comm.zeros(2)
        for (mb,), hidden in forward_hidden(model, batches()):
            if hidden is None:  # an earlier pipeline stage
                continue
            labels = mb.labels.reshape(-1).index_select(0, mb.rows)
            total = chunked_cross_entropy_sum(hidden, model.output.weight, labels, self.chunk, rows=mb.rows)
            sums[0] += total.double()
            sums[1] += len(mb.rows)
        sums = sum_over_stages(model, sums, "held-out loss over pipeline stages")
        loss_sum, n = comm.all_reduce(sums, group=self.loss_group, what="held-out loss").tolist()
        return loss_sum / max(n, 1.0), int(n)


class ExactMatchValidator(Validator):
    """After the final HF export, rank 0 greedily decodes the held-out prompts with transformers and reports the
    exact-match accuracy of the last assistant turn (``titan_sft.evaluate``). It decodes on the training device
    (a GPU: bf16), so a large export is evaluated in seconds, well within the collective timeout the other ranks
    wait under; on CPU it runs in fp32."""

    def __init__(self, path: str, max_new_tokens: int, max_examples: int):
        self.path, self.max_new_tokens, self.max_examples = path, max_new_tokens, max_examples

    def maybe_validate(self, step: int, total_steps: int, model, checkpointer) -> list[dict]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        last_export = checkpointer.last_export
        if step != total_steps or last_export is None or rank != 0:
            return []
        from titan_sft.evaluate import evaluate_exact_match

        device = comm.device()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the training state stays resident: leave the export what is free
        acc, n = evaluate_exact_match(last_export, self.path, self.max_new_tokens, self.max_examples, device)
        logger.info(f"[eval] exact-match accuracy of {last_export} on {n} held-out prompts: {acc:.1%}")
        return [{"split": "validation", "step": step, "exact_match": acc, "n_examples": n}]


register_objective("causal_lm", CausalLM)
