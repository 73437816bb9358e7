"""LLaDA's low-confidence remasking sampler, and generation validation for masked-diffusion runs.

Sampling (docs/masked_diffusion.md): start from ``[prompt | mask x gen_length]``; the answer is cut into
blocks of ``block_length`` denoised left to right, each in ``steps / n_blocks`` steps. At each step the model
scores every position; a token x0 is drawn per position from softmax(logits / temperature) with Gumbel noise in
float64 (temperature 0 = argmax); its confidence is its softmax probability (``low_confidence``) or uniform noise
(``random``); positions outside the current block or already revealed get -inf; the k most confident masked
positions of the block are revealed, k following :func:`reveal_schedule`.

``forbid_ids`` (end-of-text / end-of-turn, the ``no_early_eos`` option) get logits of -inf BEFORE sampling, so
they are never drawn. (LLaDA's published code applies this after drawing, where it changes only the confidence
and an end token can still be revealed; we do what the option says.)
``late_ids`` (the reference trainer's ``confidence_eos_eot_inf``) change only the confidence: a position whose
drawn token is one of them is revealed after every other masked position of its block (among themselves by
confidence), so end tokens can still be generated, only last.
The mask token itself is never drawn. Classifier-free guidance: ``logits = uncond + (s + 1) * (cond - uncond)``, the unconditional pass with the prompt
replaced by mask tokens. Reproducible: every prompt has its own seed.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

_THINK = re.compile(r"^\s*<think>.*?</think>\s*", re.S)


def reveal_schedule(n_masked: int, steps: int) -> list[int]:
    """Tokens revealed at each of ``steps`` steps: ``n_masked // steps`` each, the remainder one each over the
    first steps (LLaDA's ``get_num_transfer_tokens``)."""
    base, rem = divmod(n_masked, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def gumbel_argmax(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """argmax of exp(logits) / (-log u)^temperature in float64 (a sample of softmax(logits / temperature));
    temperature 0 is the plain argmax."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.double()
    u = torch.rand(logits.shape, dtype=torch.float64, generator=generator, device=logits.device)
    return (logits.exp() / (-torch.log(u)) ** temperature).argmax(-1)


@torch.no_grad()
def generate(logits_fn: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor, *, mask_id: int,
             gen_length: int, block_length: int, steps: int, temperature: float = 0.0,
             remasking: str = "low_confidence", cfg_scale: float = 0.0, forbid_ids: list[int] | None = None,
             late_ids: list[int] | None = None, seed: int = 0, shift: bool = False,
             trace: list | None = None) -> torch.Tensor:
    """Generates ``gen_length`` tokens after ``prompt`` (long [Lp]); returns them (long [gen_length]).

    Args:
        logits_fn: ``ids [B, T] -> logits [B, T, vocab]`` with bidirectional attention.
        shift: the model was trained to predict token i at position i - 1 (``objective.shift``, Dream-style).
        trace: if given, receives (step, positions revealed) per step (tests check the schedule with it).
    """
    if gen_length % block_length:
        raise ValueError(f"gen_length {gen_length} must be a multiple of block_length {block_length}")
    n_blocks = gen_length // block_length
    if steps % n_blocks or steps < n_blocks:
        raise ValueError(f"steps {steps} must be a positive multiple of the {n_blocks} blocks")
    per_block = steps // n_blocks
    device = prompt.device
    lp = len(prompt)
    x = torch.full((1, lp + gen_length), mask_id, dtype=torch.long, device=device)
    x[0, :lp] = prompt
    gen = torch.Generator(device=device).manual_seed(seed)
    step = 0
    for b in range(n_blocks):
        lo, hi = lp + b * block_length, lp + (b + 1) * block_length
        schedule = reveal_schedule(int((x[0, lo:hi] == mask_id).sum()), per_block)
        for k in schedule:
            masked = x == mask_id
            if cfg_scale > 0:
                uncond = x.clone()
                uncond[0, :lp] = mask_id
                cond_logits, uncond_logits = logits_fn(torch.cat([x, uncond])).float().chunk(2)
                logits = uncond_logits + (cfg_scale + 1) * (cond_logits - uncond_logits)
            else:
                logits = logits_fn(x).float()
            if shift:  # position i's distribution is read at i - 1
                logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
            logits[..., mask_id] = -math.inf  # a revealed position must hold a real token
            if forbid_ids:
                logits[..., forbid_ids] = -math.inf
            x0 = gumbel_argmax(logits, temperature, gen)
            if remasking == "low_confidence":
                conf = torch.gather(F.softmax(logits.double(), -1), -1, x0.unsqueeze(-1)).squeeze(-1)
            elif remasking == "random":
                conf = torch.rand(x0.shape, dtype=torch.float64, generator=gen, device=device)
            else:
                raise ValueError(f"remasking must be low_confidence or random, got {remasking!r}")
            if late_ids:  # below every confidence in [0, 1], above the -inf of positions that cannot be revealed
                conf = torch.where(torch.isin(x0, torch.tensor(late_ids, device=device)), conf - 2.0, conf)
            in_block = torch.zeros_like(masked)
            in_block[:, lo:hi] = True
            conf = torch.where(masked & in_block, conf, -math.inf)
            picked = torch.topk(conf[0], k).indices if k else torch.zeros(0, dtype=torch.long, device=device)
            x[0, picked] = x0[0, picked]
            if trace is not None:
                trace.append((step, sorted(picked.tolist())))
            step += 1
    return x[0, lp:]


def end_token_ids(tokenizer) -> list[int]:
    """End-of-text / end-of-turn ids of a tokenizer (what ``no_early_eos`` forbids, where an answer stops)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    vocab = tokenizer.get_vocab()
    ids |= {vocab[t] for t in ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>") if t in vocab}
    return sorted(ids)


def distinct_n(sequences: list[list[int]], n: int) -> float:
    """Distinct n-grams over all sequences / all n-grams (0 when there are none)."""
    grams = [tuple(s[i : i + n]) for s in sequences for i in range(len(s) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def distinct_n_per_text(sequences: list[list[int]], n: int) -> float | None:
    """Distinct n-grams / n-grams of each text, averaged over the texts that have an n-gram (None if none has)."""
    ratios = [distinct_n([s], n) for s in sequences if len(s) >= n]
    return statistics.fmean(ratios) if ratios else None


def text_prefix_id(tokenizer) -> int:
    """The token a text alone is scored after (the reference's BOS + text): the tokenizer's BOS, else the
    end-of-document token ``<|endoftext|>`` (Qwen3 has no BOS), else its EOS."""
    if tokenizer.bos_token_id is not None:
        return tokenizer.bos_token_id
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return eot if isinstance(eot, int) and eot != tokenizer.unk_token_id else tokenizer.eos_token_id


def reference_text_ids(tokenizer, text: str) -> list[int]:
    """A generated text as the reference trainer scores it alone: the decoded text encoded again by the tokenizer
    with its own special tokens (Llama 3 prepends its BOS, Qwen3 adds nothing), every token after the first scored:
    n - 1 scored tokens where nothing is prepended."""
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def answer_tokens(generated: list[int], end_ids: list[int]) -> list[int]:
    """The answer proper: up to and including the first end token (the rest is EOS padding)."""
    for i, t in enumerate(generated):
        if t in end_ids:
            return generated[: i + 1]
    return generated


class GenerationValidator:
    """Every ``validation.generation_every`` validation rounds (and after the last step): the sampler on the
    prompts of ``validation.generation_eval_path``, then each text's perplexity under the base model (the
    initial value of every trainable parameter restored: LoRA adapters contribute nothing and the norms are the
    original ones; causal attention), pooled and as mean / median per text, both given the prompt and of the text
    alone after :func:`text_prefix_id` (BOS + text, with ``<|endoftext|>`` standing in for a missing BOS), and
    of the text as the reference trainer scores it (``_reference``: :func:`reference_text_ids`, every token after
    the first), the mean NLL per token of each, token counts, distinct-1/2/3 pooled over all texts and per text averaged, and, where the rows carry a reference
    answer, exact match. Every text with its scores goes to ``generation_metrics.jsonl``.

    All ranks run the same forwards (FSDP needs every rank in each forward); rank 0 writes.
    """

    def __init__(self, objective, model: torch.nn.Module):
        from titan_sft.data.chat import load_tokenizer
        from titan_sft.hf_io import resolve_hf_dir

        self.mask_id = objective.mask_id
        cfg = objective.cfg
        self.cfg, v = cfg, cfg.validation
        tok_dir = cfg.model.tokenizer_path or cfg.model.hf_assets_path
        if not tok_dir:
            from titan_sft.data.dataset import PackedDataset

            tok_dir = PackedDataset(cfg.data.path or cfg.data.sources[0].path).manifest.get("tokenizer", "")
        self.tokenizer = load_tokenizer(resolve_hf_dir(tok_dir))
        self.prompts = inline_prompts(v.generation_prompts, self.tokenizer, v.system_prompt)
        if v.generation_eval_path:
            self.prompts += load_prompts(resolve_prompts(v.generation_eval_path), self.tokenizer,
                                         v.max_examples - len(self.prompts), v.system_prompt)
        self.every, self.rounds = v.generation_every, 0
        self.interval = v.interval
        self.row_multiple = cfg.parallelism.tp  # sequence parallel splits every row over the tp ranks
        # The base model: the starting value of every trainable parameter (this rank's shard), kept on the host.
        self.base = {n: p.detach().to_local().cpu().clone() if hasattr(p, "to_local") else p.detach().cpu().clone()
                     for n, p in model.named_parameters() if p.requires_grad}

    def maybe_validate(self, step, total_steps, model, checkpointer) -> list[dict]:
        last = step == total_steps
        if not (last or (self.interval and step % self.interval == 0)):
            return []
        self.rounds += 1
        if not (last or self.rounds % self.every == 0):
            return []
        summary, rows = self.run(model, step)
        if (dist.get_rank() if dist.is_initialized() else 0) == 0:
            path = Path(self.cfg.job.dump_folder) / "generation_metrics.jsonl"
            with open(path, "a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        return [summary]

    def run(self, model: torch.nn.Module, step: int) -> tuple[dict, list[dict]]:
        """Generates for every prompt and scores the answers; under context parallel every cp rank runs whole
        sequences (prompts have any length)."""
        from titan_sft.parallel.context_parallel import full_sequence

        with full_sequence(model):
            return self._run(model, step)

    @torch.no_grad()
    def _run(self, model: torch.nn.Module, step: int) -> tuple[dict, list[dict]]:
        v = self.cfg.validation
        device = next(model.parameters()).device
        end_ids = end_token_ids(self.tokenizer)
        was_training = model.training
        model.eval()
        outs = []
        for i, (prompt, _) in enumerate(self.prompts):
            ids = generate(lambda x: whole_row_logits(model, x, self.row_multiple), torch.tensor(prompt, device=device), mask_id=self.mask_id,
                           gen_length=v.gen_length, block_length=v.block_length, steps=v.gen_steps,
                           temperature=v.temperature, remasking=v.remasking, cfg_scale=v.cfg_scale,
                           forbid_ids=end_ids if v.no_early_eos else None,
                           late_ids=end_ids if v.confidence_eos_eot_inf else None, seed=self.cfg.validation.noise_seed + i,
                           shift=self.cfg.objective.shift)
            outs.append(answer_tokens(ids.tolist(), end_ids))
        texts = [self.tokenizer.decode(toks, skip_special_tokens=True) for toks in outs]
        nll, alone, as_ref = self.base_model_nll(model, [p for p, _ in self.prompts], outs, device,
                                                 [reference_text_ids(self.tokenizer, t) for t in texts])
        model.train(was_training)
        rows, correct, n_ref = [], 0, 0
        ppl = lambda s, n: math.exp(s / n) if n else float("nan")  # noqa: E731
        for i, ((prompt, ref), toks, text, (s, n), (s_alone, _), (s_ref, n_r)) in enumerate(
                zip(self.prompts, outs, texts, nll, alone, as_ref)):
            row = {"step": step, "index": i, "prompt": self.tokenizer.decode(prompt), "text": text,
                   "n_tokens": len(toks), "perplexity": ppl(s, n), "perplexity_text": ppl(s_alone, n),
                   "nll": s / n if n else None, "nll_text": s_alone / n if n else None,
                   "n_tokens_reference": n_r, "perplexity_reference": ppl(s_ref, n_r),
                   "nll_reference": s_ref / n_r if n_r else None}
            if ref is not None:
                ok = _THINK.sub("", text).strip() == _THINK.sub("", ref).strip()
                row["reference"], row["exact_match"] = ref, ok
                correct, n_ref = correct + ok, n_ref + 1
            rows.append(row)
        total_n = sum(n for _, n in nll)
        summary = {"split": "generation", "step": step, "n_texts": len(outs), "n_tokens": total_n,
                   "mean_length": statistics.fmean(len(o) for o in outs) if outs else 0.0}
        for suffix, scores in (("", nll), ("_text", alone), ("_reference", as_ref)):
            total, count = sum(s for s, _ in scores), sum(n for _, n in scores)
            finite = [p for p in (ppl(s, n) for s, n in scores) if math.isfinite(p)]
            summary.update({f"perplexity{suffix}_pooled": math.exp(total / count) if count else None,
                            f"perplexity{suffix}_mean": statistics.fmean(finite) if finite else None,
                            f"perplexity{suffix}_median": statistics.median(finite) if finite else None,
                            f"nll{suffix}_mean": total / count if count else None})
        for n in (1, 2, 3):
            summary[f"distinct_{n}"] = distinct_n(outs, n)
            summary[f"distinct_{n}_per_text"] = distinct_n_per_text(outs, n)
        if n_ref:
            summary["exact_match"] = correct / n_ref
        return summary, rows

    def base_model_nll(self, model, prompts, outs, device, reference_ids) -> tuple[list[tuple[float, int]], ...]:
        """(summed NLL, tokens) of each generated answer given its prompt, of the answer alone after
        :func:`text_prefix_id`, and of ``reference_ids`` (:func:`reference_text_ids`) after their first token, under
        the base model with causal attention: trainable parameters swapped for their starting values, then back."""
        swap_parameters(model, self.base)
        backend = model.backend
        backend.causal = True
        prefix = [text_prefix_id(self.tokenizer)]

        def score(context: list[int], toks: list[int]) -> tuple[float, int]:
            if not toks:
                return 0.0, 0
            ids = torch.tensor([context + toks], device=device)
            logits = whole_row_logits(model, ids, self.row_multiple).float()[0, len(context) - 1 : -1]
            return float(F.cross_entropy(logits, ids[0, len(context):], reduction="sum")), len(toks)

        try:
            return ([score(p, t) for p, t in zip(prompts, outs)], [score(prefix, t) for t in outs],
                    [score(ids[:1], ids[1:]) for ids in reference_ids])
        finally:
            backend.causal = False
            swap_parameters(model, self.base)


def whole_row_logits(model: torch.nn.Module, ids: torch.Tensor, multiple: int) -> torch.Tensor:
    """``model(ids)`` for rows [B, T] of any length on a model whose rows must split evenly into ``multiple``
    sequence slices (tensor parallel's sequence parallel): each row is padded with a second document of filler
    tokens, which attention keeps apart from the row (document isolation, causal or bidirectional), so the row's
    logits are those of the row alone; the filler's are dropped."""
    b, t = ids.shape
    pad = -t % multiple
    if not pad:
        return model(ids)
    row = t + pad
    starts = torch.arange(b, dtype=torch.int32, device=ids.device) * row
    cu = torch.cat([torch.stack([starts, starts + t], 1).flatten(), starts.new_tensor([b * row])])
    return model(torch.cat([ids, ids.new_zeros(b, pad)], 1), cu_seqlens=cu)[:, :t]


def swap_parameters(model: torch.nn.Module, store: dict[str, torch.Tensor]) -> None:
    """Exchanges the named parameters' local values with ``store`` (in place, both ways). FSDP modules are
    resharded first, so no unsharded copy of the old values outlives the swap."""
    from torch.distributed.fsdp import FSDPModule

    for m in [*model.modules(), *getattr(model, "stage_modules", [])]:  # a pipeline's stage roots too
        if isinstance(m, FSDPModule):
            m.reshard()
    params = dict(model.named_parameters())
    for name, saved in store.items():
        local = params[name].detach()
        local = local.to_local() if hasattr(local, "to_local") else local
        tmp = local.cpu().clone()
        local.copy_(saved.to(local.device))
        store[name] = tmp


BUILTIN_PROMPTS = Path(__file__).resolve().parent / "assets" / "generation_prompts.jsonl"


def resolve_prompts(path: str) -> str:
    """``builtin``: the shipped 30 varied prompts (user turns without references, as the reference trainer's
    built-in list); anything else is a JSONL path."""
    return str(BUILTIN_PROMPTS) if path == "builtin" else path


def with_system(messages: list, system_prompt: str) -> list:
    """``messages`` with ``system_prompt`` as a leading system turn, unless empty or the chat has its own."""
    if not system_prompt or any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def _encode_prompt(tokenizer, messages: list) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def inline_prompts(texts: list[str], tokenizer, system_prompt: str = "") -> list[tuple[list[int], None]]:
    """(prompt ids, None) per user turn given inline (``validation.generation_prompts``)."""
    return [(_encode_prompt(tokenizer, with_system([{"role": "user", "content": t}], system_prompt)), None)
            for t in texts]


def load_prompts(path: str, tokenizer, limit: int, system_prompt: str = "") -> list[tuple[list[int], str | None]]:
    """(prompt ids, reference answer or None) per row of a chat / instruction JSONL (the last assistant turn is
    the reference; a chat row ending with a user turn is a prompt without one), at most ``limit``; a row without
    a system turn gets ``system_prompt`` (when not empty)."""
    from titan_sft.data.prepare_diffusion import examples_from_row

    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if len(out) >= limit:
            break
        if not line.strip():
            continue
        row = json.loads(line)
        msgs = row.get("messages")
        if isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict) and msgs[-1].get("role") == "user":
            out.append((_encode_prompt(tokenizer, with_system(msgs, system_prompt)), None))
        else:
            try:
                prompt_msgs, answer, _ = examples_from_row(row, np.random.default_rng(0), -1, 1.0)[-1]
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
            out.append((_encode_prompt(tokenizer, with_system(prompt_msgs, system_prompt)), answer["content"]))
    return out
