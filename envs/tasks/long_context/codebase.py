"""CodebaseQA-v0: a generated Python package shown as files, with questions answered by running it.

The question's modules form a chain (leaf -> mid -> top) with a re-exporting ``api`` module; filler modules reuse
the same names. Answers come from executing the generated source in this process (`run_modules`).
"""
from __future__ import annotations

import builtins
import dataclasses
import random
import types
from collections.abc import Callable

from envs.tasks.long_context import lengths

FAMILY = "codebase"
TYPES = ("call_value", "callee_module", "reexport_value")
HEAD = ("Below are the files of a Python package. Read the code carefully: the question at the end asks what it "
        "computes or where something is defined. Modules import only from this package.")
PACKAGES = ("quillwork", "tidepool", "ironbark", "lumen", "saltmarsh", "cobblestone", "windrose", "brightline",
            "nettle", "orrery", "kiln", "parcel", "fathom", "haystack", "meadowlark", "tinder")
SUBPACKAGES = ("core", "util", "services", "models", "io", "engine")
WORDS = ("ledger", "tariff", "routing", "parser", "quota", "beacon", "mosaic", "harbor", "cipher", "lattice",
         "prism", "ember", "summit", "anchor", "bramble", "cascade", "delta", "ferry", "garnet", "hinge", "isle",
         "jetty", "kestrel", "lantern", "marrow", "needle", "orbit", "pylon", "quarry", "ripple", "spindle",
         "thicket", "umber", "vector", "willow", "yarrow", "zenith", "atlas", "bolt", "crest")
VERBS = ("scale", "blend", "shift", "fold", "clamp", "mix", "tally", "weigh", "warp", "pack", "spin", "trim")
NOUNS = ("total", "score", "offset", "weight", "count", "index", "level", "ratio", "span", "rank")
CONSTANTS = ("RATE", "LIMIT", "FACTOR", "OFFSET", "BASE", "STEP", "SEED", "SPAN", "MARGIN", "WIDTH")
MODULI = (97, 101, 997, 1009)
CALL_Q = ("What does `{f}({x})` return?", "Run `{f}({x})` in your head: what value does it return?",
          "If you call `{f}({x})`, what integer comes back?")
CALLEE_Q = (("The function `{f}` calls exactly one other function. Which module defines that function? Answer with "
            "the module's dotted path."),
            "`{f}` delegates to one function. Give the dotted path of the module where that function is defined.")
REEXPORT_Q = ("What is the value of `{c}`?", "To what integer does the constant `{c}` resolve?",
              "Follow the imports: what value does `{c}` have?")


@dataclasses.dataclass
class Module:
    """One generated module.

    Attributes:
      name: its dotted path; imports: (module, name, alias) of ``from module import name as alias``.
      constants: name -> expression source; functions: name -> definition source; callee: function -> the one
        name it calls ("" for none).
    """

    name: str
    imports: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    constants: dict[str, str] = dataclasses.field(default_factory=dict)
    functions: dict[str, str] = dataclasses.field(default_factory=dict)
    callee: dict[str, str] = dataclasses.field(default_factory=dict)

    def source(self) -> str:
        """The module's Python source."""
        lines = [f'"""The {self.name.rsplit(".", 1)[1]} module."""']
        lines += [f"from {m} import {n}" + (f" as {a}" if a != n else "") for m, n, a in self.imports]
        lines += [""] + [f"{n} = {e}" for n, e in self.constants.items()]
        return "\n".join(lines) + "\n" + "".join(f"\n\n{src}" for src in self.functions.values())

    def render(self) -> str:
        """The module as the prompt shows it: its path, then its source in a python block."""
        return f"### File: {self.name.replace('.', '/')}.py\n```python\n{self.source()}```"


class Names:
    """Unique module paths of one package."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.package, self.used = rng, rng.choice(PACKAGES), set()

    def module(self) -> str:
        """A new dotted module path: package.subpackage.word (a numeric suffix once the words run out)."""
        while True:
            word = self.rng.choice(WORDS) + (f"_{self.rng.randint(2, 999)}" if len(self.used) > 60 else "")
            name = f"{self.package}.{self.rng.choice(SUBPACKAGES)}.{word}"
            if name not in self.used:
                self.used.add(name)
                return name


def function_source(rng: random.Random, name: str, callee: str, constant: str) -> str:
    """A one-argument integer function calling `callee` ("" for none) and reading `constant`."""
    inner = f"{callee}(x + {rng.randint(1, 9)})" if callee else f"x * {rng.randint(2, 9)}"
    m, shape = rng.choice(MODULI), rng.randrange(3)
    doc = f'    """Return the {rng.choice(NOUNS)} of x after the {rng.choice(VERBS)} step."""\n'
    if shape == 0:
        body = f"    return ({inner} * {rng.randint(2, 5)} + {constant}) % {m}"
    elif shape == 1:
        body = f"    y = {inner} + {constant}\n    if y % 2 == 0:\n        return y // 2\n    return (3 * y + 1) % {m}"
    else:
        body = (f"    total = {constant}\n    for i in range({rng.randint(2, 3)}):\n        total += {inner} - i\n"
                f"    return total % {m}")
    return f"def {name}(x):\n{doc}{body}\n"


def _fill_module(rng: random.Random, mod: Module, n_functions: int, n_constants: int,
                 callables: list[str], readable: list[str]) -> None:
    """Add literal constants and functions (each calling one of `callables` or an earlier local function)."""
    for name in rng.sample([c for c in CONSTANTS if c not in readable and c not in mod.constants], n_constants):
        mod.constants[name] = str(rng.randint(2, 60))
    taken = set(callables) | set(mod.functions)
    for name in rng.sample([f"{v}_{n}" for v in VERBS for n in NOUNS if f"{v}_{n}" not in taken], n_functions):
        options = callables + list(mod.functions)
        callee = rng.choice(options) if options and rng.random() < 0.85 else ""
        mod.functions[name] = function_source(rng, name, callee, rng.choice(readable + list(mod.constants)))
        mod.callee[name] = callee


def _link(rng: random.Random, low: Module, high: Module) -> None:
    """Make `high` import a function and a constant of `low`: a constant derived from it, a function calling it
    (shadowing its name, the import aliased, half the time) and one more function."""
    fn, const = rng.choice(list(low.functions)), rng.choice(list(low.constants))
    shadow = rng.random() < 0.5
    alias = f"base_{fn}" if shadow else fn
    high.imports += [(low.name, fn, alias), (low.name, const, const)]
    derived = rng.choice([c for c in CONSTANTS if c != const])
    high.constants[derived] = f"{const} {rng.choice(('+', '-', '*'))} {rng.randint(2, 9)}"
    verb, noun = fn.split("_")
    first = fn if shadow else f"{rng.choice([v for v in VERBS if v != verb])}_{noun}"
    high.functions[first] = function_source(rng, first, alias, derived)
    high.callee[first] = alias
    _fill_module(rng, high, 1, 0, [alias], [derived, const])


def chain(rng: random.Random, names: Names) -> list[Module]:
    """The question's modules [leaf, mid, top, api].

    mid imports from leaf and top from mid (`_link`); api re-exports top's derived constant as PUBLIC_<name> and
    mid's first function."""
    mods = [Module(names.module()) for _ in range(3)] + [Module(f"{names.package}.api")]
    _fill_module(rng, mods[0], 2, 2, [], [])
    _link(rng, mods[0], mods[1])
    _link(rng, mods[1], mods[2])
    api, top, mid = mods[3], mods[2], mods[1]
    top_const, mid_fn = next(iter(top.constants)), next(iter(mid.functions))
    api.imports += [(top.name, top_const, f"PUBLIC_{top_const}"), (mid.name, mid_fn, mid_fn)]
    return mods


def twin(rng: random.Random, names: Names, functions: list[str], constants: list[str]) -> Module:
    """A standalone module defining functions and constants of the same names as the chain's (distractors)."""
    mod = Module(names.module())
    for name in constants:
        mod.constants[name] = str(rng.randint(2, 60))
    for name in functions:
        mod.functions[name] = function_source(rng, name, "", rng.choice(list(mod.constants) or ["7"]))
        mod.callee[name] = ""
    _fill_module(rng, mod, 1, 1, [], [])
    return mod


def filler_module(rng: random.Random, names: Names, earlier: list[Module]) -> Module:
    """A module of 1 to 3 functions and 1 to 3 constants, importing a function from an earlier filler module."""
    mod = Module(names.module())
    callables: list[str] = []
    if earlier and rng.random() < 0.7:
        src = rng.choice(earlier[-20:])
        fn = rng.choice(list(src.functions))
        mod.imports.append((src.name, fn, fn))
        callables.append(fn)
    _fill_module(rng, mod, rng.randint(1, 3), rng.randint(1, 3), callables, [])
    return mod


def run_modules(modules: list[Module]) -> dict[str, types.ModuleType]:
    """Execute the generated (self-made, trusted) modules in order; returns {dotted path: module}.

    Their imports resolve only to these modules (ImportError for anything else)."""
    loaded: dict[str, types.ModuleType] = {}

    def importer(name, globals=None, locals=None, fromlist=(), level=0):
        if name not in loaded:
            raise ImportError(f"generated package: no module {name!r}")
        return loaded[name]

    safe_builtins = {**vars(builtins), "__import__": importer}
    for mod in modules:
        module = types.ModuleType(mod.name)
        module.__dict__["__builtins__"] = safe_builtins
        exec(compile(mod.source(), f"<{mod.name}>", "exec"), module.__dict__)  # noqa: S102 - our own source
        loaded[mod.name] = module
    return loaded


def _distractor(kind: str, label: str, value: object) -> dict:
    return {"kind": kind, "label": label, "value": str(value)}


def call_value(rng: random.Random, names: Names) -> dict:
    """What a call of the top module's first function returns (it calls down the chain)."""
    mods = chain(rng, names)
    leaf, mid, top, api = mods
    fn, x = next(iter(top.functions)), rng.randint(1, 30)
    twins = [twin(rng, names, [fn], list(top.constants)) for _ in range(2)]
    loaded = run_modules(mods + twins)
    dist = [_distractor("same_name", f"{t.name}.{fn}", loaded[t.name].__dict__[fn](x)) for t in twins]
    dist += [_distractor("other_argument", f"{top.name}.{fn}({x + 1})", loaded[top.name].__dict__[fn](x + 1))]
    dist += [_distractor("other_function", f"{top.name}.{g}", loaded[top.name].__dict__[g](x))
             for g in list(top.functions)[1:]]
    return {"evidence": [top.render(), mid.render(), leaf.render()], "scatter": [[api.render()]] +
            [[t.render()] for t in twins], "question": rng.choice(CALL_Q).format(f=f"{top.name}.{fn}", x=x),
            "answer": str(loaded[top.name].__dict__[fn](x)), "numeric": True, "distractors": dist, "keys": [fn]}


def callee_module(rng: random.Random, names: Names) -> dict:
    """Which module defines the one function a function of the top or mid module calls (aliases, shadowing)."""
    mods = chain(rng, names)
    leaf, mid, top, api = mods
    caller = rng.choice([top, mid])
    fn = rng.choice([f for f, c in caller.callee.items() if c])
    callee = caller.callee[fn]
    original = callee.removeprefix("base_")
    twins = [twin(rng, names, [original], []) for _ in range(2)]
    loaded = run_modules(mods + twins)
    defining = loaded[caller.name].__dict__[callee].__module__
    below = leaf if caller is mid else mid
    dist = [_distractor("same_name", t.name, t.name) for t in twins]
    dist += [_distractor("caller_module", m.name, m.name) for m in (caller, below, api) if m.name != defining]
    shown = [caller] + ([below] if defining == below.name else [])
    rest = [[m.render()] for m in (leaf, mid, top, api) if m not in shown] + [[t.render()] for t in twins]
    return {"evidence": [m.render() for m in shown], "scatter": rest,
            "question": rng.choice(CALLEE_Q).format(f=f"{caller.name}.{fn}"), "answer": defining,
            "accepted": [defining.replace(".", "/") + ".py"], "numeric": False, "distractors": dist, "keys": [fn]}


def reexport_value(rng: random.Random, names: Names) -> dict:
    """The value of a constant re-exported by api, derived through top, mid and leaf."""
    mods = chain(rng, names)
    leaf, mid, top, api = mods
    public = next(n for m, _, n in api.imports if n.startswith("PUBLIC_"))
    twins = [twin(rng, names, [], list(top.constants)[:1] + list(mid.constants)[:1]) for _ in range(2)]
    loaded = run_modules(mods + twins)
    dist = [_distractor("same_name", f"{t.name}.{c}", v) for t in twins
            for c, v in ((c, loaded[t.name].__dict__[c]) for c in t.constants)]
    dist += [_distractor("chain", f"{m.name}.{c}", loaded[m.name].__dict__[c]) for m in (mid, leaf)
             for c in m.constants]
    return {"evidence": [api.render(), top.render(), mid.render(), leaf.render()],
            "scatter": [[t.render()] for t in twins],
            "question": rng.choice(REEXPORT_Q).format(c=f"{api.name}.{public}"),
            "answer": str(loaded[api.name].__dict__[public]), "numeric": True, "distractors": dist,
            "keys": [public]}


BUILDERS: dict[str, Callable[[random.Random, Names], dict]] = {
    "call_value": call_value, "callee_module": callee_module, "reexport_value": reexport_value}


def filler(rng: random.Random, names: Names) -> tuple[Callable[[], lengths.Piece], Callable[[], lengths.Piece]]:
    """(blocks, lines): filler modules (each importing from a recent one), and one-constant data modules."""
    made: list[Module] = []

    def blocks() -> lengths.Piece:
        made.append(filler_module(rng, names, made))
        return made[-1].render(), "code"

    def lines() -> lengths.Piece:
        path = names.module().replace(".", "/")
        return f"### File: {path}.py\n```python\nLABEL = \"{rng.choice(WORDS)}\"\n```", "code"

    return blocks, lines


def make_task(seed: int, *, target_tokens: int, depth: float, count_tokens: lengths.CountTokens,
              kind: str) -> dict:
    """One codebase task (the dict of `lengths.task_record`); its answer is computed by running the package.

    Args:
      seed: the generator seed (`lengths.task_seed`); kind: one of TYPES.
      target_tokens, depth: the prompt's length in `count_tokens` tokens and where the evidence starts.

    Raises:
      ValueError: an unknown kind, a bad length or depth, or a target too small for the evidence.
    """
    if kind not in BUILDERS:
        raise ValueError(f"codebase: unknown question type {kind!r}; valid types: {', '.join(TYPES)}")
    rng = random.Random(f"{FAMILY}:{kind}:{seed}")
    names = Names(rng)
    parts = BUILDERS[kind](rng, names)
    tail = f"Question: {parts['question']}\n{lengths.ANSWER_FORMAT}"
    blocks, lines = filler(rng, names)
    layout = lengths.build_layout(HEAD, tail, parts["evidence"], blocks, lines, count_tokens, target_tokens, depth,
                                  rng, parts["scatter"], 0.2)
    return lengths.task_record(FAMILY, kind, seed, layout, parts["question"], parts["answer"],
                               numeric=parts["numeric"], target_tokens=target_tokens, depth=depth,
                               distractors=[d for d in parts["distractors"] if d["value"] != parts["answer"]],
                               keys=parts["keys"], accepted=parts.get("accepted", ()))
