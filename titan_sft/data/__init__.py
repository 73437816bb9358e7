"""Packed chat SFT data: prepare (JSONL -> packed npy), reader, sampler, collator."""
