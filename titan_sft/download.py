"""``python -m titan_sft.download HUB_ID --to DIR``: config, tokenizer and safetensors of a hub model into DIR.

Written to ``DIR.partial`` and renamed when complete. Set ``model.hf_assets_path = DIR`` (or keep the hub id: a
model in the huggingface_hub cache is found by its id). Needs the network, or ``HF_HUB_OFFLINE=1`` and the
model in the cache (then it is copied out of the cache).
"""

from __future__ import annotations

import argparse
import fnmatch
import shutil
import sys
from pathlib import Path

from titan_sft.hf_io import HF_FILES, HUB_ID


def download(repo_id: str, to: str | Path, revision: str | None = None) -> Path:
    from huggingface_hub import snapshot_download

    if not HUB_ID.match(repo_id):
        raise ValueError(f"'{repo_id}' is not a hub id (owner/name)")
    out = Path(to)
    if out.exists():
        raise FileExistsError(f"{out} already exists; choose another --to")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    snapshot = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HF_FILES))
    wanted = lambda name: any(fnmatch.fnmatch(name, pat) for pat in HF_FILES)  # noqa: E731
    # Follows the cache's symlinks (a plain directory) and keeps only model files: an offline snapshot holds all.
    shutil.copytree(snapshot, tmp, ignore=lambda d, names: [n for n in names if not wanted(n)])
    if not (tmp / "config.json").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        raise FileNotFoundError(f"{repo_id}: the snapshot has no config.json")
    tmp.rename(out)
    return out


def _one_line(e: Exception, repo_id: str) -> str:
    """What went wrong, in one line: an unreachable hub (with what to do offline), else the error's first line."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    if isinstance(e, LocalEntryNotFoundError):  # no connection, and the model is not in the local cache
        cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
        return (f"the Hugging Face hub cannot be reached{cause} and {repo_id} is not in the local cache. Offline: "
                f"copy a model directory (config.json, tokenizer, *.safetensors) to this machine and set "
                f"model.hf_assets_path to it, or fill the cache where the hub is reachable (huggingface-cli "
                f"download {repo_id}) and copy it to $HF_HOME with HF_HUB_OFFLINE=1 set here")
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_sft.download", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("repo_id", help="hub id, e.g. Qwen/Qwen3-8B")
    ap.add_argument("--to", required=True, help="directory to create")
    ap.add_argument("--revision", default=None)
    a = ap.parse_args(argv)
    try:
        path = download(a.repo_id, a.to, a.revision)
    except Exception as e:  # noqa: BLE001 - network, auth or disk: one line for the user
        print(f"download: error: {_one_line(e, a.repo_id)}", file=sys.stderr)
        return 2
    print(f"download: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
