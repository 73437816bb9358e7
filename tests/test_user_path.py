"""The user's path, as a new user walks it (issue 39): a pipeline's tied head stays tied under weight decay; the best
held-out loss, the learning-rate schedule and the records survive a resume as the current config says; a kill during
the first save keeps the run in its own folder; bad input and Ctrl-C through ``./run_train.sh`` end with one line
and no launcher traceback. Each test failed before its fix."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from test_train_e2e import BASE, run
from titan_sft.config import load_config
from titan_sft.lr_schedule import Schedule

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _records(dump):
    return [json.loads(x) for x in (Path(dump) / "metrics.jsonl").read_text().splitlines()]


def test_a_pipeline_stage_copy_of_a_tied_head_does_not_decay():
    """The last stage's copy of a tied embedding is named ``output.weight``; the decay mask follows the
    embedding's rule for it (decaying one copy only pulls the two apart under weight decay)."""
    from titan_sft.optimizer import decay_groups

    class LastStage(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.output, self.w = nn.LayerNorm(4), nn.Linear(4, 8, bias=False), nn.Linear(4, 4, bias=False)

        def tied_copies(self):
            return [self.output.weight]

    assert decay_groups(LastStage()) == (["w.weight"], ["norm.weight", "norm.bias", "output.weight"])


def test_the_best_held_out_loss_is_restored_on_resume(tmp_path):
    """keep_best compares with the best loss as of the resumed checkpoint (both objectives call
    ``CheckpointManager.keep_if_best``): a worse first validation after a resume does not replace the best
    checkpoint; checkpoints-best's loss counts when it is not newer than the checkpoint (the validation of a
    checkpoint's own step runs after the save and is not repeated)."""
    from titan_sft.checkpoint import CheckpointManager

    ckpt = CheckpointManager.__new__(CheckpointManager)
    ckpt.root, ckpt.best_loss = tmp_path, float("inf")
    saved = []
    ckpt.save = lambda step, kind, extra_meta: saved.append((step, kind, extra_meta["validation_loss"]))
    assert ckpt._best_as_of({"step": 8, "best_validation_loss": 1.5}) == 1.5
    assert ckpt._best_as_of({"step": 8, "best_validation_loss": None}) == float("inf")
    best = tmp_path / "checkpoints-best"
    best.mkdir()
    (best / ".metadata").write_text("")
    (best / "meta.json").write_text(json.dumps({"step": 6, "validation_loss": 1.25}))
    assert ckpt._best_as_of({"step": 8}) == 1.25  # a checkpoint from before the record
    assert ckpt._best_as_of({"step": 6, "best_validation_loss": 1.5}) == 1.25  # validated after its checkpoint
    assert ckpt._best_as_of({"step": 4}) == float("inf")  # the best is from steps this run will redo
    ckpt.best_loss = ckpt._best_as_of({"step": 8, "best_validation_loss": 1.25})
    assert not ckpt.keep_if_best(10, 1.3) and saved == []
    assert ckpt.keep_if_best(12, 1.2) and saved == [(12, "best", 1.2)] and ckpt.best_loss == 1.2


def test_records_past_the_resumed_step_are_dropped(tmp_path):
    """metrics.jsonl keeps the records up to the checkpoint's step (a torn last line goes too), and TensorBoard
    purges the later events: each step is seen once after the redone steps log again."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from titan_sft.metrics import MetricsLogger

    cfg = load_config(None, ["--job.dump_folder", str(tmp_path), "--metrics.enable_tensorboard", "true"])

    def logger_at(step):
        m = MetricsLogger(cfg, 0, torch.device("cpu"), 10, None)
        m.start(step)
        return m

    m = logger_at(0)
    for step in range(1, 6):
        m.log({"split": "validation", "step": step, "loss": float(step)})
    m.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"split": "valid')  # killed mid-write
    m = logger_at(3)
    for step in (4, 5):
        m.log({"split": "validation", "step": step, "loss": 10.0 + step})
    m.close()
    assert [(r["step"], r["loss"]) for r in _records(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0),
                                                                    (5, 15.0)]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("validation/loss")] == [(1, 1.0), (2, 2.0), (3, 3.0),
                                                                             (4, 14.0), (5, 15.0)]


def test_resume_follows_the_current_schedule(tmp_path):
    """6 steps stopped after 3, resumed with ``training.steps`` 8: the resumed updates use the 8-step schedule
    (before: the first one kept the 6-step schedule's lr, loaded with the optimizer state)."""
    run(1, tmp_path, "--training.steps", "6", "--training.stop_at_step", "3", "--lr_scheduler.decay", "1")
    log = tmp_path / "log.txt"
    records = run(1, tmp_path, "--training.steps", "8", "--lr_scheduler.decay", "1", log=log)
    assert [r["step"] for r in records] == list(range(1, 9))
    cfg = load_config(None, [*BASE, "--lr_scheduler.decay", "1"])
    for r in records[3:]:
        assert r["lr"] == pytest.approx(1e-3 * Schedule.from_config(cfg.lr_scheduler, 8).multiplier(r["step"] - 1),
                                        rel=1e-12), r
    assert "the learning-rate schedule differs from the checkpoint's" in log.read_text()


def _train_sh(*args, **kw):
    return subprocess.run(["./run_train.sh", *args], cwd=ROOT, env={**ENV, **kw.pop("env", {})},
                          capture_output=True, text=True, timeout=600, **kw)


def _no_launcher_noise(output: str) -> None:
    assert "Traceback" not in output and "ChildFailedError" not in output and "FAILED" not in output, output[-3000:]


@pytest.mark.parametrize("args, nproc, line", [
    (["--optimzer.lr", "1"], "1", "error: command line: unknown config section '[optimzer]' (did you mean "
                                  "'optimizer'?)"),
    (["--parallelism.tp", "4"], "2", "error: config key 'parallelism': dp_replicate=1 x dp_shard=-1 x cp=1 x tp=4 "
                                     "does not multiply to the world size 2"),
    (["--data.seq_len", "999"], "2", "error: config key 'data.seq_len': 999, but the packed data has rows of 256 "
                                     "tokens"),
    (["--job.dump_folder", "/proc/titan_sft_test"], "1", "error: config key 'job.dump_folder': cannot create "
                                                         "/proc/titan_sft_test"),
])
def test_bad_input_through_the_launcher_ends_with_its_one_line(tmp_path, args, nproc, line):
    """A config error and a layout error stop in the launcher's check pass before any rank starts; an error only
    a rank can see (the data's row length) ends with the rank's line; no torchrun traceback after either, and the
    exit status is 2."""
    r = _train_sh("--job.dump_folder", str(tmp_path / "out"), *args, env={"NGPU": nproc})
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    errors = [x.removeprefix("[rank0]:") for x in (r.stdout + r.stderr).splitlines() if "error:" in x]
    assert len(errors) == 1 and errors[0].startswith(line), errors
    _no_launcher_noise(r.stdout + r.stderr)


def test_ctrl_c_through_the_launcher_saves_and_ends_quietly(tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) during the debug job: the ranks save and say so, the
    launcher ends without a traceback (status 128 + 2), and running the same command again continues the run
    in its folder (the debug configs resume automatically)."""
    dump = tmp_path / "out"
    proc = subprocess.Popen(["./run_train.sh", "--job.dump_folder", str(dump), "--metrics.log_freq", "1",
                             "--training.steps", "40"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not ((dump / "metrics.jsonl").exists() and (dump / "metrics.jsonl").read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
    assert "[stop] signal 2: stopped after step" in out and "checkpoint saved" in out
    _no_launcher_noise(out)
    stopped = _records(dump)[-1]["step"]
    again = _train_sh("--job.dump_folder", str(dump), "--metrics.log_freq", "1", "--training.steps", "40",
                      "--training.stop_at_step", str(stopped + 1))
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"[resume] continuing after step {stopped} of 40" in again.stdout
    assert [r["step"] for r in _records(dump) if r["split"] == "train"] == list(range(1, stopped + 2))
    assert not Path(f"{dump}-1").exists()


@pytest.mark.slow
def test_a_kill_during_the_first_save_keeps_the_run_in_its_folder(tmp_path):
    """TP 2 with ``resume = "auto"``, SIGKILL (torchrun and both ranks) while the first checkpoint is being
    written, twice: each restart starts over in the same folder (no ``-1``/``-2``), the third runs to the end,
    every step is logged once, and the steps the killed attempts logged are the same numbers again."""
    dump = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "titan_sft.train", "--config", "train_configs/debug_model.toml", *BASE, "--job.dump_folder", str(dump),
           "--parallelism.tp", "2", "--training.steps", "6", "--checkpoint.interval", "2"]
    killed = []
    for attempt in range(2):
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        started, deadline = time.time_ns(), time.monotonic() + 300
        partial = dump / "checkpoints" / "step-2.partial"
        while not (partial.exists() and partial.stat().st_ctime_ns > started):  # not the last attempt's
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first save"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert not (dump / "checkpoints" / "step-2").exists()  # killed before the rename
        killed.append(_records(dump))
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    records = _records(dump)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in (dump / "checkpoints").iterdir()) == ["step-2", "step-4", "step-5"]
    for attempt in killed:
        assert [r["step"] for r in attempt] == [1, 2, 3]
        assert [r["loss"] for r in attempt] == [r["loss"] for r in records[:3]]


def test_the_causal_head_runs_at_target_positions_only_with_the_same_loss_and_gradients():
    """The causal objective applies the head and the cross-entropy at the positions with a target only
    (``Microbatch.rows``): loss and every gradient equal the head over all positions (weight 0 where there is no
    target) within 1e-6 (fp32, the debug model and data: 4 packs, 2 loss groups, chunks of 100 positions), and the
    FLOP count takes the head at those positions."""
    from titan_sft.data.dataset import PackedDataset
    from titan_sft.loss import chunked_cross_entropy_sum
    from titan_sft.models import build_model
    from titan_sft.models.qwen3 import QWEN3_FLAVORS
    from titan_sft.objectives.causal_lm import CausalLM, group_weights

    cfg = load_config(None, ["--training.loss_groups", "2", "--training.loss_chunk_size", "100"])
    objective = CausalLM(cfg)
    ds = PackedDataset(ROOT / "titan_sft/assets/debug_data/packed")
    mb = objective.collate([ds[i] for i in range(4)], [0, 0, 1, 1])
    counts = torch.stack([(mb.labels[g * 2 : g * 2 + 2] != -100).sum() for g in range(2)]).double()
    objective.counts = counts
    assert 0 < mb.n_loss_tokens == len(mb.rows) < mb.input_ids.numel() / 2  # the debug data: ~40% are targets
    assert objective.head_positions(mb) == mb.n_loss_tokens

    def grads(loss_fn):
        torch.manual_seed(0)
        model = build_model(QWEN3_FLAVORS["debug"], device="cpu")
        model.init_weights()
        loss = loss_fn(model)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    def every_position(model):
        hidden = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, positions=mb.positions, hidden_only=True)
        weights = group_weights(mb.labels, mb.groups, counts, 2)
        return chunked_cross_entropy_sum(hidden, model.output.weight, mb.labels, 100, weights)

    (ours, g_ours), (ref, g_ref) = grads(lambda m: objective.loss(m, mb)), grads(every_position)
    assert abs(ours - ref) <= 1e-6 * abs(ref)
    for name, g in g_ref.items():
        assert (g_ours[name] - g).norm() <= 1e-6 * g.norm(), name


@pytest.mark.parametrize("module", ["prepare", "prepare_diffusion"])
def test_an_unwritable_prepare_out_is_one_line(tmp_path, module):
    r = subprocess.run([sys.executable, "-m", f"titan_sft.data.{module}", "--input",
                        "titan_sft/assets/debug_data/train.jsonl", "--tokenizer", "titan_sft/assets/debug_tokenizer",
                        "--seq-len", "256", "--out", "/proc/titan_sft_test/out"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [f"{module}: error: --out /proc/titan_sft_test/out: cannot create "
                                             "/proc/titan_sft_test (No such file or directory)"]


def test_download_without_the_hub_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "titan_sft.download", "Qwen/Qwen3-0.6B", "--to", str(tmp_path / "m")],
                       cwd=ROOT, env={**ENV, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("download: error: the Hugging Face hub cannot be reached"), lines
    assert "model.hf_assets_path" in lines[0] and not (tmp_path / "m").exists()


def test_generate_help_is_whole():
    r = subprocess.run([sys.executable, "-m", "titan_sft.generate", "--help"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "a trained model, in one process." in r.stdout and "--mask-token-id" in r.stdout
