"""Run under torchrun with 2 ranks: tensor parallel with compiled blocks on the llama3 debug model (untied head).

Prints, on rank 0, ``grad_rel <value>``: the largest relative difference of any parameter's gradient (tp 2,
compiled blocks) from one process's eager model; and ``saved_mib <mode> <value>`` for the activations the
forward keeps for backward with compiled blocks alone (``compile``), and with full activation checkpointing
wrapped around them (``compile_ac``, the order parallelize_transformer takes under tp) or eager (``ac``).
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import titan_sft.families  # noqa: F401  (registers the families)
from titan_sft.parallel.parallelize import apply_activation_checkpointing, apply_compile
from titan_sft.parallel.tensor_parallel import apply_tp
from titan_sft.registry import get_train_spec


def build(mode: str, mesh, state):
    spec = get_train_spec("llama3")
    model = spec.model_cls(spec.flavors["debug"])
    model.load_state_dict(state)
    apply_tp(model, mesh, spec.tp_plan_fn())
    if mode.startswith("compile"):
        apply_compile(model)
    if mode.endswith("ac"):
        apply_activation_checkpointing(model, "full")
    return model


def main() -> None:
    dist.init_process_group("gloo")
    spec = get_train_spec("llama3")
    torch.manual_seed(0)
    ref = spec.model_cls(spec.flavors["debug"])
    ref.init_weights()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ids = torch.randint(0, ref.args.vocab_size, (2, 256), generator=torch.Generator().manual_seed(1))
    h = ref(ids, hidden_only=True)
    (h.square().sum() / h.numel()).backward()
    for mode in ("compile", "compile_ac", "ac"):
        model = build(mode, mesh, ref.state_dict())
        saved = [0]

        def pack(t):
            saved[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(ids, hidden_only=True)
        # each rank's sequence slice: the local sums add up to the whole loss
        (out.to_local().square().sum() / out.numel()).backward()
        if mode == "compile":
            worst = 0.0
            for (name, p0), (_, p1) in zip(ref.named_parameters(), model.named_parameters()):
                if p0.grad is None:  # the head: hidden states only
                    continue
                g = p1.grad.full_tensor() if isinstance(p1.grad, DTensor) else p1.grad
                worst = max(worst, ((g - p0.grad).abs().max() / p0.grad.abs().max()).item())
            if dist.get_rank() == 0:
                print(f"grad_rel {worst}")
        if dist.get_rank() == 0:
            print(f"saved_mib {mode} {saved[0] / 2**20}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
