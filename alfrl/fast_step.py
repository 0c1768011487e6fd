"""Faster steps of ALFWorld's PDDL games in the environment workers: TextWorld's text grammar parsed once per string.

TextWorld's ``PddlEnv`` (textworld 1.7) writes every step's feedback with its context-sensitive grammar
(``textworld.envs.pddl.textgen``): each derivation parses its start string (``#look.feedback#`` ...) with tatsu, and
each conditional symbol and conditional rule parses its logic query (``Rule.parse_conjunctive_query``) with tatsu, at
every step, though the strings all come from the game's fixed grammar. ``memoize_grammar_parses`` keeps each string's
parse and hands out what the parser would have built:

- the grammar's symbols as a deep copy of the first parse (a derivation sets the contexts of the symbols it gets);
- a query's predicates as parsed once (TextWorld's predicates are immutable: a name and a tuple of placeholders), in a
  new ``Rule`` each time, as before.

``enable_fast_step()`` installs it in the current process (the workers' own interpreters); it leaves TextWorld as it
is when its structure is not the expected one. Same states on real games: tests/test_fast_step.py; measured side by
side by ``bench/env_throughput.py --compare-step``.
"""

from __future__ import annotations

from copy import deepcopy


def memoize_grammar_parses() -> bool:
    """Each grammar string and logic query parsed once per process; whether installed."""
    from textworld import logic
    from textworld.envs.pddl import textgen

    if getattr(textgen, "_alfrl_memoized", False):
        return True
    rule_cls = getattr(logic, "Rule", None)
    if not callable(getattr(textgen, "_parse_and_convert", None)) or not callable(getattr(logic, "_parse_and_convert", None)) \
            or rule_cls is None or not hasattr(rule_cls, "parse_conjunctive_query"):
        return False
    parse_symbols, parse_logic = textgen._parse_and_convert, logic._parse_and_convert
    symbols: dict = {}
    queries: dict[str, tuple] = {}

    def memoized_symbols(*args, **kwargs):
        if kwargs.get("trace"):  # TextWorld's tracing prints the parse: parse again
            return parse_symbols(*args, **kwargs)
        key = (args, tuple(sorted(kwargs.items())))
        if key not in symbols:
            symbols[key] = parse_symbols(*args, **kwargs)
        return deepcopy(symbols[key])

    def parse_conjunctive_query(cls, expr: str):
        if expr not in queries:
            queries[expr] = tuple(parse_logic(expr, rule_name="conjunctiveQuery"))
        return cls("query", queries[expr], [])

    textgen._parse_and_convert = memoized_symbols
    rule_cls.parse_conjunctive_query = classmethod(parse_conjunctive_query)
    textgen._alfrl_memoized = True
    return True


def shallow_context_copies() -> bool:
    """A derivation's context copied one level deep (its own dicts of variables and of the query mapping, the same
    entities in them), not deep-copied at every symbol; whether installed."""
    from textworld.envs.pddl import textgen

    if getattr(textgen, "_alfrl_shallow_contexts", False):
        return True
    symbol_cls = getattr(textgen, "Symbol", None)
    if not callable(getattr(textgen, "copy_context", None)) or symbol_cls is None or not hasattr(symbol_cls, "copy"):
        return False

    def copy_context(context):
        return {"state": context["state"], "facts": context["facts"], "variables": dict(context["variables"]),
                "mapping": dict(context["mapping"]), "entity_infos": context["entity_infos"]}

    def copy(self, context):
        own, self.context = self.context, {}  # deep-copied below only to be replaced
        try:
            twin = deepcopy(self)
        finally:
            self.context = own
        twin.context = copy_context(context)
        return twin

    textgen.copy_context, symbol_cls.copy = copy_context, copy
    textgen._alfrl_shallow_contexts = True
    return True


def enable_fast_step() -> tuple[bool, bool]:
    """Install both in this process; returns (parses memoized, contexts copied shallow)."""
    return memoize_grammar_parses(), shallow_context_copies()
