"""RULER-style calibration tasks (Hsieh et al. 2024, arXiv:2404.06654) in generated filler prose.

`multikey_needle`: several key-value needles, one asked; `variable_tracking`: chains ``X2 = X1`` from a value,
which variables hold it (a sorted comma list); `common_words`: the three most frequent words of a word list.
`make_task` builds one task of a type with `lengths.build_layout`.
"""
from __future__ import annotations

import random
import string
from collections.abc import Callable

from envs.tasks.long_context import lengths

FAMILY = "synthetic"
TYPES = ("multikey_needle", "variable_tracking", "common_words")
HEAD = ("Below is a long text. Somewhere in it are the facts a question at the end asks about; the rest is "
        "unrelated. Read it carefully.")
SUBJECTS = ("the harbor master", "a retired botanist", "the village council", "our night watchman",
            "the old ferry captain", "a young cartographer", "the museum curator", "the baker on Elm Street",
            "a traveling violinist", "the school librarian", "a quiet beekeeper", "the river pilot",
            "the lighthouse keeper", "a tired surveyor", "my grandmother", "the choir director", "a stonemason",
            "the postmaster", "two fishermen", "the mayor's nephew", "a visiting geologist", "the innkeeper")
VERBS = ("repainted", "catalogued", "rebuilt", "photographed", "measured", "sold", "mended", "described",
         "counted", "carried", "borrowed", "inspected", "sketched", "polished", "moved", "guarded", "weighed",
         "cleaned", "repaired", "found", "kept", "sent", "left", "ordered", "wrapped", "tested")
OBJECTS = ("the north bridge", "a crate of lemons", "the broken clock tower", "an old map of the coast",
           "the orchard fence", "a box of letters", "the chapel bell", "a pair of brass compasses",
           "the copper kettle", "the signal lamps", "a stack of timber", "the ferry's logbook", "a bolt of blue cloth",
           "the market awnings", "a barrel of cider", "the school piano", "the weather vane", "a sack of seed potatoes",
           "the town's only telescope", "a basket of pears", "the mill wheel", "a chest of tools")
TAILS = ("before the first snow", "during the long summer", "after the spring market", "in {year}",
         "on a {weekday} morning", "for {n} days", "with {n} helpers", "while the tide was low", "without a word",
         "near the {place}", "at dawn", "in the rain", "by lantern light", "for {n} coins", "late in {month}")
PLACES = ("granary", "old quarry", "east pier", "salt marsh", "rope walk", "station", "abbey ruins", "canal lock")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "March", "April", "June", "August", "October", "November")
KEY_ADJ = ("crimson", "silent", "amber", "rapid", "hollow", "frozen", "gentle", "brave", "ancient", "velvet",
           "scarlet", "golden", "misty", "bitter", "lucky", "restless", "copper", "silver", "wild", "quiet")
KEY_NOUN = ("falcon", "lantern", "harbor", "meadow", "compass", "orchid", "glacier", "anchor", "willow", "ember",
            "heron", "thistle", "beacon", "canyon", "marble", "sparrow", "quarry", "ribbon", "tundra", "cobalt")
NEEDLES = ("One of the special magic numbers for {key} is: {value}.", "The special magic number for {key} is {value}.",
           "Remember this: {key} has the magic number {value}.",
           "For the record, the magic number attached to {key} is {value}.")
NEEDLE_QUESTIONS = ("What is the special magic number for {key} mentioned in the text?",
                    "Which magic number does the text give for {key}?",
                    "Find the magic number attached to {key} in the text. What is it?")
ASSIGNMENTS = ("VAR {a} = {b}", "{a} := {b}", "Let {a} equal {b}.", "Set variable {a} to {b}.")
VAR_QUESTIONS = (("Which variables are assigned the value {value}, directly or through other variables? List them in "
                 "alphabetical order, separated by commas."),
                 ("Following every assignment in the text, which variables end up equal to {value}? Give their names "
                 "sorted alphabetically, comma-separated."))
WORD_QUESTIONS = (("In the word list of the text, which three words occur most often? Give them in alphabetical order, "
                  "separated by commas."),
                  ("Count the words of the word list: name the three most frequent ones, alphabetically, "
                  "comma-separated."))
ONSETS = ("br", "qu", "d", "v", "tr", "m", "sk", "l", "p", "gr", "n", "f", "z", "st", "k", "h", "pl", "r")
VOWELS = ("a", "e", "i", "o", "u")
CODAS = ("lt", "n", "sh", "rv", "k", "m", "st", "x", "nd", "r")


def sentence(rng: random.Random) -> str:
    """One generated filler sentence (no hyphens, no capitalised codes: those mark the evidence)."""
    tail = rng.choice(TAILS).format(year=rng.randint(1850, 2020), weekday=rng.choice(WEEKDAYS),
                                    n=rng.randint(2, 90), place=rng.choice(PLACES), month=rng.choice(MONTHS))
    subject, verb, obj = rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)
    shape = rng.randrange(3)
    text = (f"{subject} {verb} {obj} {tail}" if shape == 0 else f"{tail}, {subject} {verb} {obj}" if shape == 1
            else f"{obj} was {verb} by {subject} {tail}")
    return text[0].upper() + text[1:] + "."


def filler(rng: random.Random) -> tuple[Callable[[], lengths.Piece], Callable[[], lengths.Piece]]:
    """(blocks, lines) of generated prose: paragraphs of 3 to 7 sentences, single sentences."""
    return (lambda: (" ".join(sentence(rng) for _ in range(rng.randint(3, 7))), "prose"),
            lambda: (sentence(rng), "prose"))


def _keys(rng: random.Random, count: int) -> list[str]:
    """`count` distinct needle keys, the first with near-identical twins (same adjective, or same noun)."""
    adj, noun = rng.choice(KEY_ADJ), rng.choice(KEY_NOUN)
    keys = [f"{adj}-{noun}", f"{adj}-{rng.choice([n for n in KEY_NOUN if n != noun])}",
            f"{rng.choice([a for a in KEY_ADJ if a != adj])}-{noun}"]
    while len(keys) < count:
        key = f"{rng.choice(KEY_ADJ)}-{rng.choice(KEY_NOUN)}"
        keys += [key] if key not in keys else []
    return keys[:count]


def multikey_needle(rng: random.Random) -> dict:
    """Parts of a multi-key needle task: 4 to 6 needles with distinct 7-digit values, the first asked."""
    keys = _keys(rng, rng.randint(4, 6))
    values = rng.sample(range(1_000_000, 10_000_000), len(keys))
    needles = [rng.choice(NEEDLES).format(key=k, value=v) for k, v in zip(keys, values)]
    return {"evidence": [needles[0]], "scatter": [[n] for n in needles[1:]],
            "question": rng.choice(NEEDLE_QUESTIONS).format(key=keys[0]), "answer": str(values[0]), "numeric": True,
            "distractors": [{"kind": "other_key", "label": k, "value": str(v)} for k, v in zip(keys[1:], values[1:])],
            "keys": [keys[0]]}


def _chain(rng: random.Random, names: list[str], value: int, form: str) -> list[str]:
    """Statements assigning `value` to names[0], then each name from an earlier one of the chain."""
    lines = [form.format(a=names[0], b=value)]
    for i in range(1, len(names)):
        lines.append(form.format(a=names[i], b=names[rng.randrange(i)]))
    return lines


def variable_tracking(rng: random.Random) -> dict:
    """Parts of a variable-tracking task.

    A chain of 3 to 6 variables from a 5-digit value, two distractor chains (one from a near-identical value), one
    assignment format per task."""
    form = rng.choice(ASSIGNMENTS)
    names: list[str] = []
    while len(names) < 16:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        names += [name] if name not in names else []
    hops = rng.randint(3, 6)
    value = rng.randint(10_000, 99_999)
    near = int(str(value)[:3] + str(value)[4] + str(value)[3]) if str(value)[3] != str(value)[4] else value + 1
    other = value
    while other in (value, near):
        other = rng.randint(10_000, 99_999)
    target, rest = names[:hops], names[hops:]
    chains = [_chain(rng, rest[:4], near, form), _chain(rng, rest[4:8], other, form)]
    answer = ", ".join(sorted(target))
    return {"evidence": _chain(rng, target, value, form), "scatter": chains, "spread": 0.3,
            "question": rng.choice(VAR_QUESTIONS).format(value=value), "answer": answer,
            "accepted": [answer.replace(", ", ",")], "numeric": False,
            "distractors": [{"kind": "other_chain", "label": n, "value": str(v)}
                            for v, chain in ((near, rest[:4]), (other, rest[4:8])) for n in chain],
            "keys": [str(value)]}


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(rng.randint(1, 2))) + rng.choice(CODAS)


def _word_counts(rng: random.Random, n_words: int, top: int) -> tuple[list[str], list[str], dict[str, int]]:
    """(three common words, their look-alikes, {word: count}) of a list of `n_words` words: the common ones `top`
    times each, the look-alikes (an added "e") top // 2 times, the others at most top // 2 - 1 times."""
    seen: set[str] = set()
    common: list[str] = []
    while len(common) < 3:
        word = _pseudo_word(rng)
        if len(word) >= 4 and word not in seen:
            common.append(word)
            seen.update((word, word + "e", word.removesuffix("e")))
    twins = [w + "e" for w in common]
    counts = {**{w: top for w in common}, **{t: top // 2 for t in twins}}
    low, need = max(1, top // 2 - 1), n_words - 3 * top - 3 * (top // 2)
    while need > 0:
        word = _pseudo_word(rng)
        if len(word) >= 4 and word not in seen:
            seen.add(word)
            counts[word] = min(need, rng.randint(1, low))
            need -= counts[word]
    return common, twins, counts


def common_words(rng: random.Random, target_tokens: int) -> dict:
    """Parts of a common-words task.

    A word list of about 12% of the target (3 tokens a word assumed): three words most frequent, a look-alike of
    each half as frequent, the others rarer still."""
    n_words = max(40, int(0.12 * target_tokens / 3))
    common, twins, counts = _word_counts(rng, n_words, max(4, min(30, n_words // 15)))
    bag = [w for w, c in counts.items() for _ in range(c)]
    rng.shuffle(bag)
    lines = ["Word list:"] + [", ".join(bag[i:i + 25]) for i in range(0, len(bag), 25)]
    answer = ", ".join(sorted(common))
    return {"evidence": lines, "scatter": [], "question": rng.choice(WORD_QUESTIONS), "answer": answer,
            "accepted": [answer.replace(", ", ",")], "numeric": False,
            "distractors": [{"kind": "look_alike", "label": t, "value": t} for t in twins], "keys": []}


def make_task(seed: int, *, target_tokens: int, depth: float, count_tokens: lengths.CountTokens,
              kind: str) -> dict:
    """One synthetic task (the dict of `lengths.task_record`).

    Args:
      seed: the generator seed (`lengths.task_seed`); kind: one of TYPES.
      target_tokens, depth: the prompt's length in `count_tokens` tokens and where the evidence starts.

    Raises:
      ValueError: an unknown kind, a bad length or depth.
    """
    if kind not in TYPES:
        raise ValueError(f"synthetic: unknown task type {kind!r}; valid types: {', '.join(TYPES)}")
    rng = random.Random(f"{FAMILY}:{kind}:{seed}")
    parts = (common_words(rng, target_tokens) if kind == "common_words"
             else multikey_needle(rng) if kind == "multikey_needle" else variable_tracking(rng))
    tail = f"Question: {parts['question']}\n{lengths.ANSWER_FORMAT}"
    blocks, lines = filler(rng)
    layout = lengths.build_layout(HEAD, tail, parts["evidence"], blocks, lines, count_tokens, target_tokens, depth,
                                  rng, parts["scatter"], parts.get("spread", 0.0))
    return lengths.task_record(FAMILY, kind, seed, layout, parts["question"], parts["answer"],
                               numeric=parts["numeric"], target_tokens=target_tokens, depth=depth,
                               distractors=parts["distractors"], keys=parts["keys"],
                               accepted=parts.get("accepted", ()))
