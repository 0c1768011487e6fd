"""Random-weight checkpoints with the real structure and parameter names of named model shapes.

    alfrl random-model --shape qwen3.5-4b --out .cache/random-qwen3.5-4b

No download: the weights are random, the tokenizer is the tiny model's (its ids fit any of these
vocabularies), and the files are what ``save_pretrained`` writes for the real architecture, so the
trainer, vLLM and the weight sync meet exactly the names and shapes of the real checkpoint.

- ``qwen3-4b``: Qwen3ForCausalLM, 36 layers, hidden 2560, 32 / 8 heads of 128, MLP 9728, vocabulary
  151,936, tied embeddings.
- ``qwen3.5-4b``: Qwen3_5ForConditionalGeneration (a vision-language checkpoint): a 24-block vision
  tower and a text stack of 32 layers (24 Gated DeltaNet ``linear_attention`` + 8 ``full_attention``),
  hidden 2560, 16 / 4 heads of 256, linear attention 16 key / 32 value heads of 128, MLP 9216,
  vocabulary 248,320, tied embeddings; names ``model.language_model.*`` and ``model.visual.*``. As the released Qwen3.5
  configs, the text config names ``mamba_ssm_dtype: float32`` (vLLM keeps the Gated DeltaNet state, and the states its
  prefix cache stores, in float32; without the key it keeps them in the weights' bf16) and the rotary settings (theta
  10,000,000, interleaved multimodal sections 11 / 11 / 10 over a quarter of each head).
- ``qwen3.5-small``: the same structure, every dimension shrunk (the CPU tests).
"""

from __future__ import annotations

import time
from pathlib import Path

QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1_000_000.0)
QWEN35_RELEASED = dict(mamba_ssm_dtype="float32")   # in every released Qwen3.5 text config; transformers' default has no such key
QWEN35_4B_TEXT = dict(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
                      head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                      full_attention_interval=4, vocab_size=248320, tie_word_embeddings=True, max_position_embeddings=262144,
                      rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                                           mrope_section=[11, 11, 10], mrope_interleaved=True), **QWEN35_RELEASED)
QWEN35_4B_VISION = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560)
QWEN35_SMALL_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                         full_attention_interval=4, vocab_size=4096, tie_word_embeddings=True, max_position_embeddings=32768,
                         **QWEN35_RELEASED)
QWEN35_SMALL_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
SHAPES = ("qwen3-4b", "qwen3.5-4b", "qwen3.5-small")


def build_config(shape: str, tokenizer, layers: int | None = None):
    """The transformers config of ``shape`` with the tokenizer's special ids; ``layers`` keeps only that many
    (text) layers, every other size as the shape's (quick GPU checks of the real kernels)."""
    special = dict(eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    if layers is not None and layers < 1:
        raise ValueError(f"--layers {layers}: give at least 1 (or leave it out for the shape's own count)")
    depth = {} if layers is None else {"num_hidden_layers": layers}
    if shape == "qwen3-4b":
        from transformers import Qwen3Config

        return Qwen3Config(**{**QWEN3_4B, **depth}, **special)
    if shape in ("qwen3.5-4b", "qwen3.5-small"):
        from transformers import Qwen3_5Config

        text, vision = (QWEN35_4B_TEXT, QWEN35_4B_VISION) if shape == "qwen3.5-4b" else (QWEN35_SMALL_TEXT, QWEN35_SMALL_VISION)
        return Qwen3_5Config(text_config={**text, **depth, **special}, vision_config=vision, tie_word_embeddings=True)
    raise ValueError(f"unknown shape {shape!r}: choose one of {', '.join(SHAPES)}")


def write_random_model(shape: str, out: str | Path, seed: int = 0, layers: int | None = None) -> tuple[Path, int]:
    """Write the random-weight checkpoint (bf16, on the GPU when there is one); returns (folder, parameters)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from alfrl.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = build_config(shape, tokenizer, layers)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if shape != "qwen3.5-small" else torch.float32
    builder = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    with torch.device(device):
        model = builder.from_config(config, dtype=dtype)
    out = Path(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def parser():
    import argparse

    parser = argparse.ArgumentParser(prog="alfrl random-model", description="Write a random-weight checkpoint of a real model's shape.")
    parser.add_argument("--shape", required=True, choices=SHAPES)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="keep only this many text layers (default: the shape's)")
    return parser


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    start = time.perf_counter()
    try:
        out, n = write_random_model(args.shape, args.out, args.seed, args.layers)
    except ValueError as e:
        parser.error(str(e))
    print(f"{args.shape}: {n / 1e9:.3f} B parameters written to {out} in {time.perf_counter() - start:.1f}s")
    return 0
