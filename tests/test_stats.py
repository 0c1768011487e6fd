"""The paired comparison of two runs on the same games, against numbers worked out by hand."""

import pytest

from alfrl.stats import mcnemar_exact, paired_comparison


def test_mcnemar_exact_by_hand():
    # 3 discordant games, all won by B: p = 2 * (1/2)^3 = 0.25
    assert mcnemar_exact(3, 0) == pytest.approx(0.25)
    # 10 discordant, 8 / 2: p = 2 * (C(10,0) + C(10,1) + C(10,2)) / 2^10 = 2 * 56 / 1024
    assert mcnemar_exact(8, 2) == pytest.approx(112 / 1024)
    assert mcnemar_exact(2, 8) == mcnemar_exact(8, 2)
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(5, 5) == 1.0


def test_paired_comparison_by_hand():
    # 10 games: A wins 0-3; B wins 0-5 and 7 -> B only on 4, 5, 7; A only on none
    a = {f"g{i}": i < 4 for i in range(10)}
    b = {f"g{i}": i < 6 or i == 7 for i in range(10)}
    b["extra"] = True  # a game only B played is left out
    c = paired_comparison(a, b, n_boot=4000, seed=1)
    assert (c["games"], c["a_success"], c["b_success"]) == (10, 0.4, 0.7)
    assert c["difference"] == pytest.approx(0.3) and (c["b_only"], c["a_only"]) == (3, 0)
    assert c["p_value"] == pytest.approx(0.25)
    # the bootstrap difference only takes values 0, 0.1, 0.2, ... (3 discordant games of 10, each +1)
    assert 0.0 <= c["ci_low"] <= 0.1 and 0.5 <= c["ci_high"] <= 0.6
    assert paired_comparison(a, b, n_boot=4000, seed=1) == c  # seeded
    with pytest.raises(ValueError, match="no game in common"):
        paired_comparison({"x": True}, {"y": True})


def test_unpaired_comparison_against_newcombe_1998():
    """Newcombe (Stat. Med. 1998, 17:873-890), example (a): 56/70 against 48/80, difference 0.2, method 10
    interval 0.0524 to 0.3339. The Wilson interval of 56/70 by hand: center (0.8 + z^2/140) / (1 + z^2/70) = 0.78439,
    half z / (1 + z^2/70) * sqrt(0.16/70 + z^2/19600) = 0.09256."""
    from alfrl.stats import unpaired_comparison, wilson_interval

    low, high = wilson_interval(56, 70)
    assert (round(low, 4), round(high, 4)) == (0.6918, 0.8770)
    c = unpaired_comparison(48, 80, 56, 70)  # B = 56/70
    assert c["difference"] == pytest.approx(0.2)
    assert (round(c["ci_low"], 4), round(c["ci_high"], 4)) == (0.0524, 0.3339)
    flipped = unpaired_comparison(56, 70, 48, 80)
    assert flipped["ci_low"] == pytest.approx(-c["ci_high"]) and flipped["ci_high"] == pytest.approx(-c["ci_low"])
    with pytest.raises(ValueError, match="at least one game"):
        wilson_interval(0, 0)
