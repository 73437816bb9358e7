"""Checkpoint save / load / HF export throughput, and how long async saving blocks the training loop.

    python benchmarks/bench_checkpoint.py --params 1e9 --dir /tmp/ckpt_bench

One process (gloo group of 1), an fp32 model state of ``--params`` parameters (Qwen3-shaped, dim 2048), on local
disk. Prints GB/s for each operation and the ratio of the async blocking time to a synchronous save.
"""

import argparse
import dataclasses
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--dir", default="/tmp/titan_sft_ckpt_bench")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    dist.init_process_group("gloo")
    from titan_sft.hf_io import export_hf
    from titan_sft.models import build_model
    from titan_sft.models.qwen3 import QWEN3_FLAVORS
    from titan_sft.registry import get_train_spec

    base = QWEN3_FLAVORS["1.7B"]
    fixed = dataclasses.replace(base, n_layers=0).num_params()
    per_layer = (base.num_params() - fixed) / base.n_layers
    layers = max(1, round((a.params - fixed) / per_layer))
    args = dataclasses.replace(base, n_layers=layers)
    model = build_model(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    gb = sum(p.numel() * 4 for p in model.parameters()) / 1e9
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    state = {"model": model.state_dict()}
    pg = dist.new_group(backend="gloo")

    def timed(fn):
        ts = []
        for i in range(a.runs):
            t = time.perf_counter()
            fn(i)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    from safetensors.torch import save_file

    from titan_sft.parallel.distributed import transient_group

    from torch.distributed.checkpoint import FileSystemWriter

    def dcp_save(i, pg=None):
        dcp.save(state, checkpoint_id=str(root / f"sync{i}"), process_group=pg)

    def dcp_save_transient(i):
        with transient_group() as pg:  # as the trainer saves (see titan_sft.parallel.distributed)
            dcp.save(state, storage_writer=FileSystemWriter(str(root / f"tsync{i}"), thread_count=4), process_group=pg)

    def fsynced(path):
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    unique = {}  # a tied head shares the embedding's storage; safetensors stores it once
    for k, v in state["model"].items():
        if all(v.data_ptr() != u.data_ptr() for u in unique.values()):
            unique[k] = v.contiguous()
    # The disk's write speed drifts with the page cache's dirty-page throttling, so the variants are interleaved
    # round by round (each written, fsynced where DCP fsyncs, then deleted) and medians compared.
    def plain(i):
        save_file(unique, str(root / f"plain{i}.safetensors"))

    def plain_sync(i):  # DCP fsyncs what it writes before the checkpoint counts as complete; so must a fair rival
        save_file(unique, str(root / f"ps{i}.safetensors"))
        fsynced(str(root / f"ps{i}.safetensors"))

    variants = {"plain": plain, "plain_sync": plain_sync, "dcp4": dcp_save_transient, "dcp1": dcp_save}
    times = {k: [] for k in variants}
    for i in range(a.runs):
        for k, fn in variants.items():
            os.sync()
            t = time.perf_counter()
            fn(i)
            times[k].append(time.perf_counter() - t)
            if k != "dcp1":  # dcp1's files are read back by the load timing below
                for f in root.glob(f"{ {'plain': 'plain', 'plain_sync': 'ps', 'dcp4': 'tsync'}[k] }{i}*"):
                    shutil.rmtree(f) if f.is_dir() else f.unlink()
    t_plain, t_plain_sync, t_save_transient, t_save = (statistics.median(times[k]) for k in variants)
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # As the trainer does it: staging in the background too; the loop waits for it only before its next
    # optimizer step. Reported: the time async_save takes to return, and how long staging runs after that.
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                                          use_non_blocking_copy=False))
    returns, staging = [], []
    for i in range(a.runs):
        t = time.perf_counter()
        resp = dcp.async_save(state, checkpoint_id=str(root / f"async{i}"), process_group=pg, async_stager=stager)
        returns.append(time.perf_counter() - t)
        resp.staging_completion.result()
        staging.append(time.perf_counter() - t)
        resp.upload_completion.result()
    stager.close()
    t_block, t_stage = statistics.median(returns), statistics.median(staging)
    t_load = timed(lambda i: dcp.load(state, checkpoint_id=str(root / f"sync{i}")))
    t_export = timed(lambda i: export_hf(model, args, root / f"hf{i}", "bfloat16", spec=get_train_spec("qwen3")))
    print(f"state: {args.num_params() / 1e9:.2f}B params, {gb:.2f} GB fp32 (Qwen3 dim 2048, {layers} layers)")
    print(f"plain safetensors write {t_plain:.2f}s  {gb / t_plain:.2f} GB/s")
    print(f"plain safetensors write + fsync {t_plain_sync:.2f}s  {gb / t_plain_sync:.2f} GB/s")
    print(f"DCP save as the trainer does it (a group per save, 4 writer threads) {t_save_transient:.2f}s  "
          f"{gb / t_save_transient:.2f} GB/s = {t_plain_sync / t_save_transient:.2f}x the speed of plain write + fsync, "
          f"{t_plain / t_save_transient:.2f}x of the plain write")
    print(f"DCP save with DCP's default writer (1 thread) {t_save:.2f}s  {gb / t_save:.2f} GB/s = "
          f"{t_plain_sync / t_save:.2f}x of plain write + fsync")
    print(f"DCP load   {t_load:.2f}s  {gb / t_load:.2f} GB/s")
    print(f"HF export (bf16) {t_export:.2f}s  {gb / t_export:.2f} GB/s of fp32 state")
    print(f"async save returns after {t_block:.2f}s = {100 * t_block / t_save:.0f}% of a synchronous save; staging then "
          f"runs {t_stage:.2f}s ({100 * t_stage / t_save:.0f}%) in the background, overlapping the next step's "
          "forward/backward (the loop waits only if that step is shorter)")
    shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
