"""Grouped rollouts on real games: exact rewards, advantages, masks and token chains."""

import pytest

from alfrl.advantages import AdvantageConfig, group_advantages, make_samples
from alfrl.chat import chat_format
from alfrl.envs import EnvPool
from alfrl.rewards import RewardConfig
from alfrl.rollout import RolloutConfig, RolloutRunner, rollout_metrics
from alfrl.types import read_jsonl, repeated_turns, write_jsonl
from tests.helpers import RAW, ScriptedEngine

GAME = "valid_seen:look_at_obj_in_light-AlarmClock-None-DeskLamp-323/trial_T20190909_044715_250790"
WALK = ["go to desk 1", "use desklamp 1", "take alarmclock 2 from desk 1"]


@pytest.fixture(scope="module")
def played(valid_games, tiny_tokenizer):
    game = next(g for g in valid_games if g.id == GAME)
    assert game.walkthrough() == WALK
    fmt = chat_format(tiny_tokenizer, "tool_call")
    scripts = [
        WALK,  # A: wins in 3 turns
        [RAW + "I am not sure what to do."] + WALK,  # B: one invalid format, then wins in 4 turns
        ["look"] * 4,  # C: wanders until max_steps
    ]
    engine = ScriptedEngine(fmt, scripts)
    cfg = RolloutConfig(max_episode_steps=4, max_trajectory_tokens=20000, max_assistant_tokens=200)
    with EnvPool(num_workers=2) as pool:
        groups = RolloutRunner(engine, pool, fmt, cfg, RewardConfig()).run([game], group_size=3, seed=7)
    return groups, engine, fmt


def test_stop_reasons_rewards_and_turn_records(played):
    (group,), _, _ = played
    a, b, c = group.trajectories
    assert [t.stop_reason for t in (a, b, c)] == ["won", "won", "max_steps"]
    assert [t.steps for t in (a, b, c)] == [3, 4, 4]
    assert [t.invalid_actions for t in (a, b, c)] == [0, 1, 0]
    assert [t.reward for t in (a, b, c)] == pytest.approx([1.0, 0.9, 0.0])
    assert b.turns[0].status == "invalid format" and not b.turns[0].valid_format and b.turns[0].action is None
    assert b.turns[1].observation_before == "Nothing happens."
    assert a.turns[-1].status == "task completed" and c.turns[-1].status == "episode ended"
    assert list(b.step_rewards) == pytest.approx([-0.1, 0.0, 0.0, 1.0])


def test_first_turn_is_one_request_with_n_equal_k(played):
    _, engine, _ = played
    assert engine.requests[0].n == 3
    assert all(r.n == 1 for r in engine.requests[1:])


def test_token_ids_are_exactly_the_prefix_chain_of_the_turns(played):
    (group,), engine, fmt = played
    prompts = {tuple(r.prompt_ids) for r in engine.requests}
    for traj in group.trajectories:
        (seq,) = traj.sequences
        assert len(seq.token_ids) == len(seq.sampler_logprobs) == len(seq.assistant_mask)
        for turn, (t, start, end) in zip(traj.turns, seq.spans):
            assert start == turn.prompt_tokens and end - start == turn.completion_tokens
            assert tuple(seq.token_ids[:start]) in prompts  # the engine was asked exactly this prefix
            completion = list(seq.token_ids[start:end])
            assert completion[-1] == fmt.end_of_turn_id
            assert fmt.completion_text(completion) == turn.completion_text
        for (_, _, end), (_, next_start, _) in zip(seq.spans, seq.spans[1:]):
            between = fmt.tokenizer.decode(list(seq.token_ids[end:next_start]))
            assert between.startswith("\n<|im_start|>user\n<tool_response>\nStatus: ")
            assert between.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
        # the mask is 1 exactly on sampled tokens, and the sampler log-probs sit on them
        mask = seq.assistant_mask
        assert sum(mask) == sum(t.completion_tokens for t in traj.turns)
        assert all((lp == -0.5) == bool(m) for lp, m in zip(seq.sampler_logprobs, mask))
        assert seq.token_ids[-1] == fmt.end_of_turn_id  # ends with the last completion


def test_advantages_worked_out_by_hand(played):
    (group,), _, _ = played
    trajs = list(group.trajectories)
    reward = RewardConfig()
    # rewards 1.0, 0.9, 0.0; mean 0.633333...
    mean = (1.0 + 0.9 + 0.0) / 3
    assert group_advantages(trajs, AdvantageConfig("grpo_mean"), reward) == [
        pytest.approx([1.0 - mean] * 3), pytest.approx([0.9 - mean] * 4), pytest.approx([0.0 - mean] * 4)]
    std = ((1.0 - mean) ** 2 + (0.9 - mean) ** 2 + (0.0 - mean) ** 2) / 3
    std = std ** 0.5  # 0.449691... (population)
    assert std == pytest.approx(0.4496912521)
    grpo_std = group_advantages(trajs, AdvantageConfig("grpo_std", std="population"), reward)
    assert grpo_std[0] == pytest.approx([(1.0 - mean) / (std + 1e-6)] * 3)
    assert grpo_std[2] == pytest.approx([-mean / (std + 1e-6)] * 4)
    unbiased = std * (3 / 2) ** 0.5  # 0.550757... (n - 1), verl's torch.std: the default
    grpo_std = group_advantages(trajs, AdvantageConfig("grpo_std"), reward)
    assert grpo_std[0] == pytest.approx([(1.0 - mean) / (unbiased + 1e-6)] * 3)
    # gigpo (mean_norm, gamma 0.95). Step returns: A [0.9025, 0.95, 1], B [-0.1 + 0.95 * 0.9025, 0.9025, 0.95, 1],
    # C [0, 0, 0, 0]. Anchor groups: the start state {A0, B0, C0} (mean 0.553291667); at desk 1 {A1, B2};
    # lamp on {A2, B3}; after "look" {C1, C2, C3}; B1 ("Nothing happens.") alone.
    b0 = -0.1 + 0.95 * 0.9025
    assert b0 == pytest.approx(0.757375)
    m0 = (0.9025 + b0 + 0.0) / 3
    gigpo = group_advantages(trajs, AdvantageConfig("gigpo", norm="mean_norm", step_weight=1.0, episode_stats="trajectory"), reward)
    assert gigpo[0] == pytest.approx([1.0 - mean + 0.9025 - m0, 1.0 - mean, 1.0 - mean])
    assert gigpo[1] == pytest.approx([0.9 - mean + b0 - m0, 0.9 - mean, 0.9 - mean, 0.9 - mean])
    assert gigpo[2] == pytest.approx([-mean - m0, -mean, -mean, -mean])
    assert gigpo[0][0] == pytest.approx(0.366666667 + 0.349208333)


def test_samples_carry_each_turns_advantage_on_its_tokens(played):
    (group,), _, _ = played
    cfg = AdvantageConfig("gigpo", norm="mean_norm")
    result = make_samples([group], cfg, RewardConfig())
    assert result.degenerate_groups == 0 and len(result.samples) == 3
    expected = group_advantages(list(group.trajectories), cfg, RewardConfig())
    for sample, traj, adv in zip(result.samples, group.trajectories, expected):
        for turn, start, end in traj.sequences[0].spans:
            assert sample.advantages_T[start - 1 : end - 1].tolist() == pytest.approx([adv[turn]] * (end - start))
            assert sample.loss_mask_T[start - 1 : end - 1].all()
        assert (sample.advantages_T[~sample.loss_mask_T] == 0).all()
        assert int(sample.loss_mask_T.sum()) == sum(traj.sequences[0].assistant_mask)


def test_degenerate_groups_are_counted_and_dropped(played):
    (group,), _, _ = played
    import dataclasses

    same = dataclasses.replace(group, trajectories=tuple(dataclasses.replace(t, reward=0.5) for t in group.trajectories))
    kept = make_samples([same], AdvantageConfig("grpo_mean", drop_degenerate_groups=False), RewardConfig())
    dropped = make_samples([same], AdvantageConfig("grpo_mean", drop_degenerate_groups=True), RewardConfig())
    assert kept.degenerate_groups == dropped.degenerate_groups == 1
    assert len(kept.samples) == 3 and dropped.samples == [] and dropped.dropped_groups == 1


def test_cut_completions_are_invalid_and_the_episode_goes_on(valid_games, tiny_tokenizer):
    game = next(g for g in valid_games if g.id == GAME)
    fmt = chat_format(tiny_tokenizer, "tool_call")
    engine = ScriptedEngine(fmt, [WALK, [WALK[0]] + WALK], cut=lambda k, turn: k == 1 and turn == 0)
    cfg = RolloutConfig(max_episode_steps=5, max_trajectory_tokens=20000, max_assistant_tokens=200)
    with EnvPool(num_workers=1) as pool:
        (group,) = RolloutRunner(engine, pool, fmt, cfg, RewardConfig()).run([game], 2, seed=0)
    cut = group.trajectories[1]
    assert cut.turns[0].finish_reason == "length" and not cut.turns[0].valid_format
    assert cut.turns[0].format_error == "cut off by the token limit"
    assert cut.stop_reason == "won" and cut.steps == 4  # the cut turn counted as a step, then it played on
    # the cut completion has no end-of-turn token, so the full close followed it
    (seq,) = cut.sequences
    _, _, end = seq.spans[0]
    assert seq.token_ids[end] == fmt.end_of_turn_id


def test_a_loop_is_an_action_taken_again_from_a_state_it_was_taken_in(played):
    """C looks four times: the first look leaves the opening observation for the room's description, and every later
    look is answered by that same description, so C's third and fourth looks stand where its second stood: 2 loops."""
    (group,), _, _ = played
    a, b, c = group.trajectories
    assert [repeated_turns((u.state_key, u.action) for u in t.turns) for t in (a, b, c)] == [(0, 3), (0, 3), (2, 4)]  # B's first turn: no action
    assert c.turns[1].state_key == c.turns[2].state_key == c.turns[3].state_key != c.turns[0].state_key
    assert rollout_metrics([group])["rollout/repeated_turns_mean"] == pytest.approx(2 / 3)


def test_trajectory_budget_ends_the_episode(valid_games, tiny_tokenizer):
    game = next(g for g in valid_games if g.id == GAME)
    fmt = chat_format(tiny_tokenizer, "tool_call")
    engine = ScriptedEngine(fmt, [["look"] * 50, ["look"] * 50])
    first_prompt = len(fmt.first_prompt_ids("x"))
    cfg = RolloutConfig(max_episode_steps=50, max_trajectory_tokens=first_prompt + 900, max_assistant_tokens=2048)
    with EnvPool(num_workers=1) as pool:
        (group,) = RolloutRunner(engine, pool, fmt, cfg, RewardConfig()).run([game], 2, seed=0)
    for t in group.trajectories:
        assert t.stop_reason == "trajectory_too_long"
        assert len(t.sequences[0].token_ids) < cfg.max_trajectory_tokens
    # every request's budget was min(max_assistant_tokens, what is left)
    assert all(r.max_new_tokens == min(2048, cfg.max_trajectory_tokens - len(r.prompt_ids)) for r in engine.requests)


def test_tiny_model_rollout_through_the_hf_engine_round_trips_jsonl(valid_games, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alfrl.engines import HFEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    fmt = chat_format(tok, "tool_call")
    cfg = RolloutConfig(max_episode_steps=3, max_trajectory_tokens=4000, max_assistant_tokens=40)
    games = [valid_games[0], valid_games[-1]]
    with EnvPool(num_workers=2) as pool:
        groups = RolloutRunner(HFEngine(model, tok.pad_token_id), pool, fmt, cfg, RewardConfig()).run(games, 3, seed=1)
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 6 and all(t.steps >= 1 for t in trajs)
    for t in trajs:
        (seq,) = t.sequences
        for _, start, end in seq.spans:
            assert all(lp <= 0.0 for lp in seq.sampler_logprobs[start:end])
            assert any(lp != 0.0 for lp in seq.sampler_logprobs[start:end])
    path = tmp_path / "rollouts.jsonl"
    write_jsonl(path, trajs)
    assert read_jsonl(path) == trajs
    metrics = rollout_metrics(groups)
    assert metrics["rollout/trajectories"] == 6.0
    turns = [u for t in trajs for u in t.turns]  # the tiny random model rarely closes a call within 40 tokens
    cut = [u for u in turns if u.finish_reason == "length"]
    assert cut and all(u.completion_tokens <= 40 and not u.valid_format for u in cut)
    assert metrics["rollout/turns_cut_off"] == len(cut) / len(turns)
    assert metrics["rollout/valid_turn_tokens_max"] == max((u.completion_tokens for u in turns if u.valid_format), default=0)
    assert sum(metrics[f"rollout/stop/{r}"] for r in ("won", "env_done", "max_steps", "trajectory_too_long", "env_error")) == pytest.approx(1.0)


def test_stop_strings_cut_a_completion_after_its_action(valid_games, tiny_tokenizer):
    from alfrl.engines import Completion
    from alfrl.rollout import cut_at_stop_strings

    fmt = chat_format(tiny_tokenizer, "action_tag")
    text = "<think>the desk</think><action>go to desk 1</action>\n<observation>You arrive at desk 1.</observation><action>look"
    ids = fmt.encode(text)
    c = Completion(tuple(ids), tuple(-0.1 * (i + 1) for i in range(len(ids))), "length")
    cut = cut_at_stop_strings(c, ("</action>",), fmt)
    assert fmt.completion_text(list(cut.token_ids)).endswith("</action>")
    assert fmt.completion_text(list(cut.token_ids)) == "<think>the desk</think><action>go to desk 1</action>"
    assert cut.token_ids == c.token_ids[: len(cut.token_ids)] and cut.logprobs == c.logprobs[: len(cut.token_ids)]
    assert cut.finish_reason == "stop"
    assert cut_at_stop_strings(c, (), fmt) is c and cut_at_stop_strings(c, ("</never>",), fmt) is c
    # a completion cut at the length limit whose last token completes the stop string is a stop, not "cut off"
    exact = fmt.encode("<think>x</think><action>look</action>")
    at_limit = cut_at_stop_strings(Completion(tuple(exact), tuple([-0.1] * len(exact)), "length"), ("</action>",), fmt)
    assert at_limit.token_ids == tuple(exact) and at_limit.finish_reason == "stop"
    # in a rollout the cut answer is a valid action and the episode goes on from it
    game = next(g for g in valid_games if g.id == GAME)
    engine = ScriptedEngine(fmt, [[RAW + "<think>x</think><action>" + a + "</action> and then I will" for a in WALK]] * 2)
    cfg = RolloutConfig(action_format="action_tag", max_episode_steps=4, max_assistant_tokens=200, stop_strings=("</action>",))
    with EnvPool(num_workers=1) as pool:
        (group,) = RolloutRunner(engine, pool, fmt, cfg, RewardConfig()).run([game], 2, seed=0)
    assert all(t.won and t.invalid_actions == 0 for t in group.trajectories)
    assert all(turn.completion_text.endswith("</action>") for t in group.trajectories for turn in t.turns)
    # every request carries the stop strings, so an engine that can stop on them does (vLLM with its tokenizer)
    assert engine.requests and all(r.stop_strings == ("</action>",) for r in engine.requests)


def test_reward_noise_gives_a_group_of_equal_outcomes_advantages_reproducibly(valid_games, tiny_tokenizer):
    """data.reward.noise (pipeline checks on weights that never win): equal play, different rewards, the same for the same
    seed; the step rewards still sum to the reward; 0 changes nothing."""
    from alfrl.rewards import reward_noise

    game = next(g for g in valid_games if g.id == GAME)
    fmt = chat_format(tiny_tokenizer, "tool_call")
    cfg = RolloutConfig(max_episode_steps=2, max_trajectory_tokens=20000, max_assistant_tokens=200)
    noisy = RewardConfig(noise=0.5)
    with EnvPool(num_workers=2) as pool:
        runs = [RolloutRunner(ScriptedEngine(fmt, [["look"] * 2] * 3), pool, fmt, cfg, reward).run([game], 3, seed=seed)[0]
                for reward, seed in ((RewardConfig(), 7), (noisy, 7), (noisy, 7), (noisy, 8))]
    plain, a, b, c = ([t.reward for t in g.trajectories] for g in runs)
    assert plain == [0.0, 0.0, 0.0]
    assert a == b and a != c and len(set(a)) == 3
    assert a == pytest.approx([reward_noise(noisy, 7, game.id, i) for i in range(3)])
    for t in runs[1].trajectories:
        assert sum(t.step_rewards) == pytest.approx(t.reward)
    assert make_samples([runs[0]], AdvantageConfig("grpo_mean"), RewardConfig()).samples == []  # degenerate: nothing trains
    assert len(make_samples([runs[1]], AdvantageConfig("grpo_mean"), noisy).samples) == 3
    assert RewardConfig(noise=-1).problems() == ["data.reward.noise=-1 must be >= 0 (0: no noise, the setting for learning runs)"]
