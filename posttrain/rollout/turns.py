"""The extension property of multi-turn samples and the rule that splits a sample where it breaks (issue 25 item 5).

Dimension legend: n tokens of a sample so far, m tokens of a rendered next prompt.

A multi-turn episode is trained as one sample (prompt, then reply / bridge / reply ... segments, the bridges
masked) only if every next prompt *extends* the tokens before it exactly: the prompt the policy continues at turn
k + 1 must begin with the very tokens it saw and produced up to turn k (prime-rl's "extension property"). Two
ways to build the next prompt:
  * token append (`episodes.run_episodes`, `chat.bridge_text`): the reply's tokens are kept as sampled and only
    the template's text after them is rendered; the property holds by construction, and `assert_extends` checks
    it at every turn (a failure is a bug, an AssertionError);
  * re-rendering the whole conversation through the chat template (envs that return message lists, tool results
    rendered as the template wants): the template may render earlier turns differently from how they were
    sampled. Observed kinds (the table in tests/posttrain/rollout/test_turns.py): Qwen3's template drops the
    `<think>` block of assistant turns before the last user query and rewrites its whitespace after it; templates
    that `trim` message content drop a reply's trailing whitespace; text that encodes to other tokens than the
    model produced. Tool results appended after a reply extend it.

The split rule (`TurnTokens.next_prompt`): where the rendered next prompt extends the sample's tokens, the new
tokens are appended as a masked bridge segment; where it does not (an *extension break*, counted in
`rollout/extension_breaks`), the sample so far is closed as it is (its prompt and segments are exactly what the
policy saw and produced, so its logprobs stay exact) and a new part of the same episode starts whose prompt is the
whole rendered next prompt (all of it masked, as a prompt is); later turns go to the new part. Every part keeps
the episode's group and gets the episode's reward (`to_samples`), so a break never trains a token the policy did
not produce in the context it produced it. Sources: prime-rl's multi-turn samples (merge only on the extension
property), TRL #5224 and rllm PR #272 (re-rendering between turns changing the trained tokens).
"""
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
    """The token-append path's check: raises AssertionError naming the first differing position when next_m does
    not extend previous_n."""
    if not extends(previous_n, next_m):
        n = min(len(previous_n), len(next_m))
        first = next((i for i in range(n) if previous_n[i] != next_m[i]), n)
        raise AssertionError(f"{where or 'next prompt'} does not extend the sample's {len(previous_n)} tokens: "
                             f"first difference at token {first} (next prompt has {len(next_m)})")


@dataclasses.dataclass
class TurnTokens:
    """One episode's token record across turns whose next prompts are rendered through the chat template (the
    split rule of the module doc). parts: [(prompt ids, segments)], segments as `episodes.Sample.segments`
    ((tokens int32, logp float32, is_policy)); breaks: extension breaks so far."""

    parts: list = dataclasses.field(default_factory=list)
    breaks: int = 0

    @classmethod
    def start(cls, prompt_ids: Sequence[int]) -> TurnTokens:
        """The record of an episode whose first prompt is `prompt_ids`. Raises ValueError when it is empty."""
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
        """Takes the next turn's prompt as rendered through the chat template; returns what the policy continues
        (the current part's context after the rule). Extension: the new tokens become a masked bridge segment.
        Break: counted, a new part starts with `rendered_ids` as its prompt."""
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
        """One `Sample` per part that holds a sampled turn, each with the episode's domain, group, reward,
        status, done / truncated flags and info (texts and routing left to the caller)."""
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
