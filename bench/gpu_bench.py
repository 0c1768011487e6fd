"""GPU benchmark on a random-weight Qwen3-4B-shaped model with the colocated vLLM engine.

    python bench/gpu_bench.py --model .cache/random-qwen3-4b --data-dir DIR --out OUT.json [--eval-out EVAL.jsonl]

1. rollout: 8 train games x 8 trajectories on real games, full history, 50 steps, 12,000 trajectory
   tokens; completions forced to ``--completion-tokens`` tokens (random weights never stop on their own).
   Reports seconds, generated tokens per second and the share of prompt tokens served from the prefix cache.
2. update: one PPO update of 8 sequences of exactly 12,000 tokens beside the resident engine
   (token ids random; the trained mask follows the rollout's pattern, ``--completion-tokens`` sampled
   tokens per turn-sized block). Reports peak memory, seconds for old log-probs / training / weight
   sync, trained tokens per second and MFU.
3. eval: the 274-game evaluation (valid_seen + valid_unseen, temperature 0.01, seed 42, 50 steps,
   12,000 tokens) through the same runner as ``alfrl eval``; wall time and tokens per second.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

H200_BF16_DENSE_PEAK = 989e12  # FLOP/s, NVIDIA's H200 SXM figure for dense bf16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--eval-out", default=None)
    parser.add_argument("--completion-tokens", type=int, default=100)
    parser.add_argument("--eval-completion-tokens", type=int, default=None, help="forced completion length in the eval (default: --completion-tokens)")
    parser.add_argument("--eval-games-per-chunk", type=int, default=274,
                        help="games played together in the eval (fewer keeps all their KV cache resident)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    parser.add_argument("--skip", nargs="*", default=[])
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / torch.compile (faster start)")
    args = parser.parse_args()

    from alfrl.advantages import Sample
    from alfrl.chat import chat_format
    from alfrl.engines import VLLMEngine
    from alfrl.envs import EnvPool
    from alfrl.evaluation import EvalConfig, eval_games, run_eval
    from alfrl.games import discover_games, shuffled
    from alfrl.policy import AlfrlPolicy
    from alfrl.rewards import RewardConfig
    from alfrl.rollout import RolloutConfig, RolloutRunner, rollout_metrics
    from callbacks.weight_sync import probe_difference

    report: dict = {"model": args.model, "completion_tokens": args.completion_tokens}
    t0 = time.perf_counter()
    policy = AlfrlPolicy(model_name=args.model, dtype="bfloat16", lora_rank=32, lora_alpha=64, gradient_checkpointing=True,
                         microbatch_tokens=12288, lr=1e-6)
    if "update" not in args.skip:  # the trainer's copy is only needed for the update
        policy.configure_model()
        policy.to("cuda")
        report["policy_load_seconds"] = time.perf_counter() - t0
        n_params = sum(p.numel() for p in policy.model.parameters())
        embed = policy.model.get_base_model().get_input_embeddings().weight.numel()
        report["parameters"] = n_params
    tok = policy.load_tokenizer()
    fmt = chat_format(tok, "tool_call")
    t0 = time.perf_counter()
    engine = VLLMEngine(args.model, gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=12288, dtype="bfloat16", seed=0,
                        enforce_eager=args.enforce_eager)
    report["enforce_eager"] = args.enforce_eager
    report["gpu_memory_utilization"] = args.gpu_memory_utilization
    report["vllm_start_seconds"] = time.perf_counter() - t0
    forced = args.completion_tokens
    # random weights almost never sample a stop token: completions run to max_assistant_tokens
    cfg = RolloutConfig(max_episode_steps=50, max_trajectory_tokens=12000, max_assistant_tokens=forced)
    with EnvPool(num_workers=16) as pool:
        runner = RolloutRunner(engine, pool, fmt, cfg, RewardConfig())
        if "rollout" not in args.skip:
            games = shuffled(discover_games(args.data_dir, ["train"]), 42)[:8]
            c0 = engine.counters()
            t0 = time.perf_counter()
            groups = runner.run(games, 8, seed=1)
            seconds = time.perf_counter() - t0
            c = engine.counters().minus(c0)
            trajs = [t for g in groups for t in g.trajectories]
            report["rollout"] = {
                "games": 8, "group_size": 8, "seconds": seconds,
                "generated_tokens": c.generated_tokens, "prompt_tokens": c.prompt_tokens, "cached_prompt_tokens": c.cached_prompt_tokens,
                "generated_tokens_per_second": c.generated_tokens / seconds,
                "prefix_cache_share": c.cached_prompt_tokens / max(c.prompt_tokens, 1),
                "mean_turns": sum(t.steps for t in trajs) / len(trajs),
                "mean_final_tokens": sum(len(t.sequences[0].token_ids) for t in trajs) / len(trajs),
                "metrics": rollout_metrics(groups),
            }
            print(json.dumps(report["rollout"], indent=2), flush=True)
            Path(args.out).write_text(json.dumps(report, indent=2))

        if "update" not in args.skip:
            g = torch.Generator().manual_seed(0)
            samples = []
            block = forced + 350  # a turn: sampled tokens, then template + tool response
            for i in range(8):
                ids = torch.randint(0, len(tok), (12000,), generator=g).tolist()
                mask = [0] * 12000
                for start in range(1500, 12000 - forced, block):
                    mask[start:start + forced] = [1] * forced
                adv = 1.0 if i % 2 == 0 else -1.0
                samples.append(Sample(tuple(ids), tuple(mask), tuple(-2.0 * m for m in mask), tuple(adv * m for m in mask), 0, i))
            optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-6, betas=(0.9, 0.95), weight_decay=0.0)
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            stats = policy.update(samples, optimizer=optimizer)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.update_weights(policy.merged_weights())
            torch.cuda.synchronize()
            sync_seconds = time.perf_counter() - t0
            probe = samples[0].token_ids[:2000]
            t0 = time.perf_counter()
            diff = probe_difference(engine, policy, list(probe))
            probe_seconds = time.perf_counter() - t0
            tokens = 8 * 12000
            compute_params = n_params - embed  # the tied output layer runs only on trained positions
            flops = 2 * compute_params * tokens + 6 * compute_params * tokens  # old log-probs forward + training forward/backward
            busy = stats["old_logprob_seconds"] + stats["update_seconds"]
            report["update"] = {
                "sequences": 8, "tokens_per_sequence": 12000, "trained_tokens": stats["trained_tokens"],
                "old_logprob_seconds": stats["old_logprob_seconds"], "training_seconds": stats["update_seconds"],
                "weight_sync_seconds": sync_seconds, "probe_check_seconds": probe_seconds, "probe_abs_logprob_diff": diff,
                "trainer_peak_allocated_gib": stats["peak_memory_gib"],
                "gpu_used_before_update_gib": (total - free) / 2**30,
                "gpu_total_gib": total / 2**30,
                "sequence_tokens_per_second": tokens / busy,
                "trained_tokens_per_second": stats["trained_tokens"] / busy,
                "mfu_vs_989_tflops": flops / busy / H200_BF16_DENSE_PEAK,
                "stats": stats,
            }
            free_after, _ = torch.cuda.mem_get_info()
            report["update"]["gpu_used_after_update_gib"] = (total - free_after) / 2**30
            print(json.dumps(report["update"], indent=2), flush=True)
            Path(args.out).write_text(json.dumps(report, indent=2))

        if "eval" not in args.skip:
            eval_forced = args.eval_completion_tokens or forced
            ecfg = EvalConfig(max_assistant_tokens=eval_forced, games_per_chunk=args.eval_games_per_chunk)
            erunner = RolloutRunner(engine, pool, fmt, ecfg.rollout_config(cfg), RewardConfig())
            games = eval_games(args.data_dir, ecfg.splits, None)
            c0 = engine.counters()
            t0 = time.perf_counter()
            summary = run_eval(erunner, games, ecfg, args.eval_out or "/tmp/eval.jsonl", {"model": args.model, "bench": True}, overwrite=True)
            seconds = time.perf_counter() - t0
            c = engine.counters().minus(c0)
            report["eval"] = {
                "games": len(games), "games_per_chunk": args.eval_games_per_chunk, "completion_tokens": eval_forced, "seconds": seconds, "generated_tokens": c.generated_tokens, "prompt_tokens": c.prompt_tokens,
                "cached_prompt_tokens": c.cached_prompt_tokens, "generated_tokens_per_second": c.generated_tokens / seconds,
                "overall": summary["overall"],
            }
            print(json.dumps(report["eval"], indent=2), flush=True)
    report["vllm_metrics"] = {m.name: getattr(m, "value", None) for m in engine.llm.get_metrics() if "prefix" in m.name or "token" in m.name}
    print(json.dumps(report["vllm_metrics"], indent=2))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
