"""The supported torch range (titan_sft/compat.py), proven per layout family: CI runs this module (marker
``torch_range``) on the oldest supported torch as well as on the pinned one (scripts/torch_range_leg.sh). Each
layout trains the debug model (or debug_moe for expert parallel) for 3 steps and equals its 1-rank run: 1 rank,
FSDP 2, TP 2, CP 2, PP 2 (Interleaved1F1B, with held-out validation), EP 2 and TP 2 on debug_moe (on torch < 2.13
the routers and experts are FSDP modules of their own: the fallback for per-parameter meshes)."""

import re

import pytest
import torch

from test_moe import _close, _train
from test_parallel import close, run

pytestmark = pytest.mark.torch_range

# 3 steps, recipe settings (weight decay on, tied debug model), held-out validation at step 2
SHORT = ["--training.steps", "3", "--checkpoint.hf_export_interval", "-1", "--checkpoint.interval", "100",
         "--validation.holdout_fraction", "0.1", "--validation.max_packs", "8", "--validation.batch_size", "1",
         "--validation.interval", "2"]
DENSE = {  # name: (processes, overrides)
    "fsdp2": (2, []),
    "tp2": (2, ["--parallelism.tp", "2"]),
    "cp2": (2, ["--parallelism.cp", "2"]),
    "pp2": (2, ["--parallelism.pp", "2", "--parallelism.pp_schedule", "Interleaved1F1B"]),
}


def test_this_torch_is_in_the_supported_range():
    from titan_sft.compat import PER_PARAM_MESH, SUPPORTED_TORCH

    lo, hi = (tuple(int(x) for x in v.split(".")) for v in re.findall(r"[\d.]+", SUPPORTED_TORCH))
    assert lo <= tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < hi
    assert PER_PARAM_MESH == (tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13))


@pytest.fixture(scope="module")
def dense_one_rank(tmp_path_factory):
    return run(1, tmp_path_factory.mktemp("one"), *SHORT)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(DENSE))
def test_dense_layouts_equal_one_rank(dense_one_rank, tmp_path, layout):
    """Training losses and grad norms within 1e-5 (1e-4 under tp: its row-wise partial sums change the fp32
    summation order) of one rank, the same token counts; the validation loss within 1e-5."""
    nproc, overrides = DENSE[layout]
    records = run(nproc, tmp_path / layout, *SHORT, *overrides)
    tol = 1e-4 if layout == "tp2" else 1e-5
    for split in ("train", "validation"):
        ours, ref = ([r for r in recs if r["split"] == split] for recs in (records, dense_one_rank))
        assert [r["step"] for r in ours] == [r["step"] for r in ref] == ([1, 2, 3] if split == "train" else [2, 3])
        for a, b in zip(ours, ref):
            assert close(a["loss"], b["loss"], tol) and a["n_loss_tokens"] == b["n_loss_tokens"], (split, a, b)
            if split == "train":
                assert close(a["grad_norm"], b["grad_norm"], tol), (a, b)


@pytest.mark.slow
def test_expert_parallel_and_moe_under_tp_equal_one_rank(tmp_path):
    """debug_moe: EP 2 (experts sharded by expert; on torch < 2.13 an FSDP module of their own on the experts'
    mesh) and TP 2 (routers and experts FSDP-sharded over the tp ranks) within 1e-5 of one rank: loss, grad norm,
    aux loss, and the same expert load."""
    one = _train(1, tmp_path / "one")
    for name, overrides in (("ep2", ["--parallelism.ep", "2"]), ("tp2", ["--parallelism.tp", "2"])):
        records = _train(2, tmp_path / name, *overrides)
        assert [r["step"] for r in records] == [1, 2, 3]
        for a, b in zip(records, one):
            _close(a, b)
            assert a["expert_load_max"] == b["expert_load_max"]
