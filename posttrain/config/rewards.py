"""The `rewards` section of a run config: a reward model and an LLM judge scoring each reply after the environment
(`posttrain.rollout.rewards`), combined with the environment's reward by weights.

Kept beside `schema.py` (which imports it into `Config`); validated here (one ValueError naming the key, turned
into a ConfigError at load); `posttrain.recipes.reward_plan` makes the rollout phase's typed settings of it.

Example (a config file)::

    c.rewards.model = "runs/rm"                 # a `posttrain rm` run (its reward_model/) or an exported directory
    c.rewards.judge.enabled = True
    c.rewards.judge.path = "models/judge.gguf"  # the judge model: a policy source, like the reference model
    c.rewards.judge.criteria = ({"name": "correct", "weight": 2.0, "description": "the final answer is right"},
                                {"name": "clear", "weight": 1.0, "description": "the reasoning is easy to follow"})
    c.rewards.weights = {"env": 1.0, "model": 0.5, "judge": 0.5}
"""
from __future__ import annotations

import dataclasses
import math
import re
import string
from typing import Any, Mapping

SOURCES = ("env", "model", "judge")  # the rewards `weights` combine
TEMPLATE_FIELDS = ("prompt", "reply", "rubric", "max_score")  # what a judge template may name
CRITERION_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
DEFAULT_TEMPLATE = (
    "You grade a reply to a task. Score each criterion with a number from 0 to {max_score}.\n\n"
    "Criteria:\n{rubric}\n\nTask:\n{prompt}\n\nReply:\n{reply}\n\n"
    "Answer with exactly one line per criterion, in the order above, formatted as <name>: <score>, and nothing "
    "else.")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeConfig:
    """The `rewards.judge` section: an LLM that grades each reply against a rubric.

    Attributes:
        enabled: score replies with the judge.
        path: the judge model, a .gguf file or an HF model directory ("" with no preset: the default SmolLM2-135M
            GGUF), loaded like the policy (`posttrain.checkpoints.policy.PolicySource`).
        preset: a `posttrain.model.presets` name instead (random init with the byte tokenizer: tests).
        overrides: preset fields replaced (e.g. {"vocab_size": 320}).
        template: the judge's user message, a `str.format` template naming some of {prompt}, {reply} (both
            required), {rubric} (one line per criterion) and {max_score}.
        criteria: the rubric: a tuple of {"name": a word, "weight": > 0, "description": str}; the judge scores each
            in [0, max_score] and the judgement's score is sum(weight * score) / (sum(weight) * max_score), in [0, 1].
        max_score: > 0, the top of each criterion's scale.
        max_new_tokens: the judge's token budget per judgement (greedy decoding).
        batch_size: judgements per sampler call (the last call is padded to it: one compiled shape).
    """

    enabled: bool = False
    path: str = ""
    preset: str = ""
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    template: str = DEFAULT_TEMPLATE
    criteria: tuple[Mapping[str, Any], ...] = ()
    max_score: float = 10.0
    max_new_tokens: int = 64
    batch_size: int = 8

    def __post_init__(self):
        crit = tuple(dict(c) if isinstance(c, Mapping) else c for c in self.criteria)
        object.__setattr__(self, "criteria", crit)
        for i, c in enumerate(crit):
            if not isinstance(c, dict) or set(c) != {"name", "weight", "description"}:
                raise ValueError(f"judge.criteria[{i}]={c!r}: a criterion is {{'name', 'weight', 'description'}}")
            if not (isinstance(c["name"], str) and CRITERION_NAME.fullmatch(c["name"])):
                raise ValueError(f"judge.criteria[{i}].name={c['name']!r}: a word (letters, digits, _ or -)")
            if not (_finite(c["weight"]) and c["weight"] > 0) or not isinstance(c["description"], str):
                raise ValueError(f"judge.criteria[{i}]={c!r}: weight must be a number > 0, description a string")
        names = [c["name"] for c in crit]
        if len(set(names)) != len(names):
            raise ValueError(f"judge.criteria names {names} repeat one")
        if self.enabled and not crit:
            raise ValueError("judge.enabled needs a rubric: set judge.criteria")
        if self.path and self.preset:
            raise ValueError(f"judge: set at most one of path={self.path!r} and preset={self.preset!r}")
        fields = [f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None]
        bad = sorted(set(fields) - set(TEMPLATE_FIELDS))
        if bad or not {"prompt", "reply"} <= set(fields):
            raise ValueError(f"judge.template names {sorted(set(fields))}: it must name {{prompt}} and {{reply}} and "
                             f"may name only {list(TEMPLATE_FIELDS)} (unknown: {bad})")
        checks = {"max_score (> 0)": _finite(self.max_score) and self.max_score > 0,
                  "max_new_tokens (>= 1)": self.max_new_tokens >= 1, "batch_size (>= 1)": self.batch_size >= 1}
        wrong = [k for k, ok in checks.items() if not ok]
        if wrong:
            raise ValueError(f"invalid judge.{', judge.'.join(wrong)}: max_score={self.max_score!r}, "
                             f"max_new_tokens={self.max_new_tokens!r}, batch_size={self.batch_size!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardsConfig:
    """The `rewards` section: model and judge rewards after the environment's (`posttrain.rollout.rewards`).

    Attributes:
        model: a reward model scoring each reply: a `posttrain rm` run directory (its `reward_model/`) or an
            exported transformers sequence-classification directory ("": none).
        judge: the LLM judge (`JudgeConfig`; off unless judge.enabled).
        weights: {"env" | "model" | "judge": weight}: a sample's reward is the sum over the sources in use of weight
            x that source's score (a source left out weighs 1; an infra-error sample keeps its env reward).
        judge_unparsable_score: the judge score of a judgement the strict parser rejects (never an error).
        batch_size: sequences per reward-model call (the last call is padded to it).
        max_len: tokens of prompt + reply the reward model reads (a longer sequence keeps its last max_len).
    """

    model: str = ""
    judge: JudgeConfig = JudgeConfig()
    weights: Mapping[str, float] = dataclasses.field(default_factory=lambda: {s: 1.0 for s in SOURCES})
    judge_unparsable_score: float = 0.0
    batch_size: int = 16
    max_len: int = 512

    def __post_init__(self):
        bad = sorted(set(self.weights) - set(SOURCES))
        if bad or not all(_finite(w) for w in self.weights.values()):
            raise ValueError(f"rewards.weights={dict(self.weights)}: keys among {SOURCES}, finite numbers")
        if not _finite(self.judge_unparsable_score):
            raise ValueError(f"rewards.judge_unparsable_score={self.judge_unparsable_score!r}: a finite number")
        if self.batch_size < 1 or self.max_len < 2:
            raise ValueError(f"rewards.batch_size={self.batch_size!r} (>= 1), rewards.max_len={self.max_len!r} (>= 2)")

    @property
    def enabled(self) -> bool:
        """Whether any reward besides the environment's is configured."""
        return bool(self.model) or self.judge.enabled
