"""Training objectives: what a step computes from a batch, chosen by ``[objective] name``.

An objective owns everything between the data and the gradient that differs from one kind of SFT to another:

* ``collate(packs, groups, keys)``: the collator that turns packed examples into a microbatch (its fields are the
  objective's: shifted labels for causal LM, noised tokens for masked diffusion);
* ``check_dataset(dataset)``: refuses a training dataset its settings cannot use (before any work);
* ``check_model(args)``: refuses a model architecture it cannot train; returns notices for the start-up log;
* ``causal``: the attention mode (causal, or bidirectional within each document);
* ``begin_step(batch, dataset, first)``: per-step set-up before any forward (e.g. loss denominators all-reduced
  over the data-parallel ranks, ``self.dp_group``, so that the step loss is the same for any layout);
* ``local(mb)``: under context parallel, this rank's part of the microbatch's rows (``mb.shard(self.cp)``; the
  microbatch type says how its fields follow the positions); losses computed on parts are summed over
  ``self.loss_group`` (data-parallel x cp ranks), counts of whole microbatches over ``self.dp_group``;
* ``loss(model, microbatch)``: runs the model to hidden states and applies the output head itself (chunked, or
  only where loss is carried); the returned scalars, summed over microbatches and ranks, are the step loss;
* ``router_loss(model, loss)``: with routed experts, adds the load-balancing loss of the forward just run (the
  built-in objectives call it; see :meth:`Objective.router_loss`);
* ``step_sums()``: this rank's per-step sums (device scalars, e.g. component losses) that the trainer adds to the
  step's one all-reduce; the agreed values come back through ``step_metrics(sums)``;
* ``step_metrics(sums)``: extra fields of the step's train record;
* ``end_step(model, sums)``: after the optimizer step, with the same sums: state that follows the step outside
  the optimizer (here: the aux-loss-free routing biases); returns more fields for the record;
* ``build_validator(model)``: what runs every so often and at the end (or None).

Register one with ``titan_sft.registry.register_objective(name, build)`` where ``build(cfg)`` returns an
:class:`Objective`; the trainer never names a concrete objective.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_sft.config import JobConfig


class BatchError(RuntimeError):
    """A batch the objective cannot train on (bad data that passed prepare); the message names what and where."""


class Validator:
    """Evaluation a run performs between steps; returns records for metrics.jsonl (``"split"`` set).

    Called on every rank after each step's checkpoint and export (``checkpointer.last_export`` is the newest HF
    export; ``checkpointer.save(step, kind="best")`` keeps a best checkpoint).
    """

    def maybe_validate(self, step: int, total_steps: int, model: torch.nn.Module, checkpointer) -> list[dict[str, Any]]:
        raise NotImplementedError


class Validators(Validator):
    """Several validators, run in order."""

    def __init__(self, validators: list[Validator]):
        self.validators = validators

    def maybe_validate(self, step, total_steps, model, checkpointer) -> list[dict[str, Any]]:
        return [r for v in self.validators for r in v.maybe_validate(step, total_steps, model, checkpointer)]


class Objective:
    """Base class of objectives; see the module docstring for the contract."""

    causal: bool = True

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.dp_group = None  # the data-parallel process group (None: all ranks); set by bind()
        self.loss_group = None  # the data-parallel x context-parallel group (None: all ranks); set by bind()
        self.cp = self.cp_group = None  # this rank's SequenceShard and the cp ranks; set by shard_sequence()
        self.router_tp_group = None  # tp ranks that route different tokens of the same rows; split_router_tokens()

    def bind(self, dp_group, loss_group=None) -> None:
        """Tells the objective which ranks hold different data (``dp_group``: tensor- and context-parallel ranks
        share theirs) and which compute different losses (``loss_group``: context-parallel ranks each compute
        their part's; default ``dp_group``)."""
        self.dp_group = dp_group
        self.loss_group = dp_group if loss_group is None else loss_group

    def shard_sequence(self, shard, group=None) -> None:
        """Under context parallel (``shard``: this rank's ``parallel.context_parallel.SequenceShard``; None
        without; ``group``: the cp ranks) every forward runs on this rank's part of the rows (:meth:`local`)."""
        self.cp, self.cp_group = shard, group

    def set_router_layout(self, n_experts: int, moe_layers: list[int]) -> None:
        """The model's routed experts (per MoE layer, in order): the size of the router sums every rank adds to
        the step's all-reduce, also a rank that runs no loss (an earlier pipeline stage)."""
        self._n_experts, self._moe_layers = n_experts, list(moe_layers)

    def split_router_tokens(self, tp_group) -> None:
        """Under tensor parallel (``tp_group``) each tp rank's routers see only its sequence slice of the tokens
        (``parallel.tensor_parallel``), as each cp rank's see only its part of the rows."""
        self.router_tp_group = tp_group

    def local(self, mb: Any) -> Any:
        """This rank's part of microbatch ``mb`` under context parallel (``mb.shard``), else ``mb`` itself."""
        return mb if self.cp is None else mb.shard(self.cp)

    def setup(self, vocab_size: int, tokenizer: Any) -> dict[str, Any]:
        """Checks the objective's settings against the model's vocabulary and the tokenizer (None when the run has
        none) before any step; returns what the run records in ``<dump_folder>/objective.json`` (empty: nothing)."""
        return {}

    def check_dataset(self, dataset: Any) -> None:
        """Refuses (``ConfigError``, naming the config key) a training dataset this objective's settings cannot use
        correctly; called once, before the model is built."""

    def check_model(self, args: Any) -> list[str]:
        """Refuses (``ConfigError``) model arguments (``models.transformer.ModelArgs``) this objective cannot
        train; returns notice lines for the start-up log (what the architecture means for the objective)."""
        return []

    def collate(self, packs: list, groups: list[int], keys: list[int]) -> Any:
        """``packs`` from the dataset, their loss groups, and their draw keys (``titan_sft.data.loader``)."""
        raise NotImplementedError

    def begin_step(self, batch: Any, dataset: Any, first: bool) -> str | None:
        """Called once per optimizer step with all of this rank's microbatches, before any forward. Returns None
        to run the step, or (the same on every rank) the reason to skip it without an update."""
        return None

    def loss(self, model: torch.nn.Module, mb: Any) -> torch.Tensor:
        raise NotImplementedError

    def router_loss(self, model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` plus, for a model with routed experts, the router losses of the forward just run divided by
        the number of forwards of the global step (the step adds their mean over its forwards, as HF adds them per
        forward): ``objective.router_aux_loss_coef`` x transformers' load-balancing loss
        (``models.moe.load_balancing_loss`` over all MoE layers; -1 takes the model config's coefficient) and
        ``objective.router_z_loss_coef`` x the router z-loss (``models.moe.router_z_loss``)."""
        stats = getattr(model, "router_stats", None)
        if not stats:
            return loss
        from titan_sft.models.moe import load_balancing_loss, router_z_loss

        args, o = model.args, self.cfg.objective
        coef = args.router_aux_loss_coef if o.router_aux_loss_coef < 0 else o.router_aux_loss_coef
        share = 1.0
        if self.cp is not None or self.router_tp_group is not None:  # the routers' statistics of the whole rows
            stats = self._rows_router_stats(stats)
            share = 1.0 / self.cp.size if self.cp is not None else 1.0  # each cp rank adds its share
        aux, z = load_balancing_loss(stats, args.n_experts), router_z_loss(stats)
        self._n_experts, self._moe_layers = args.n_experts, args.moe_layers()
        counts = torch.stack([s.counts for s in stats])
        done = share * torch.cat([torch.stack([aux.detach(), z.detach()]).double(), counts.double().flatten()])
        self._router_sums = done if getattr(self, "_router_sums", None) is None else self._router_sums + done
        forwards = self.cfg.training.global_batch_size // self.cfg.training.per_device_batch
        if coef:
            loss = loss + (share * coef / forwards) * aux
        if o.router_z_loss_coef:
            loss = loss + (share * o.router_z_loss_coef / forwards) * z
        return loss

    def _rows_router_stats(self, stats: list) -> list:
        """Under context and/or tensor parallel: every MoE layer's router statistics summed over the cp and tp
        ranks (differentiably), i.e. those of the whole rows. The load-balancing loss is a product of two token
        means, so the parts' own losses would not add up to the row's.

        * tp ranks compute the same loss (each backpropagates it whole, as with the cross-entropy): the sum over
          them passes the gradient back unchanged (Megatron's "g");
        * cp ranks compute their parts' losses, which are summed: every cp rank adds 1 / cp of the row's, and the
          sum's backward adds the cp ranks' gradients back onto each rank's tokens."""
        from titan_sft.models.moe import RouterStats
        from titan_sft.parallel import comm

        rows = self.cp.size if self.cp is not None else 1  # n_tokens counts this cp part's positions (tp: all)
        out = []
        for s in stats:
            counts, prob, z = s.counts.detach().clone(), s.prob_sum, s.z_sum
            if self.router_tp_group is not None:
                comm.all_reduce(counts, group=self.router_tp_group, what="router counts over tp")
                prob = comm.all_reduce_same_loss(prob, self.router_tp_group, what="router probabilities over tp")
                z = comm.all_reduce_same_loss(z, self.router_tp_group, what="router z-loss over tp")
            if self.cp is not None:
                comm.all_reduce(counts, group=self.cp_group, what="router counts over cp")
                prob = comm.all_reduce_autograd(prob, self.cp_group, what="router probabilities over cp")
                z = comm.all_reduce_autograd(z, self.cp_group, what="router z-loss over cp")
            out.append(RouterStats(counts, prob, z, s.n_tokens * rows))
        return out

    def step_sums(self) -> list[torch.Tensor]:
        """This rank's sums for the step's all-reduce (the same number on every rank and step); reset each step.
        Here: the router's (load-balancing loss and expert selections per MoE layer) when the model has experts."""
        sums, self._router_sums = getattr(self, "_router_sums", None), None
        if sums is None and getattr(self, "_n_experts", 0):  # no loss here (an earlier pipeline stage): zeros
            from titan_sft.parallel import comm

            sums = comm.zeros(2 + len(self._moe_layers) * self._n_experts)
        return [] if sums is None else list(sums.unbind())

    def step_metrics(self, sums: list[float] = ()) -> dict[str, Any]:
        """Extra fields of the step's train record; ``sums`` are :meth:`step_sums` summed over all ranks: the
        mean load-balancing loss and z-loss of the step's forwards and, over the MoE layers, the highest and lowest
        expert load relative to the mean (1.0 is perfect balance)."""
        if not sums:
            return {}
        forwards = self.cfg.training.global_batch_size // self.cfg.training.per_device_batch
        counts = torch.tensor(sums[2:], dtype=torch.float64).view(-1, self._n_experts)
        return {"aux_loss": sums[0] / forwards, "z_loss": sums[1] / forwards, **expert_load(counts, self._moe_layers)}

    def end_step(self, model: torch.nn.Module, sums: list[float] = ()) -> dict[str, Any]:
        """After the optimizer step, with the step's agreed sums: with ``model.router_bias_rate``, every MoE
        layer's routing bias moves by ``models.moe.routing_bias_update`` of the step's selections per expert (all
        ranks' and microbatches'), the same on every rank. Returns the largest bias magnitude for the record."""
        rate = self.cfg.model.router_bias_rate
        if not rate or not sums:
            return {}
        import re

        from titan_sft.models.moe import Router, routing_bias_update

        counts = torch.tensor(sums[2:], dtype=torch.float64).view(-1, self._n_experts)
        row = {layer: i for i, layer in enumerate(self._moe_layers)}
        # this rank's routers by layer (a pipeline stage holds some layers only)
        routers = {int(re.search(r"layers\.(\d+)\.", name).group(1)): m for name, m in model.named_modules()
                   if isinstance(m, Router)}
        with torch.no_grad():
            for layer, router in routers.items():
                bias = router.expert_bias
                bias.add_(routing_bias_update(counts[row[layer]], rate).to(bias.device, bias.dtype))
        biggest = torch.stack([r.expert_bias.abs().max().float() for r in routers.values()] or [torch.zeros(())]).max()
        if getattr(model, "pp_group", None) is not None:  # a pipeline stage: the largest of all stages'
            from titan_sft.parallel import comm

            biggest = comm.all_reduce(biggest.to(comm.device()), op=torch.distributed.ReduceOp.MAX,
                                      group=model.pp_group, what="routing bias over pipeline stages")
        return {"router_bias_max": biggest.item()}

    def head_positions(self, mb: Any) -> int:
        """How many positions of ``mb`` the output head is applied to (for the FLOP count): all of them, unless
        the objective applies it at some only."""
        return mb.input_ids.numel()

    def build_validator(self, model: torch.nn.Module) -> Validator | None:
        """Called once the model holds its starting weights (before any resume), so a validator may keep what it
        needs of them."""
        return None


def forward_hidden(model: torch.nn.Module, items):
    """Held-out forwards: yields each of ``items`` (tuples whose first element is a microbatch on the device) with
    the model's final hidden states. A pipelined model runs them through its stages forward only
    (``PipelinedModel.hidden_states``) and gives None on ranks without the last stage: only that stage counts, and
    :func:`sum_over_stages` hands its sums to every rank."""
    if getattr(model, "pp_group", None) is not None:
        yield from model.hidden_states(items)
        return
    for item in items:
        mb = item[0]
        yield item, model(mb.input_ids, cu_seqlens=mb.cu_seqlens, positions=mb.positions, hidden_only=True)


def sum_over_stages(model: torch.nn.Module, sums: torch.Tensor, what: str) -> torch.Tensor:
    """``sums`` (on the device) that only the last pipeline stage counted, summed over the pp ranks (zeros
    elsewhere), so every rank has them; unchanged without pipeline parallel."""
    group = getattr(model, "pp_group", None)
    if group is None:
        return sums
    from titan_sft.parallel import comm

    return comm.all_reduce(sums, group=group, what=what)


def validation_records(step: int, results: list[tuple[str | None, float, dict]], best_source: str = ""
                       ) -> tuple[list[dict], float]:
    """The records of one validation round over one or more held-out sets, and the loss best-checkpoint selection
    follows. ``results``: (source name or None, weight, fields with ``loss``) per set. One unnamed set gives its
    record as is; named sets give one record each (``source``: name) and a record of their weighted mean loss
    (``sources``: name -> loss), which selection follows unless ``best_source`` names a set."""
    if len(results) == 1 and results[0][0] is None:
        rec = {"split": "validation", "step": step, **results[0][2]}
        return [rec], rec["loss"]
    records = [{"split": "validation", "step": step, "source": name, **fields} for name, _, fields in results]
    total = sum(w for _, w, _ in results)
    mean = sum(w * fields["loss"] for _, w, fields in results) / total
    records.append({"split": "validation", "step": step, "loss": mean, "weighted_mean_of": len(results),
                    "sources": {name: fields["loss"] for name, _, fields in results}})
    chosen = next((f["loss"] for n, _, f in results if n == best_source), mean) if best_source else mean
    return records, chosen


def expert_load(counts: torch.Tensor, layers: list[int]) -> dict:
    """An expert's selections relative to its layer's mean (1.0 everywhere is perfect balance), from the step's
    selections ``counts`` [MoE layers, E]: max and min over all layers and, per layer (keyed by layer index, for
    TensorBoard curves), max and min over its experts."""
    load = counts / counts.mean(dim=1, keepdim=True).clamp(min=1e-12)
    hi, lo = load.max(dim=1).values.tolist(), load.min(dim=1).values.tolist()
    return {"expert_load_max": max(hi), "expert_load_min": min(lo),
            "expert_load_max_by_layer": {str(i): v for i, v in zip(layers, hi)},
            "expert_load_min_by_layer": {str(i): v for i, v in zip(layers, lo)}}


def build_objective(cfg: JobConfig) -> Objective:
    """The objective named by ``[objective] name`` (a KeyError lists the registered ones)."""
    from titan_sft.registry import get_objective

    return get_objective(cfg.objective.name)(cfg)
