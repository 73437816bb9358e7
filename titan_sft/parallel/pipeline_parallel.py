"""Pipeline parallel: the decoder's layers cut into stages over the ``pp`` mesh dimension, run by a
``torch.distributed.pipelining`` schedule (GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble).

* Stages are the family's own model with parts left out (``models.transformer``: no ``tok_embeddings`` after the
  first stage, no ``norm``/``output`` before the last), built on the meta device with only their layers, which keep
  their global indices (``layers.<i>``), so every parameter has its unsharded name on whichever rank holds it.
  Nothing here knows a family: a stage is ``spec.model_cls(args)`` pruned.
* Each stage is parallelized like a whole model (TP plan, AC, compile, FSDP2 with the stage as its root); a rank
  with several stages (interleaved schedules) keeps them together in one :class:`PipelinedModel`, whose
  parameters carry those names: the optimizer, gradient clipping, checkpoints (DCP, so a pp run resumes on any
  layout) and HF export see one model per rank.
* The step's microbatches (``training.per_device_batch`` rows each; ``parallelism.pp_microbatch_size``) are the
  pipeline's: the loss groups' denominators are all-reduced before the step (``objective.begin_step``), so the last
  stage computes each microbatch's loss with the objective, as one rank would (chunked CE, masked diffusion's noise
  made by the collator and carried with the microbatch), and the schedule sums the gradients (``scale_grads``
  off: the loss is already normalised by the global counts).

A tied embedding and head (Qwen3 <= 4B, the debug model) lives on the first and the last stage as two copies with
the same numbers: their gradients are summed between the two after every step (as Megatron does), the norm counts
one, and checkpoints and exports store one under the embedding's name.

* Routed experts: the router statistics of every MoE layer travel from stage to stage with the hidden states
  (:class:`_RouterStatsStage`), so the last stage computes the load-balancing loss of all layers, as one rank does.

* Tensor parallel inside the stages: each stage gets the family's TP plan (the parts it holds), so the hidden
  states between stages are each tp rank's sequence slice [rows, seq_len / tp, dim], a plain tensor sent to the
  same tp rank of the next stage; the last stage's final norm hands on its slice too, and the loss sees it as the
  sequence-sharded DTensor it is (loss parallel on the vocab-split head, as without pp).
* Context parallel inside the stages: every stage runs this cp rank's part of the rows (the objective's
  ``local``), its attention exchanging with the other cp ranks of the same stage; the hidden states between
  stages are that part ([rows, seq_len / cp / tp, dim]) and the last stage's loss takes the same part's targets.

* Calling the pipelined model (:meth:`PipelinedModel.forward`: masked diffusion's generation and scoring during
  training) runs one forward through the stages and broadcasts the logits to every rank of the slice.

* Held-out validation runs the stages forward only (:meth:`PipelinedModel.hidden_states`): a chunk of
  microbatches goes through the stages in ticks (stage s runs microbatch k - s at tick k), each tick starting with one
  batched exchange of activations (order-proof under NCCL), so the stages
  overlap as in GPipe's forward; the last stage computes the loss and its sums reach every rank.

Not composed yet (refused with one line by :func:`check_pipeline_parallel`): the ZBVZeroBubble schedule (planned
here, its weight-gradient pass fails on these stages).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from titan_sft.config import ConfigError, JobConfig, pipeline_split, pipeline_stages_per_rank
from titan_sft.constants import DTYPES


@dataclass
class PipelinePlan:
    """Which layers each stage runs and which stages each pp rank holds."""

    pp: int
    schedule: str
    layers: list[int]  # layers per stage, in stage order

    @classmethod
    def from_config(cls, cfg: JobConfig, n_layers: int) -> "PipelinePlan":
        p = cfg.parallelism
        n_stages = p.pp * pipeline_stages_per_rank(p.pp_schedule, p.pp_stages_per_rank)
        if n_stages > n_layers:
            raise ConfigError(f"config key 'parallelism.pp': {p.pp} ranks x "
                              f"{n_stages // p.pp} stages per rank need at least {n_stages} layers; the model has "
                              f"{n_layers}")
        return cls(p.pp, p.pp_schedule, pipeline_split(n_layers, n_stages, p.pp_layers, p.pp_first_last_lighter))

    @property
    def n_stages(self) -> int:
        return len(self.layers)

    def stage_layers(self, stage: int) -> list[int]:
        start = sum(self.layers[:stage])
        return list(range(start, start + self.layers[stage]))

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pp rank ``pp_rank`` runs: a loop (r, r + pp, ...), or ZBV's V (r and 2 pp - 1 - r)."""
        if self.schedule == "ZBVZeroBubble":
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return list(range(pp_rank, self.n_stages, self.pp))

    def bubble_fraction(self, n_microbatches: int) -> float:
        """The idle share of a step in the schedule's theory, with equal stage times: (p - 1) / (v m + p - 1) for
        GPipe and 1F1B (v = 1) and Interleaved1F1B (v stages per rank); ZBV's zero-bubble schedule splits the weight
        gradients out to fill it, (p - 1) / (3 v m + p - 1) when forward, input and weight backward take equal time."""
        p, v, m = self.pp, self.n_stages // self.pp, n_microbatches
        if self.schedule == "ZBVZeroBubble":
            return (p - 1) / (3 * v * m + p - 1)
        return (p - 1) / (v * m + p - 1)

    def describe(self) -> list[str]:
        out = []
        for r in range(self.pp):
            parts = []
            for s in self.stages_of(r):
                ids = self.stage_layers(s)
                extra = (["embeddings"] if s == 0 else []) + (["norm + head"] if s == self.n_stages - 1 else [])
                parts.append(f"stage {s}: layers {ids[0]}-{ids[-1]}" + (f" + {' + '.join(extra)}" if extra else ""))
            out.append(f"pp rank {r}: " + "; ".join(parts))
        return out


def check_pipeline_parallel(cfg: JobConfig, args) -> None:
    """What pipeline parallel does not compose with yet: one line each, before any model is built."""
    if cfg.parallelism.pp == 1:
        return
    p = cfg.parallelism
    PipelinePlan.from_config(cfg, args.n_layers)  # the split's own errors
    refusals = [
        (p.pp_schedule == "ZBVZeroBubble", "parallelism.pp_schedule",
         "ZBVZeroBubble is not supported yet (its separate weight-gradient pass looks up the gradient "
         "accumulators of the stage's registered parameters, FSDP2's shards, while the graph holds the gathered "
         "ones: KeyError in torch 2.13); use 1F1B or Interleaved1F1B"),
    ]
    for bad, key, why in refusals:
        if bad:
            raise ConfigError(f"config key '{key}' with parallelism.pp = {p.pp}: {why}")


def build_stage(model_cls, args, layer_ids: list[int], first: bool, last: bool) -> nn.Module:
    """The model with only ``layer_ids`` (global indices kept), embeddings if ``first``, norm and head if ``last``;
    call on the meta device."""
    model = model_cls(args)
    for key in [k for k in model.layers if int(k) not in layer_ids]:
        del model.layers[key]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = model.output = None
    return model


class PipelinedModel(nn.Module):
    """This rank's stages as one module for everything but the forward: its children are the stages' parts under
    their unsharded names (``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``, None where another rank holds
    them), so ``named_parameters``, DCP state dicts and the optimizer see global FQNs. The step runs through
    :meth:`forward_backward`."""

    def __init__(self, stages: list[nn.Module], args, plan: PipelinePlan, stage_ids: list[int], pp_group):
        super().__init__()
        self.args, self.plan, self.stage_ids, self.pp_group = args, plan, stage_ids, pp_group
        self.router_stats: list = []
        self._stages = stages  # a plain list: not children (their parts are, by name)
        self.tok_embeddings = next((s.tok_embeddings for s in stages if s.tok_embeddings is not None), None)
        self.layers = nn.ModuleDict({k: m for s in stages for k, m in s.layers.items()})
        last = next((s for s in stages if s.norm is not None), None)
        self.norm, self.output = (last.norm, last.output) if last is not None else (None, None)
        # A tied head on the last stage is a copy of the first stage's embedding (see the module docstring).
        self.tied = args.tie_embeddings and plan.n_stages > 1
        self.state_renames = ({"output.weight": "tok_embeddings.weight"}
                              if self.tied and self.output is not None and self.tok_embeddings is None else {})
        self.tie_group = None  # the first and last stage's ranks of this slice (set by build_pipelined_model)
        self.backend = stages[0].backend  # the attention backend (its default positions, for later stages' inputs)
        self.schedule = None
        self.reduce_last = False  # grad_reduce = "last_microbatch": the schedule defers FSDP's reduction
        self._microbatches: list = []
        self.is_last = plan.n_stages - 1 in stage_ids
        self.is_first = 0 in stage_ids
        self.tp_mesh = None  # the tp mesh when tp > 1 (set by build_pipelined_model)
        self.cp = 1  # context-parallel ranks per row (set by build_pipelined_model)
        # expert parallel x tp: the experts' gradients each stage sums over tp (parallelize_transformer sets them)
        summed = [s.tp_summed_params for s in stages if hasattr(s, "tp_summed_params")]
        if summed:
            self.tp_summed_params = ([p for params, _ in summed for p in params], summed[0][1])

    @property
    def stage_modules(self) -> list[nn.Module]:
        """This rank's stages: FSDP roots that are not in this module's tree (their parts are)."""
        return list(self._stages)

    def full_state_on_rank0(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The whole model's unsharded state (or, given ``state``, those of this rank's tensors and the same
        selection on every other stage) on global rank 0 (:func:`gather_full_state`)."""
        return gather_full_state(self, state)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] of a forward-only pass through the pipeline, on every rank, for whole-model calls
        outside training (masked diffusion's generation and base-model scoring). A collective: every rank of the
        pipeline slice calls it with the same inputs. Each stage's output goes to the next pp rank; the last
        stage's logits (in the compute dtype) are broadcast from the last pp rank. Training runs through
        :meth:`forward_backward`, held-out losses through :meth:`hidden_states`."""
        from titan_sft.parallel import comm

        b, t = input_ids.shape
        if positions is None:
            positions = self.backend.default_positions(t, input_ids.device).expand(b, t)
        kwargs = {"cu_seqlens": cu_seqlens, "positions": positions}
        logits = self._forward_stages([(input_ids, kwargs)], logits=True)[0]
        if logits is None:
            logits = torch.empty(b, t, self.args.vocab_size, dtype=self.hidden_dtype, device=input_ids.device)
        owner = dist.get_global_rank(self.pp_group, self.plan.pp - 1)
        return comm.broadcast(logits.to(self.hidden_dtype).contiguous(), owner, group=self.pp_group,
                              what="pipeline logits")

    def to_empty(self, *, device, recurse: bool = True) -> "PipelinedModel":
        for stage in self._stages:  # each stage is an FSDP root: materialise through it
            stage.to_empty(device=device, recurse=recurse)
        return self

    def set_requires_gradient_sync(self, flag: bool) -> None:
        """No-op: ``parallelism.grad_reduce`` decides (see :class:`_ReducePerMicrobatch`)."""

    def build_schedule(self, n_microbatches: int, device: torch.device, loss_fn, rows: int, seq_len: int,
                       dtype: torch.dtype) -> None:
        """The schedule over this rank's stages; ``loss_fn(hidden, microbatch index)`` runs on the last stage.

        Stages are given their shapes (token ids [rows, seq_len] into the first, hidden states [rows, seq_len,
        dim] in the compute ``dtype`` between stages): every microbatch has them, and torch's runtime inference
        would run the objective's loss on placeholder targets to learn them."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        # this cp rank's part of the rows; requires_grad: the metadata says which activations have gradients to
        # exchange; between stages, under tp, each tp rank's sequence slice of that part
        ids = torch.empty(rows, seq_len // self.cp, dtype=torch.long, device="meta")
        hidden = torch.empty(rows, seq_len // self.cp // self.tp, self.args.dim, dtype=dtype, device="meta",
                             requires_grad=True)
        between = hidden
        moe_layers, n_experts = self.args.moe_layers(), self.args.n_experts
        if n_experts:  # routed experts: the router statistics travel with the hidden states (_RouterStatsStage)
            between = (hidden, torch.empty(len(moe_layers), 2 * n_experts + 1, device="meta", requires_grad=True))

        def module(m):
            run = m if self.reduce_last else _ReducePerMicrobatch(m)
            return _RouterStatsStage(run, m, moe_layers, n_experts) if n_experts else run

        stages = [PipelineStage(module(m), s, self.plan.n_stages, device, input_args=ids if s == 0 else between,
                                output_args=between, group=self.pp_group)
                  for m, s in zip(self._stages, self.stage_ids)]
        cls = get_schedule_class(self.plan.schedule)
        single = issubclass(cls, PipelineScheduleSingle)
        self.schedule = cls(stages[0] if single else stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
        self.pipeline_stages = stages
        self.hidden_dtype, self.n_microbatches = dtype, n_microbatches

    @torch.no_grad()
    def hidden_states(self, items: Iterable[tuple]) -> Iterator[tuple[tuple, torch.Tensor | None]]:
        """Forward only through the pipeline, for held-out evaluation: ``items`` are tuples whose first element is
        a microbatch on the device (every rank of a pipeline slice gives the same ones); yields each item with the
        model's final hidden states (as ``model(..., hidden_only=True)`` returns them) on ranks holding the last
        stage, None elsewhere. A step's number of microbatches at a time go through :meth:`_forward_stages`."""
        inputs = stage_inputs(self.backend)
        it = iter(items)
        while chunk := list(itertools.islice(it, self.n_microbatches)):
            outs = self._forward_stages([inputs(item[0]) for item in chunk])
            yield from zip(chunk, [None if h is None else self.final_hidden(h) for h in outs])

    def _forward_stages(self, args: list[tuple], logits: bool = False) -> list:
        """Runs each ``(ids, kwargs)`` of ``args`` (microbatch m) through this rank's stages, GPipe-style in ticks:
        at tick k stage s runs microbatch k - s. Each tick starts with one batched exchange
        (``batch_isend_irecv``) of the outputs the previous tick made and the inputs this tick needs, so no rank
        waits on a send its peer has not yet matched with a receive (NCCL, unlike gloo, does not buffer large
        sends: hand-ordered sends and receives deadlock as soon as two ranks post them in different orders).
        Returns the last stage's outputs (its hidden states, or with ``logits`` the head's), None on other ranks."""
        me, pp = dist.get_rank(self.pp_group), self.plan.pp
        prev, succ = (dist.get_global_rank(self.pp_group, (me + d) % pp) for d in (-1, 1))
        last, n = self.plan.n_stages - 1, len(args)
        stages = sorted(zip(self.stage_ids, self._stages), key=lambda x: x[0])
        outs: list = [None] * n
        to_send: list[torch.Tensor] = []  # in stage order, as the next rank posts its receives
        for tick in range(n + last):
            ops, inbox = [], {}
            for h in to_send:
                ops.append(dist.P2POp(dist.isend, h, succ, self.pp_group))
            for stage_id, _ in stages:
                m = tick - stage_id
                if stage_id > 0 and 0 <= m < n:
                    ids = args[m][0]
                    inbox[stage_id] = torch.empty(ids.shape[0], self._local_len(ids.shape[1]), self.args.dim,
                                                  dtype=self.hidden_dtype, device=ids.device)
                    ops.append(dist.P2POp(dist.irecv, inbox[stage_id], prev, self.pp_group))
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            to_send = []
            for stage_id, stage in stages:
                m = tick - stage_id
                if not 0 <= m < n:
                    continue
                ids, kwargs = args[m]
                h = stage(ids if stage_id == 0 else inbox[stage_id],
                          **{**kwargs, "hidden_only": not (logits and stage_id == last)})
                if stage_id == last:
                    outs[m] = h
                else:
                    to_send.append(h.to(self.hidden_dtype).contiguous())
        return outs

    def _local_len(self, t: int) -> int:
        """This tp rank's sequence slice of ``t`` positions between stages (torch.chunk's split, as Shard(1)
        has it)."""
        return len(torch.arange(t).chunk(self.tp)[self.tp_mesh.get_local_rank()]) if self.tp > 1 else t

    @property
    def tp(self) -> int:
        return self.tp_mesh.size() if self.tp_mesh is not None else 1

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The last stage's output as the objective takes it: under tp this rank's sequence slice becomes the
        sequence-sharded DTensor (the whole model's ``hidden_only`` output)."""
        from torch.distributed.tensor import DTensor, Shard

        if self.tp_mesh is None:
            return h
        return DTensor.from_local(h, self.tp_mesh, [Shard(1)], run_check=False)

    def forward_backward(self, microbatches: list, inputs) -> torch.Tensor:
        """One step's forwards and backwards over ``microbatches`` (on the device); ``inputs(mb)`` gives the first
        stage's ``input_ids`` and every stage's keyword arguments. Returns the sum of the step's losses on the last
        stage (0 elsewhere)."""
        args, kwargs = zip(*(inputs(mb) for mb in microbatches))
        self._microbatches = microbatches  # the loss function's targets, by index
        losses: list = []
        for st in self.pipeline_stages:  # what the schedule's step() does before it splits a whole batch
            st.has_backward = True
            st.clear_runtime_states()
        targets = [torch.tensor([i]) for i in range(len(microbatches))]
        self.schedule._step_microbatches([(a,) for a in args], list(kwargs), targets, losses, return_outputs=False)
        self._microbatches = []
        self._sum_tied_grads()
        if self.is_last:
            return torch.stack([x.detach() for x in losses]).sum()
        return torch.zeros((), device=microbatches[0].input_ids.device)


    def _tied_params(self) -> list[nn.Parameter]:
        if not self.tied:
            return []
        # a frozen tie (LoRA) has no gradient to sum; both copies agree on requires_grad
        return [m.weight for m in (self.tok_embeddings, self.output) if m is not None and m.weight.requires_grad]

    def _sum_tied_grads(self) -> None:
        """The embedding's and the head's gradients summed between the first and the last stage: both copies get
        the tied weight's whole gradient (each FSDP rank its shard: the two stages shard alike)."""
        from torch.distributed.tensor import DTensor

        from titan_sft.parallel import comm

        for p in self._tied_params():
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            comm.all_reduce(g, group=self.tie_group, what="tied embedding gradient")

    def tied_copies(self) -> list[nn.Parameter]:
        """The last stage's copy of a tied head: clipped with the rest, not counted in the norm."""
        return [self.output.weight] if self.tied and self.output is not None else []

    def counted_parameters(self) -> list[nn.Parameter]:
        """The parameters the gradient norm counts (all but :meth:`tied_copies`)."""
        copies = {id(p) for p in self.tied_copies()}
        return [p for p in self.parameters() if id(p) not in copies]


class _ReducePerMicrobatch(nn.Module):
    """A stage as the schedule sees it under ``grad_reduce = "per_microbatch"``: not an FSDP module, so the
    schedule does not suspend FSDP's gradient sync until the step's last backward (which would hold the stage's
    whole fp32 gradients unsharded in between: 67 GiB for Llama-70B's 21-layer pp rank); every microbatch's backward
    reduce-scatters, as without pipeline parallel."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, *args, **kwargs):
        return self.stage(*args, **kwargs)


class _RouterStatsStage(nn.Module):
    """A stage of a model with routed experts as the schedule sees it: besides the hidden states it passes on the
    router statistics of every MoE layer so far, one row per MoE layer of the model ([counts (E), probability sums
    (E), z-loss sum], fp32; rows of later stages zero), and adds its own layers' rows.

    The load-balancing loss multiplies the selections summed over all layers with the probabilities summed over
    all layers; the last stage computes it from these rows as one rank does. Its gradient reaches each stage's
    probability sums through the schedule's backward exchange of the rows' gradient (the counts' is zero: they
    enter the loss detached)."""

    def __init__(self, stage: nn.Module, model: nn.Module, moe_layers: list[int], n_experts: int):
        super().__init__()
        self.stage, self.model, self.n_experts = stage, model, n_experts
        row = {layer: i for i, layer in enumerate(moe_layers)}
        self.rows = [row[int(k)] for k in model.layers if int(k) in row]  # this stage's MoE layers, in order
        self.n_rows = len(moe_layers)

    def forward(self, x, stats=None, **kwargs):
        h = self.stage(x, **kwargs)
        if stats is None:  # the first stage; requires_grad, as the schedule exchanges a gradient for the rows
            stats = torch.zeros(self.n_rows, 2 * self.n_experts + 1, device=h.device, requires_grad=True)
        mine = [torch.cat([s.counts.float(), s.prob_sum.float(), s.z_sum.float().view(1)])
                for s in self.model.router_stats]
        if mine:
            index = torch.tensor(self.rows, device=h.device)
            stats = stats.index_add(0, index, torch.stack(mine))
        else:
            stats = stats.clone()
        return h, stats


def router_stats_from_rows(rows: torch.Tensor, n_experts: int, n_tokens: int) -> list:
    """The per-layer :class:`models.moe.RouterStats` of a forward from :class:`_RouterStatsStage`'s rows."""
    from titan_sft.models.moe import RouterStats

    E = n_experts
    return [RouterStats(r[:E].detach(), r[E:2 * E], r[2 * E], n_tokens) for r in rows]


class _Head:
    """What an objective's ``loss(model, mb)`` sees on the last stage: calling it returns the stage's hidden
    states (the pipeline ran the layers), ``output`` is the head, ``router_stats`` the whole model's (all
    stages') router statistics of this forward."""

    def __init__(self, stage: nn.Module, hidden: torch.Tensor, router_stats: list = ()):
        self.output, self.args, self._hidden = stage.output, stage.args, hidden
        self.router_stats = list(router_stats)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return self._hidden


def build_pipelined_model(spec, args, cfg: JobConfig, mesh, device: torch.device, objective,
                          n_microbatches: int, seq_len: int) -> PipelinedModel:
    """This rank's stages (meta device), each parallelized by the family's ``parallelize_fn``, joined in a
    :class:`PipelinedModel` whose schedule computes the loss with ``objective`` on the last stage."""
    plan = PipelinePlan.from_config(cfg, args.n_layers)
    pp_rank = mesh["pp"].get_local_rank()
    ids = plan.stages_of(pp_rank)
    stages = []
    for s in ids:
        with torch.device("meta"):
            stage = build_stage(spec.model_cls, args, plan.stage_layers(s), s == 0, s == plan.n_stages - 1)
        spec.parallelize_fn(stage, mesh, cfg, device, stage_tp_plan(spec.tp_plan_fn()))
        stages.append(stage)
    share_attention_backend(stages)
    model = PipelinedModel(stages, args, plan, ids, mesh["pp"].get_group())
    if mesh["tp"].size() > 1:
        model.tp_mesh = mesh["tp"]
    model.cp = mesh["cp"].size()
    # the first rank of its stage (rank 0 for stage 0): it sends the stage's tensors for an HF export
    model.stage_lead = mesh["dp_cp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
    if model.tied:  # one group per pipeline slice: its first and last stage's ranks (made collectively)
        slices = mesh.mesh.reshape(plan.pp, -1)
        for col in range(slices.shape[1]):
            group = dist.new_group([int(slices[0, col]), int(slices[-1, col])])
            if dist.get_rank() in (int(slices[0, col]), int(slices[-1, col])):
                model.tie_group = group
    last = stages[-1] if model.is_last else None

    def loss_fn(output, index: torch.Tensor) -> torch.Tensor:
        mb = model._microbatches[int(index)]
        if not args.n_experts:
            return objective.loss(_Head(last, model.final_hidden(output)), mb)
        hidden, rows = output
        # a forward's statistics count the positions it ran: this cp rank's part of the rows
        return objective.loss(_Head(last, model.final_hidden(hidden),
                                    router_stats_from_rows(rows, args.n_experts, mb.input_ids.numel() // model.cp)),
                              mb)

    t = cfg.training
    model.reduce_last = cfg.parallelism.grad_reduce == "last_microbatch"
    model.build_schedule(n_microbatches, device, loss_fn, t.per_device_batch, seq_len, DTYPES[t.param_dtype])
    return model


def share_attention_backend(stages: list[nn.Module]) -> None:
    """Points every stage of this rank at the first stage's attention backend, so that what a caller sets on
    the pipelined model's ``backend`` (causal scoring, context parallel's whole-row mode) holds for all its
    stages, as for a whole model's layers."""
    from titan_sft.models.attention import AttentionBackend
    from titan_sft.models.gated_deltanet import GatedDeltaNet
    from titan_sft.parallel.context_parallel import ContextParallelAttention

    backend = stages[0].backend
    for stage in stages[1:]:
        for m in stage.modules():
            if isinstance(getattr(m, "backend", None), (AttentionBackend, ContextParallelAttention)):
                m.backend = backend
            if isinstance(m, GatedDeltaNet) and m.cp is not None:  # its Ulysses exchange follows whole-row mode too
                m.cp = backend


def stage_tp_plan(plan):
    """The family's TP plan for a stage: the final norm hands on its plain sequence slice (a stage's output goes
    to the schedule, which sends and receives plain tensors; :meth:`PipelinedModel.final_hidden` makes the DTensor
    again for the loss)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    root, block = plan
    return {**root, "norm": SequenceParallel(use_local_output=True)}, block


def stage_inputs(backend, local=None):
    """``inputs(mb)`` for :meth:`PipelinedModel.forward_backward`: the token ids, and the masks' and RoPE's
    arguments every stage needs (positions always given: a later stage reads the row length from them), of
    ``local(mb)`` (the objective's: this context-parallel rank's part of the rows) where given."""

    def inputs(mb):
        if local is not None:
            mb = local(mb)
        positions = mb.positions
        if positions is None:
            positions = backend.default_positions(mb.input_ids.shape[1], mb.input_ids.device).expand_as(mb.input_ids)
        return mb.input_ids, {"cu_seqlens": mb.cu_seqlens, "positions": positions, "hidden_only": True}

    return inputs


def startup_check_on_first_stage(model: PipelinedModel, check) -> None:
    """Runs ``check(stage)`` (the document-isolation check, which compares hidden states) on the first stage, whose
    layers take token ids; every rank learns the verdict, so all stop together. All stages use the same attention
    backend and masks."""
    from titan_sft.parallel import comm
    from titan_sft.startup_checks import StartupCheckError

    error = ""
    if model.is_first:
        try:
            check(_FirstStageHidden(model._stages[0], model))
        except StartupCheckError as e:
            error = str(e)
    if comm.all_reduce(comm.tensor(float(bool(error))), dist.ReduceOp.MAX, what="isolation check").item():
        raise StartupCheckError(error or "document isolation check failed on the first pipeline stage")


@torch.no_grad()
def gather_full_state(model: PipelinedModel, state: dict[str, torch.Tensor] | None = None
                      ) -> dict[str, torch.Tensor]:
    """The whole model's unsharded state on global rank 0 (CPU), one tensor at a time; empty elsewhere.
    ``state``: this rank's tensors to gather by name (default: its model state), e.g. only the trainable ones.

    Each tensor is gathered within its stage (``full_tensor`` over the stage's data-parallel ranks); the first rank
    of every later stage sends its stage's tensors to rank 0, which receives them in pp-rank order. No rank holds
    more than one unsharded tensor on its device. Collective over all ranks.
    """
    from torch.distributed.tensor import DTensor

    from titan_sft.checkpoint import model_state
    from titan_sft.parallel import comm

    rank = dist.get_rank()
    state = model_state(model) if state is None else state
    meta: list = [None] * dist.get_world_size()
    dist.all_gather_object(meta, [(k, tuple(v.shape), str(v.dtype).split(".")[-1]) for k, v in state.items()]
                           if model.stage_lead else None)
    full: dict[str, torch.Tensor] = {}
    for name, t in state.items():  # this stage's tensors: gathered by its ranks, kept (rank 0) or sent on
        t = t.full_tensor() if isinstance(t, DTensor) else t
        if rank == 0:
            full[name] = t.cpu()
        elif model.stage_lead:
            dist.send(t.contiguous(), dst=0)
    if rank == 0:
        for src, entries in enumerate(meta):
            for name, shape, dtype in entries if src and entries else ():
                buf = torch.empty(shape, dtype=getattr(torch, dtype), device=comm.device())
                dist.recv(buf, src=src)
                full[name] = buf.cpu()
    return full


class _FirstStageHidden(nn.Module):
    """The first stage as the isolation check calls it: its output, under tp this rank's sequence slice, as the
    sequence-sharded DTensor a whole model returns (the check gathers it)."""

    def __init__(self, stage: nn.Module, model: PipelinedModel):
        super().__init__()
        self.stage, self._final = stage, model.final_hidden
        self.backend = stage.backend  # the check shards its row as the attention backend does (cp)

    @property
    def router_stats(self) -> list:
        return self.stage.router_stats

    def forward(self, *args, **kwargs):
        return self._final(self.stage(*args, **kwargs))
