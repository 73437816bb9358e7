"""The sharded random init (titan_sft.parallel.init_sharded): the numbers of init_weights() on one device, drawn one
part at a time, so the whole model is never materialised (a GPU run never builds it on the host)."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from titan_sft.parallel import init_sharded
from titan_sft.registry import get_train_spec


def test_init_sharded_equals_init_weights_holding_one_part_at_a_time(tmp_path):
    spec = get_train_spec("qwen3")
    args = spec.flavors["debug"]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with torch.device("meta"):
            model, reference, expected = spec.model_cls(args), spec.model_cls(args), spec.model_cls(args)
        expected.to_empty(device="cpu")
        torch.manual_seed(3)
        expected.init_weights()
        for block in model.layers.values():
            fully_shard(block, mesh=init_device_mesh("cpu", (1,)))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        model.to_empty(device="cpu")
        held = []
        parts = reference.init_parts()

        def counting(init):
            def run(module):
                held.append(sum(p.numel() for p in reference.parameters() if not p.is_meta))
                init(module)
            return run

        reference.init_parts = lambda: [(name, counting(init)) for name, init in parts]
        torch.manual_seed(3)
        init_sharded(model, reference, torch.device("cpu"))
        got = {k: v.full_tensor() for k, v in model.state_dict().items()}
        for k, v in expected.state_dict().items():
            assert torch.equal(got[k], v), k
        largest = max(sum(p.numel() for p in reference.get_submodule(n).parameters()) for n, _ in parts)
        assert max(held) == largest < args.num_params() / 2
        assert all(p.is_meta for p in reference.parameters())  # every part released again
    finally:
        dist.destroy_process_group()
