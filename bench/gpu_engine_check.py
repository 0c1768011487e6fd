"""GPU check of VLLMEngine against HFEngine on the tiny model (issue: rollouts).

    python bench/gpu_engine_check.py --model .cache/tiny-model --data-dir DIR --out OUT.json

- the same requests through both engines give completions of the same form;
- the engine's log-probs of its samples match the trainer's (bf16 on both sides);
- after update_weights with changed LoRA weights the greedy outputs change and the probe log-probs
  follow the trainer's;
- the prompt / prefix-cache / generated token counters are reported;
- a grouped rollout on real games through VLLMEngine gives trajectories like HFEngine's.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def completion_form(c) -> dict:
    return {
        "ids_are_ints": all(isinstance(t, int) for t in c.token_ids),
        "one_logprob_per_id": len(c.logprobs) == len(c.token_ids),
        "logprobs_nonpositive": all(lp <= 1e-6 for lp in c.logprobs),
        "finish_reason_known": c.finish_reason in ("stop", "length"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from alfrl.chat import chat_format
    from alfrl.engines import HFEngine, SamplingRequest, VLLMEngine
    from alfrl.envs import EnvPool
    from alfrl.games import discover_games
    from alfrl.policy import AlfrlPolicy
    from alfrl.rewards import RewardConfig
    from alfrl.rollout import RolloutConfig, RolloutRunner
    from callbacks.weight_sync import probe_difference

    report: dict = {}
    policy = AlfrlPolicy(model_name=args.model, dtype="bfloat16", lora_rank=8, lora_alpha=16)
    policy.configure_model()
    policy.to("cuda")
    tok = policy.load_tokenizer()
    fmt = chat_format(tok, "tool_call")
    hf = HFEngine(lambda: policy.model, tok.pad_token_id)
    start = time.perf_counter()
    vl = VLLMEngine(args.model, gpu_memory_utilization=0.15, max_model_len=8192, enforce_eager=True, dtype="bfloat16", seed=0)
    report["vllm_start_seconds"] = time.perf_counter() - start

    prompt = fmt.first_prompt_ids("Your task is to: put a clean mug in coffeemachine.\n\nStep 1 of 50.\nObservation: You are in the middle of a room.\nAvailable actions:\nlook\ninventory\ngo to countertop 1")
    request = SamplingRequest(tuple(prompt), n=4, temperature=1.0, top_p=1.0, max_new_tokens=48, stop_token_ids=fmt.stop_token_ids, seed=3)
    (hf_out,), (vl_out,) = hf.generate([request]), vl.generate([request])
    report["form"] = {"hf": [completion_form(c) for c in hf_out], "vllm": [completion_form(c) for c in vl_out]}
    report["n"] = {"hf": len(hf_out), "vllm": len(vl_out)}
    report["vllm_texts"] = [fmt.completion_text(list(c.token_ids)) for c in vl_out]
    report["hf_texts"] = [fmt.completion_text(list(c.token_ids)) for c in hf_out]
    diffs = []
    for c in vl_out:
        trainer = policy.score(prompt + list(c.token_ids))[len(prompt):]
        diffs += [abs(a - b) for a, b in zip(c.logprobs, trainer)]
    report["sampler_vs_trainer_mean_abs_logprob_diff"] = sum(diffs) / len(diffs)
    probe = prompt + fmt.encode('<tool_call>\n{"name": "alfworld_step", "arguments": {"action": "look"}}\n</tool_call>') + [fmt.end_of_turn_id]
    report["probe_diff_before_update"] = probe_difference(vl, policy, probe)

    greedy = SamplingRequest(tuple(prompt), n=1, temperature=0.0, top_p=1.0, max_new_tokens=32, stop_token_ids=fmt.stop_token_ids, seed=0)
    before = vl.generate([greedy])[0][0].token_ids
    probe_request = SamplingRequest(tuple(probe), n=1, temperature=1.0, top_p=1.0, max_new_tokens=16, stop_token_ids=(), seed=0)
    before_probe = vl.generate([probe_request])[0][0].logprobs
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    counters_before = vl.counters()
    start = time.perf_counter()
    vl.update_weights(policy.merged_weights())
    report["update_weights_seconds"] = time.perf_counter() - start
    after = vl.generate([greedy])[0][0].token_ids
    after_probe = vl.generate([probe_request])[0][0].logprobs
    report["greedy_output_changed_after_update"] = before != after
    report["probe_logprobs_changed_after_update"] = sum(abs(a - b) for a, b in zip(before_probe, after_probe)) / len(before_probe)
    report["probe_diff_after_update"] = probe_difference(vl, policy, probe)
    report["counters_delta_after_update"] = vars(vl.counters().minus(counters_before))

    games = discover_games(args.data_dir, ["valid_seen"])[:2]
    cfg = RolloutConfig(max_episode_steps=5, max_trajectory_tokens=8000, max_assistant_tokens=48)
    with EnvPool(num_workers=4) as pool:
        runs = {}
        for name, engine in (("hf", hf), ("vllm", vl)):
            c0 = engine.counters()
            t0 = time.perf_counter()
            groups = RolloutRunner(engine, pool, fmt, cfg, RewardConfig()).run(games, 4, seed=5)
            trajs = [t for g in groups for t in g.trajectories]
            runs[name] = {
                "seconds": time.perf_counter() - t0,
                "trajectories": len(trajs),
                "steps": [t.steps for t in trajs],
                "stop_reasons": [t.stop_reason for t in trajs],
                "valid_format_turns": sum(turn.valid_format for t in trajs for turn in t.turns),
                "turns": sum(t.steps for t in trajs),
                "counters": vars(engine.counters().minus(c0)),
                "mask_matches_turns": all(sum(s.assistant_mask) == sum(x.completion_tokens for x in t.turns) for t in trajs for s in t.sequences),
            }
        report["rollout"] = runs
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
