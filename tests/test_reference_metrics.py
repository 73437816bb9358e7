"""Metrics comparable with the reference diffusion trainer (issue 19, item 6): component losses in train records,
a validation sample cap and eval batch size, text-alone perplexity, mean NLL, token counts, per-text distinct-n,
and the progress bar."""

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_per_text_distinct_and_the_text_prefix_token():
    from conftest import QWEN_DIR
    from titan_sft.data.chat import load_tokenizer
    from titan_sft.diffusion_sampler import distinct_n, distinct_n_per_text, text_prefix_id

    texts = [[1, 1, 1, 1], [1, 2, 3, 4], [5]]
    assert distinct_n(texts, 1) == pytest.approx(5 / 9)  # pooled
    assert distinct_n_per_text(texts, 1) == pytest.approx((1 / 4 + 1 + 1) / 3)  # per text, averaged
    assert distinct_n_per_text(texts, 2) == pytest.approx((1 / 3 + 1) / 2)  # [5] has no bigram
    assert distinct_n_per_text([[1]], 2) is None
    qwen = load_tokenizer(QWEN_DIR)  # no BOS: the end-of-document token
    assert qwen.bos_token_id is None and text_prefix_id(qwen) == qwen.convert_tokens_to_ids("<|endoftext|>")


def test_progress_bar_draws_steps_loss_and_eta():
    from titan_sft.metrics import ProgressBar

    out = io.StringIO()
    bar = ProgressBar(10, file=out)
    bar.bar.mininterval = 0
    for step in range(4, 8):  # a run resumed after step 3
        bar.update({"step": step, "loss": 2.0 - step / 10, "lr": 1e-3})
    bar.close()
    text = out.getvalue()
    assert "7/10" in text and "loss 1.3000" in text and "avg 1.4500" in text and "<" in text  # tqdm's ETA


@pytest.mark.slow
def test_diffusion_run_records_reference_metrics(tmp_path):
    dump = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "titan_sft.train", "--config", "train_configs/debug_diffusion.toml",
                        "--job.dump_folder", str(dump), "--training.steps", "4", "--metrics.log_freq", "1",
                        "--metrics.enable_tensorboard", "false", "--metrics.progress_bar", "true",
                        "--checkpoint.hf_export_interval", "-1", "--checkpoint.interval", "100",
                        "--objective.split_loss", "true", "--objective.answer_weight", "0.9",
                        "--objective.padding_weight", "0.1", "--validation.interval", "2",
                        "--validation.max_packs", "6", "--validation.batch_size", "4",
                        "--validation.generation_every", "2", "--validation.max_examples", "3",
                        "--validation.test_path", ""],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in records if x["split"] == "train"]
    assert len(train) == 4
    for x in train:
        assert x["loss_answer"] + x["loss_padding"] == pytest.approx(x["loss"], rel=1e-6)
        assert x["loss_answer"] > 0 and x["loss_padding"] > 0
    val = [x for x in records if x["split"] == "validation"]
    assert [x["step"] for x in val] == [2, 4] and all(x["n_examples"] == 6 for x in val)  # one example a pack
    gen = [x for x in records if x["split"] == "generation"]
    assert [x["step"] for x in gen] == [4]
    g = gen[0]
    rows = [json.loads(x) for x in (dump / "generation_metrics.jsonl").read_text().splitlines()]
    assert len(rows) == g["n_texts"] == 3 and g["n_tokens"] == sum(x["n_tokens"] for x in rows)
    for suffix in ("", "_text"):
        total = sum(x[f"nll{suffix}"] * x["n_tokens"] for x in rows)
        assert g[f"nll{suffix}_mean"] == pytest.approx(total / g["n_tokens"], rel=1e-9)
        assert g[f"perplexity{suffix}_pooled"] == pytest.approx(math.exp(g[f"nll{suffix}_mean"]), rel=1e-9)
    assert g["perplexity_text_mean"] != g["perplexity_mean"]  # the text alone is scored without its prompt
    # As the reference scores a text alone: re-encoded by the tokenizer (the debug one, like Qwen3's, prepends no
    # BOS), every token after the first, under the base model: by hand with transformers on the shipped base.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(ROOT / "titan_sft/assets/debug_base", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(ROOT / "titan_sft/assets/debug_tokenizer")
    total = count = 0
    for x in rows:
        ids = tok(x["text"])["input_ids"]
        assert x["n_tokens_reference"] == max(len(ids) - 1, 0)
        if len(ids) > 1:
            with torch.no_grad():
                logits = base(torch.tensor([ids])).logits[0, :-1].float()
            nll = float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
            assert x["nll_reference"] * x["n_tokens_reference"] == pytest.approx(nll, rel=1e-4, abs=1e-4)
            total, count = total + nll, count + len(ids) - 1
    assert g["nll_reference_mean"] == pytest.approx(total / count, rel=1e-4)
    assert all(g[f"distinct_{n}_per_text"] is not None for n in (1, 2))
    assert "4/4" in r.stderr  # the bar, on stderr; the log lines still on stdout
    assert "step 4/4" in r.stdout


def test_reference_config_carries_the_reference_defaults():
    from titan_sft.config import load_config

    c = load_config(ROOT / "train_configs" / "qwen3_8b_diffusion_lora_reference.toml")
    v = c.validation
    assert (c.job.seed, c.data.shuffle, c.data.reshuffle_each_epoch, c.training.epochs, c.training.steps) == \
        (42, True, True, 1, 0)
    assert (c.lr_scheduler.name, c.lr_scheduler.warmup_steps, c.training.max_grad_norm) == ("linear", 0, 0.0)
    assert c.optimizer.decay_mask == "all"
    assert (v.interval, v.max_loss_examples, v.generation_eval_path, v.max_examples, v.gen_length, v.gen_steps,
            v.temperature, v.noise_seed) == (100, 200, "builtin", 30, 128, 64, 0.7, 1234)
    env = {**os.environ, "WORLD_SIZE": "8"}
    r = subprocess.run([sys.executable, "-m", "titan_sft.train", "--config",
                        "train_configs/qwen3_8b_diffusion_lora_reference.toml", "--dry-run", "--model.init_from_hf",
                        "false"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "steps: 1 epochs of the packed data" in r.stdout and "no clipping" in r.stdout


def test_builtin_prompts_are_thirty_varied_user_turns():
    from titan_sft.data.chat import load_tokenizer
    from titan_sft.diffusion_sampler import load_prompts, resolve_prompts

    prompts = load_prompts(resolve_prompts("builtin"), load_tokenizer(ROOT / "titan_sft/assets/debug_tokenizer"), 100)
    assert len(prompts) == 30 and len({tuple(p) for p, _ in prompts}) == 30
    assert all(ref is None for _, ref in prompts)  # prompts without references: scored, not exact-matched


def test_reshuffle_each_epoch_is_a_new_permutation_per_epoch_for_any_layout_and_resume():
    import numpy as np

    from titan_sft.data.sampler import RecipeSampler
    from titan_sft.lr_schedule import total_steps
    from titan_sft.config import load_config

    n, B = 10, 4
    s = RecipeSampler(n, B, shuffle=True, seed=42, reshuffle=True)
    seen = np.concatenate([s.global_indices(k) for k in range(10)])  # 40 examples = 4 epochs
    epochs = seen.reshape(4, n)
    assert all(sorted(e) == list(range(n)) for e in epochs)  # every epoch visits every pack once
    assert len({tuple(e) for e in epochs}) == 4  # in a new order each time
    once = RecipeSampler(n, B, shuffle=True, seed=42)
    assert np.array_equal(np.concatenate([once.global_indices(k) for k in range(5)]).reshape(2, n)[1],
                          np.concatenate([once.global_indices(k) for k in range(5)]).reshape(2, n)[0])
    # Two data-parallel ranks take contiguous halves of the same global batch; a resumed sampler continues.
    halves = [RecipeSampler(n, B, r, 2, shuffle=True, seed=42, reshuffle=True) for r in (0, 1)]
    for k in range(6):
        step_ids = halves[0].global_indices(k)
        assert np.array_equal(step_ids, seen[k * B:(k + 1) * B])
        assert np.array_equal(np.concatenate([step_ids[h.local_positions()] for h in halves]), step_ids)
    s.step = 7
    resumed = RecipeSampler(n, B, shuffle=True, seed=42, reshuffle=True)
    resumed.load_state_dict(s.state_dict())
    assert np.array_equal(resumed.next()[1], seen[28:32])
    with __import__("pytest").raises(ValueError, match="reshuffle"):
        RecipeSampler(n, B, shuffle=True, seed=42).load_state_dict(s.state_dict())
    cfg = load_config(None, ["--training.epochs", "1", "--training.global_batch_size", "4"])
    assert total_steps(cfg, 10) == 3


def test_wandb_offline_run_resumes_under_the_same_id(tmp_path):
    """metrics.wandb_project / wandb_id: an offline W&B run, stopped and resumed, logs each step once under one id."""
    pytest.importorskip("wandb")
    dump = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}

    def run(*extra):
        r = subprocess.run([sys.executable, "-m", "titan_sft.train", "--config", "train_configs/debug_model.toml",
                            "--job.dump_folder", str(dump), "--training.steps", "4", "--metrics.log_freq", "1",
                            "--checkpoint.interval", "2", "--checkpoint.hf_export_interval", "-1",
                            "--validation.generation_eval_path", "", "--metrics.wandb_project", "titan-test",
                            "--metrics.wandb_id", "resume0001", "--checkpoint.resume", "auto", *extra],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]

    run("--training.stop_at_step", "2")
    run()
    losses = {x["step"]: x["loss"] for x in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())
              if x["split"] == "train"}
    assert sorted(losses) == [1, 2, 3, 4]
    # offline-run-<YYYYmmdd_HHMMSS>-<id>: the timestamp orders them (glob order is the filesystem's)
    runs = sorted((dump / "wandb").glob("offline-run-*-resume0001*"), key=lambda p: p.name.split("-")[2])
    assert len(runs) == 2  # the same id twice: W&B merges them when synced
    logged = [next(r.glob("run-resume0001.wandb")).read_bytes() for r in runs]
    for blob, (mine, other) in zip(logged, (((1, 2), (3, 4)), ((3, 4), (1, 2)))):
        assert b"train/loss" in blob
        assert all(json.dumps(losses[s]).encode() in blob for s in mine)
        assert not any(json.dumps(losses[s]).encode() in blob for s in other)


def test_wandb_carries_the_reference_scripts_keys_and_names_the_run_after_its_folder(tmp_path, monkeypatch):
    """metrics.wandb_reference_keys: train/tokens = the loss targets, train/step_time, and train/lr = the next
    update's lr (titan_sft's step lr under train/lr_step); validation records unchanged. An empty wandb_run_name
    names the run after the run folder, as the Levanter-port script's --wandb-name does."""
    import types

    import torch

    from titan_sft.config import load_config
    from titan_sft.metrics import MetricsLogger

    calls = {"log": []}

    class Run:
        def log(self, payload, step):
            calls["log"].append((step, payload))

        def finish(self):
            pass

    def init(**kwargs):
        calls["init"] = kwargs
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    cfg = load_config(None, ["--job.dump_folder", str(tmp_path / "my-run"), "--metrics.wandb_project", "p",
                             "--metrics.enable_tensorboard", "false", "--metrics.wandb_reference_keys", "true",
                             "--metrics.progress_bar", "false"])
    m = MetricsLogger(cfg, 0, torch.device("cpu"), 10, None)
    m.start(0)
    m.log({"split": "train", "step": 1, "loss": 2.0, "lr": 0.0, "lr_next": 1e-4, "grad_norm": 1.0,
           "n_loss_tokens": 37, "n_tokens": 64, "step_time_s": 0.5, "tokens_per_s": 128.0})
    m.log({"split": "validation", "step": 1, "loss": 2.5})
    m.close()
    assert calls["init"]["name"] == "my-run"
    (_, train), (_, val) = calls["log"]
    assert train["train/lr"] == 1e-4 and train["train/lr_step"] == 0.0 and train["train/lr_next"] == 1e-4
    assert train["train/tokens"] == 37 and train["train/step_time"] == 0.5 and train["train/loss"] == 2.0
    assert val == {"validation/step": 1, "validation/loss": 2.5}


def test_generation_prompts_inline_and_with_a_system_prompt(tmp_path):
    """validation.system_prompt: a system turn for every prompt without one (a chat's own system turn is kept);
    validation.generation_prompts: user turns given inline, before the file's prompts."""
    from titan_sft.data.chat import load_tokenizer
    from titan_sft.diffusion_sampler import inline_prompts, load_prompts

    tok = load_tokenizer(str(ROOT / "titan_sft/assets/debug_tokenizer"))
    enc = lambda msgs: tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),  # noqa: E731
                                  add_special_tokens=False)
    rows = [{"messages": [{"role": "user", "content": "upper: ab"}, {"role": "assistant", "content": "AB"}]},
            {"messages": [{"role": "system", "content": "own"}, {"role": "user", "content": "upper: cd"}]}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sys_turn = {"role": "system", "content": "be brief"}
    got = load_prompts(str(path), tok, 10, "be brief")
    assert got[0] == (enc([sys_turn, rows[0]["messages"][0]]), "AB")
    assert got[1] == (enc(rows[1]["messages"]), None)
    assert load_prompts(str(path), tok, 10) == [(enc(rows[0]["messages"][:1]), "AB"), (enc(rows[1]["messages"]), None)]
    assert load_prompts(str(path), tok, 1, "be brief") == got[:1]
    assert inline_prompts(["upper: xy"], tok, "be brief") == [(enc([sys_turn, {"role": "user", "content": "upper: xy"}]),
                                                               None)]
