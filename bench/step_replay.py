"""A fit step's GPU work without its sampling's spread (``sampler_bench --phases step``): a saved rollout's turns replayed
on the engine while the update of its finished groups runs beside them, as ``alfrl fit`` runs them
(``model.ppo.update_during_rollout``), then the optimizer step and the weight sync with its probe check.

Why: a fit's step follows the longest trajectory it sampled (on the H200, 17.3 s + 4.26 ms a token of it over 35 steps;
two fits of one setting sat 3 s apart from that line, bench/leases/2026-12-04c.md), and two settings sample different
trajectories from the first update on (2026-12-04e), so fits are not pairs. Here every run plays the same turns
(``--replay-turns``, written by ``--save-turns`` in another run) and trains the same samples: one run per setting that
needs a process of its own (MPS priority, tuned LoRA kernels, packed-row size), its figures beside the others'.

Modes, one after the other in one run (``--step-modes``): ``beside`` (the fit's way: each group's passes start when its
last trajectory's last turn ends), ``serial`` (the update after the replay, as a fit with ``update_during_rollout: false``
runs it). Each: the replay's seconds and engine
steps, its tail (the steps once half of the trajectories had ended: how many, their mean ms), the update left after the
replay, the sync, and their sum, the step. The samples are the saved turns with the sampler's log-probs and advantages
of +1 and -1 by turns of trajectory (every sampled token trained, as in the update phase; a fit with no degenerate group
trains all 64 too).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from replay_ceiling import on_vllm, replay  # bench/ (the script's folder is on sys.path)

from alfrl.advantages import sample_of
from alfrl.types import RolloutStats, Sample, TokenSequence
from alfrl.update import GroupUpdate

STEP_MODES = ("beside", "serial")


def turn_samples(trajectories, group_size: int) -> list[Sample]:
    """Each trajectory's sequences as training samples: trajectory i is group i // group_size's member i % group_size, its
    every turn's advantage +1 (even i) or -1 (odd i)."""
    out = []
    for i, t in enumerate(trajectories):
        for seq in t.sequences:
            if seq.spans:
                turns = max(turn for turn, _, _ in seq.spans) + 1
                out.append(sample_of(seq, [1.0 if i % 2 == 0 else -1.0] * turns, i // group_size, i % group_size))
    return out


def tail_figures(step_log: list[tuple[float, int]], trajectories: int) -> dict:
    """The replay's tail as a fit's rollout logs it (``RolloutStats``: the engine steps that began once half of the
    trajectories had ended, and their mean milliseconds)."""
    stats = RolloutStats()
    for seconds, ended in step_log:
        stats.engine_step(seconds, 2 * ended >= trajectories, None)
    figures = stats.tail_figures()
    return {"tail_steps": int(figures.get("rollout/tail_steps", 0)), "tail_step_ms": figures.get("rollout/tail_step_ms", 0.0)}


def play_step(run_replay, policy, trajectories, group_size: int, temperature: float, optimizer, mode: str,
              sync=None, threaded: bool | None = None) -> dict:
    """One step's work in ``mode``: ``run_replay(on_end=..., step_log=...)`` replays the turns (``replay`` on an engine),
    the groups' update beside it (``beside``) or after it (``serial``), then ``optimizer.step`` and ``sync()`` (the weight
    sync, None: none). ``threaded``: the update in its worker thread (default: on a GPU, as a fit with vLLM runs it)."""
    if mode not in STEP_MODES:
        raise ValueError(f"step mode {mode!r}: choose one of {', '.join(STEP_MODES)}")
    samples = turn_samples(trajectories, group_size)
    by_group: dict[int, list[Sample]] = {}
    for s in samples:
        by_group.setdefault(s.group, []).append(s)
    left: dict[int, int] = {}
    for i, t in enumerate(trajectories):
        if any(seq.spans for seq in t.sequences):
            left[i // group_size] = left.get(i // group_size, 0) + 1
    playing = sum(left.values())
    threaded = policy.device.type == "cuda" if threaded is None else threaded
    update = GroupUpdate(policy, temperature, threaded=threaded) if mode == "beside" else None
    handed: list[tuple[int, int]] = []  # (group, trajectories still playing when it went to the update)

    def on_end(i: int) -> None:
        g = i // group_size
        left[g] -= 1
        if left[g] == 0 and update is not None:
            handed.append((g, sum(left.values())))
            update.add(by_group.get(g, []))

    step_log: list[tuple[float, int]] = []
    started = time.perf_counter()
    try:
        replayed = run_replay(on_end=on_end, step_log=step_log)
    except BaseException:
        if update is not None:
            update.abort()
        raise
    replay_seconds = time.perf_counter() - started
    if update is None:  # the fit's update after the rollout (model.ppo.update_during_rollout: false): rows packed over the batch
        handed.extend((g, 0) for g in sorted(by_group))
        stats = policy.update(samples, optimizer=optimizer, temperature=temperature)
    else:
        stats = update.finish(samples, optimizer.step)
    update_after = time.perf_counter() - started - replay_seconds
    synced, sync_seconds = {}, 0.0
    if sync is not None:
        synced = {k: v for k, v in sync().items() if isinstance(v, (int, float))}
        sync_seconds = time.perf_counter() - started - replay_seconds - update_after
    return {"mode": mode, "step_seconds": replay_seconds + update_after + sync_seconds, "replay_seconds": replay_seconds,
            "update_after_replay_seconds": update_after, "sync_seconds": sync_seconds,
            **{k: replayed[k] for k in ("engine_steps", "generated_tokens", "turns") if k in replayed},
            **tail_figures(step_log, playing),
            "groups_handed": handed, "samples": len(samples), "sequence_tokens": sum(len(s) for s in samples),
            **{f"update/{k}": v for k, v in stats.items()}, **{f"sync/{k}": v for k, v in synced.items()}}


class ProtocolCore:
    """``drive``'s core over an alfrl ``Engine`` (``submit`` / ``step``): a CPU dry run's hf engine. ``n`` tokens asked, not
    forced (the engine may stop sooner at a stop token of its model)."""

    def __init__(self, engine):
        self.engine, self.rid = engine, {}

    def add_request(self, rid, prompt, n):
        from alfrl.engines import SamplingRequest

        (engine_id,) = self.engine.submit([SamplingRequest(tuple(prompt), 1, 1.0, 1.0, n, (), seed=1)])
        self.rid[engine_id] = rid

    def step(self):
        return [SimpleNamespace(request_id=self.rid.pop(engine_id), finished=True, outputs=[SimpleNamespace(token_ids=list(c.token_ids))])
                for engine_id, (c,) in self.engine.step()]


def first_turns(trajectories, turns: int) -> list:
    """The trajectories cut after their first ``turns`` turns (a full-history sequence cut after that turn's span, a windowed
    trajectory's first sequences): the warm-up's short replay."""
    out = []
    for t in trajectories:
        seqs = []
        for seq in t.sequences:
            spans = tuple(span for span in seq.spans if span[0] < turns)
            if spans:
                end = spans[-1][2]
                seqs.append(TokenSequence(seq.token_ids[:end], seq.sampler_logprobs[:end], spans))
        out.append(SimpleNamespace(sequences=tuple(seqs)))
    return out


def step_phase(sampler, policy, trajectories, group_size: int, temperature: float, modes=STEP_MODES) -> dict:
    """``play_step`` on the engine once per mode: vLLM's with the adapter served, its prefix cache reset before each replay;
    another (the hf engine of a CPU dry run) through its ``submit`` / ``step``. First, untimed, the first two turns replayed
    and one group's passes with their gradients dropped: no mode pays for a first call (kernels chosen, memory grown)."""
    optimizer = policy.configure_optimizers()  # the fit's AdamW, its state made at once

    def run_replay(played, **hooks):
        if sampler.engine.name != "vllm":
            return replay(ProtocolCore(sampler.engine), played, lambda n: n, **hooks)
        return on_vllm(sampler.engine, lambda core, params, wrap: replay(core, played, params, wrap, **hooks),
                       reset_prefix_cache=True, served=True)

    started = time.perf_counter()
    run_replay(first_turns(trajectories, 2))
    warm = GroupUpdate(policy, temperature, threaded=False)
    warm.add(turn_samples(trajectories[:group_size], group_size))
    warm.abort()  # its gradients dropped: no optimizer step
    out = {"trajectories": len(trajectories), "group_size": group_size, "warm_up_seconds": time.perf_counter() - started, "runs": []}
    for mode in modes:
        out["runs"].append(play_step(lambda **hooks: run_replay(trajectories, **hooks), policy, trajectories, group_size, temperature,
                                     optimizer, mode, sync=lambda: sampler.sync(policy)))
    return out
