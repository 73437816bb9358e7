"""Checkpoint save / load / HF export throughput, and how long async saving blocks the training loop.

    python benchmarks/bench_checkpoint.py --params 1e9 --dir /tmp/ckpt_bench

One process (gloo group of 1), an fp32 model state of ``--params`` parameters (Qwen3-shaped, dim 2048), on local
disk. Prints, side by side: the raw bytes written + fsynced (the disk's speed), a safetensors write + fsync, DCP as
the trainer saves, DCP with CRC32s and DCP's defaults (medians and minima of shuffled rounds, ratios to raw and
to safetensors); then DCP load, the HF export, and how long an async save blocks the loop. ``--dir /dev/shm/x``
takes the disk out and leaves what each writer costs in CPU.
"""

import argparse
import dataclasses
import os
import random
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
    from titan_sft.checkpoint import _CrcFreeWriter, model_state
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
    state = {"model": model.state_dict()}  # DCP's default: every key, so the tied head is written twice
    stored = {"model": model_state(model)}  # as the trainer saves: each shared parameter once
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


    def dcp_save(i, pg=None):  # before: DCP's defaults (one writer thread, CRC32s), every key of the state dict
        dcp.save(state, checkpoint_id=str(root / f"sync{i}"), process_group=pg)

    def dcp_trainer(i):  # as the trainer saves: a group per save, write_threads writers, no CRC32
        with transient_group() as pg:
            dcp.save(stored, storage_writer=_CrcFreeWriter(str(root / f"tsync{i}"), thread_count=4), process_group=pg)

    def dcp4_crc(i):  # the trainer's writer threads, CRC32 left on: what skipping it saves
        with transient_group() as pg:
            dcp.save(stored, storage_writer=FileSystemWriter(str(root / f"crc{i}"), thread_count=4), process_group=pg)

    def fsynced(path):
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    unique = {}  # a tied head shares the embedding's storage; safetensors stores it once
    for k, v in state["model"].items():
        if all(v.data_ptr() != u.data_ptr() for u in unique.values()):
            unique[k] = v.contiguous()

    def plain_sync(i):  # DCP fsyncs what it writes before the checkpoint counts as complete; so must a fair rival
        save_file(unique, str(root / f"ps{i}.safetensors"))
        fsynced(str(root / f"ps{i}.safetensors"))

    def raw_sync(i):  # the bytes alone, one write per tensor, then fsync: the disk's speed for this state
        with open(root / f"raw{i}", "wb") as f:
            for v in unique.values():
                f.write(memoryview(v.view(-1).view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())

    # This VM's disk (and its page allocation) drifts by 2-3x from one write to the next, so the variants run in a
    # shuffled order every round, each written, fsynced and deleted before the next; medians and minima are
    # reported (the minimum is the closest to what each can do when the disk is not in a slow phase).
    variants = {"raw": raw_sync, "plain_sync": plain_sync, "dcp_trainer": dcp_trainer, "dcp4_crc": dcp4_crc,
                "dcp1": dcp_save}
    prefix = {"raw": "raw", "plain_sync": "ps", "dcp_trainer": "tsync", "dcp4_crc": "crc"}
    times = {k: [] for k in variants}
    for i in range(a.runs):
        order = list(variants)
        random.Random(i).shuffle(order)
        for k in order:
            os.sync()
            t = time.perf_counter()
            variants[k](i)
            times[k].append(time.perf_counter() - t)
            if k != "dcp1":  # dcp1's files are read back by the load timing below
                for f in root.glob(f"{prefix[k]}{i}*"):
                    shutil.rmtree(f) if f.is_dir() else f.unlink()
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
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
    print(f"{'variant':44s} {'median':>8s} {'GB/s':>6s} {'x raw':>6s} {'x st':>6s} | {'min':>6s} {'x raw':>6s} {'x st':>6s}")
    names = {"raw": "raw write of the bytes + fsync (disk speed)", "plain_sync": "safetensors save_file + fsync",
             "dcp_trainer": "DCP as the trainer saves (4 threads, no CRC)", "dcp4_crc": "DCP, 4 threads, CRC32 on",
             "dcp1": "before: DCP defaults, tied head twice"}
    for k in variants:
        print(f"{names[k]:44s} {med[k]:7.2f}s {gb / med[k]:6.2f} {med['raw'] / med[k]:6.2f} "
              f"{med['plain_sync'] / med[k]:6.2f} | {best[k]:5.2f}s {best['raw'] / best[k]:6.2f} "
              f"{best['plain_sync'] / best[k]:6.2f}")
    t_save = med["dcp1"]
    print(f"DCP load   {t_load:.2f}s  {gb / t_load:.2f} GB/s")
    print(f"HF export (bf16) {t_export:.2f}s  {gb / t_export:.2f} GB/s of fp32 state")
    print(f"async save returns after {t_block:.2f}s = {100 * t_block / t_save:.0f}% of a synchronous save; staging then "
          f"runs {t_stage:.2f}s ({100 * t_stage / t_save:.0f}%) in the background, overlapping the next step's "
          "forward/backward (the loop waits only if that step is shorter)")
    shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
