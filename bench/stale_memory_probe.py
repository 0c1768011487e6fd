"""Does the vLLM engine read GPU memory it has already freed? Awake, in one process, block by block.

    python bench/stale_memory_probe.py --model DIR --out result.json [--eager] [--cudagraph-mode piecewise]

Why (bench/README.md, 2026-12-02, fourth lease): with CUDA graphs the random Qwen3.5-4B scores NaN right after
the first update between sleep and wake-up (vLLM's default graphs and piecewise ones, prefix caching on and off),
although its probe scored finite after the rollout, just before the sleep; without sleep mode it faults with an
illegal memory access a few seconds into the first rollout (default and piecewise graphs); in eager mode one step
ran clean. One explanation fits all of it: a CUDA graph keeps the address of every tensor it was captured with; if
one of them is freed after the capture, every replay reads memory PyTorch's allocator holds as free. That memory
stays right while nothing else allocates it (the rollout), holds the trainer's data after an update (NaN after the
wake-up), and faults once the allocator has given it back to the driver (no sleep mode: nothing is cached the same
way). The Qwen2.5 models never showed it.

The test: PyTorch's allocator records its history from before the engine starts (the product's ``VLLMEngine``:
the recipe's engine settings for the checkpoint, sleep mode on as in the recipe, the trainer's LoRA adapter served, CUDA
graphs unless ``--eager``). The engine decodes a batch and scores a fixed probe twice (the baseline and its own jitter). Then
every block PyTorch's allocator holds as free (the default pool's: what the trainer's next allocation gets; vLLM's
sleep-mode pool's: dropped at a sleep; the graphs' own scratch) is filled with 0xFF bytes (NaN as a float, -1 as an
integer), one block at a time, and the probe scored after each.
The first block after which the probe is not finite or moved (or the process faults: each block is printed before
it is written) is memory the engine reads after freeing it; its recorded allocation and free stacks name the tensor.
Last, ``torch.cuda.empty_cache()`` gives the inactive segments back to the driver and the probe is scored once more
(a fault there is the no-sleep failure); with sleep mode, one sleep / wake-up cycle as in ``alfrl fit`` but with 0xFF
bytes where the trainer's update would be (``sleep_cycle``). ``--dry`` runs the plumbing on the CPU (HF engine, a made-up snapshot).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the sleep probe's poisoning of the free memory
from sleep_probe import poison_free_memory  # noqa: E402

DEFAULT_POOL = (0, 0)


def inactive_blocks(segments: list[dict], pools: str = "all") -> list[dict]:
    """The blocks PyTorch's allocator holds as free, in address order, each with its pool's id: ``pools="default"``
    only the default pool's (what the trainer's next allocation may get), ``"all"`` also vLLM's sleep-mode pool's
    (dropped or given back at a sleep) and the CUDA graphs' private pools' (scratch a replay writes before it reads)."""
    out = []
    for seg in segments:
        pool = tuple(seg.get("segment_pool_id", DEFAULT_POOL))
        if pools == "default" and pool != DEFAULT_POOL:
            continue
        for b in seg.get("blocks", []):
            if b.get("state") == "inactive":
                out.append({"address": b["address"], "size": b["size"], "pool": list(pool), "frames": b.get("frames", [])})
    return sorted(out, key=lambda b: b["address"])


def short_frames(frames: list[dict], n: int = 8) -> list[str]:
    """The first ``n`` frames of a stack in vLLM, alfrl or transformers code (else the first ``n`` at all)."""
    text = [f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}" for f in frames]
    ours = [t for t in text if any(k in t for k in ("/vllm/", "/alfrl/", "/transformers/", "/fla/"))]
    return (ours or text)[:n]


def block_history(traces: list[dict], block: dict) -> dict:
    """The last allocation and the last free recorded at an address inside ``block`` (``device_traces`` entries)."""
    lo, hi = block["address"], block["address"] + block["size"]
    last: dict[str, dict] = {}
    for t in traces:
        if lo <= t.get("addr", -1) < hi and t.get("action") in ("alloc", "free_requested", "free_completed"):
            last["alloc" if t["action"] == "alloc" else "free"] = t
    return {k: {"addr": t["addr"], "size": t.get("size"), "frames": short_frames(t.get("frames", []))} for k, t in last.items()}


def moved(scores: list[float], base: list[float], tolerance: float) -> dict:
    """How far ``scores`` are from ``base``: non-finite count and the largest finite difference."""
    bad = sum(not math.isfinite(x) for x in scores)
    diffs = [abs(a - b) for a, b in zip(scores, base) if math.isfinite(a) and math.isfinite(b)]
    largest = max(diffs) if diffs else 0.0
    return {"non_finite": bad, "max_abs_diff": largest, "moved": bad > 0 or largest > tolerance}


def brief(block: dict) -> dict:
    """A block's address, size and pool (what a result names it by)."""
    return {k: block[k] for k in ("address", "size", "pool") if k in block}


def written(poison, block: dict) -> bool:
    """``poison(block)``; False when its pages are not mapped (RuntimeError: cudaMemset's "invalid argument"). On the
    H200 (2026-12-02) vLLM's sleep-mode pool held such blocks while awake (``use_memory_pool`` unmaps and releases the
    segments left empty at its end, which PyTorch's pool still lists as free)."""
    try:
        poison(block)
    except RuntimeError:
        return False
    return True


def find_stale(blocks: list[dict], poison, score, base: list[float], tolerance: float, log=print) -> dict:
    """Poison ``blocks`` one at a time (``poison(block)``), scoring after each (``score()``); stops at the first block
    after which the scores moved from ``base``. Each block is logged before it is written, so a fault names it. A block
    whose pages are not mapped is skipped and listed (``written``)."""
    unmapped: list[dict] = []
    for i, b in enumerate(blocks):
        log(f"poisoning block {i + 1}/{len(blocks)}: address {b['address']:#x}, {b['size']} bytes", flush=True)
        if not written(poison, b):
            log("  not mapped: skipped", flush=True)
            unmapped.append(brief(b))
            continue
        change = moved(score(), base, tolerance)
        if change["moved"]:
            return {"found": True, "index": i, "block": brief(b), **change, "unmapped": unmapped}
    return {"found": False, "blocks": len(blocks) - len(unmapped),
            "bytes": sum(b["size"] for b in blocks) - sum(b["size"] for b in unmapped), "unmapped": unmapped}


def sleep_cycle(engine, poison, score, base: list[float], tolerance: float) -> dict:
    """As in `alfrl fit` without the trainer: the engine sleeps, every free block still mapped and 90% of the device's
    free memory are filled with 0xFF bytes (the memory an update takes), the engine wakes up and scores the probe."""
    import torch
    from vllm.device_allocator.cumem import CuMemAllocator

    engine.sleep()
    asleep = [(ptr, data.handle[1]) for ptr, data in CuMemAllocator.get_instance().pointer_to_data.items()]
    blocks = [b for b in inactive_blocks(torch.cuda.memory._snapshot()["segments"])
              if not any(p <= b["address"] < p + n for p, n in asleep)]  # the sleeping pool's pages are unmapped
    poisoned = sum(written(poison, b) for b in blocks)
    filled_gib = poison_free_memory(0.9)
    engine.wake_up()
    return {"blocks_poisoned": poisoned, "blocks_unmapped": len(blocks) - poisoned, "free_gib_poisoned": filled_gib,
            **moved(score(), base, tolerance)}


def gpu_poison():
    """0xFF bytes over a block's address range (vLLM's ctypes binding of the CUDA runtime)."""
    import ctypes

    import torch
    from vllm.distributed.device_communicators.cuda_wrapper import CudaRTLibrary

    cudart = CudaRTLibrary()

    def poison(block: dict) -> None:
        cudart.cudaMemset(ctypes.c_void_p(block["address"]), 0xFF, block["size"])
        torch.cuda.synchronize()

    return poison


def dry_snapshot(n: int = 3) -> tuple[list[dict], list[dict], list]:
    """A made-up allocator snapshot and host-side blocks to poison, for ``--dry`` (the plumbing on a CPU)."""
    memory = [[1.0] * 4 for _ in range(n)]
    segments = [{"segment_pool_id": [0, 0], "blocks": [{"address": 4096 * (i + 1), "size": 64, "state": "inactive",
                                                         "frames": []} for i in range(n)]}]
    traces = [{"action": "alloc", "addr": 4096 * (i + 1), "size": 64, "frames": [{"filename": "/x/alfrl/dry.py", "line": i, "name": "f"}]}
              for i in range(n)]
    return segments, traces, memory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stale_memory_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face folder (e.g. alfrl random-model --shape qwen3.5-4b --layers 4)")
    parser.add_argument("--out", required=True, help="where the JSON goes (rewritten after every phase)")
    parser.add_argument("--eager", action="store_true", help="no torch.compile, no CUDA graphs (the control)")
    parser.add_argument("--cudagraph-mode", default=None, help="data.engine.cudagraph_mode (none, piecewise, full, ...; default vLLM's)")
    parser.add_argument("--no-compile", action="store_true", help="vLLM without torch.compile (compilation_config.mode 0, with --cudagraph-mode "
                        "full_decode_only: graphs of the uncompiled model)")
    parser.add_argument("--no-sleep-mode", action="store_true", help="start the engine without sleep mode (no cumem pools)")
    parser.add_argument("--decode", type=int, default=32, help="tokens each of 16 sequences decodes before the probe (0: none)")
    parser.add_argument("--turns", type=int, default=1, help="decoding turns: each next prompt is the last one + its completion + "
                        "50 new tokens, as a rollout resumes over its cached prefix (crossing the cache's blocks)")
    parser.add_argument("--probe-tokens", type=int, default=389)
    parser.add_argument("--tolerance", type=float, default=1e-3, help="a probe change above this (after the baseline's own) counts")
    parser.add_argument("--max-blocks", type=int, default=5000, help="poison at most this many blocks")
    parser.add_argument("--pools", choices=("all", "default"), default="all", help="whose free blocks to poison (see inactive_blocks)")
    parser.add_argument("--no-adapter", action="store_true", help="serve no LoRA adapter (default: the trainer's, as `alfrl fit` does)")
    parser.add_argument("--dry", action="store_true", help="the CPU plumbing only: HF engine, a made-up snapshot")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    import random

    import torch

    from alfrl.engines import SamplingRequest
    from alfrl.models import read_config
    from alfrl.sampler_config import EngineConfig

    t0 = time.perf_counter()
    result: dict = {"model": args.model, "eager": args.eager, "cudagraph_mode": args.cudagraph_mode, "torch_compile": not args.no_compile,
                    "sleep_mode": not args.no_sleep_mode, "adapter": not args.no_adapter, "decode_tokens": args.decode,
                    "turns": args.turns}

    def save() -> None:
        result["seconds"] = time.perf_counter() - t0
        Path(args.out).write_text(json.dumps(result, indent=1))

    if not args.dry:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")  # C++ stacks would slow every allocation
    rng = random.Random(0)
    config = read_config(args.model)
    vocab = getattr(getattr(config, "text_config", None) or config, "vocab_size", 3000)
    top = min(3000, vocab)
    probe = [rng.randrange(10, top) for _ in range(args.probe_tokens)]
    if args.dry:
        from alfrl.engines import HFEngine
        from alfrl.models import load_causal_lm

        engine = HFEngine(load_causal_lm(args.model, dtype=torch.float32), pad_token_id=0)
    else:
        from alfrl.vllm_engine import VLLMEngine

        settings = EngineConfig(kind="vllm", cudagraph_mode=args.cudagraph_mode,
                                vllm_args={"compilation_config": {"mode": 0}} if args.no_compile else None)
        if settings.problems():
            raise SystemExit("; ".join(settings.problems()))
        engine = VLLMEngine(args.model, gpu_memory_utilization=0.5, max_model_len=4096, enable_sleep_mode=not args.no_sleep_mode,
                            enforce_eager=args.eager, seed=0, lora_rank=32, extra=settings.vllm_extra(args.model))
    result["engine_start_seconds"] = time.perf_counter() - t0
    if not args.dry and not args.no_adapter:
        # the trainer's adapter served, as in `alfrl fit` (vLLM replays the graphs it captured with LoRA): the recipe's LoRA
        import yaml

        from alfrl.policy import AlfrlPolicy
        from alfrl.policy import LoRAConfig

        lora = LoRAConfig(**yaml.safe_load(open("recipes/qwen4b_80step.yaml"))["model"]["lora"])
        policy = AlfrlPolicy(model_name=args.model, dtype="bfloat16", lora=lora, linear_attention_kernel="torch")
        policy.configure_model()
        policy.to("cuda")
        result["adapter_modules_taken"] = engine.load_adapter(policy.adapter_weights())
    if args.decode:
        start = time.perf_counter()
        histories = [tuple(rng.randrange(10, top) for _ in range(50)) for _ in range(16)]
        result["decoded_tokens"] = 0
        for turn in range(args.turns):
            print(f"decoding turn {turn + 1}/{args.turns}: prompts of {min(map(len, histories))}-{max(map(len, histories))} tokens",
                  flush=True)
            done = engine.generate([SamplingRequest(h, 1, 1.0, 1.0, args.decode, (), seed=i) for i, h in enumerate(histories)])
            result["decoded_tokens"] += sum(len(c.token_ids) for cs in done for c in cs)
            histories = [h + tuple(cs[0].token_ids) + tuple(rng.randrange(10, top) for _ in range(50)) for h, cs in zip(histories, done)]
            result["turns_done"] = turn + 1
            save()
        result["decode_seconds"] = time.perf_counter() - start
    base = engine.score(probe)
    result["baseline"] = moved(engine.score(probe), base, float("inf"))   # the engine's own jitter on the same probe
    tolerance = args.tolerance + result["baseline"]["max_abs_diff"]
    save()

    if args.dry:
        segments, traces, memory = dry_snapshot()
        cells = {b["address"]: memory[i] for i, b in enumerate(segments[0]["blocks"])}
        weights = engine.model.get_input_embeddings().weight

        def poison(block: dict) -> None:  # the second block stands for memory the engine still reads
            cells[block["address"]][:] = [float("nan")] * 4
            if block["address"] == 8192:
                weights.data[:] = float("nan")
    else:
        snapshot = torch.cuda.memory._snapshot()
        segments, traces = snapshot["segments"], [t for dev in snapshot.get("device_traces", []) for t in dev]
        poison = gpu_poison()
    every = inactive_blocks(segments, args.pools)
    blocks = every[: args.max_blocks]
    result["inactive_blocks"] = {"count": len(blocks), "of": len(every), "bytes": sum(b["size"] for b in blocks)}
    result["segments_freed_after_start"] = sum(t.get("action") == "segment_free" for t in traces)
    save()
    print(f"{len(blocks)} inactive blocks ({args.pools} pools), {result['inactive_blocks']['bytes'] / 2**20:.1f} MiB", flush=True)
    found = find_stale(blocks, poison, lambda: engine.score(probe), base, tolerance)
    if found["found"]:
        b = blocks[found["index"]]
        found["allocated_at"] = short_frames(b["frames"])
        found["history"] = block_history(traces, b)
    result["stale"] = found
    save()
    print("stale", json.dumps(found, indent=1), flush=True)
    if not args.dry and not found["found"]:
        print("empty_cache, then the probe once more (a fault here: the engine reads memory given back to the driver)", flush=True)
        torch.cuda.empty_cache()
        result["after_empty_cache"] = moved(engine.score(probe), base, tolerance)
        save()
        if engine.sleep_mode:
            result["sleep_cycle"] = sleep_cycle(engine, poison, lambda: engine.score(probe), base, tolerance)
            save()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
