"""The engine alone: the issue's fixed-shape ceiling, and a rollout's own work replayed (the Sampler's overhead apart
from the work's shape).

``sampler_bench --phases ceiling runners replay``: one driver of vLLM's step API (``drive``) plays both the issue's
ceiling (``ceiling``: 8 x 8 sequences, 20 turns of 40 tokens) and a rollout's own turns again (``replay``). The ceiling
is not the work an asynchronous rollout does (on the H200, 2026-12-01: 51,200 tokens there against 72,843 in the
rollout, and a long tail of the last trajectories). The replay plays every trajectory of the rollout again with no
environment and no Sampler: its turns in order, each prompt the recorded one (token-in/token-out: the real history,
so the prefix cache sees what the rollout's prompts were), each completion forced to its recorded length, a trajectory's
next turn submitted the moment its last one ends. Rollout / replay is what the Sampler and the environments add;
replay / ceiling is what the rollout's own shape costs. (The replay samples other tokens than the recorded ones, so each
turn prefills its recorded completion where the rollout had it cached: a few tokens more per turn.)
"""
from __future__ import annotations

import gzip
import json
import random
import time
from collections.abc import Callable
from types import SimpleNamespace

from alfrl.types import TokenSequence


def turn_requests(trajectory) -> list[tuple[tuple[int, ...], int]]:
    """(prompt ids, completion length) of each turn, in order: a full-history trajectory's one sequence gives
    every turn's prompt as its tokens before that turn's sampled span; a windowed one has one sequence per turn."""
    out = []
    for seq in trajectory.sequences:
        for _, start, end in seq.spans:
            out.append((tuple(seq.token_ids[:start]), end - start))
    return out


def save_turns(trajectories, path: str) -> None:
    """Each trajectory's token sequences and sampled spans (what ``turn_requests`` reads) -> gzipped JSON at ``path``: the
    same turns replayed on another engine (``load_turns``) make a clean pair. Derived from games: keep such files out of
    the repository."""
    data = [[[list(seq.token_ids), [list(span) for span in seq.spans], list(seq.sampler_logprobs)] for seq in t.sequences]
            for t in trajectories]
    with gzip.open(path, "wt") as f:
        json.dump(data, f)


def load_turns(path: str) -> list:
    """``save_turns``' trajectories, each with ``.sequences`` as ``turn_requests`` and ``replay`` take them (the sampler's
    log-probs where the file has them: written since 2026-12-04e; 0 before)."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return [SimpleNamespace(sequences=tuple(TokenSequence(tuple(ids), tuple(rest[0]) if rest else (0.0,) * len(ids),
                                                          tuple(tuple(s) for s in spans)) for ids, spans, *rest in t)) for t in data]


def drive(core, firsts, next_turn, make_params, submit_prompt=lambda ids: ids, prefix: str = "replay",
          on_end: Callable[[int], None] | None = None, step_log: list | None = None) -> dict:
    """Sequences turn after turn on ``core`` (vLLM's ``LLMEngine``: ``add_request(id, prompt, params)`` and ``step()`` ->
    outputs with ``request_id``, ``finished`` and ``outputs[0].token_ids``), each sequence's next turn submitted the moment
    its last one ends. ``firsts``: (prompt ids, forced length) of each sequence's first turn; ``next_turn(i, token_ids)``:
    the next (prompt, length) of sequence i after a turn that sampled ``token_ids``, or None when it is done.
    ``make_params(n)`` gives sampling parameters forcing n tokens; ``submit_prompt(ids)`` wraps prompt ids as the engine
    takes them. Returns seconds, engine steps, generated tokens, turns and the submission order (sequence, turn).
    ``on_end(i)``: sequence i played its last turn; ``step_log`` gets (seconds, sequences ended before it) of each step."""
    done_turns = [0] * len(firsts)
    owner: dict[str, int] = {}
    order: list[tuple[int, int]] = []

    def submit(i: int, prompt, length: int) -> None:
        rid = f"{prefix}-{len(order)}"
        order.append((i, done_turns[i]))
        owner[rid] = i
        core.add_request(rid, submit_prompt(list(prompt)), make_params(length))

    start = time.perf_counter()
    for i, first in enumerate(firsts):
        if first is not None:
            submit(i, *first)
    steps = generated = ended = 0
    while owner:
        steps += 1
        step_started = time.perf_counter()
        outs = core.step()
        if step_log is not None:
            step_log.append((time.perf_counter() - step_started, ended))
        for out in outs:
            if not out.finished:
                continue
            i = owner.pop(out.request_id)
            ids = list(out.outputs[0].token_ids)
            generated += len(ids)
            done_turns[i] += 1
            turn = next_turn(i, ids)
            if turn is not None:
                submit(i, *turn)
            else:
                ended += 1
                if on_end is not None:
                    on_end(i)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "engine_steps": steps, "generated_tokens": generated,
            "generated_tokens_per_second": generated / seconds if seconds else 0.0, "turns": len(order), "order": order}


def replay(core, trajectories, make_params, submit_prompt=lambda ids: ids, **hooks) -> dict:
    """Play ``trajectories`` again on ``core`` (``drive``, ``hooks`` its ``on_end`` and ``step_log``): each turn's recorded
    prompt, its recorded length forced."""
    plans = [turn_requests(t) for t in trajectories]
    nxt = [1] * len(plans)

    def next_turn(i: int, _ids) -> tuple | None:
        if nxt[i] >= len(plans[i]):
            return None
        nxt[i] += 1
        return plans[i][nxt[i] - 1]

    return drive(core, [plan[0] if plan else None for plan in plans], next_turn, make_params, submit_prompt, **hooks)


def ceiling(core, make_params, submit_prompt=lambda ids: ids, groups: int = 8, group_size: int = 8, start_tokens: int = 1000,
            turns: int = 20, sampled: int = 40, appended: int = 250, vocab: int = 30000) -> dict:
    """The issue's engine-only ceiling on ``core`` (``drive``): ``groups`` x ``group_size`` sequences, each group's sharing a
    random ``start_tokens``-token start, ``turns`` turns of exactly ``sampled`` tokens, each next prompt the last one + its
    sampled tokens + ``appended`` random ones (a tool response)."""
    rng = random.Random(0)
    starts = [[rng.randrange(100, vocab) for _ in range(start_tokens)] for _ in range(groups)]
    seqs = [list(starts[g]) for g in range(groups) for _ in range(group_size)]
    done = [0] * len(seqs)

    def next_turn(i: int, ids: list[int]) -> tuple | None:
        done[i] += 1
        if done[i] >= turns:
            return None
        seqs[i] += ids + [rng.randrange(100, vocab) for _ in range(appended)]
        return seqs[i], sampled

    return drive(core, [(s, sampled) for s in seqs], next_turn, make_params, submit_prompt, prefix="ceiling")


class _Served:
    """vLLM's LLMEngine with ``lora`` on every request (as the rollout's requests carried the loaded adapter)."""

    def __init__(self, core, lora):
        self.core, self.lora = core, lora

    def add_request(self, rid, prompt, params):
        self.core.add_request(rid, prompt, params, lora_request=self.lora)

    def step(self):
        return self.core.step()


def on_vllm(engine, run, reset_prefix_cache: bool, served: bool = False) -> dict:
    """``run(core, make_params, submit_prompt)`` (``replay`` or ``ceiling``) on a VLLMEngine's step API: forced lengths
    (EOS ignored), final outputs only; with the engine's prompt and prefix-cache counters. ``served``: every request
    carries the engine's loaded adapter (none loaded, or merged weights: the same as not)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    def params(n: int):
        p = SamplingParams(temperature=1.0, max_tokens=n, min_tokens=n, ignore_eos=True, logprobs=0, detokenize=False, seed=1)
        p.output_kind = RequestOutputKind.FINAL_ONLY
        return p

    if reset_prefix_cache:
        engine.llm.reset_prefix_cache()
    before = engine.counters()
    lora = engine._lora if served else None
    core = engine.llm.llm_engine if lora is None else _Served(engine.llm.llm_engine, lora)
    out = run(core, params, lambda ids: TokensPrompt(prompt_token_ids=ids))
    c = engine.counters().minus(before)
    out.pop("order")
    return {**out, "adapter_served": lora is not None, "prompt_tokens": c.prompt_tokens, "cached_prompt_tokens": c.cached_prompt_tokens,
            "prefix_cache_share": c.cached_prompt_tokens / max(c.prompt_tokens, 1)}


def vllm_replay(engine, trajectories, served: bool = True) -> dict:
    """``replay`` on a VLLMEngine, its prefix cache reset first (the rollout cached every recorded prompt: start as cold
    as the rollout did), with the adapter the rollout was served (``served``; since 2026-12-03, before that none)."""
    return on_vllm(engine, lambda core, params, wrap: replay(core, trajectories, params, wrap), reset_prefix_cache=True, served=served)


def vllm_ceiling(engine) -> dict:
    """``ceiling`` on a VLLMEngine (its prefix cache as the engine has it, as every measured ceiling ran)."""
    return on_vllm(engine, ceiling, reset_prefix_cache=False)
