"""``python -m titan_sft.launch [torchrun options] -m titan_sft.train --config FILE [overrides]``: torchrun for the
trainer, as ``./run_train.sh`` and ``scripts/multinode_trainer.slurm`` call it.

Three things plain torchrun does not do:

- a check pass before any rank starts: the config (keys, values, custom imports), the layout for this launch's
  world size, and the output folder; a bad input stops here with its one ``error:`` line and exit status 2;
- ``--help`` and ``--dry-run`` run once, in this process (no ranks);
- a rank's clean stop ends without torchrun's traceback: a rank that printed its one ``error:`` line (exit 2), or a
  stop signal the ranks handled (they checkpoint and report ``[stop]``), ends with that line as the last word.
  A rank that crashed keeps torchrun's report of which rank failed and how. Exit status: 0 on success, 2 for a
  user error, 128 + the signal for a signalled stop, the failed rank's status otherwise.
"""

from __future__ import annotations

import logging
import sys


def _world_size(args) -> int | None:
    """Ranks this launch starts in all (nodes x processes per node), when both are fixed numbers."""
    try:
        nproc = int(args.nproc_per_node)
        lo, _, hi = str(args.nnodes).partition(":")
    except ValueError:
        return None
    if hi and hi != lo:
        return None  # an elastic node count: the layout is checked by the ranks
    return nproc * int(lo)


def check(train_argv: list[str], world: int | None) -> None:
    """The trainer's checks that need no rank: the config, its custom imports, the layout for ``world`` ranks
    and the output folder. Raises ConfigError (or the loader's ValueError / FileNotFoundError) with one line."""
    import importlib

    from titan_sft.config import check_layout, load_config
    from titan_sft.train import check_output_folder, parse_cli

    config_path, _, rest = parse_cli(train_argv)
    cfg = load_config(config_path, rest)
    for module in cfg.job.custom_imports:
        importlib.import_module(module)
    if world is not None:
        check_layout(cfg, world)
    check_output_folder(cfg.job.dump_folder)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from titan_sft.config import ConfigError

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    train_argv = list(args.training_script_args)
    if not (args.module and args.training_script == "titan_sft.train"):
        run(args)  # not the trainer: plain torchrun
        return 0
    if {"--help", "-h", "--dry-run"} & set(train_argv):
        from titan_sft.train import main as train_main

        return train_main(train_argv)
    try:
        check(train_argv, _world_size(args))
    except (ConfigError, FileNotFoundError, ValueError, KeyError, ModuleNotFoundError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return 2
    # The agent's per-process lines (closing signals sent, "failed (exitcode: 2)") repeat what the ranks printed
    # or what the failure report below says.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(args)
    except SignalException as e:  # the ranks got the signal too: they saved and said so
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()  # the others were stopped by torchrun because of it
        if failure.exitcode == 2:  # a clean error: the rank printed its one line (LOG_RANK shows other ranks)
            return 2
        print(e.format_msg(), file=sys.stderr)
        print(f"error: rank {rank} failed with exit status {failure.exitcode} (its output: LOG_RANK={rank})",
              file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
