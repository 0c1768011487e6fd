"""Write a random-weight model of a real model's shape (no download), with the project's tokenizer.

    python bench/random_model.py --shape qwen3-4b --out .cache/random-qwen3-4b

Qwen3-4B's shape: 36 layers, hidden 2560, 32 query / 8 key-value heads of 128, MLP 9728, vocabulary
151,936, tied embeddings (4.0 B parameters). The tokenizer is the tiny model's (its ids are all
below the vocabulary size), so prompts, templates and parsing run exactly as for a real model.
"""

from __future__ import annotations

import argparse
import time

SHAPES = {
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1_000_000.0),
}


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from alfrl.tiny import build_tokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    tokenizer = build_tokenizer()
    config = Qwen3Config(**SHAPES[args.shape], eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.shape}: {n / 1e9:.2f} B parameters written to {args.out} in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
