"""Benchmark-only model sizes, registered from outside titan_sft (``--job.custom_imports bench_families`` with
``benchmarks/`` on PYTHONPATH): the qwen3 family plus ~100M- and ~50M-parameter flavors whose vocabulary fits the
embedded debug dataset."""

import dataclasses

from titan_sft.registry import get_train_spec, register_train_spec

_qwen3 = get_train_spec("qwen3")
_debug = _qwen3.flavors["debug"]
FLAVORS = {
    **_qwen3.flavors,
    # 12 layers x (attention 1.6M + MLP 5.9M) + embeddings: 90.1M parameters
    "100M": dataclasses.replace(_debug, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, head_dim=64, ffn_dim=2560),
    # 10 layers x (attention 1.0M + MLP 3.9M): 49.5M parameters; 10 heads and 2 kv heads split over cp 2
    "50M": dataclasses.replace(_debug, dim=640, n_layers=10, n_heads=10, n_kv_heads=2, head_dim=64, ffn_dim=2048),
}
register_train_spec(_qwen3.replace(name="qwen3_bench", flavors=FLAVORS), overwrite=True)
