"""One GPU process, one engine, side by side: the Sampler's speed, the weight sync's checks, the update's MFU.

    python bench/sampler_bench.py --recipe recipes/qwen15b_coder_h200.yaml --out bench.json [--eval-out base.jsonl]
        [--phases ceiling runners replay eval update sync decode pushes] [--dry]

Phases (figures into one JSON; each phase's errors are recorded, the others still run):
- ceiling: the engine alone (no environment): 8 groups x 8 sequences sharing a 1,000-token start,
  20 turns of exactly 40 sampled + 250 appended tokens, each turn submitted when the last came back.
- runners: the same 8 training games x 8 trajectories (recipe's episode limits, same seeds) through the
  old round-based schedule and the asynchronous one (``--schedules``): seconds, generated tokens/s, engine busy share;
  before any phase the policy is synced the recipe's way (LoRA served, or merged), as a fit's rollouts run (``--no-sync``: not);
  ``--repeats N``: N rollouts per schedule (seeds 7, 8, ...), each one's figures kept; schedule ``prefetched``: the
  asynchronous one with the games' resets submitted and back before its clock starts (``Sampler.prefetch``), as a fit's
  rollouts after its first run (their resets ran during the update before);
  --profile-rollout START:COUNT: then one more asynchronous rollout with that window of engine steps profiled.
- eval: the recipe's evaluation protocol on every evaluation game (the base model, or --adapter) -> --eval-out;
  --profile-steps START:COUNT profiles that window of engine steps (torch.profiler, then cProfile) -> OUT.profile.txt.
- replay: the engine alone playing the asynchronous rollout's own turns again (bench/replay_ceiling.py; seed 7's, of the
  `async` schedule where it ran, else of the first one: ``replayed_schedule``, ``<schedule>_over_replay_time``), each request
  carrying the adapter the rollout was served (until 2026-12-03 none: the replay ran on the base weights);
  ``--save-turns FILE`` in one run and ``--replay-turns FILE`` in another replay the same turns on two engine settings.
- update (bench/update_bench.py): PPO updates on the asynchronous rollout's trajectories, one per UPDATE_VARIANTS entry (packed-row
  size, gradient checkpointing, the LoRA's float32 matmul precision, the adapter's dtype, compiled layers, SDPA's kernels): seconds,
  peak memory and MFU (6N, and 8N with the gradient-checkpoint recompute), each compiling variant after an untimed
  warm-up; the same packed row's log-probs under sdpa and sdpa_varlen;
  ``--profile-update``: PROFILED_VARIANT once more under torch.profiler -> OUT.update_profile.txt.
- sync: in the recipe's sync mode (run twice, ``--data.engine.weight_sync=lora`` then ``=merged``, for
  the side by side): decode speed of one batch with a non-zero adapter, the probe gap and response
  after 1 and 10 updates at lr 1e-6, and skipped syncs after an update at lr 1e-6 and at 1e-4.
- decode: for each of ``--decode-rows`` (1 8 64), that many random 1,000-token prompts each sampling ``--decode-tokens``
  (256), with a non-zero adapter served and on the same engine without it (two passes, alternating): what serving the
  LoRA costs per engine step where a rollout's tail runs (a few rows) and where its bulk does.
- pushes: a fit's weight sync (the adapter gathered, written, loaded by the engine, probed) alone and right after the
  next rollout's resets were submitted (``Sampler.prefetch``: every worker resetting, as in a fit's prefetched window),
  alternating, ``--pushes`` of each: where a fit's adapter loads ran long (raw-results-2026-12-06:bench/leases/2026-12-04i.md).

``--dry`` runs the phases that need no vLLM on the CPU with the recipe's HF engine (tiny model).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time
import traceback

import torch
from replay_ceiling import load_turns, save_turns, vllm_ceiling, vllm_replay  # bench/ (the script's folder is on sys.path)
from update_bench import UPDATE_VARIANTS, profile_tables, timed, update_phase

from alfrl.rollout import completion_tokens
from alfrl.ppo import ppo_update


def quantiles(values) -> dict:
    """min, p50, p90, max of a list (nearest rank), empty if it is."""
    v = sorted(values)
    return {"min": v[0], "p50": v[(len(v) - 1) // 2], "p90": v[min(len(v) - 1, round(0.9 * (len(v) - 1)))], "max": v[-1]} if v else {}


def rollout_figures(result, seconds: float) -> dict:
    trajs = [t for g in result.groups for t in g.trajectories]
    return {"seconds": seconds, "engine_seconds": result.stats.engine_seconds, "engine_busy_share": result.stats.engine_seconds / seconds,
            "env_wait_seconds": result.stats.env_wait_seconds, "requests": result.stats.requests,
            "engine_steps": result.stats.engine_steps, "submit_seconds": result.stats.submit_seconds,
            "tail_engine_steps": result.stats.tail_engine_steps, "tail_engine_seconds": result.stats.tail_engine_seconds,
            **{k.split("/")[1]: v for k, v in result.stats.tail_output_figures().items()},
            "generated_tokens": result.counters.generated_tokens, "generated_tokens_per_second": result.counters.generated_tokens / seconds,
            "prompt_tokens": result.counters.prompt_tokens, "cached_prompt_tokens": result.counters.cached_prompt_tokens,
            "trajectories": len(trajs), "turns": sum(t.steps for t in trajs), "wins": sum(t.won for t in trajs),
            # the tail: when the trajectories ended (seconds after the start), and the sampled tokens of each
            "ended_seconds": quantiles(result.stats.trajectory_end_seconds),
            "last_group_started_seconds": max(result.stats.group_start_seconds, default=None),  # its resets back and checked
            "completion_tokens": quantiles([completion_tokens(t) for t in trajs]),
            "last_ended": result.stats.last_ended,  # the critical path: where the last trajectory's seconds went
            "stop_reasons": {r: sum(t.stop_reason == r for t in trajs) for r in sorted({t.stop_reason for t in trajs})}}


def prefetch_resets(sampler, games, group_size: int, limit: float = 300.0) -> dict:
    """Submit the games' resets (``Sampler.prefetch``) and wait until every one is back: the next rollout starts as a fit's
    rollouts after the first do, their resets done during the update before. Returns the resets' seconds."""
    started = time.perf_counter()
    sampler.prefetch(games, group_size)
    if sampler.prefetch_counts() is None:
        raise RuntimeError("--schedules prefetched: the recipe's resets cannot be prefetched (data.rollout.max_live_games below "
                           "the games); set it to 0")
    while (counts := sampler.prefetch_counts())[0] < counts[1]:
        if time.perf_counter() - started > limit:
            raise RuntimeError(f"--schedules prefetched: {counts[1] - counts[0]} of {counts[1]} resets not back after {limit:.0f} s")
        time.sleep(0.01)
    return {"resets_seconds": time.perf_counter() - started}


def profile_window(engine, start: int, count: int, path: str):
    """Wrap ``engine.step``: steps start..start+count-1 under torch.profiler (CPU + CUDA), the next ``count`` under
    cProfile. Returns (figures, finish): ``finish()`` (after the evaluation) writes the tables into ``path``.

    The evaluation's clock includes the wrapper's own bookkeeping (starting and stopping the profilers), reported
    as ``profiler_overhead_seconds``; the tables are made after the evaluation (on 2026-12-01 making them inside the
    step stalled the evaluation ~20 s)."""
    import cProfile

    from torch.profiler import ProfilerActivity, profile

    real, seen, figures, state = engine.step, [0], {"profiler_overhead_seconds": 0.0}, {}
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]

    def step():
        seen[0] += 1
        n = seen[0]
        t0 = time.perf_counter()
        if n == start:
            sync()
            state["prof"] = profile(activities=activities)
            state["prof"].__enter__()
            state["t"] = time.perf_counter()
        elif n == start + count:
            state["cp"] = cProfile.Profile()
            state["t2"] = time.perf_counter()
            state["cp"].enable()
        figures["profiler_overhead_seconds"] += time.perf_counter() - t0
        out = real()
        t1 = time.perf_counter()
        if n == start + count - 1:
            sync()
            figures.update({"torch_profiler_steps": count, "torch_profiler_wall_seconds": time.perf_counter() - state["t"]})
            state["prof"].__exit__(None, None, None)
        elif n == start + 2 * count - 1:
            state["cp"].disable()
            figures["cprofile_steps"], figures["cprofile_wall_seconds"] = count, time.perf_counter() - state["t2"]
        if n in (start + count - 1, start + 2 * count - 1):
            figures["profiler_overhead_seconds"] += time.perf_counter() - t1
        return out

    def finish() -> None:
        import io
        import pstats

        engine.step = real
        if "torch_profiler_wall_seconds" in figures:
            figures.update(profile_tables(state["prof"], figures["torch_profiler_wall_seconds"], path,
                                          f"engine steps {start}..{start + count - 1}"))
        if "cprofile_steps" in figures:
            text = io.StringIO()
            stats = pstats.Stats(state["cp"], stream=text)
            stats.sort_stats("tottime").print_stats(40)
            stats.sort_stats("cumulative").print_stats(60)
            with open(path, "a") as f:
                f.write(f"\n== cProfile, engine steps {start + count}..{start + 2 * count - 1}\n" + text.getvalue())

    engine.step = step
    return figures, finish


def push(sampler, policy) -> None:
    """The policy's weights into the engine the way the recipe syncs them (lora or merged)."""
    sampler.weight_sync(check=False).push(policy)
    sampler.engine.llm.reset_prefix_cache()


def decode_speed(sampler, policy, rows: int = 64, prompt: int = 1000, tokens: int = 256) -> dict:
    """Generated tokens/s of one batch served the recipe's way (a non-zero adapter, unmerged or merged)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = sampler.engine
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-3)
    push(sampler, policy)
    rng = random.Random(1)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(100, 30000) for _ in range(prompt)]) for _ in range(rows)]
    params = SamplingParams(temperature=1.0, max_tokens=tokens, min_tokens=tokens, logprobs=0, detokenize=False, seed=2)
    served = {"served": engine._lora}
    if engine._lora is not None:  # the same engine without the adapter: base weights, what a merged push serves
        served["no_adapter"] = None
    runs = []
    for _ in range(2):  # the first pass warms up; both are reported, alternating
        for name, lora in served.items():
            engine.llm.reset_prefix_cache()
            _, seconds = timed(lambda: engine.llm.generate(prompts, params, use_tqdm=False, lora_request=lora))
            runs.append({"requests": name, "seconds": seconds, "generated_tokens_per_second": rows * tokens / seconds,
                         "ms_per_token_step": 1000 * seconds / tokens})  # every row samples one token a step (prefill in)
    return {"rows": rows, "prompt_tokens": prompt, "generated_tokens": tokens, "runs": runs}


def sync_phase(out: dict, sampler, policy, samples, temperature: float, dry: bool) -> None:
    """Decode speed, the probe after 1 and 10 updates at lr 1e-6, and skipped syncs, in the recipe's sync mode.

    Fills ``out`` as it goes (a failure keeps what was measured); every sync's error is recorded, not raised.
    """
    from alfrl.sync import WeightSync, WeightSyncError

    def attempt(sync, **kwargs) -> dict:
        try:
            return {"caught": False, **sync.sync(policy, **kwargs)}
        except WeightSyncError as e:
            return {"caught": True, "message": str(e)}

    mode = sampler.engine_cfg.weight_sync
    out["mode"] = mode
    if not dry:
        out["decode"] = decode_speed(sampler, policy)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.zero_()
    policy.weight_version = 0
    probe = sampler.probe_ids()
    measuring = WeightSync(sampler.engine, probe, mode, 1.0, 0.0)  # records gap and response, never stops
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-6, betas=(0.9, 0.95))
    rows = out["probe_at_lr_1e-6"] = [{"updates": 0, **attempt(measuring)}]
    for u in range(1, 11):
        ppo_update(policy, optimizer, samples, temperature)
        policy.weight_version += 1
        if u in (1, 10):
            rows.append({"updates": u, **attempt(measuring)})
    checked = WeightSync(sampler.engine, probe, mode, sampler.engine_cfg.sync_check_tolerance, sampler.engine_cfg.sync_min_response)
    out["real_sync_before_skips"] = attempt(checked)
    for lr in (1e-6, 1e-5, 1e-4):  # one more update at each lr, each followed by a skipped sync and a real one
        ppo_update(policy, torch.optim.AdamW(policy.trainable_parameters(), lr=lr, betas=(0.9, 0.95)), samples, temperature)
        policy.weight_version += 1
        out[f"skipped_sync_lr_{lr:g}"] = attempt(checked, push=False)
        out[f"real_sync_after_skip_lr_{lr:g}"] = attempt(checked)


def pushes_phase(sampler, policy, games, group_size: int, rounds: int) -> dict:
    """``rounds`` syncs alone and ``rounds`` beside freshly submitted resets, alternating; the same adapter each time (what
    a load costs does not depend on the values). Each run: its seconds (the probes included), the ``sync/*seconds`` parts
    (the push, its gather, write, load and swap), and how many of the resets were back when it ended."""
    runs: dict = {"alone": [], "beside_resets": []}
    for _ in range(rounds):
        for mode, out in runs.items():
            policy.weight_version += 1
            if mode == "beside_resets":
                sampler.prefetch(games, group_size)
            metrics, seconds = timed(lambda: sampler.sync(policy))
            counts = sampler.prefetch_counts()  # how far the resets had got when the push ended
            back = list(counts) if counts is not None else None
            sampler.drop_prefetch()
            out.append({"seconds": seconds, "resets_back_at_end": back, **{k: v for k, v in metrics.items() if k.endswith("seconds")}})
    for mode in list(runs):
        for key in ("seconds", "sync/load_seconds"):
            values = [r[key] for r in runs[mode] if key in r]
            if values:
                runs[f"{mode} {key}"] = quantiles(values)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--eval-out", default=None)
    parser.add_argument("--phases", nargs="+", default=["ceiling", "runners", "eval", "update", "sync"])
    parser.add_argument("--games", type=int, default=8)
    parser.add_argument("--schedules", nargs="+", default=["rounds", "async"], choices=["rounds", "async", "prefetched"],
                        help="runners phase: which runners play the games (async alone halves the phase; prefetched: async with "
                        "the resets done before the clock starts, as in a fit after its first rollout)")
    parser.add_argument("--adapter", default=None, help="eval phase: this adapter (a checkpoint folder or its adapter/) into the engine")
    parser.add_argument("--profile-steps", default=None, help="eval phase: START:COUNT engine steps profiled (torch.profiler, then cProfile)")
    parser.add_argument("--profile-rollout", default=None, help="runners phase: one more asynchronous rollout with engine steps "
                        "START:COUNT profiled (torch.profiler, then cProfile) -> OUT.rollout_profile.txt")
    parser.add_argument("--profile-update", action="store_true", help="update phase: PROFILED_VARIANT once more under torch.profiler -> OUT.update_profile.txt")
    parser.add_argument("--update-variants", nargs="+", default=None, help="update phase: only these UPDATE_VARIANTS "
                        "names, in this order (a compiling one after one compiled the same way skips the warm-up)")
    parser.add_argument("--repeats", type=int, default=1, help="runners phase: rollouts per schedule, seeds 7, 8, ... "
                        "(the rollout lasts as long as its slowest trajectory, which changes with the seed)")
    parser.add_argument("--save-turns", default=None, help="runners phase: seed 7's asynchronous (else round-based) rollout's "
                        "turns -> this file (.json.gz), for --replay-turns in another run")
    parser.add_argument("--replay-turns", default=None, help="replay phase: replay these saved turns (--save-turns of another "
                        "run: the same work on this run's engine settings) instead of this run's own rollout")
    parser.add_argument("--no-sync", action="store_true", help="no sync before the phases (the engine's base weights, no "
                        "adapter served: how the runners and the replay ran until 2026-12-03)")
    parser.add_argument("--decode-rows", nargs="+", type=int, default=[1, 8, 64], help="decode phase: batch sizes")
    parser.add_argument("--decode-tokens", type=int, default=256, help="decode phase: tokens each row samples")
    parser.add_argument("--pushes", type=int, default=4, help="pushes phase: syncs alone and beside resets, this many of each")
    parser.add_argument("--dry", action="store_true", help="CPU check with the recipe's HF engine (no vLLM phases)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. --data.engine.gpu_memory_utilization=0.5")
    args = parser.parse_args()
    if min(args.decode_rows) < 1 or args.decode_tokens < 1:
        parser.error(f"--decode-rows {args.decode_rows} --decode-tokens {args.decode_tokens}: give 1 or more of each")
    if args.repeats < 1 or args.pushes < 1:
        parser.error(f"--repeats {args.repeats} --pushes {args.pushes}: give 1 or more of each")
    if args.replay_turns and not os.path.isfile(args.replay_turns):
        parser.error(f"--replay-turns {args.replay_turns}: no such file; write it first with --save-turns in another run")
    by_name = {v[0]: v for v in UPDATE_VARIANTS}
    unknown = [n for n in args.update_variants or [] if n not in by_name]
    if unknown:
        parser.error(f"--update-variants {' '.join(unknown)}: not in bench/update_bench.py's UPDATE_VARIANTS ({', '.join(by_name)})")

    from alfrl.advantages import AdvantageConfig, make_samples
    from alfrl.evaluation import eval_games
    from alfrl.games import discover_games, shuffled
    from alfrl.recipe import load_recipe

    report: dict = {"recipe": args.recipe, "overrides": args.overrides, "phases": {}}

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)

    cli = load_recipe(["--config", args.recipe, *args.overrides])
    dm, policy = cli.datamodule, cli.model
    policy.configure_model()
    if torch.cuda.is_available():
        policy.to("cuda")
    sampler, start_seconds = timed(lambda: dm.connect(policy))
    report["engine_start_seconds"] = start_seconds
    games = sorted(shuffled(discover_games(dm.data_dir, [dm.train_split]), dm.seed)[: args.games], key=lambda g: g.id)
    async_result, async_source = None, None  # seed 7's rollout the later phases reuse, and its schedule
    if not args.no_sync:  # served as a fit's rollouts are: after the first sync (the LoRA loaded, or merged weights)
        report["first_sync"] = {k: v for k, v in sampler.sync(policy).items() if isinstance(v, (int, float))}
    save()  # a run cut off before its first phase ends still tells how long the engine's start took
    print(f"engine started in {start_seconds:.1f} s", flush=True)
    for phase in args.phases:
        started = time.perf_counter()
        try:
            if phase == "ceiling" and not args.dry:
                report["phases"]["ceiling"] = vllm_ceiling(sampler.engine)
            elif phase == "runners":
                runs = {}
                for rep in range(args.repeats):  # seed 7, then 8, ...: the schedules alternate within each seed
                    for schedule in args.schedules:
                        sampler.rollout_cfg = dataclasses.replace(dm.rollout, schedule="async" if schedule == "prefetched" else schedule)
                        resets = prefetch_resets(sampler, games, dm.group_size) if schedule == "prefetched" else {}
                        result, seconds = timed(lambda: sampler.rollout(games, dm.group_size, seed=7 + rep))
                        figures = {"seed": 7 + rep, **rollout_figures(result, seconds), **resets}
                        if rep == 0:
                            runs[schedule] = figures
                            if schedule == "async" or async_result is None:  # the replay and the update use seed 7's
                                async_result, async_source = result, schedule
                        else:
                            runs[schedule].setdefault("repeats", []).append(figures)
                sampler.rollout_cfg = dm.rollout
                if args.profile_rollout:  # one more asynchronous rollout (untimed figures above) with a window of its steps profiled
                    first, count = (int(x) for x in args.profile_rollout.split(":"))
                    profiled, finish = profile_window(sampler.engine, first, count, args.out + ".rollout_profile.txt")
                    sampler.rollout_cfg = dataclasses.replace(dm.rollout, schedule="async")
                    result, seconds = timed(lambda: sampler.rollout(games, dm.group_size, seed=7))
                    finish()
                    runs["profiled_async"] = {**rollout_figures(result, seconds), "profile": profiled}
                if "rounds" in runs and "async" in runs:
                    runs["async_over_rounds_speedup"] = runs["rounds"]["seconds"] / runs["async"]["seconds"]
                ceiling = report["phases"].get("ceiling", {}).get("seconds")  # none where it failed: the runs' figures stay
                for schedule in ("async", "prefetched"):
                    if ceiling is not None and schedule in runs:  # seed 7's as <schedule>_over_ceiling_time, each repeat's in its figures
                        runs[f"{schedule}_over_ceiling_time"] = runs[schedule]["seconds"] / ceiling
                        for figures in runs[schedule].get("repeats", []):
                            figures["over_ceiling_time"] = figures["seconds"] / ceiling
                report["phases"]["runners"] = runs
                if args.save_turns and async_result is not None:  # seed 7's turns, for --replay-turns in another run
                    save_turns([t for g in async_result.groups for t in g.trajectories], args.save_turns)
                    runs["saved_turns"] = args.save_turns
            elif phase == "replay" and not args.dry:  # the engine alone, the async rollout's own turns (bench/replay_ceiling.py)
                if async_result is None and not args.replay_turns:
                    async_result = sampler.rollout(games, dm.group_size, seed=7)
                if args.replay_turns:  # another run's turns (--save-turns): the same work on this engine
                    replayed = {"replayed_from": args.replay_turns, **vllm_replay(sampler.engine, load_turns(args.replay_turns))}
                else:
                    replayed = vllm_replay(sampler.engine, [t for g in async_result.groups for t in g.trajectories])
                # the rollout whose turns these are, timed (none where the runners phase failed or did not run)
                source = report["phases"].get("runners", {}).get(async_source)
                if source is not None and not args.replay_turns:
                    replayed["replayed_schedule"] = async_source
                    replayed[f"{async_source}_over_replay_time"] = source["seconds"] / replayed["seconds"]
                if "seconds" in report["phases"].get("ceiling", {}):
                    replayed["replay_over_ceiling_time"] = replayed["seconds"] / report["phases"]["ceiling"]["seconds"]
                report["phases"]["replay"] = replayed
            elif phase == "decode" and not args.dry:  # the adapter served against none, at each batch size
                decoded = report["phases"]["decode"] = {}
                for r in args.decode_rows:  # each batch size kept and printed as it ends: a run cut off keeps those done
                    decoded[str(r)] = decode_speed(sampler, policy, rows=r, tokens=args.decode_tokens)
                    save()
                    print(f"decode {r} rows, ms a step:", *(f"{x['requests']} {x['ms_per_token_step']:.3f}" for x in decoded[str(r)]["runs"]),
                          flush=True)
            elif phase == "pushes":  # the sync alone and in the prefetched resets' window (dry: the hf engine's)
                pushed = report["phases"]["pushes"] = pushes_phase(sampler, policy, games, dm.group_size, args.pushes)
                for mode in ("alone", "beside_resets"):
                    print(f"pushes {mode}: s", *(f"{r['seconds']:.3f}" for r in pushed[mode]), "load s",
                          *(f"{r.get('sync/load_seconds', float('nan')):.3f}" for r in pushed[mode]), flush=True)
            elif phase == "eval":
                cfg = dm.eval_cfg
                if args.dry:
                    cfg = dataclasses.replace(cfg, limit_per_split=2)
                eval_list = eval_games(dm.data_dir, cfg.splits, cfg.limit_per_split)
                if args.adapter:
                    policy.load_adapter(args.adapter)
                    sampler.sync(policy)
                profiled, finish = {}, (lambda: None)
                if args.profile_steps:
                    first, count = (int(x) for x in args.profile_steps.split(":"))
                    profiled, finish = profile_window(sampler.engine, first, count, args.out + ".profile.txt")
                summary = sampler.evaluate(eval_list, args.eval_out or args.out + ".eval.jsonl", {"model_name": policy.hparams.model_name,
                                           "adapter": args.adapter, "bench": "sampler_bench",
                                           "deterministic": sampler.deterministic}, cfg, overwrite=True)
                finish()
                report["phases"]["eval"] = {"games": len(eval_list), "seconds": summary.pop("seconds"), "overall": summary["overall"],
                                            "splits": summary["splits"], "time": summary.get("time"), "profile": profiled}
            elif phase in ("update", "sync"):
                if async_result is None:
                    async_result = sampler.rollout(games, dm.group_size, seed=7)
                samples = make_samples(async_result.groups, AdvantageConfig(drop_degenerate_groups=False), dm.reward).samples
                for i, s in enumerate(samples):  # a non-zero advantage everywhere: every token gets a gradient
                    s.advantages_T[s.loss_mask_T] = 1.0 if i % 2 == 0 else -1.0
                if phase == "update":
                    variants = UPDATE_VARIANTS if not args.update_variants else [by_name[n] for n in args.update_variants]
                    report["phases"]["update"] = update_phase(policy, samples, dm.rollout.temperature, variants,
                                                              profile_path=args.out + ".update_profile.txt" if args.profile_update else None)
                else:  # 8 trajectories are enough to move the weights, and keep 12 updates short
                    report["phases"]["sync"] = {}
                    sync_phase(report["phases"]["sync"], sampler, policy, samples[:8], dm.rollout.temperature, args.dry)
        except Exception:  # noqa: BLE001 - one phase's failure must not lose the others' figures (nor its own so far)
            report["phases"].setdefault(phase, {})["error"] = traceback.format_exc(limit=6)
        report.setdefault("phase_seconds", {})[phase] = time.perf_counter() - started
        save()
        print(f"phase {phase}: {report['phase_seconds'][phase]:.1f} s", flush=True)
    dm.close()
    save()
    print(json.dumps(report, indent=1)[:6000])


if __name__ == "__main__":
    main()
