"""Run under torchrun: load an HF directory into an FSDP2-sharded model; each rank's shard must equal its slice."""

import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from titan_sft.hf_io import hf_safetensors_files, load_hf_weights, read_hf_config
from titan_sft.models import build_model
from titan_sft.models.hf_adapter import args_from_hf_config, native_to_hf_name
from titan_sft.registry import get_train_spec

path = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
args = args_from_hf_config(read_hf_config(path))
model = build_model(args)
for block in model.layers.values():
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
model.to_empty(device="cpu")
load_hf_weights(model, args, path, get_train_spec("qwen3"))
ref = {}
for f in hf_safetensors_files(path):
    ref.update(load_file(str(f)))
checked = 0
for name, p in model.named_parameters():
    full = ref[native_to_hf_name(name)].float()
    local = p.to_local()
    expected = torch.chunk(full, world, dim=0)[rank] if full.shape[0] >= world else full[: local.shape[0]]
    assert torch.equal(local[: expected.shape[0]], expected), (rank, name)
    checked += 1
dist.barrier()
print(f"rank {rank}: {checked} shards equal their HF slices", flush=True)
dist.destroy_process_group()
