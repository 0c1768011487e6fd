"""The update's variants alone on the GPU: no engine, no games, no kit (torch, transformers, peft and lightning only).

    PYTHONPATH=. python bench/update_alone.py --config raw-results-2026-12-06:bench/results/2026-12-03d/model_config.json --out upd.json \
        --variants varlen_rows32768_bf16_compiled varlen_rows32768_bf16_compiled_cudnn

A model of the config's shape with random weights (saved to a temporary folder, loaded as the trainer loads a checkpoint),
and synthetic samples shaped like an 8 x 8 x 20 rollout of the 1.5B recipe: 64 sequences of 3,000-7,200 tokens; after a
start of a quarter to a half of the shortest length, turns of 42 sampled tokens making 16% of the rest (~13% of all); the
sampler's log-probs those of a uniform distribution (the random model's are near it: a mean gap of 0.67 on the H200).
``update_bench.update_phase`` runs on them, the JSON written after every variant (a run cut short keeps what finished).
The figures are the update's alone: in a fit the engine holds ~56 GiB more. ``--dry`` runs on the CPU with a small
config (two layers, 256-token rows) to check the mechanics.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from update_bench import UPDATE_VARIANTS, update_phase  # noqa: E402


def synthetic_samples(n: int, low: int, high: int, vocab: int, seed: int = 0, turn: int = 42, share: float = 0.16) -> list:
    """``n`` sequences of ``low``..``high`` tokens; after a start (system prompt and task), turns of ``turn`` sampled
    tokens make ``share`` of the rest (the others prompt and tool responses); advantages +1 / -1 by sequence so every trained token has a gradient."""
    from alfrl.types import Sample

    rng = random.Random(seed)  # one stream for tokens, lengths and turns: the samples of raw-results-2026-12-06:bench/leases/2026-12-03d.md
    samples = []
    for i in range(n):
        length = rng.randint(low, high)
        ids = torch.tensor([rng.randrange(vocab) for _ in range(length)], dtype=torch.int64)
        mask = torch.zeros(length, dtype=torch.bool)
        gap = max(int(turn / share) - turn, 1)
        t = rng.randint(low // 4, low // 2)  # the first turn after the system prompt and the task
        while t + turn < length - 1:
            mask[t : t + turn] = True
            t += turn + gap
        mask[-1] = False
        lps = torch.where(mask, torch.tensor(-math.log(vocab)), torch.tensor(0.0)).float()
        adv = torch.where(mask, torch.tensor(1.0 if i % 2 == 0 else -1.0), torch.tensor(0.0)).float()
        samples.append(Sample(ids, mask, lps, adv, group=i // 8, trajectory=i % 8))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a model's config.json (its shape; the weights are random)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", nargs="+", default=None, help="UPDATE_VARIANTS names (default: all)")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs=2, default=(3000, 7200), metavar=("LOW", "HIGH"),
                        help="each sequence's tokens, uniform in [LOW, HIGH] (the 50-step learning run's averaged ~7,000)")
    parser.add_argument("--dry", action="store_true", help="CPU: a small config, short sequences")
    parser.add_argument("--profile", default=None, metavar="TXT", help="one variant once more under torch.profiler: its tables "
                        "here, its kernels' busy share of the wall clock in --out (below 1: the GPU waited for the host)")
    parser.add_argument("--profile-variant", default=None, help="the variant profiled (default: the first of --variants)")
    args = parser.parse_args()
    by_name = {v[0]: v for v in UPDATE_VARIANTS}
    unknown = [n for n in args.variants or [] if n not in by_name]
    if unknown:
        parser.error(f"--variants {' '.join(unknown)}: not in bench/update_bench.py's UPDATE_VARIANTS ({', '.join(by_name)})")
    variants = [by_name[n] for n in args.variants] if args.variants else list(UPDATE_VARIANTS)

    from transformers import AutoConfig, AutoModelForCausalLM

    from alfrl.policy import AlfrlPolicy

    cuda = torch.cuda.is_available() and not args.dry
    if Path(args.config).is_dir():
        config = AutoConfig.from_pretrained(args.config)
    else:
        fields = json.loads(Path(args.config).read_text())
        if args.dry:
            fields.pop("layer_types", None)
            fields.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        config = AutoConfig.for_model(**fields)
    if args.dry:
        variants = [(name, attn, 256, *rest) for name, attn, _rows, *rest in variants]
    dtype = torch.bfloat16  # the variants' bf16 adapter needs a bf16 model (on the CPU too)
    import alfrl

    report: dict = {"alfrl": str(Path(alfrl.__file__).parent), "config": args.config, "dry": args.dry, "variants": [v[0] for v in variants], "started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def save(update: dict | None = None) -> None:
        if update is not None:
            report["update"] = update
        Path(args.out).write_text(json.dumps(report, indent=2))

    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        with torch.device("cuda" if cuda else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.save_pretrained(folder)
        del model
        policy = AlfrlPolicy(model_name=folder, dtype="bfloat16", attn_implementation="sdpa_varlen")
        policy.configure_model()
        if cuda:
            policy.to("cuda")
        report["model_seconds"] = time.perf_counter() - started
        low, high = tuple(args.lengths) if not args.dry else (60, 120)
        samples = synthetic_samples(args.sequences if not args.dry else 4, low, high, config.vocab_size)
        save()
        update_phase(policy, samples, 1.0, variants, on_run=save, profile_path=args.profile,
                     profile_variant=args.profile_variant or variants[0][0])
    save()
    for run in report["update"]["runs"]:
        failed = run.get("error", "").strip().splitlines()[-1:]
        print(run["variant"], failed[0] if failed else f"{run['seconds']:.2f} s, MFU {100 * run['mfu_6n']:.1f}%")


if __name__ == "__main__":
    main()
