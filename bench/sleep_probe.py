"""Does the vLLM engine score right after a level-1 sleep and wake-up? Side by side in one process.

    python bench/sleep_probe.py --model DIR --out results.json [--eager]

The product's ``VLLMEngine`` (LoRA served, sleep mode, the recipe's engine settings for the checkpoint) scores a
fixed probe, then goes through two sleep / wake-up cycles. Between sleep and wake-up the GPU memory the engine
gave back is filled with 0xFF bytes (NaN as a float, -1 as an integer) and freed, as the trainer's update leaves
it with its own data. Then the probe is scored twice. With ``--adapter`` (as ``alfrl fit`` runs): the trainer
(``AlfrlPolicy`` with the reference recipe's LoRA) pushes its adapter first, the engine serves it, and between
sleep and wake-up the trainer runs one optimizer step on the probe (the PyTorch reference for its linear
attention, as in both failing fits), which it does not push: the engine must score exactly as before the sleep. The cycles:

- ``kept``: as alfrl sleeps now: every engine buffer vLLM built beside its KV cache kept with the weights
  (``keep_across_sleep``), the cache pages zeroed at wake-up;
- ``dropped``: those buffers tagged back as vLLM had them, so sleep drops them (alfrl before 2026-12-02;
  the cache is still zeroed).

With ``--adapter`` a control comes first (``awake``: the trainer's step with the engine awake, then the probe; a NaN
there would come from the trainer's step, not from sleep), and each cycle is run twice: the served adapter registered
again at wake-up as a push does (alfrl now), and re-activated in place (alfrl before 2026-12-02).

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


def train_once(policy, optimizer, probe: list[int]) -> dict:
    """One optimizer step of the trainer on the probe (its log-likelihood), as an update would between sleep and
    wake-up; returns the loss, the trainer's probe change and the linear-attention kernel it used."""
    import torch

    policy.prepare_training()
    before = policy.score(probe)
    ids = torch.tensor([probe], device=policy.device)
    logits = policy.model(input_ids=ids).logits[0, :-1].float()
    loss = -torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    after = policy.score(probe)
    kernel = policy.linear_attention.kernel if policy.linear_attention is not None else None
    return {"loss": loss.item(), "trainer_probe_change": sum(abs(a - b) for a, b in zip(before, after)) / len(probe),
            "linear_attention": kernel}


def wake_in_place(engine) -> None:
    """The engine's wake-up as alfrl did it until 2026-12-02: the served adapter re-activated in place, not registered
    again (on 2026-12-01 the Qwen3.5 probe stayed NaN after such a wake-up until a push)."""
    engine.llm.wake_up()
    engine._asleep = False
    engine._zero_kv_cache()
    manager = engine._runner().lora_manager._adapter_manager
    manager.deactivate_adapter(engine._lora.lora_int_id)
    manager.activate_adapter(engine._lora.lora_int_id)


def compare(scores: list[float], base: list[float]) -> dict:
    bad = sum(not math.isfinite(x) for x in scores)
    finite = [abs(a - b) for a, b in zip(scores, base) if math.isfinite(a) and math.isfinite(b)]
    return {"non_finite": bad, "tokens": len(scores), "max_abs_diff_finite": max(finite) if finite else None}


def run_cycles(engine, allocations: dict, policy, optimizer, probe: list[int], base: list[float], poison=poison_free_memory) -> dict:
    """The sleep / wake-up cycles (see the module's doc) on a started ``VLLMEngine``; ``allocations`` is vLLM's
    sleep-mode allocator's table. Returns one result per cycle; leaves ``keep_across_sleep`` as it found it."""
    from alfrl import vllm_engine

    tags = {address: data.tag for address, data in allocations.items()}
    keep = vllm_engine.keep_across_sleep
    cycles = [("kept", "registered"), ("kept", "in place"), ("dropped", "registered"), ("dropped", "in place")]
    out = {}
    if policy is not None:
        # the control: the trainer's step with the engine awake (nothing slept): a NaN here is not sleep's doing
        start = time.perf_counter()
        trained = train_once(policy, optimizer, probe)
        first, second = engine.score(probe), engine.score(probe)
        out["awake"] = {"trained": trained, "first_after_wake": compare(first, base), "second_after_wake": compare(second, base),
                        "seconds": time.perf_counter() - start}
        print("awake", json.dumps(out["awake"]), flush=True)
    try:
        for buffers, adapter in cycles if policy is not None else [("kept", None), ("dropped", None)]:
            cycle = buffers if adapter is None else f"{buffers}, adapter {adapter}"
            if buffers == "dropped" and vllm_engine.keep_across_sleep is keep:  # as vLLM tagged them, alfrl's sleep leaving them so
                for address, data in allocations.items():
                    data.tag = tags.get(address, data.tag)
                vllm_engine.keep_across_sleep = lambda allocations, kv_ranges: 0
                engine._kept_bytes = 0
            start = time.perf_counter()
            engine.sleep()
            poisoned = poison()
            trained = train_once(policy, optimizer, probe) if policy is not None else None
            wake_in_place(engine) if adapter == "in place" else engine.wake_up()
            first, second = engine.score(probe), engine.score(probe)
            out[cycle] = {"kept_mib": (engine._kept_bytes if buffers == "kept" else 0) / 2**20, "poisoned_gib": poisoned,
                          "trained": trained, "first_after_wake": compare(first, base), "second_after_wake": compare(second, base),
                          "seconds": time.perf_counter() - start}
            print(cycle, json.dumps(out[cycle]), flush=True)
    finally:
        vllm_engine.keep_across_sleep = keep
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sleep_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face folder (e.g. alfrl random-model --shape qwen3.5-4b --layers 4)")
    parser.add_argument("--out", required=True, help="where the JSON goes")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (a faster engine start)")
    parser.add_argument("--probe-tokens", type=int, default=389)
    parser.add_argument("--adapter", action="store_true", help="serve the trainer's adapter and train it between sleep and wake-up")
    parser.add_argument("--dry", action="store_true", help="the CPU plumbing only: HF engine, no sleep")
    args = parser.parse_args(argv)

    import random

    import torch

    from alfrl.sampler_config import EngineConfig

    t0 = time.perf_counter()
    rng = random.Random(0)
    probe = [rng.randrange(10, 3000) for _ in range(args.probe_tokens)]
    result: dict = {"model": args.model, "eager": args.eager, "adapter": args.adapter, "probe_tokens": len(probe)}
    policy = optimizer = None
    if args.adapter:
        import yaml

        from alfrl.policy import AlfrlPolicy
        from alfrl.policy import LoRAConfig

        lora = LoRAConfig(**yaml.safe_load(open("recipes/qwen4b_80step.yaml"))["model"]["lora"])
        # the PyTorch reference for the Gated DeltaNet layers (as the 2026-12-01 and 2026-12-02 second-lease fits trained;
        # the third lease's fit used FLA after its check passed); `auto` would spend ~2 minutes autotuning FLA
        policy = AlfrlPolicy(model_name=args.model, dtype="float32" if args.dry else "bfloat16", lora=lora,
                             linear_attention_kernel="torch")
        policy.configure_model()
        policy.to("cpu" if args.dry else "cuda")
        optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-3)
    if args.dry:
        from alfrl.engines import HFEngine
        from alfrl.models import load_causal_lm

        engine = HFEngine(load_causal_lm(args.model, dtype=torch.float32), pad_token_id=0)
    else:
        from alfrl.vllm_engine import VLLMEngine

        engine = VLLMEngine(args.model, gpu_memory_utilization=0.5, max_model_len=4096, enable_sleep_mode=True,
                            enforce_eager=args.eager, seed=0, lora_rank=policy.lora.rank if policy else 32,
                            extra=EngineConfig(kind="vllm").vllm_extra(args.model))
    result["engine_start_seconds"] = time.perf_counter() - t0
    if policy is not None and not args.dry:
        result["adapter_modules_taken"] = engine.load_adapter(policy.adapter_weights())
    base = engine.score(probe)
    result["before_sleep"] = compare(base, base)
    if not args.dry:
        from vllm.device_allocator.cumem import CuMemAllocator

        result.update(run_cycles(engine, CuMemAllocator.get_instance().pointer_to_data, policy, optimizer, probe, base))
    elif policy is not None:
        result["trained"] = train_once(policy, optimizer, probe)
    result["seconds"] = time.perf_counter() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
