"""Is run B better than run A on the same games? A paired test over games.

Each game is played once by each run (greedy evaluation), so the runs are paired by game:
McNemar's exact test looks only at the discordant games (won by one run, lost by the other), and a
bootstrap over games gives a 95% interval of the difference in success rate.

When one run left only its summary (wins of games, no per-game record), the games cannot be paired:
``unpaired_comparison`` gives Newcombe's interval for the difference of two independent proportions, which
is wider than the paired one on the same games.
"""

from __future__ import annotations

import math

import numpy as np


def mcnemar_exact(b_only: int, a_only: int) -> float:
    """Two-sided exact McNemar p-value: under "no difference" each discordant game is a fair coin."""
    n = b_only + a_only
    if n == 0:
        return 1.0
    k = min(b_only, a_only)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_comparison(a: dict[str, bool], b: dict[str, bool], n_boot: int = 10000, seed: int = 0) -> dict:
    """B against A on the games both played: success rates, difference, discordant counts, McNemar p,
    and the bootstrap 95% interval of the difference (games resampled with replacement, seeded)."""
    games = sorted(set(a) & set(b))
    if not games:
        raise ValueError("the two runs have no game in common: compare evaluations of the same games")
    x = np.array([a[g] for g in games], dtype=np.float64)
    y = np.array([b[g] for g in games], dtype=np.float64)
    b_only, a_only = int(((y == 1) & (x == 0)).sum()), int(((x == 1) & (y == 0)).sum())
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(games), size=(n_boot, len(games)))
    diffs = (y[idx] - x[idx]).mean(axis=1)
    low, high = np.percentile(diffs, [2.5, 97.5])
    return {
        "games": len(games),
        "a_success": float(x.mean()),
        "b_success": float(y.mean()),
        "difference": float(y.mean() - x.mean()),
        "b_only": b_only,
        "a_only": a_only,
        "p_value": mcnemar_exact(b_only, a_only),
        "ci_low": float(low),
        "ci_high": float(high),
    }


def wilson_interval(wins: int, games: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson's score interval of a success rate (95% by default)."""
    if games <= 0:
        raise ValueError("a success rate needs at least one game")
    p, zz = wins / games, z * z
    center = (p + zz / (2 * games)) / (1 + zz / games)
    half = z / (1 + zz / games) * math.sqrt(p * (1 - p) / games + zz / (4 * games * games))
    return max(0.0, center - half), min(1.0, center + half)


def unpaired_comparison(a_wins: int, a_games: int, b_wins: int, b_games: int) -> dict:
    """B's success rate minus A's, with Newcombe's 95% interval (hybrid score, his method 10) for two independent
    proportions: for runs that cannot be paired game by game."""
    pa, pb = a_wins / a_games, b_wins / b_games
    la, ua = wilson_interval(a_wins, a_games)
    lb, ub = wilson_interval(b_wins, b_games)
    d = pb - pa
    return {"a_success": pa, "b_success": pb, "difference": d,
            "ci_low": d - math.sqrt((pb - lb) ** 2 + (ua - pa) ** 2),
            "ci_high": d + math.sqrt((ub - pb) ** 2 + (pa - la) ** 2)}
