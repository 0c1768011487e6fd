"""Does the vLLM engine score right after a level-1 sleep and wake-up? Side by side in one process.

    python bench/sleep_probe.py --model DIR --out results.json [--eager]

The product's ``VLLMEngine`` (LoRA served, sleep mode, the recipe's engine settings for the checkpoint) scores a
fixed probe, then goes through two sleep / wake-up cycles. Between sleep and wake-up the GPU memory the engine
gave back is filled with 0xFF bytes (NaN as a float, -1 as an integer) and freed, as the trainer's update leaves
it with its own data. Then the probe is scored twice. The cycles:

- ``kept``: as alfrl sleeps now: every engine buffer vLLM built beside its KV cache kept with the weights
  (``keep_across_sleep``), the cache pages zeroed at wake-up;
- ``dropped``: those buffers tagged back as vLLM had them, so sleep drops them (alfrl before 2026-12-02;
  the cache is still zeroed).

For each: the non-finite probe log-probs and the largest difference from the scores before any sleep.
On the H200 the random Qwen3.5-4B scored 388 of 389 probe tokens as NaN after a wake-up (2026-12-02); the
Qwen2.5 models never did. ``--dry`` runs the script's plumbing on the CPU with the HF engine (no sleep).
"""

from __future__ import annotations

import argparse
import json
import math
import time


def poison_free_memory(share: float = 0.9) -> float:
    """Fill ``share`` of the free GPU memory with 0xFF bytes and free it again; returns the GiB written."""
    import torch

    free = torch.cuda.mem_get_info()[0]
    n = int(free * share) // 4
    x = torch.full((n,), -1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    del x
    torch.cuda.empty_cache()
    return n * 4 / 2**30


def compare(scores: list[float], base: list[float]) -> dict:
    bad = sum(not math.isfinite(x) for x in scores)
    finite = [abs(a - b) for a, b in zip(scores, base) if math.isfinite(a) and math.isfinite(b)]
    return {"non_finite": bad, "tokens": len(scores), "max_abs_diff_finite": max(finite) if finite else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sleep_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face folder (e.g. alfrl random-model --shape qwen3.5-4b --layers 4)")
    parser.add_argument("--out", required=True, help="where the JSON goes")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (a faster engine start)")
    parser.add_argument("--probe-tokens", type=int, default=389)
    parser.add_argument("--dry", action="store_true", help="the CPU plumbing only: HF engine, no sleep")
    args = parser.parse_args(argv)

    import random

    import torch

    from alfrl.sampler import EngineConfig

    t0 = time.perf_counter()
    rng = random.Random(0)
    probe = [rng.randrange(10, 3000) for _ in range(args.probe_tokens)]
    result: dict = {"model": args.model, "eager": args.eager, "probe_tokens": len(probe)}
    if args.dry:
        from alfrl.engines import HFEngine
        from alfrl.models import load_causal_lm

        engine = HFEngine(load_causal_lm(args.model, dtype=torch.float32), pad_token_id=0)
    else:
        from alfrl import vllm_engine
        from alfrl.vllm_engine import VLLMEngine

        config = EngineConfig(kind="vllm", sleep_mode=True, enforce_eager=args.eager, gpu_memory_utilization=0.5)
        engine = VLLMEngine(args.model, gpu_memory_utilization=0.5, max_model_len=4096, enable_sleep_mode=True,
                            enforce_eager=args.eager, seed=0, lora_rank=32, extra=config.vllm_extra(args.model))
    result["engine_start_seconds"] = time.perf_counter() - t0
    base = engine.score(probe)
    result["before_sleep"] = compare(base, base)
    if not args.dry:
        from vllm.device_allocator.cumem import CuMemAllocator

        allocations = CuMemAllocator.get_instance().pointer_to_data
        tags = {address: data.tag for address, data in allocations.items()}
        keep = vllm_engine.keep_across_sleep
        for cycle in ("kept", "dropped"):
            if cycle == "dropped":  # as vLLM tagged them, and alfrl's sleep leaving them so
                for address, data in allocations.items():
                    data.tag = tags.get(address, data.tag)
                vllm_engine.keep_across_sleep = lambda allocations, kv_ranges: 0
            start = time.perf_counter()
            engine.sleep()
            poisoned = poison_free_memory()
            engine.wake_up()
            first, second = engine.score(probe), engine.score(probe)
            result[cycle] = {"kept_mib": (engine._kept_bytes if cycle == "kept" else 0) / 2**20, "poisoned_gib": poisoned,
                             "first_after_wake": compare(first, base), "second_after_wake": compare(second, base),
                             "seconds": time.perf_counter() - start}
            print(cycle, json.dumps(result[cycle]), flush=True)
        vllm_engine.keep_across_sleep = keep
    result["seconds"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
