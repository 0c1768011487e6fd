"""The engine alone replaying a rollout's own work: the Sampler's overhead apart from the work's shape.

``sampler_bench --phases ceiling runners replay``: the issue's ceiling (8 x 8 sequences, 20 turns of 40 tokens) is not
the work an asynchronous rollout does (on the H200, 2026-12-01: 51,200 tokens there against 72,843 in the rollout, and
a long tail of the last trajectories). Here every trajectory of the rollout is played again by the engine with no
environment and no Sampler: its turns in order, each prompt the recorded one (token-in/token-out: the real history,
so the prefix cache sees what the rollout's prompts were), each completion forced to its recorded length, a trajectory's
next turn submitted the moment its last one ends. Rollout / replay is what the Sampler and the environments add;
replay / ceiling is what the rollout's own shape costs. (The replay samples other tokens than the recorded ones, so each
turn prefills its recorded completion where the rollout had it cached: a few tokens more per turn.)
"""

from __future__ import annotations

import time


def turn_requests(trajectory) -> list[tuple[tuple[int, ...], int]]:
    """(prompt ids, completion length) of each turn, in order: a full-history trajectory's one sequence gives
    every turn's prompt as its tokens before that turn's sampled span; a windowed one has one sequence per turn."""
    out = []
    for seq in trajectory.sequences:
        for _, start, end in seq.spans:
            out.append((tuple(seq.token_ids[:start]), end - start))
    return out


def replay(core, trajectories, make_params, submit_prompt=lambda ids: ids) -> dict:
    """Play ``trajectories`` again on ``core`` (vLLM's ``LLMEngine``: ``add_request(id, prompt, params)`` and
    ``step()`` -> outputs with ``request_id``, ``finished`` and ``outputs[0].token_ids``). ``make_params(n)`` gives
    sampling parameters forcing n tokens; ``submit_prompt(ids)`` wraps prompt ids as the engine takes them.
    Returns seconds, engine steps, generated tokens and the submission order (trajectory, turn) for checks."""
    plans = [turn_requests(t) for t in trajectories]
    nxt = [0] * len(plans)
    owner: dict[str, int] = {}
    order: list[tuple[int, int]] = []
    counter = [0]

    def submit(i: int) -> None:
        prompt, length = plans[i][nxt[i]]
        rid = f"replay-{counter[0]}"
        counter[0] += 1
        order.append((i, nxt[i]))
        nxt[i] += 1
        owner[rid] = i
        core.add_request(rid, submit_prompt(list(prompt)), make_params(length))

    start = time.perf_counter()
    for i, plan in enumerate(plans):
        if plan:
            submit(i)
    steps = generated = 0
    while owner:
        steps += 1
        for out in core.step():
            if not out.finished:
                continue
            i = owner.pop(out.request_id)
            generated += len(out.outputs[0].token_ids)
            if nxt[i] < len(plans[i]):
                submit(i)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "engine_steps": steps, "generated_tokens": generated,
            "generated_tokens_per_second": generated / seconds if seconds else 0.0,
            "turns": sum(len(p) for p in plans), "order": order}


def vllm_replay(engine, trajectories) -> dict:
    """``replay`` on a VLLMEngine (the step API, as the ceiling): forced lengths, EOS ignored, final outputs only."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    def params(n: int):
        p = SamplingParams(temperature=1.0, max_tokens=n, min_tokens=n, ignore_eos=True, logprobs=0, detokenize=False, seed=1)
        p.output_kind = RequestOutputKind.FINAL_ONLY
        return p

    engine.llm.reset_prefix_cache()  # the rollout cached every recorded prompt: start as cold as the rollout did
    before = engine.counters()
    out = replay(engine.llm.llm_engine, trajectories, params, lambda ids: TokensPrompt(prompt_token_ids=ids))
    c = engine.counters().minus(before)
    out.pop("order")
    return {**out, "prompt_tokens": c.prompt_tokens, "cached_prompt_tokens": c.cached_prompt_tokens,
            "prefix_cache_share": c.cached_prompt_tokens / max(c.prompt_tokens, 1)}
