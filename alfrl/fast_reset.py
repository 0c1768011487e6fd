"""Faster resets of ALFWorld's PDDL games in the environment workers: one PDDL -> SAS translation, not four.

TextWorld's ``PddlEnv`` (textworld 1.7) translates a game four times per start + reset:
``load`` builds the start state (``PddlState``) only to name the game's entities, ``reset`` builds it
again, and every ``PddlState`` translates the game twice: once as the game (the states alfrl steps
through) and once, optimized, for TextWorld's planner (``replan``), which answers only the
``policy_commands`` and walkthrough requests. alfrl's workers request neither, so:

- ``reuse_loaded_start_state``: the first reset after a load takes the state the load built (nothing
  runs between the two; later resets of the same env build a new one, as before);
- ``skip_replan_translation``: states skip the planner's translation; asking one for a plan raises.

``enable_fast_reset()`` installs both in the current process (the workers' own interpreters); each
leaves TextWorld as it is when its structure is not the expected one. Measured side by side by
``bench/env_throughput.py --compare-reset``.
"""

from __future__ import annotations

PLANNER_SKIPPED = ("this TextWorld state was built without the planner's translation (alfrl.fast_reset): "
                   "start the environment in a process without enable_fast_reset() to ask it for a plan")


def reuse_loaded_start_state() -> bool:
    """A freshly loaded game's first reset takes the start state its load built; whether installed."""
    from textworld.envs.pddl import logic as pddl_logic
    from textworld.envs.pddl import pddl as tw_pddl

    env_cls = tw_pddl.PddlEnv
    if getattr(env_cls, "_alfrl_reuses_start_state", False):
        return True
    if not hasattr(pddl_logic, "PddlState") or getattr(tw_pddl, "pddl_logic", None) is not pddl_logic:
        return False
    load, reset = env_cls.load, env_cls.reset

    def load_keeping_start(self, data):
        load(self, data)
        self._alfrl_start_state = getattr(self, "_pddl_state", None)

    def reset_from_start(self):
        start = self.__dict__.pop("_alfrl_start_state", None)
        if start is None:
            return reset(self)
        build = pddl_logic.PddlState
        pddl_logic.PddlState = lambda *args, **kwargs: start  # a worker runs one command at a time
        try:
            return reset(self)
        finally:
            pddl_logic.PddlState = build

    env_cls.load, env_cls.reset = load_keeping_start, reset_from_start
    env_cls._alfrl_reuses_start_state = True
    return True


def skip_replan_translation() -> bool:
    """``PddlState`` skips the planner's (optimized) translation; ``replan`` raises. Whether installed."""
    import fast_downward
    from textworld.envs.pddl import logic as pddl_logic

    state_cls = getattr(pddl_logic, "PddlState", None)
    if state_cls is None or not hasattr(state_cls, "replan") or not hasattr(fast_downward, "pddl2sas"):
        return False
    if getattr(state_cls, "_alfrl_skips_replan", False):
        return True
    init, translate = state_cls.__init__, fast_downward.pddl2sas

    def game_translation_only(domain, problem, verbose=False, optimize=False):
        if optimize:
            return None, ""
        return translate(domain, problem, verbose=verbose, optimize=optimize)

    def init_without_planner(self, downward_lib, pddl_problem, logic):
        load_replan = downward_lib.load_sas_replan
        fast_downward.pddl2sas, downward_lib.load_sas_replan = game_translation_only, lambda sas: None
        try:
            init(self, downward_lib, pddl_problem, logic)
        finally:
            fast_downward.pddl2sas, downward_lib.load_sas_replan = translate, load_replan

    def replan(self, infos):
        raise RuntimeError(PLANNER_SKIPPED)

    state_cls.__init__, state_cls.replan = init_without_planner, replan
    state_cls._alfrl_skips_replan = True
    return True


def enable_fast_reset() -> tuple[bool, bool]:
    """Install both in this process; returns (start state reused, planner translation skipped)."""
    return reuse_loaded_start_state(), skip_replan_translation()
