"""titan_sft: torchtitan-style SFT of Qwen3 and Llama 3 (see README.md)."""

from titan_sft.log import quiet_known_noise

quiet_known_noise()
