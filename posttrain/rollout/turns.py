"""The extension property of multi-turn samples and the rule that splits a sample where it breaks (docs/rollout.md).

Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from posttrain.rollout.samples import Sample


def extends(previous_n: Sequence[int], next_m: Sequence[int]) -> bool:
    """Whether next_m begins with previous_n exactly (m >= n, every token equal)."""
    n = len(previous_n)
    return len(next_m) >= n and list(next_m[:n]) == list(previous_n)


def assert_extends(previous_n: Sequence[int], next_m: Sequence[int], where: str = "") -> None:
    """Raises AssertionError naming the first differing position when next_m does not extend previous_n."""
    if not extends(previous_n, next_m):
        n = min(len(previous_n), len(next_m))
        first = next((i for i in range(n) if previous_n[i] != next_m[i]), n)
        raise AssertionError(f"{where or 'next prompt'} does not extend the sample's {len(previous_n)} tokens: "
                             f"first difference at token {first} (next prompt has {len(next_m)})")


@dataclasses.dataclass
class TurnTokens:
    """One episode's token record across re-rendered turns: parts [(prompt ids, segments)] and breaks so far."""

    parts: list = dataclasses.field(default_factory=list)
    breaks: int = 0

    @classmethod
    def start(cls, prompt_ids: Sequence[int]) -> TurnTokens:
        """The record of an episode whose first prompt is `prompt_ids`; ValueError when it is empty."""
        if not len(prompt_ids):
            raise ValueError("TurnTokens.start: the first prompt has no tokens")
        return cls(parts=[(list(map(int, prompt_ids)), [])])

    def context(self) -> list[int]:
        """The current part's tokens: its prompt and every segment (what the policy continues next)."""
        prompt, segments = self.parts[-1]
        return prompt + [int(t) for seg, _, _ in segments for t in seg]

    def add_reply(self, tokens, logprobs) -> None:
        """A sampled turn (tokens int, logprobs float, same length; raises ValueError otherwise)."""
        tokens, logprobs = np.asarray(tokens, np.int32), np.asarray(logprobs, np.float32)
        if tokens.shape != logprobs.shape or tokens.ndim != 1:
            raise ValueError(f"add_reply: tokens {tokens.shape} and logprobs {logprobs.shape} must be equal 1-D")
        self.parts[-1][1].append((tokens, logprobs, True))

    def next_prompt(self, rendered_ids: Sequence[int]) -> list[int]:
        """Takes the next turn's rendered prompt (a masked bridge, or a new part on a break); returns it."""
        rendered = list(map(int, rendered_ids))
        ctx = self.context()
        if extends(ctx, rendered):
            if len(rendered) > len(ctx):
                bridge = np.asarray(rendered[len(ctx):], np.int32)
                self.parts[-1][1].append((bridge, np.zeros(len(bridge), np.float32), False))
            return rendered
        self.breaks += 1
        self.parts.append((rendered, []))
        return rendered

    def to_samples(self, episode: Sample) -> list[Sample]:
        """One `Sample` per part holding a sampled turn, each with `episode`'s group, reward and flags."""
        out = []
        for prompt, segments in self.parts:
            while segments and not segments[-1][2]:  # a trailing bridge trains nothing
                segments = segments[:-1]
            if any(pol for _, _, pol in segments):
                out.append(dataclasses.replace(episode, prompt_ids=list(prompt), segments=list(segments),
                                               texts=[], routing=None))
        return out


def break_metrics(records: Sequence[TurnTokens]) -> dict[str, float]:
    """rollout/extension_breaks: breaks summed over the episodes' records."""
    return {"rollout/extension_breaks": float(sum(r.breaks for r in records))}
