"""Typed run configuration: TOML file + ``--section.key VALUE`` overrides -> ``JobConfig``.

Every key lives in a dataclass below, so an unknown section or key, a value of the wrong type, or an
impossible combination is caught here, before any work, with one line that names the key. The names of
``docs/formats.md`` and the README are what users script against; keep them stable.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                # Qwen3.5's Gated DeltaNet projections (transformers' names)
                "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the key and what is allowed."""


def doc(default: Any, text: str) -> Any:
    """A config field with its one-line doc (printed by ``python -m titan_sft.train --help``)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


@dataclass
class Job:
    dump_folder: str = doc("./outputs", "output directory: metrics, TensorBoard, checkpoints, HF exports")
    description: str = doc("", "free text shown at start and stored with the run (TensorBoard, W&B notes)")
    seed: int = doc(0, "seed of the random init and of anything else the run draws")
    custom_imports: list[str] = doc([], "modules imported before anything is built; they register models, "
                                        "objectives or converters")


@dataclass
class Model:
    name: str = doc("qwen3", "registered model family (qwen3, llama3, or one registered by custom_imports)")
    flavor: str = doc("debug", "size of the family (debug, 0.6B ... 32B, 8B, 70B); with init_from_hf only a dry "
                               "run without the HF directory on disk plans from it")
    hf_assets_path: str = doc("", "HF directory for config, tokenizer and (with init_from_hf) weights")
    init_from_hf: bool = doc(False, "start from the weights and config.json in hf_assets_path")
    tokenizer_path: str = doc("", "tokenizer directory; empty means hf_assets_path (then the dataset's)")
    freeze_router: bool = doc(False, "models with routed experts: the routers' weights do not train (the base "
                                     "model's routing is kept)")
    router_bias_rate: float = doc(0.0, "models with routed experts: auxiliary-loss-free balancing (DeepSeek-V3; "
                                       "torchtitan's load_balance_coeff, e.g. 1e-3): after each step every MoE "
                                       "layer's routing bias moves this much towards its under-loaded experts; the "
                                       "bias picks experts, never weights them; 0 disables it")
    attention: Literal["auto", "sdpa", "flex", "varlen", "flash_varlen"] = doc(
        "sdpa", "attention backend: sdpa (everywhere), flex, varlen (torch's varlen kernels, GPU, bf16), flash_varlen "
                "(flash-attn, GPU, bf16), auto (GPU: flash_varlen where flash-attn is installed, else varlen; CPU: sdpa)")
    yarn_factor: float = doc(0.0, "YaRN RoPE context extension over the checkpoint's RoPE (Qwen3: 4.0 with "
                                   "yarn_original_positions 32768 reaches 131072 tokens); 0: as the HF config or "
                                   "flavor says; written into exported config.json")
    yarn_original_positions: int = doc(32768, "with yarn_factor: the context length the model was pretrained for "
                                              "(YaRN's original_max_position_embeddings)")
    reset_positions_per_document: bool = doc(False, "RoPE positions restart at 0 in every packed document")
    converters: list[str] = doc([], "extra model converters by registered name, applied in order before "
                                    "sharding (float8 is switched by training.float8)")


@dataclass
class Objective:
    name: str = doc("causal_lm", "training objective: causal_lm (the recipe), masked_diffusion, or a registered one")
    # masked_diffusion (docs/masked_diffusion.md)
    mask_token_id: int = doc(-1, "masked_diffusion: id of the mask token; -1: the first embedding row past the "
                                 "tokenizer (Qwen3: 151669), else its last reserved special token (Llama 3)")
    t_min: float = doc(0.1, "masked_diffusion: noise level t ~ Uniform(t_min, 1) per example (LLaDA: 1e-3)")
    normalization: Literal["per_example", "per_token"] = doc(
        "per_example", "masked_diffusion: 1/t-weighted CE summed per example over its answer length, mean over "
                       "examples (LLaDA), or summed over the batch / all supervised positions")
    shift: bool = doc(False, "masked_diffusion: position i predicts token i+1 (Dream); false predicts token i "
                             "(LLaDA)")
    eos_padding_loss: bool = doc(False, "masked_diffusion on an --eos-pad dataset: the end-of-turn padding is "
                                        "noised and supervised as part of the answer (normalised by answer + "
                                        "padding); false keeps it clean and unsupervised (the reference's default)")
    split_loss: bool = doc(False, "masked_diffusion: answer and EOS-padding losses normalised separately and "
                                  "mixed by answer_weight / padding_weight (needs an --eos-pad dataset and "
                                  "eos_padding_loss)")
    answer_weight: float = doc(0.9, "masked_diffusion with split_loss: weight of the answer part")
    padding_weight: float = doc(0.1, "masked_diffusion with split_loss: weight of the padding part")
    router_aux_loss_coef: float = doc(-1.0, "models with routed experts: weight of transformers' load-balancing "
                                            "loss added to each forward's loss; -1 takes the model config's "
                                            "router_aux_loss_coef (Qwen3-MoE: 0.001), 0 disables it")
    router_z_loss_coef: float = doc(0.0, "models with routed experts: weight of the ST-MoE router z-loss (mean "
                                         "logsumexp(router logits)^2 per MoE layer, summed); 0 disables it")


@dataclass
class DataSource:
    """One source of a mixture (``[[data.sources]]``)."""

    name: str = doc("", "the source's name in train records, validation records and errors")
    path: str = doc("", "its packed dataset directory (prepare or prepare_diffusion output)")
    weight: float = doc(1.0, "its share of the packs drawn (the weights are normalised to sum 1)")
    max_epochs: float = doc(0.0, "stop drawing from it after this many passes over its packs (0: no cap); the "
                                 "other sources' weights are then renormalised")


@dataclass
class Data:
    path: str = doc("", "packed dataset directory (python -m titan_sft.data.prepare); or data.sources")
    sources: list[DataSource] = doc([], "a weighted mixture instead of data.path: [[data.sources]] tables with "
                                        "name, path, weight and max_epochs (docs: README, Data mixtures)")
    shuffle: bool = doc(False, "visit packs in a seeded random order instead of the recipe's sequential one")
    seq_len: int = doc(0, "the packed row length the data must have (0: as prepared); a dry run plans activation "
                          "memory with it before the data exists")
    shuffle_seed: int = doc(0, "seed of that order")
    reshuffle_each_epoch: bool = doc(False, "with shuffle: a new seeded order every epoch (the reference diffusion "
                                            "trainer) instead of one order repeated")
    skip_examples: int = doc(0, "start this many packed examples into the data order (continue where another "
                                "run, e.g. the one a warm start's adapter came from, stopped); a resume keeps it")
    allow_tokenizer_mismatch: bool = doc(False, "train on a dataset whose recorded tokenizer or chat template "
                                                "hash differs from the run's tokenizer (otherwise a start-up error)")


@dataclass
class Training:
    steps: int = doc(0, "optimizer steps; 0 = training.epochs over the packed data")
    epochs: int = doc(8, "with steps = 0: passes over the packed data (8: the recipe; 1: the reference diffusion "
                         "trainer)")
    stop_at_step: int = doc(0, "stop cleanly with a checkpoint after this many steps, keeping the schedule of "
                               "steps; 0 runs to the end")
    global_batch_size: int = doc(8, "packed examples per optimizer step, all ranks together")
    per_device_batch: int = doc(1, "packed examples per forward on one rank (microbatch); must divide the "
                                   "per-rank batch")
    loss_groups: int = doc(1, "the step loss is the mean over this many groups of consecutive examples of each "
                              "group's token mean")
    max_grad_norm: float = doc(1.0, "clip to this global L2 norm; 0 disables clipping")
    param_dtype: Literal["bfloat16", "float32"] = doc("bfloat16", "dtype of forward/backward compute")
    reduce_dtype: Literal["float32", "bfloat16"] = doc("float32", "dtype of gradient reduction across ranks")
    loss_chunk_size: int = doc(4096, "tokens per chunk of the output head + cross-entropy")
    activation_checkpoint: Literal["none", "full", "selective", "every_n"] = doc(
        "none", "recompute in backward: whole blocks (full), all but matmul/attention outputs (selective, per op), "
                "or whole blocks, every ac_every_n-th one (every_n)")
    ac_every_n: int = doc(2, "with activation_checkpoint = every_n: checkpoint blocks 0, n, 2n, ...")
    compile: bool = doc(False, "torch.compile each transformer block (fullgraph: a graph break is an error; "
                                "a Gated DeltaNet block's delta rule runs eagerly between compiled parts)")
    compile_loss: bool = doc(False, "torch.compile the loss's per-chunk softmax/cross-entropy math (fuses its "
                                    "passes over the [chunk, vocab] logits; the head's matmuls are unchanged)")
    float8: bool = doc(False, "float8 matmuls in the blocks (torchao; SM >= 8.9, else bf16; emulated on CPU)")
    float8_backend: Literal["torchao", "te"] = doc(
        "torchao", "float8 implementation: torchao, or Transformer Engine linears (te; SM 8.9 / 9.0+, pip install "
                   "transformer-engine[pytorch])")
    float8_recipe: Literal["rowwise", "tensorwise", "rowwise_with_gw_hp"] = doc(
        "rowwise", "torchao float8 scaling: rowwise (default: keeps documents isolated), tensorwise (fastest; "
                   "with float8 FSDP all-gather on GPU), rowwise_with_gw_hp (weight gradients in high precision)")
    te_format: Literal["HYBRID", "E4M3"] = doc(
        "HYBRID", "Transformer Engine float8 format: HYBRID (E4M3 forward, E5M2 gradients) or E4M3 throughout")
    te_margin: int = doc(0, "Transformer Engine delayed scaling: margin (scale by 2**-margin below the amax)")
    te_interval: int = doc(1, "Transformer Engine delayed scaling: steps between scale updates (TE < 2 only)")
    te_amax_history_len: int = doc(1024, "Transformer Engine delayed scaling: amax history length")
    te_amax_compute_algo: Literal["max", "most_recent"] = doc(
        "max", "Transformer Engine delayed scaling: the amax of the history (max) or the last step's")
    te_override_linear_precision: list[bool] = doc(
        [False, False, False], "Transformer Engine: run fprop, dgrad, wgrad of the linears in high precision")
    skip_startup_checks: bool = doc(False, "skip the document-isolation start-up check (the loss-denominator "
                                           "check of the first step always runs)")
    deterministic: bool = doc(False, "torch.use_deterministic_algorithms(True)")
    skip_empty_loss_groups: bool = doc(False, "skip (count and report) a step with a loss group that has no loss "
                                              "token, instead of stopping with the packs and source rows named")


@dataclass
class Optimizer:
    name: Literal["adamw", "adamw8bit"] = doc("adamw", "optimizer: adamw (adamw8bit, bitsandbytes' 8-bit states, is refused for now: no FSDP2 support)")
    lr: float = doc(2e-5, "peak learning rate (before lr_scaling)")
    lr_scaling: Literal["none", "sqrt", "linear"] = doc(
        "none", "scale lr by (global_batch_size / reference_batch), square root or linear")
    reference_batch: int = doc(8, "batch the lr was tuned for (lr_scaling)")
    beta1: float = doc(0.9, "AdamW beta1")
    beta2: float = doc(0.999, "AdamW beta2")
    eps: float = doc(1e-8, "AdamW epsilon")
    weight_decay: float = doc(0.0, "decoupled weight decay (decay_mask says on which parameters)")
    decay_mask: Literal["recipe", "all"] = doc(
        "recipe", "recipe: no decay on norms, the token embedding or biases; all: every trainable parameter (the "
                  "masked-diffusion reference script's)")
    fused: bool = doc(False, "fused AdamW kernel (GPU)")
    foreach: bool = doc(True, "multi-tensor AdamW; ignored when fused")


@dataclass
class LRScheduler:
    name: Literal["levanter", "linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                  "constant_with_warmup", "inverse_sqrt", "cosine_with_min_lr"] = doc("levanter", "levanter (warmup -> stable -> decay, the recipe's), or a transformers scheduler: "
                                "linear, cosine, cosine_with_restarts, polynomial, constant, constant_with_warmup, "
                                "inverse_sqrt, cosine_with_min_lr (transformers' get_scheduler, its defaults)")
    warmup: float = doc(0.0, "linear warmup: <= 1 a fraction of the steps, > 1 whole steps")
    warmup_steps: int = doc(-1, "linear warmup as a count of steps (0 = none); -1 uses lr_scheduler.warmup")
    decay: float = doc(1.0, "levanter: decay phase at the end, same rule as warmup; the steps between are stable")
    min_lr_ratio: float = doc(0.0, "final LR as a fraction of the peak (levanter, cosine_with_min_lr)")
    decay_type: Literal["cosine", "linear", "constant"] = doc("cosine", "levanter: shape of the decay phase")


@dataclass
class Checkpoint:
    enable: bool = doc(True, "save DCP checkpoints and resume from them")
    interval: int = doc(20, "checkpoint every this many steps (Levanter labels)")
    hf_export_interval: int = doc(100, "HF export every this many steps; 0 only after the final step; -1 never")
    temp_interval_minutes: float = doc(10.0, "minutes between temporary checkpoints (overwritten); 0 disables")
    keep_latest_k: int = doc(0, "regular checkpoints to keep; 0 keeps all")
    resume: str = doc("auto", "auto (newest complete checkpoint), none, or a checkpoint path (a weights-only one "
                              "from `convert from-hf` is the starting point: the run still resumes its own)")
    frozen_base: Literal["identity", "stored"] = doc(
        "identity", "a run with frozen parameters (LoRA's base): identity stores the trainable state and the base's "
                    "source and fingerprint, the base is rebuilt on resume; stored writes the whole model")
    async_mode: Literal["disabled", "async"] = doc(
        "disabled", "async: stage the state in host memory and write it in the background")
    hf_export_dtype: Literal["bfloat16", "float32", "float16"] = doc("bfloat16", "dtype of HF exports")
    write_threads: int = doc(4, "threads per rank writing a DCP checkpoint's files (1 serialises, writes and "
                                "fsyncs one file at a time)")
    hf_max_shard_size_gb: float = doc(5.0, "largest safetensors file of an HF export, in GB")
    hf_generation_config: bool = doc(True, "write generation_config.json (EOS ids incl. the chat end-of-turn "
                                           "token, so vLLM stops at the end of a turn); false reproduces the "
                                           "reference export")


@dataclass
class Metrics:
    log_freq: int = doc(1, "log every this many steps (and the last)")
    enable_tensorboard: bool = doc(True, "write TensorBoard event files under <dump_folder>/tb")
    wandb_project: str = doc("", "Weights & Biases project; empty disables W&B")
    wandb_id: str = doc("", "W&B run id to resume; empty starts a new run")
    wandb_run_name: str = doc("", "W&B run name; empty: the run folder's name (job.dump_folder)")
    wandb_reference_keys: bool = doc(
        False, "also log the Levanter-port SFT script's W&B keys by its definitions: train/tokens (loss targets), "
               "train/step_time (s) and train/lr as the next update's lr (titan_sft's step lr moves to "
               "train/lr_step), so its dashboards keep working")
    progress_bar: Literal["auto", True, False] = doc(
        "auto", "a live progress bar (rank 0: step, running loss, rate, ETA) under the log lines; auto: when "
                "stderr is a terminal")


@dataclass
class ValidationSource:
    """One held-out set of ``[[validation.sources]]``."""

    name: str = doc("", "the source's name in its validation records (a training source's, to share its weight)")
    path: str = doc("", "its packed held-out dataset directory")
    weight: float = doc(0.0, "its weight in the weighted mean; 0: the weight of the training source of the same "
                             "name, else 1")


@dataclass
class Validation:
    generation_eval_path: str = doc("", "JSONL of held-out chats: after the final export, greedy decoding of "
                                        "each prompt and exact match with the last assistant turn; empty disables; "
                                        "masked_diffusion: \"builtin\" is a shipped list of 30 varied prompts")
    max_new_tokens: int = doc(32, "tokens generated per held-out prompt")
    max_examples: int = doc(200, "held-out prompts evaluated at most")
    path: str = doc("", "packed dataset for the held-out loss (prepare's output); empty: none, or holdout_fraction")
    sources: list[ValidationSource] = doc([], "several held-out sets instead of path: [[validation.sources]] tables "
                                              "(name, path, weight); one record per source and their weighted mean")
    best_source: str = doc("", "with validation.sources: keep_best follows this source's loss; empty: the "
                               "weighted mean")
    holdout_fraction: float = doc(0.0, "hold this fraction of the training packs out for the held-out loss "
                                       "(seeded split; they are not trained on)")
    holdout_seed: int = doc(0, "seed of that split")
    max_packs: int = doc(0, "held-out and test loss: evaluate only the first this many packs of the split (0: all)")
    max_loss_examples: int = doc(0, "masked_diffusion held-out loss: only the first this many examples of each "
                                    "held-out set, counted in examples whatever the packing (0: all; the reference "
                                    "trainer's validation_samples); the test split is evaluated whole")
    batch_size: int = doc(0, "packs per forward in held-out and test evaluation (0: training.per_device_batch)")
    interval: int = doc(0, "held-out loss every this many steps (and after the last); 0: only after the last")
    keep_best: Literal["auto", True, False] = doc(
        "auto", "keep the checkpoint with the lowest held-out loss in checkpoints-best/ (LoRA: and adapters/best); "
                "auto: on when a held-out set is given (path or holdout_fraction)")
    best_only: bool = doc(False, "with keep_best: no regular checkpoints, only the best one (and the temporary "
                                 "one that preemption needs)")
    test_path: str = doc("", "masked_diffusion: packed test split, evaluated once after the last step with the "
                             "best checkpoint's weights (the final ones without keep_best)")
    noise_seed: int = doc(1234, "masked_diffusion: seed of the validation noise (t and masks follow from it and "
                                "the example index, so the loss is comparable across steps and runs)")
    generation_every: int = doc(0, "masked_diffusion: generation validation on generation_prompts and "
                                   "generation_eval_path every this "
                                   "many validation rounds (and after the last step); 0 disables")
    gen_length: int = doc(32, "masked_diffusion sampler: answer tokens generated (a multiple of block_length)")
    gen_steps: int = doc(32, "masked_diffusion sampler: denoising steps in all (a multiple of the blocks)")
    block_length: int = doc(32, "masked_diffusion sampler: tokens per semi-autoregressive block")
    temperature: float = doc(0.0, "masked_diffusion sampler: Gumbel temperature (0 = argmax)")
    remasking: Literal["low_confidence", "random"] = doc("low_confidence", "masked_diffusion sampler: confidence "
                                                                           "used to pick the tokens revealed")
    cfg_scale: float = doc(0.0, "masked_diffusion sampler: classifier-free guidance scale (0 disables)")
    no_early_eos: bool = doc(False, "masked_diffusion sampler: never generate end-of-text/turn tokens (their "
                                    "logits set to -inf before sampling)")
    confidence_eos_eot_inf: bool = doc(False, "masked_diffusion sampler, the reference trainer's option: a drawn "
                                              "end-of-text/turn token gets the lowest confidence, so it is revealed "
                                              "after every other masked position of its block (still generated)")
    system_prompt: str = doc("", "masked_diffusion generation validation: a system turn for every prompt without "
                                 "one; empty: none")
    generation_prompts: list[str] = doc([], "masked_diffusion generation validation: user turns given inline, "
                                            "evaluated before generation_eval_path's prompts (which may be empty)")


@dataclass
class Lora:
    rank: int = doc(16, "LoRA rank r (model.converters = [\"lora\"] switches LoRA on)")
    alpha: float = doc(32.0, "LoRA alpha; the update is scaled by alpha / rank")
    dropout: float = doc(0.0, "dropout on the LoRA branch's input")
    targets: list[str] = doc(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                             "projections given adapters, by HF name")
    train_norms: bool = doc(True, "train the RMSNorm weights too (saved with the adapter)")
    use_rslora: bool = doc(False, "rank-stabilised LoRA: scale the update by alpha / sqrt(rank) instead of alpha / rank")
    use_dora: bool = doc(False, "DoRA: a trained magnitude per output row of each adapted linear (PEFT's use_dora); "
                                "not with tensor parallel, float8 or lora.experts")
    base_quant: Literal["none", "nf4"] = doc(
        "none", "QLoRA: 'nf4' stores the frozen linear and expert weights of the blocks in 4-bit NormalFloat "
                "(torchao's format; embedding, head, norms and routers stay as they are), dequantized per matmul")
    experts: bool = doc(False, "models with routed experts: also adapt every expert's weights among the targets "
                               "(gate/up/down_proj), with per-expert factors stored stacked")
    init_from: str = doc("", "warm start: a PEFT LoRA adapter directory (titan_sft's adapters/* or peft's) whose "
                             "adapters (and trained norms, also the reference trainer's normalization_state.pt) "
                             "replace the initial ones; its r must equal rank")
    adapter_interval: int = doc(0, "adapter-only snapshots adapters/step-<L> every this many steps (Levanter's step "
                                   "labels), apart from the merged exports; 0 = none")


@dataclass
class Parallelism:
    dp_replicate: int = doc(1, "data-parallel replicas (HSDP across groups of ranks)")
    dp_shard: int = doc(-1, "FSDP shards per replica; -1 = the rest of the ranks")
    tp: int = doc(1, "tensor-parallel degree (with sequence parallel and a vocab-parallel loss)")
    ep: int = doc(1, "expert-parallel degree (models with routed experts): each expert lives on one of ep "
                     "data-parallel ranks within dp_shard, tokens reach it by all-to-all; FSDP shards the experts "
                     "over the other dp_shard / ep ranks")
    cp: int = doc(1, "context-parallel degree: every packed row is split along the sequence across cp ranks, which "
                     "read the same data; attention exchanges them (cp_mode)")
    cp_mode: Literal["ulysses", "ring"] = doc(
        "ulysses", "context-parallel attention: 'ulysses' (all-to-all to head shards; any backend, heads per tp "
                   "rank divisible by cp) or 'ring' (keys/values all-gathered, head-tail load balancing; sdpa/flex)")
    pp: int = doc(1, "pipeline-parallel degree: the layers are cut into stages on pp groups of ranks (the outermost "
                     "mesh dimension), which pass activations; every pp rank of a data-parallel rank reads its data")
    pp_schedule: Literal["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "GPipe"] = doc(
        "1F1B", "pipeline schedule (torch.distributed.pipelining; ZBVZeroBubble is refused for now); multi-stage ones run "
                "pp_stages_per_rank stages per rank (ZBV: exactly 2, in a V: rank r holds stages r and 2pp-1-r)")
    pp_stages_per_rank: int = doc(2, "stages per rank of the multi-stage schedules (Interleaved1F1B, ZBVZeroBubble)")
    pp_microbatch_size: int = doc(0, "rows per pipeline microbatch; 0 = training.per_device_batch (set, it replaces "
                                     "per_device_batch: the pipeline's microbatches are the step's microbatches)")
    pp_layers: list[int] = doc([], "layers per stage, in stage order (they sum to the model's layers); empty = even "
                                   "split, with pp_first_last_lighter fewer on the first and last stage")
    pp_first_last_lighter: int = doc(0, "layers fewer on the first and the last stage than on the others (they "
                                        "also hold the embedding, and the norm and output head); even split only")
    grad_reduce: Literal["per_microbatch", "last_microbatch"] = doc(
        "per_microbatch", "reduce-scatter gradients after every microbatch (sharded memory) or only after the "
                          "last (one collective, but unsharded fp32 gradients in between)")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    objective: Objective = field(default_factory=Objective)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    lora: Lora = field(default_factory=Lora)
    parallelism: Parallelism = field(default_factory=Parallelism)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def write_resolved(self, path: str | Path, derived: dict | None = None) -> None:
        """Writes ``resolved_config.json`` atomically (temporary sibling, then rename); ``derived``: what the run
        derived from the settings (its own section)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text(json.dumps({**self.to_dict(), **({"derived": derived} if derived else {})}, indent=2) + "\n")
        tmp.replace(path)


# --------------------------------------------------------------------------------------------------
# Parsing and coercion


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def _closest(name: str, options: list[str]) -> str:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        elem = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(elem):
            return f"an array of tables with {', '.join(_field_names(elem))}"
        return f"a list of {_describe(elem)}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _coerce(key: str, tp: Any, value: Any, from_cli: bool) -> Any:
    """Converts ``value`` to ``tp``; CLI values arrive as strings, TOML values keep their types."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"config key '{key}': got {value!r}, expected {_describe(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if from_cli and isinstance(value, str) and True in allowed and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if value not in allowed or (isinstance(value, (bool, int)) and not any(
                type(a) is type(value) and a == value for a in allowed)):
            raise bad
        return value
    if origin is list:
        (elem,) = typing.get_args(tp)
        if dataclasses.is_dataclass(elem):  # an array of tables; on the command line a JSON list of objects
            if from_cli and isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError:
                    raise bad from None
            if not isinstance(value, list):
                raise bad
            return [_table(f"{key}[{i}]", elem, v, from_cli) for i, v in enumerate(value)]
        if from_cli and isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise bad
        return [_coerce(key, elem, v, from_cli) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if from_cli and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad from None
        raise bad
    if tp is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            return float(value)
        if from_cli and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise TypeError(f"unsupported config type {tp} for {key}")  # a bug in this file, not user input


def _table(key: str, cls: type, value: Any, from_cli: bool) -> Any:
    """One table of an array of tables (``[[data.sources]]``) as its dataclass; unknown keys name the table."""
    if not isinstance(value, dict):
        raise ConfigError(f"config key '{key}': got {value!r}, expected a table ({', '.join(_field_names(cls))})")
    hints = typing.get_type_hints(cls)
    unknown = [k for k in value if k not in hints]
    if unknown:
        raise ConfigError(f"config key '{key}.{unknown[0]}': unknown{_closest(unknown[0], list(hints))}; known: "
                          f"{', '.join(hints)}")
    return cls(**{k: _coerce(f"{key}.{k}", hints[k], v, from_cli) for k, v in value.items()})


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _set(cfg: JobConfig, section: str, key: str, value: Any, from_cli: bool, where: str) -> None:
    sections = _sections()
    if section not in sections:
        raise ConfigError(
            f"{where}unknown config section '[{section}]'{_closest(section, list(sections))}; "
            f"known: {', '.join(sections)}"
        )
    sec_obj = getattr(cfg, section)
    hints = typing.get_type_hints(type(sec_obj))
    if key not in hints:
        raise ConfigError(
            f"{where}unknown config key '{section}.{key}'{_closest(key, list(hints))}; "
            f"known in [{section}]: {', '.join(hints)}"
        )
    try:
        setattr(sec_obj, key, _coerce(f"{section}.{key}", hints[key], value, from_cli))
    except ConfigError as e:
        raise ConfigError(f"{where}{e}") from None


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """Parses ``--section.key VALUE`` / ``--section.key=VALUE`` into (section, key, value) triples.

    A key followed by another ``--`` option or nothing is a boolean switch set to ``true``.
    """
    out: list[tuple[str, str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument '{arg}': overrides look like --section.key VALUE")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
            else:
                value = "true"
        section, _, key = name.partition(".")
        out.append((section.replace("-", "_"), key.replace("-", "_"), value))
        i += 1
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Builds a validated ``JobConfig`` from an optional TOML file and CLI overrides.

    Args:
        path: TOML file; ``None`` uses the defaults.
        overrides: ``["--training.steps", "20", "--optimizer.lr=1e-4", ...]``.

    Raises:
        ConfigError: one line naming the file or key and what is allowed.
    """
    cfg = JobConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key '{section}' must be a [section] table")
            for key, value in table.items():
                _set(cfg, section, key, value, from_cli=False, where=f"{path}: ")
    for section, key, value in parse_overrides(overrides or []):
        _set(cfg, section, key, value, from_cli=True, where="command line: ")
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Checks ranges and combinations that a single key's type cannot express."""

    def need(ok: bool, key: str, allowed: str, value: Any) -> None:
        if not ok:
            raise ConfigError(f"config key '{key}': got {value!r}, allowed: {allowed}")

    t, o, s, c = cfg.training, cfg.optimizer, cfg.lr_scheduler, cfg.checkpoint
    pp = cfg.parallelism
    need(cfg.model.router_bias_rate >= 0, "model.router_bias_rate", ">= 0 (0 disables the routing bias)",
         cfg.model.router_bias_rate)
    need(pp.pp_microbatch_size >= 0, "parallelism.pp_microbatch_size", ">= 0 (0: training.per_device_batch)",
         pp.pp_microbatch_size)
    need(pp.pp_first_last_lighter >= 0, "parallelism.pp_first_last_lighter", ">= 0", pp.pp_first_last_lighter)
    if pp.pp > 1 and pp.pp_microbatch_size:
        t.per_device_batch = pp.pp_microbatch_size  # the pipeline's microbatches are the step's
    need(t.steps >= 0, "training.steps", ">= 0 (0 = training.epochs)", t.steps)
    need(t.epochs >= 1, "training.epochs", ">= 1", t.epochs)
    need(cfg.data.skip_examples >= 0, "data.skip_examples", ">= 0", cfg.data.skip_examples)
    need(not cfg.data.reshuffle_each_epoch or cfg.data.shuffle, "data.reshuffle_each_epoch",
         "true only together with data.shuffle = true", cfg.data.reshuffle_each_epoch)
    src = cfg.data.sources
    need(not (src and cfg.data.path), "data.sources", "either data.path or data.sources, not both", cfg.data.path)
    names = [x.name for x in src]
    for i, x in enumerate(src):
        need(bool(x.name) and x.name not in names[:i], f"data.sources[{i}].name", "a non-empty name no other source has",
             x.name)
        need(bool(x.path), f"data.sources[{i}].path", "a packed dataset directory", x.path)
        need(x.weight > 0 and math.isfinite(x.weight), f"data.sources[{i}].weight", "a positive number", x.weight)
        need(x.max_epochs >= 0, f"data.sources[{i}].max_epochs", ">= 0 (0: no cap)", x.max_epochs)
    need(not (src and cfg.validation.holdout_fraction), "validation.holdout_fraction",
         "0 with data.sources (give validation.path)", cfg.validation.holdout_fraction)
    need(t.stop_at_step >= 0, "training.stop_at_step", ">= 0 (0 = run to the end)", t.stop_at_step)
    need(t.global_batch_size >= 1, "training.global_batch_size", ">= 1", t.global_batch_size)
    need(t.per_device_batch >= 1, "training.per_device_batch", ">= 1", t.per_device_batch)
    need(t.loss_groups >= 1, "training.loss_groups", ">= 1", t.loss_groups)
    need(
        t.global_batch_size % t.loss_groups == 0,
        "training.loss_groups",
        f"a divisor of training.global_batch_size ({t.global_batch_size})",
        t.loss_groups,
    )
    need(t.max_grad_norm >= 0, "training.max_grad_norm", ">= 0 (0 disables clipping)", t.max_grad_norm)
    need(t.loss_chunk_size >= 1, "training.loss_chunk_size", ">= 1", t.loss_chunk_size)
    need(t.ac_every_n >= 1, "training.ac_every_n", ">= 1", t.ac_every_n)
    need(o.lr >= 0, "optimizer.lr", ">= 0", o.lr)
    need(0 <= o.beta1 < 1, "optimizer.beta1", "0 <= beta1 < 1", o.beta1)
    need(0 <= o.beta2 < 1, "optimizer.beta2", "0 <= beta2 < 1", o.beta2)
    need(o.eps > 0, "optimizer.eps", "> 0", o.eps)
    need(o.weight_decay >= 0, "optimizer.weight_decay", ">= 0", o.weight_decay)
    need(o.reference_batch >= 1, "optimizer.reference_batch", ">= 1", o.reference_batch)
    need(o.name != "adamw8bit", "optimizer.name", "'adamw' for training: adamw8bit does not run under FSDP2 yet "
         "(bitsandbytes' 8-bit update takes plain tensors, not the DTensor shards FSDP2 trains: it fails at step 1, "
         "and its blockwise states are not DCP-checkpointable)", o.name)
    ob = cfg.objective
    need(0 <= ob.t_min < 1, "objective.t_min", "0 <= t_min < 1", ob.t_min)
    for key, w in (("answer_weight", ob.answer_weight), ("padding_weight", ob.padding_weight)):
        need(math.isfinite(w) and w >= 0, f"objective.{key}", "a finite number >= 0", w)
    need(not ob.split_loss or abs(ob.answer_weight + ob.padding_weight - 1) < 1e-9, "objective.padding_weight",
         f"answer_weight + padding_weight = 1 (answer_weight is {ob.answer_weight})", ob.padding_weight)
    need(not ob.split_loss or ob.eos_padding_loss, "objective.split_loss",
         "false unless objective.eos_padding_loss is true (the split weights the supervised padding)", ob.split_loss)
    lo = cfg.lora
    need(lo.rank >= 1, "lora.rank", ">= 1", lo.rank)
    need(lo.adapter_interval >= 0, "lora.adapter_interval", ">= 0 (0: no snapshots)", lo.adapter_interval)
    need(0 <= lo.dropout < 1, "lora.dropout", "0 <= dropout < 1", lo.dropout)
    need(bool(lo.targets) and set(lo.targets) <= set(LORA_TARGETS), "lora.targets",
         f"a non-empty list of {', '.join(LORA_TARGETS)}", lo.targets)
    need(not lo.experts or bool({"gate_proj", "up_proj", "down_proj"} & set(lo.targets)), "lora.experts",
         "false unless lora.targets holds an expert weight (gate_proj, up_proj, down_proj)", lo.experts)
    need(not lo.experts or lo.rank % 8 == 0, "lora.rank", "a multiple of 8 with lora.experts (the grouped GEMM "
         "needs 16-byte strides: rank 8 in bf16)", lo.rank)
    for why, clash in (("parallelism.tp > 1", cfg.parallelism.tp > 1), ("training.float8", t.float8),
                       ("lora.experts", lo.experts)):
        # the row norms of W + sBA are not computed on tensor-parallel shards or float8 weights, and PEFT has
        # no DoRA on routed experts
        need(not (lo.use_dora and clash and "lora" in cfg.model.converters), "lora.use_dora",
             f"false with {why} (DoRA runs on whole rows of a high-precision weight: FSDP, cp, pp and ep are fine)",
             lo.use_dora)
    need(lo.base_quant == "none" or "lora" in cfg.model.converters, "lora.base_quant",
         "'none' unless model.converters holds \"lora\" (the base is only frozen under LoRA)", lo.base_quant)
    need(lo.base_quant == "none" or importlib.util.find_spec("torchao") is not None, "lora.base_quant",
         "'none' unless torchao is installed (pip install torchao: its NF4 quantization)", lo.base_quant)
    for why, clash in (("parallelism.tp > 1", cfg.parallelism.tp > 1), ("parallelism.ep > 1", cfg.parallelism.ep > 1),
                       ("training.float8", t.float8), ("lora.use_dora", lo.use_dora)):
        # NF4 weights are flat codes: no tensor-parallel or expert placement of rows, no float8 of them, and
        # DoRA's row norms would need whole rows of each weight
        need(not (lo.base_quant == "nf4" and clash and "lora" in cfg.model.converters), "lora.base_quant",
             f"'none' with {why} (an NF4 base runs with FSDP/HSDP, cp and pp)", lo.base_quant)
    need(t.te_margin >= 0, "training.te_margin", ">= 0", t.te_margin)
    need(t.te_interval >= 1, "training.te_interval", ">= 1", t.te_interval)
    need(t.te_amax_history_len >= 1, "training.te_amax_history_len", ">= 1", t.te_amax_history_len)
    need(len(t.te_override_linear_precision) == 3, "training.te_override_linear_precision",
         "three booleans (fprop, dgrad, wgrad)", t.te_override_linear_precision)
    need(not (t.float8 and t.float8_backend == "te" and cfg.parallelism.tp > 1), "training.float8_backend",
         "'torchao' with parallelism.tp > 1 (Transformer Engine's linears shard through their own TP group, which "
         "titan_sft's TP plan does not set up)", t.float8_backend)
    need(not ("lora" in cfg.model.converters and t.float8 and (t.float8_backend == "te" or cfg.parallelism.tp > 1)),
         "training.float8", "false with the lora converter and float8_backend 'te' or parallelism.tp > 1 (float8 + "
         "LoRA runs torchao's float8 base matmuls without tensor parallel)", t.float8)
    for key, v in (("warmup", s.warmup), ("decay", s.decay)):
        need(v >= 0, f"lr_scheduler.{key}", ">= 0 (<= 1: fraction of steps, > 1: whole steps)", v)
        need(v <= 1 or float(v).is_integer(), f"lr_scheduler.{key}", "a fraction <= 1 or a whole number of steps", v)
    need(0 <= s.min_lr_ratio <= 1, "lr_scheduler.min_lr_ratio", "0 <= ratio <= 1", s.min_lr_ratio)
    need(s.warmup_steps >= -1, "lr_scheduler.warmup_steps", ">= 0 (or -1: use lr_scheduler.warmup)", s.warmup_steps)
    need(s.warmup_steps == -1 or s.warmup == 0, "lr_scheduler.warmup_steps",
         "-1 when lr_scheduler.warmup is set (give the warmup one way)", s.warmup_steps)
    need(s.min_lr_ratio == 0 or s.name in ("levanter", "cosine_with_min_lr"), "lr_scheduler.min_lr_ratio",
         f"0 with transformers' {s.name!r} schedule (its final lr is its own; min_lr_ratio applies to levanter "
         "and cosine_with_min_lr)", s.min_lr_ratio)
    need(c.interval >= 1, "checkpoint.interval", ">= 1", c.interval)
    need(c.hf_export_interval >= -1, "checkpoint.hf_export_interval", ">= 0 (0 = only at the end) or -1 (never)",
         c.hf_export_interval)
    need(c.temp_interval_minutes >= 0, "checkpoint.temp_interval_minutes", ">= 0 (0 disables)", c.temp_interval_minutes)
    need(c.write_threads >= 1, "checkpoint.write_threads", ">= 1", c.write_threads)
    need(c.keep_latest_k >= 0, "checkpoint.keep_latest_k", ">= 0 (0 keeps all)", c.keep_latest_k)
    need(c.hf_max_shard_size_gb > 0, "checkpoint.hf_max_shard_size_gb", "> 0", c.hf_max_shard_size_gb)
    need(cfg.metrics.log_freq >= 1, "metrics.log_freq", ">= 1", cfg.metrics.log_freq)
    v = cfg.validation
    need(0 <= v.holdout_fraction < 1, "validation.holdout_fraction", "0 <= fraction < 1", v.holdout_fraction)
    need(not (v.path and v.holdout_fraction), "validation.holdout_fraction",
         "0 when validation.path is set (one held-out set)", v.holdout_fraction)
    need(v.interval >= 0, "validation.interval", ">= 0 (0 = only after the last step)", v.interval)
    need(not (v.sources and (v.path or v.holdout_fraction)), "validation.sources",
         "either validation.sources or validation.path / holdout_fraction", [x.name for x in v.sources])
    vnames = [x.name for x in v.sources]
    for i, x in enumerate(v.sources):
        need(bool(x.name) and x.name not in vnames[:i], f"validation.sources[{i}].name",
             "a non-empty name no other validation source has", x.name)
        need(bool(x.path), f"validation.sources[{i}].path", "a packed dataset directory", x.path)
        need(x.weight >= 0, f"validation.sources[{i}].weight", ">= 0 (0: the training source's weight, else 1)",
             x.weight)
    need(not v.best_source or v.best_source in vnames, "validation.best_source",
         f"empty (the weighted mean) or one of validation.sources' names {vnames}", v.best_source)
    if v.keep_best == "auto":
        v.keep_best = bool(v.path or v.holdout_fraction or v.sources)
    need(not v.best_only or v.keep_best, "validation.best_only", "false unless validation.keep_best", v.best_only)
    need(v.generation_every >= 0, "validation.generation_every", ">= 0 (0 disables)", v.generation_every)
    need(v.block_length >= 1 and v.gen_length % v.block_length == 0, "validation.gen_length",
         f"a positive multiple of validation.block_length ({v.block_length})", v.gen_length)
    need(v.gen_steps % max(1, v.gen_length // v.block_length) == 0 and v.gen_steps >= v.gen_length // v.block_length,
         "validation.gen_steps", "a positive multiple of the blocks gen_length / block_length", v.gen_steps)
    need(v.temperature >= 0, "validation.temperature", ">= 0", v.temperature)
    need(v.max_packs >= 0, "validation.max_packs", "0 (all) or a positive count", v.max_packs)
    need(v.max_loss_examples >= 0, "validation.max_loss_examples", "0 (all) or a positive count", v.max_loss_examples)
    need(not (v.max_loss_examples and v.max_packs), "validation.max_loss_examples",
         "0 when validation.max_packs is set (one limit on the held-out loss)", v.max_loss_examples)
    need(not v.max_loss_examples or cfg.objective.name == "masked_diffusion", "validation.max_loss_examples",
         "0 unless objective.name is masked_diffusion (causal held-out loss: validation.max_packs)",
         v.max_loss_examples)
    need(v.batch_size >= 0, "validation.batch_size", "0 (training.per_device_batch) or a positive count", v.batch_size)
    need(not v.keep_best or bool(v.path or v.holdout_fraction or v.sources), "validation.keep_best",
         "false unless validation.path, validation.sources or validation.holdout_fraction gives a held-out set",
         v.keep_best)
    p = cfg.parallelism
    need(p.dp_replicate >= 1, "parallelism.dp_replicate", ">= 1", p.dp_replicate)
    need(p.dp_shard == -1 or p.dp_shard >= 1, "parallelism.dp_shard", "-1 (the rest) or >= 1", p.dp_shard)
    need(p.tp >= 1, "parallelism.tp", ">= 1", p.tp)
    need(cfg.model.name != "", "model.name", "a registered model name", cfg.model.name)
    if cfg.model.init_from_hf:
        need(cfg.model.hf_assets_path != "", "model.hf_assets_path", "an HF directory when model.init_from_hf", "")


# --------------------------------------------------------------------------------------------------
# Checks that need more than the config (a world size, a model family, a dataset). They live here so that every
# rule about config values is in this file; the components call them at the boundary, before any work.


def require_data_path(cfg: JobConfig) -> None:
    if not cfg.data.path and not cfg.data.sources:
        raise ConfigError("config key 'data.path': empty; allowed: a packed dataset directory (titan_sft.data.prepare), "
                          "or a mixture in [[data.sources]]")


def require_flavor(model_cfg: Model, flavors: dict[str, Any]) -> None:
    if model_cfg.flavor not in flavors:
        raise ConfigError(f"config key 'model.flavor': '{model_cfg.flavor}' is not a {model_cfg.name} flavor; "
                          f"allowed: {', '.join(flavors)}")


def check_layout(cfg: JobConfig, world_size: int) -> tuple[int, int, int, int, int, int]:
    """(dp_replicate, dp_shard, tp, ep, cp, pp) for ``world_size`` ranks, with the batch arithmetic checked.

    Raises:
        ConfigError: the mesh does not multiply to the world size, or the global batch does not split into
            whole per-rank batches of whole microbatches.
    """
    p, t = cfg.parallelism, cfg.training
    if p.pp < 1 or world_size % p.pp:
        raise ConfigError(f"config key 'parallelism.pp': {p.pp} must be a positive divisor of the world size "
                          f"{world_size}")
    world_size //= p.pp  # the ranks of one pipeline stage; the other dimensions divide them
    if p.cp < 1 or world_size % p.cp:
        raise ConfigError(f"config key 'parallelism.cp': {p.cp} must be a positive divisor of the world size "
                          f"{world_size}")
    shard = world_size // (p.dp_replicate * p.cp * p.tp) if p.dp_shard == -1 else p.dp_shard
    if p.dp_replicate * shard * p.cp * p.tp != world_size:
        raise ConfigError(
            f"config key 'parallelism': dp_replicate={p.dp_replicate} x dp_shard={p.dp_shard} x cp={p.cp} x "
            f"tp={p.tp} does not multiply to the world size {world_size}"
            + (f" / pp {p.pp}" if p.pp > 1 else "")
        )
    dp = p.dp_replicate * shard
    if p.ep < 1 or shard % p.ep:
        raise ConfigError(f"config key 'parallelism.ep': {p.ep} must be a positive divisor of the FSDP shards "
                          f"per replica (dp_shard = {shard}): expert-parallel ranks are data-parallel ranks")
    if t.global_batch_size % dp:
        raise ConfigError(f"config key 'training.global_batch_size': {t.global_batch_size} must be divisible by the "
                          f"data-parallel ranks ({dp})")
    if (t.global_batch_size // dp) % t.per_device_batch:
        raise ConfigError(
            f"config key 'training.per_device_batch': {t.per_device_batch} must divide the per-rank "
            f"batch global_batch_size / ranks = {t.global_batch_size // dp}"
        )
    if p.pp > 1:
        check_pipeline_schedule(p.pp, p.pp_schedule, p.pp_stages_per_rank, t.global_batch_size // dp // t.per_device_batch)
    return p.dp_replicate, shard, p.tp, p.ep, p.cp, p.pp


def pipeline_stages_per_rank(schedule: str, stages_per_rank: int) -> int:
    """Stages each pipeline rank runs: 1 for the single-stage schedules."""
    return stages_per_rank if schedule in ("Interleaved1F1B", "ZBVZeroBubble") else 1


def check_pipeline_schedule(pp: int, schedule: str, stages_per_rank: int, n_microbatches: int) -> None:
    """The schedule's own rules: microbatches enough to fill the pipeline (interleaved: a multiple of pp), and ZBV's
    two stages per rank."""
    v = pipeline_stages_per_rank(schedule, stages_per_rank)
    if v < 1 or (schedule == "ZBVZeroBubble" and v != 2):
        raise ConfigError(f"config key 'parallelism.pp_stages_per_rank': {stages_per_rank}; allowed: "
                          f"{'2 (ZBVZeroBubble runs a V of two stages per rank)' if schedule == 'ZBVZeroBubble' else '>= 1'}")
    where = "global_batch_size / data-parallel ranks / training.per_device_batch (or parallelism.pp_microbatch_size)"
    if n_microbatches < pp:
        raise ConfigError(f"config key 'parallelism.pp': {pp} stages need at least {pp} microbatches per step, got "
                          f"{n_microbatches} ({where})")
    if schedule == "Interleaved1F1B" and n_microbatches % pp:
        raise ConfigError(f"config key 'parallelism.pp_schedule': Interleaved1F1B needs the microbatches per step "
                          f"({n_microbatches} = {where}) to be a multiple of pp = {pp}")


def pipeline_split(n_layers: int, n_stages: int, manual: list[int], lighter: int) -> list[int]:
    """Layers per stage: ``manual`` when given, else an even split of ``n_layers`` with ``lighter`` fewer layers on
    the first and last stage (the remainder goes to the middle stages first).

    Raises:
        ConfigError: the split does not cover the layers, or leaves a stage without a layer.
    """
    if manual:
        if len(manual) != n_stages or sum(manual) != n_layers or min(manual) < 1:
            raise ConfigError(f"config key 'parallelism.pp_layers': {manual} must list {n_stages} stages of at least one "
                              f"layer each, summing to the model's {n_layers} layers")
        return list(manual)
    # Each stage takes an equal share of n_layers + 2 * lighter; the remainder goes to the middle stages first,
    # then the ends lose `lighter` each.
    base, rem = divmod(n_layers + 2 * lighter, n_stages)
    split = [base] * n_stages
    for j in (list(range(1, n_stages - 1)) + [0, n_stages - 1])[:rem]:
        split[j] += 1
    if n_stages > 1:
        split[0] -= lighter
        split[-1] -= lighter
    if min(split) < 1:
        raise ConfigError(f"config key 'parallelism.pp_first_last_lighter': {lighter} leaves the first or last of "
                          f"{n_stages} stages without a layer ({n_layers} layers)")
    return split


def validation_sets(cfg: JobConfig) -> list[tuple[str | None, str, float]]:
    """(name, path, weight) of each held-out set: ``validation.sources`` (weights from the training source of the
    same name where not given, else 1), or ``validation.path`` alone (name None: records without a source)."""
    v = cfg.validation
    if not v.sources:
        return [(None, v.path, 1.0)] if v.path else []
    train = {x.name: x.weight for x in cfg.data.sources}
    return [(x.name, x.path, x.weight or train.get(x.name, 1.0)) for x in v.sources]


def check_expert_parallel(ep: int, n_experts: int, compile: bool = False, lora_experts: bool = False,
                          tp: int = 1) -> None:
    """Expert parallel places n_experts / ep whole experts on each expert-parallel rank; adapters on experts need
    a model that has them. Compiled blocks with routed experts under tp or ep need FSDP2's per-parameter mesh
    (torch >= 2.13): on an older torch the experts are FSDP modules of their own inside the block, whose hooks
    break a fullgraph compile."""
    from titan_sft.compat import PER_PARAM_MESH, PER_PARAM_MESH_TORCH

    if lora_experts and not n_experts:
        raise ConfigError("config key 'lora.experts': true, but the model has no routed experts; set it to false")
    if compile and n_experts and (ep > 1 or tp > 1) and not PER_PARAM_MESH:
        import torch

        raise ConfigError(f"config key 'training.compile': compiled blocks with routed experts under tp or ep need "
                          f"torch >= {PER_PARAM_MESH_TORCH} (FSDP2's per-parameter mesh); this is torch "
                          f"{torch.__version__}: set training.compile = false, or use torch >= {PER_PARAM_MESH_TORCH}")
    if ep == 1:
        return
    if not n_experts:
        raise ConfigError(f"config key 'parallelism.ep': {ep}, but the model has no routed experts (ep must be 1)")
    if n_experts % ep:
        raise ConfigError(f"config key 'parallelism.ep': {ep} must divide the model's {n_experts} experts")


def check_context_parallel(cp: int, mode: str, tp: int, n_heads: int, n_kv_heads: int, seq_len: int,
                           attention: str, linear_layers: int = 0, linear_k_heads: int = 0,
                           linear_conv_kernel: int = 4) -> None:
    """Context parallel cuts every row into equal shards (ring: two chunks per rank), each still divisible by tp
    for sequence parallel; Ulysses hands each cp rank whole heads of the tp rank's share. Gated DeltaNet layers
    (``linear_layers``, ``linear_k_heads`` key heads) run under Ulysses on whole rows of whole key heads; under ring
    on their segments with the state passed along, each segment at least the conv's window
    (``linear_conv_kernel - 1`` tokens) long."""
    if cp == 1:
        return
    chunks = cp * (2 if mode == "ring" else 1)
    if linear_layers and mode == "ring" and seq_len // chunks < linear_conv_kernel - 1:
        raise ConfigError(f"config key 'parallelism.cp': ring cuts rows of {seq_len} tokens into {chunks} segments of "
                          f"{seq_len // chunks}, shorter than the linear-attention conv's window of "
                          f"{linear_conv_kernel - 1} tokens; use a smaller cp or 'ulysses'")
    if linear_layers and mode == "ulysses" and (linear_k_heads // tp) % cp:
        raise ConfigError(f"config key 'parallelism.cp': ulysses gives each of the {cp} cp ranks whole key heads of "
                          f"the linear-attention layers, but there are {linear_k_heads // tp} per tp rank; use a cp "
                          "that divides them or parallelism.cp_mode = 'ring'")
    if seq_len % (chunks * tp):
        raise ConfigError(f"config key 'parallelism.cp': {cp} ({mode}{', two chunks per rank' if mode == 'ring' else ''}"
                          f"{f' x tp {tp}' if tp > 1 else ''}) must divide the packed sequence length {seq_len} into "
                          f"{chunks * tp} equal parts")
    if mode == "ulysses" and (n_heads // tp) % cp:
        raise ConfigError(f"config key 'parallelism.cp': ulysses gives each of the {cp} cp ranks whole attention "
                          f"heads, but there are {n_heads // tp} per tp rank; use a cp that divides them or "
                          "parallelism.cp_mode = 'ring'")
    if mode == "ring" and attention not in ("sdpa", "flex"):
        raise ConfigError(f"config key 'parallelism.cp_mode': 'ring' needs model.attention 'sdpa' or 'flex' (the "
                          f"varlen kernels take no per-query positions), not '{attention}'; or use 'ulysses'")


def check_tensor_parallel(tp: int, n_heads: int, n_kv_heads: int, seq_len: int, linear_k_heads: int = 0) -> None:
    """Tensor parallel splits heads and (sequence parallel) the packed rows evenly across the tp ranks;
    ``linear_k_heads``: the key heads of Gated DeltaNet layers (each rank keeps whole key heads with their value
    heads)."""
    if tp == 1:
        return
    if n_heads % tp or n_kv_heads % tp:
        raise ConfigError(f"config key 'parallelism.tp': {tp} must divide the model's attention heads ({n_heads}) "
                          f"and key/value heads ({n_kv_heads})")
    if linear_k_heads % tp:
        raise ConfigError(f"config key 'parallelism.tp': {tp} must divide the linear-attention key heads "
                          f"({linear_k_heads}): a key head and its value heads stay on one rank")
    if seq_len % tp:
        raise ConfigError(f"config key 'parallelism.tp': {tp} must divide the packed sequence length {seq_len} "
                          "(sequence parallel splits every row)")


def check_vocab(dataset_vocab: int, model_vocab: int) -> None:
    if dataset_vocab > model_vocab:
        raise ConfigError(f"data.path: the dataset's tokenizer has {dataset_vocab} tokens, more than the model's "
                          f"vocab_size {model_vocab}")


def config_help() -> str:
    """Every section and key with its type, default and one-line doc (``python -m titan_sft.train --help``)."""
    lines = ["usage: python -m titan_sft.train --config FILE.toml [--section.key VALUE ...] [--dry-run]", "",
             "Config keys (TOML [section] key = value, or --section.key VALUE on the command line):"]
    for section, cls in _sections().items():
        lines.append(f"\n[{section}]")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {f.name} = {json.dumps(default)}  ({_describe(hints[f.name])})")
            lines.append(f"      {f.metadata.get('doc', '')}")
    return "\n".join(lines)
