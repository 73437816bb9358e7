"""``masked_diffusion``: LLaDA-style masked-diffusion SFT (docs/masked_diffusion.md).

Per example (a document of a pack: prompt, then answer; the dataset's mask marks the answer, and with EOS padding
the padding after it):

* noise level ``t ~ Uniform(t_min, 1)``; every answer token (and padding token with ``eos_padding_loss``) is replaced by the mask token
  independently with probability t; prompt tokens never are. The draws come from a generator seeded by
  (job seed, stream, the example's key, its document index in the pack), where the key is
  ``step * global_batch + position`` (``titan_sft.data.loader``): the same masks for any number of ranks or
  microbatches, and on resume;
* loss: cross-entropy at masked positions only, each weighted by 1 / t; ``per_example`` (LLaDA, default) sums an
  example's terms, divides by its answer length (its end-of-turn token included; plus the padding with
  ``eos_padding_loss``) and averages over the examples of the step;
  ``per_token`` divides the step's sum by its supervised positions. ``split_loss`` normalises answer and padding
  parts separately and mixes them with ``answer_weight`` / ``padding_weight``. The denominators (examples, or
  supervised positions) are all-reduced over the data-parallel ranks before the step, so every layout computes
  the 1-rank loss;
* the output head runs only at the masked positions (``rows`` of ``titan_sft.loss``), not over the whole row;
* unshifted by default (position i predicts token i, as LLaDA); ``shift`` predicts token i from position i - 1
  (Dream), so a document's first token is never a target;
* attention is bidirectional within each document (``causal = False``); packed documents stay isolated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from titan_sft.config import ConfigError, JobConfig
from titan_sft.diffusion_sampler import GenerationValidator, end_token_ids
from titan_sft.data.dataset import first_documents
from titan_sft.loss import chunked_cross_entropy_sum
from titan_sft.objectives import (BatchError, Objective, Validator, Validators, forward_hidden, sum_over_stages,
                                  validation_records)
from titan_sft.parallel import comm
from titan_sft.registry import register_objective

TRAIN_STREAM, VALIDATION_STREAM, TEST_STREAM = 0, 1, 2
HISTORY_STREAM = 3  # the per-batch history draws of training examples (``data.dataset.PackHistory``)


@dataclass
class DiffusionMicrobatch:
    input_ids: torch.Tensor  # [P, L] long, answer tokens replaced by the mask token at masked positions
    positions: torch.Tensor  # [P, L] long
    cu_seqlens: torch.Tensor  # int32 over the flattened P * L tokens
    rows: torch.Tensor  # [n] long: flat position of the hidden state that predicts each target
    targets: torch.Tensor  # [n] long: the original tokens at the masked positions
    weights: torch.Tensor  # [n] float64: 1/t (per_token) or 1/(t * answer length) (per_example), times split weight
    part: torch.Tensor  # [n] long: 0 answer, 1 EOS padding
    stats: torch.Tensor  # float64 [6]: examples, answer positions, padding positions, masked positions, sum t, 0
    max_seqlen: int = 0
    n_answer: int = -1  # with split_loss: the first n_answer targets are answer ones, the rest padding; else -1

    def to(self, device, non_blocking: bool = False) -> "DiffusionMicrobatch":
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return DiffusionMicrobatch(move(self.input_ids), move(self.positions), move(self.cu_seqlens), move(self.rows),
                                   move(self.targets), move(self.weights), move(self.part), self.stats,
                                   self.max_seqlen, self.n_answer)

    def pin_memory(self) -> "DiffusionMicrobatch":
        pin = lambda t: t.pin_memory()  # noqa: E731
        return DiffusionMicrobatch(pin(self.input_ids), pin(self.positions), pin(self.cu_seqlens), pin(self.rows),
                                   pin(self.targets), pin(self.weights), pin(self.part), self.stats, self.max_seqlen,
                                   self.n_answer)

    def shard(self, cp) -> "DiffusionMicrobatch":
        """This context-parallel rank's part of the rows (``cp``: a ``SequenceShard``): the rows' fields sliced,
        the targets whose predicting position this rank holds (re-indexed into its part, in order, so split_loss's
        answer-first order holds), and the stats (counts of whole examples) on the first cp rank only, so that
        summing over the cp ranks counts them once. The noise was drawn on the whole rows: the same masks at any
        cp."""
        length = self.input_ids.shape[1]
        held, rows = cp.flat(self.rows, length)
        n_answer = int(held[: self.n_answer].sum()) if self.n_answer >= 0 else -1
        stats = self.stats if cp.rank == 0 else torch.zeros_like(self.stats)
        return DiffusionMicrobatch(cp.rows(self.input_ids), cp.rows(self.positions), self.cu_seqlens, rows[held],
                                   self.targets[held], self.weights[held], self.part[held], stats, self.max_seqlen,
                                   n_answer)

    @property
    def n_examples(self) -> int:
        return int(self.stats[0])


def noise_rng(seed: int, stream: int, key: int, doc: int) -> np.random.Generator:
    """The generator of one example's noise level and masks."""
    return np.random.default_rng([seed, stream, key, doc])


def collate_diffusion(packs: list, keys: list[int], *, mask_id: int, t_min: float, shift: bool, split: bool,
                      answer_weight: float, padding_weight: float, per_example: bool, seed: int,
                      stream: int = TRAIN_STREAM, padding_loss: bool = True) -> DiffusionMicrobatch:
    """Noises packed prompt/answer examples; see the module docstring for the semantics. ``padding_loss``
    (``objective.eos_padding_loss``): an example's end-of-turn padding (past ``answer_lens``) is noised and
    supervised with its answer; false leaves it clean and outside the loss. A pack whose history is drawn per
    batch (a :class:`~titan_sft.data.dataset.PackHistory` after ``answer_lens``) keeps each document's earlier
    turns with the dataset's probability, drawn from (seed, key, document) in training; held-out streams never
    keep them (the reference trainer draws history for training only)."""
    rows_ids, pos, seg_lens = [], [], []
    sel, tgt, wts, part = [], [], [], []
    stats = np.zeros(6, dtype=np.float64)
    for p, (pack, key) in enumerate(zip(packs, keys)):
        if len(pack) > 4:
            history = pack[4]
            keep = np.array([stream == TRAIN_STREAM and noise_rng(seed, HISTORY_STREAM, key, d).random() < history.prob
                             for d in range(len(pack[2]))])
            pack = history.apply(pack[:4], keep)
        tokens, mask, doc_lens = pack[0], pack[1], pack[2]
        answer_lens = pack[3] if len(pack) > 3 else None
        L = len(tokens)
        noised = tokens.astype(np.int64).copy()
        start = 0
        for d, n in enumerate(int(x) for x in doc_lens):
            sup = np.flatnonzero(mask[start : start + n]) + start
            if shift:  # the document's first token has no position before it in the document
                sup = sup[sup > start]
            start += n
            if len(sup) == 0:
                continue
            n_ans = len(sup) if answer_lens is None else min(int(answer_lens[d]), len(sup))
            if not padding_loss:
                sup = sup[:n_ans]  # the padding stays its clean end-of-turn tokens, visible and unsupervised
            is_pad = np.arange(len(sup)) >= n_ans
            rng = noise_rng(seed, stream, key, d)
            t = t_min + (1.0 - t_min) * rng.random()
            masked = rng.random(len(sup)) < t
            n_pad = len(sup) - n_ans
            if split:
                w = np.where(is_pad, padding_weight / max(n_pad, 1), answer_weight / max(n_ans, 1)) if per_example \
                    else np.where(is_pad, padding_weight, answer_weight)
            else:
                w = np.full(len(sup), 1.0 / len(sup) if per_example else 1.0)
            at = sup[masked]
            noised[at] = mask_id
            sel.append(p * L + at - (1 if shift else 0))
            tgt.append(tokens[at].astype(np.int64))
            wts.append(w[masked] / t)
            part.append(is_pad[masked].astype(np.int64))
            stats += (1, n_ans, n_pad, masked.sum(), t, 0)
        rows_ids.append(noised)
        pos.append(np.arange(L))
        used = int(np.sum(doc_lens))
        seg_lens.extend([int(x) for x in doc_lens] + ([L - used] if used < L else []))
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dtype=dt)  # noqa: E731
    P = len(packs)
    sel, tgt, wts, part = cat(sel, np.int64), cat(tgt, np.int64), cat(wts, np.float64), cat(part, np.int64)
    n_answer = -1
    if split:  # answer targets first: each part's loss is then a slice, known on the host (no device sync)
        order = np.argsort(part, kind="stable")
        sel, tgt, wts, part = sel[order], tgt[order], wts[order], part[order]
        n_answer = int((part == 0).sum())
    return DiffusionMicrobatch(
        input_ids=torch.from_numpy(np.stack(rows_ids)),
        positions=torch.from_numpy(np.stack(pos).astype(np.int64)),
        cu_seqlens=torch.from_numpy(np.concatenate([[0], np.cumsum(seg_lens)]).astype(np.int32)),
        rows=torch.from_numpy(sel),
        targets=torch.from_numpy(tgt),
        weights=torch.from_numpy(wts),
        part=torch.from_numpy(part),
        stats=torch.from_numpy(stats),
        max_seqlen=max(seg_lens) if P else 0,
        n_answer=n_answer,
    )


def resolve_mask_token(mask_token_id: int, vocab_size: int, tokenizer) -> int:
    """The configured mask token, or the default: the first embedding row past the tokenizer (a reserved row:
    Qwen3's 151669 of 151936), else the tokenizer's last reserved special token (Llama 3 fills its table).

    Raises:
        ConfigError: the id is outside the embedding table, or is an ordinary text token of the tokenizer.
    """
    n = len(tokenizer) if tokenizer is not None else None
    if mask_token_id < 0:
        if n is not None and n < vocab_size:
            return n
        reserved = [i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()
                    if "reserved" in str(tok) and i < vocab_size]
        if not reserved:
            raise ConfigError(f"config key 'objective.mask_token_id': no default here (the tokenizer fills the "
                              f"{vocab_size}-row table and has no reserved special token); set one")
        return max(reserved)
    if mask_token_id >= vocab_size:
        raise ConfigError(f"config key 'objective.mask_token_id': {mask_token_id} is outside the embedding table "
                          f"(vocab_size {vocab_size}); allowed: 0 .. {vocab_size - 1}, a reserved or special token")
    if n is not None and mask_token_id < n:
        special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        if mask_token_id not in special:
            raise ConfigError(f"config key 'objective.mask_token_id': {mask_token_id} is the text token "
                              f"{tokenizer.convert_ids_to_tokens(mask_token_id)!r}; use a reserved or special "
                              f"token, or a row past the tokenizer's {n}")
    return mask_token_id


def _ranges(ids: list[int]) -> str:
    """Layer indices as short ranges: [0, 1, 2, 4] -> '0-2, 4'."""
    spans: list[list[int]] = []
    for i in ids:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


class MaskedDiffusion(Objective):
    causal = False

    def __init__(self, cfg: JobConfig):
        super().__init__(cfg)
        o = cfg.objective
        self.chunk, self.compile_loss = cfg.training.loss_chunk_size, cfg.training.compile_loss
        self.per_example = o.normalization == "per_example"
        self.mask_id = o.mask_token_id  # resolved by setup()
        self.denoms = torch.ones(2, dtype=torch.float64)
        self.step_stats = torch.zeros(6, dtype=torch.float64)
        self.part_sums: torch.Tensor | None = None  # [answer, padding] loss of the step so far (split_loss)

    def setup(self, vocab_size: int, tokenizer) -> dict:
        self.mask_id = resolve_mask_token(self.cfg.objective.mask_token_id, vocab_size, tokenizer)
        o = self.cfg.objective
        return {"objective": "masked_diffusion", "mask_token_id": self.mask_id,
                "mask_token": tokenizer.convert_ids_to_tokens(self.mask_id)
                if tokenizer is not None and self.mask_id < len(tokenizer) else None,
                "shift": o.shift, "normalization": o.normalization, "t_min": o.t_min,
                "eos_padding_loss": o.eos_padding_loss, "split_loss": o.split_loss,
                "answer_weight": o.answer_weight, "padding_weight": o.padding_weight,
                "end_token_ids": end_token_ids(tokenizer) if tokenizer is not None else []}

    def collate(self, packs: list, groups: list[int], keys: list[int], *, stream: int = TRAIN_STREAM,
                seed: int | None = None) -> DiffusionMicrobatch:
        o = self.cfg.objective
        return collate_diffusion(packs, keys, mask_id=self.mask_id, t_min=o.t_min, shift=o.shift,
                                 split=o.split_loss, answer_weight=o.answer_weight, padding_weight=o.padding_weight,
                                 per_example=self.per_example, seed=self.cfg.job.seed if seed is None else seed,
                                 stream=stream, padding_loss=o.eos_padding_loss)

    def denominators(self, stats: torch.Tensor) -> torch.Tensor:
        """[answer, padding] denominators from all-reduced stats: examples (per_example), or supervised
        positions (per_token: all of them, or each part's own with split_loss)."""
        if self.per_example:
            return torch.stack([stats[0], stats[0]])
        if self.cfg.objective.split_loss:
            return stats[1:3].clone()
        return torch.stack([stats[1] + stats[2]] * 2)

    def begin_step(self, batch, dataset, first: bool) -> str | None:
        stats = sum((mb.stats for mb in batch.microbatches), torch.zeros(6, dtype=torch.float64))
        stats = comm.all_reduce(stats.to(comm.device()), group=self.dp_group, what="diffusion step stats").cpu()
        if stats[0] == 0:
            raise BatchError(f"step {batch.step + 1}: no example of the global batch has an answer token; its "
                             f"packs: {dataset.describe_sources([int(i) for i in batch.global_ids])}")
        self.step_stats = stats
        self.denoms = self.denominators(stats).clamp(min=1.0)
        self.part_sums = None
        return None

    def check_dataset(self, dataset) -> None:
        """``split_loss`` normalises the answer and its EOS padding separately: a dataset without that padding
        (prepared without --eos-pad) would silently rescale the loss."""
        if self.cfg.objective.split_loss and not dataset.manifest.get("eos_pad"):
            raise ConfigError(f"config key 'objective.split_loss': true needs a dataset whose answers are padded with "
                              f"end-of-turn tokens (prepare_diffusion --eos-pad); {dataset.path} has no padding")

    def check_model(self, args) -> list[str]:
        """Gated DeltaNet layers (Qwen3.5) are causal by construction: the recurrence and its conv read the row
        left to right, so bidirectional attention reaches only the full-attention layers. A masked token then sees
        the text after it only through those layers (one in four in the released Qwen3.5 models), and everything
        above them in the stack; the objective still trains, but a model with no full-attention layer could never
        see past a position and is refused."""
        linear = args.linear_layers()
        if not linear:
            return []
        if len(linear) == args.n_layers:
            raise ConfigError(f"config key 'objective.name': masked_diffusion needs at least one full-attention "
                              f"layer to see the text after a masked token; model {self.cfg.model.name!r} has only "
                              f"linear_attention layers (causal by construction)")
        full = [i for i in range(args.n_layers) if i not in set(linear)]
        return [f"[init] masked diffusion on a hybrid model: attention is bidirectional in the {len(full)} "
                f"full-attention layers ({_ranges(full)}); the {len(linear)} Gated DeltaNet layers "
                f"({_ranges(linear)}) stay causal, so the text after a masked token reaches it only through the "
                f"full-attention layers"]

    def head_positions(self, mb: DiffusionMicrobatch) -> int:
        return len(mb.rows)  # the head runs at the masked positions only

    def masked_ce(self, model, hidden, mb: DiffusionMicrobatch, weights: torch.Tensor,
                  part: slice = slice(None)) -> torch.Tensor:
        """Sum over the masked positions (``part`` of them) of weight x CE; the head runs at those positions only."""
        return chunked_cross_entropy_sum(hidden, model.output.weight, mb.targets[part], self.chunk, weights[part],
                                         rows=mb.rows[part], compiled=self.compile_loss)

    def loss(self, model: torch.nn.Module, mb: DiffusionMicrobatch) -> torch.Tensor:
        mb = self.local(mb)
        hidden = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, positions=mb.positions, hidden_only=True)
        weights = (mb.weights / self.denoms.to(mb.weights.device)[mb.part]).float()
        if mb.n_answer < 0:
            return self.router_loss(model, self.masked_ce(model, hidden, mb, weights))
        # split_loss: the answer and padding parts separately (the same head work), for their curves.
        parts = [self.masked_ce(model, hidden, mb, weights, p)
                 for p in (slice(0, mb.n_answer), slice(mb.n_answer, None))]
        done = torch.stack([x.detach() for x in parts])
        self.part_sums = done if self.part_sums is None else self.part_sums + done
        return self.router_loss(model, parts[0] + parts[1])

    def step_sums(self) -> list[torch.Tensor]:
        router = super().step_sums()
        if not self.cfg.objective.split_loss:
            return router
        s = self.part_sums if self.part_sums is not None else torch.zeros(2, device=comm.device())
        return list(s.double().unbind()) + router

    def step_metrics(self, sums=()) -> dict:
        s = self.step_stats
        split = self.cfg.objective.split_loss
        parts = {"loss_answer": sums[0], "loss_padding": sums[1]} if split and len(sums) >= 2 else {}
        parts.update(super().step_metrics(list(sums[2:] if split else sums)))
        return {"n_loss_tokens": int(s[3]), "n_examples": int(s[0]), **parts,
                "mask_fraction": float(s[3] / max(float(s[1] + s[2]), 1.0)), "mean_t": float(s[4] / max(float(s[0]), 1.0))}

    def build_validator(self, model: torch.nn.Module) -> Validator | None:
        v = self.cfg.validation
        validators: list[Validator] = []
        if v.path or v.holdout_fraction or v.test_path or v.sources:
            validators.append(DenoisingValidator(self))
        if (v.generation_eval_path or v.generation_prompts) and v.generation_every:
            validators.append(GenerationValidator(self, model))
        return Validators(validators) if validators else None


class DenoisingValidator(Validator):
    """Deterministic denoising loss on the validation split every ``validation.interval`` steps and after the last;
    the best checkpoint by it (``keep_best``); the test split once at the end with the best weights.

    Noise and masks come from ``validation.noise_seed`` and each example's index, so the number is comparable across
    steps and runs. Records: the objective's weighted loss over the whole split (its normalisation, with the
    split's example / position counts as denominators), the unweighted CE per masked token, the realised masked
    fraction and the mean t. Every data-parallel rank evaluates its share of packs; sums are all-reduced.
    """

    def __init__(self, objective: MaskedDiffusion):
        from titan_sft.config import validation_sets
        from titan_sft.data.dataset import PackedDataset, PackSubset
        from titan_sft.data.sampler import holdout_split

        cfg = objective.cfg
        v = cfg.validation
        self.objective, self.cfg = objective, cfg
        # (source name or None, dataset, weight) per held-out set: validation.path, validation.sources, or the
        # packs the sampler keeps out of training (holdout_fraction)
        self.validations = [(name, PackedDataset(path), weight) for name, path, weight in validation_sets(cfg)]
        if not self.validations and v.holdout_fraction:
            held = holdout_split(len(PackedDataset(cfg.data.path)), v.holdout_fraction, v.holdout_seed)[1]
            self.validations = [(None, PackSubset(PackedDataset(cfg.data.path), held), 1.0)]
        self.best_source = v.best_source
        self.test = PackedDataset(v.test_path) if v.test_path else None
        self.interval, self.keep_best = v.interval, v.keep_best and bool(self.validations)
        self.per_device = v.batch_size or cfg.training.per_device_batch
        self.max_packs, self.max_examples = v.max_packs, v.max_loss_examples
        self.rounds = 0

    def maybe_validate(self, step, total_steps, model, checkpointer) -> list[dict]:
        last = step == total_steps
        records = []
        if self.validations and (last or (self.interval and step % self.interval == 0)):
            results = [(name, weight, self.evaluate(model, ds, VALIDATION_STREAM))
                       for name, ds, weight in self.validations]
            recs, loss = validation_records(step, results, self.best_source)
            self.rounds += 1
            if self.keep_best and checkpointer.keep_if_best(step, loss):
                recs[-1]["best"] = True
            records.extend(recs)
        if last and self.test is not None:
            weights = "final"
            if self.keep_best:
                checkpointer.wait()
                best_step = checkpointer.load_weights(checkpointer.root / "checkpoints-best")
                weights = f"best (step {best_step})"
            records.append({"split": "test", "step": step, "weights": weights,
                            **self.evaluate(model, self.test, TEST_STREAM)})
            if (dist.get_rank() if dist.is_initialized() else 0) == 0:  # the reference's test_metrics.json
                from titan_sft.atomic import atomic_write_text

                atomic_write_text(Path(self.cfg.job.dump_folder) / "test_metrics.json",
                                  json.dumps(records[-1], indent=2) + "\n")
        return records

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, dataset, stream: int) -> dict:
        obj = self.objective
        group = obj.dp_group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        group = obj.loss_group  # the sums: each cp rank evaluates its part of the rows
        n = min(len(dataset), self.max_packs) if self.max_packs else len(dataset)
        last_docs = 0  # with max_loss_examples: the documents of pack n - 1 that are evaluated (0: all)
        if self.max_examples and stream == VALIDATION_STREAM:
            seen = 0
            for i in range(len(dataset)):
                k = len(dataset[i][2])
                if seen + k >= self.max_examples:
                    n, last_docs = i + 1, self.max_examples - seen
                    break
                seen += k
        mine = list(range(rank, n, world))
        per_rank = -(-n // world)
        device = next(model.parameters()).device
        sums = torch.zeros(10, dtype=torch.float64)  # S_answer, S_padding, CE, stats[6], forwards
        was_training = model.training
        model.eval()

        def batches():
            for start in range(0, per_rank, self.per_device):
                picks = range(start, min(start + self.per_device, per_rank))
                ids = [mine[j] if j < len(mine) else 0 for j in picks]
                packs = [first_documents(dataset[i], last_docs) if last_docs and i == n - 1 else dataset[i]
                         for i in ids]
                mb = obj.collate(packs, [0] * len(ids), ids, stream=stream, seed=self.cfg.validation.noise_seed)
                keep = torch.ones(len(mb.rows), dtype=torch.float64)
                if any(j >= len(mine) for j in picks):  # padding forward on ranks with a pack fewer: no loss
                    mb.weights.zero_()
                    keep.zero_()
                    mb.stats.zero_()
                held = obj.cp.flat(mb.rows, mb.input_ids.shape[1])[0] if obj.cp is not None else slice(None)
                yield obj.local(mb).to(device), keep[held]

        for (mb, keep), hidden in forward_hidden(model, batches()):
            if hidden is None:  # an earlier pipeline stage: the last one counts
                continue
            parts = [obj.masked_ce(model, hidden, mb, (mb.weights * (mb.part == k)).float()) for k in (0, 1)]
            ce = obj.masked_ce(model, hidden, mb, keep.float().to(device))
            sums += torch.tensor([parts[0].item(), parts[1].item(), ce.item(), *mb.stats.tolist(), 1.0],
                                 dtype=torch.float64)
        sums = sum_over_stages(model, sums.to(comm.device()), "denoising validation over pipeline stages")
        sums = comm.all_reduce(sums, group=group, what="denoising validation").cpu()
        model.train(was_training)
        stats = sums[3:9]
        denoms = obj.denominators(stats).clamp(min=1.0)
        loss = float(sums[0] / denoms[0] + sums[1] / denoms[1])
        parts = {"loss_answer": float(sums[0] / denoms[0]), "loss_padding": float(sums[1] / denoms[1])} \
            if self.cfg.objective.split_loss else {}
        masked = float(stats[3])
        return {"loss": loss, **parts, "masked_ce": float(sums[2]) / max(masked, 1.0), "n_examples": int(stats[0]),
                "n_masked": int(masked), "mask_fraction": masked / max(float(stats[1] + stats[2]), 1.0),
                "mean_t": float(stats[4]) / max(float(stats[0]), 1.0)}


register_objective("masked_diffusion", MaskedDiffusion)
