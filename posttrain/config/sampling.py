"""The `sampling` section of a run config: the training rollouts' distribution and lengths, and what samples
them (`sampling.backend`: the rollout engine on one device, the dense sampler on a sharded one; `posttrain.rollout
.engine_sampler` picks).

Kept beside `schema.py` (which imports it into `Config`); ranges and choices are checked at load
(`posttrain.config.load`, one ConfigError naming the key); `posttrain.runs.plan` builds the rollout phase's
`SamplingParams` and, for the engine, its `EngineSamplerSettings` from it.

Example (a config file, or `--config.sampling.backend=engine` on the command line)::

    c.sampling.backend = "engine"   # continuous batching over a paged KV cache, prefix reuse across turns
    c.sampling.engine_pages = 256   # a smaller pool than every slot at its longest: full pools preempt
"""
from __future__ import annotations

import dataclasses

SAMPLING_BACKENDS = ("auto", "engine", "dense")  # `sampling.backend`, checked at load


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """The `sampling` section: training rollouts.

    Attributes:
        max_new_tokens: completion tokens per turn.
        temperature: sampling temperature (0: greedy); also the trainer's logprob temperature.
        top_p: nucleus sampling mass (1: off).
        top_k: keep the k most likely tokens (0: off).
        prompt_bucket: prompt widths round up to a multiple of this (fewer compilations).
        system_prompt: a system turn before every prompt ("": none).
        decode_shrink_steps: drop finished rows from the decode batch up to this many times
            (`sampler.shrink_schedule`; 0: never). Pays off when a few completions run much longer than the rest;
            each width compiles its own decode loop. Dense sampler only (the engine refills a finished slot).
        backend: what samples the rollouts and evaluations, one of SAMPLING_BACKENDS: "engine" (`generate.engine.loop`:
            continuous batching over a paged KV cache with prefix reuse, `generate.backend`; one device),
            "dense" (`generate.sampler.sample`: one call per batch, a dense KV cache per row; any sampler mesh) or
            "auto": the engine when the sampler runs on one device and decode_shrink_steps is 0 (a dense-only
            knob), the dense sampler otherwise. Both record the same logprobs and MoE routing, draw the same
            tokens from a key (up to float rounding) and give equal greedy replies.
        engine_slots: the engine's sequences decoded together (0: rl.prompts_per_step x rl.group_size, a step's
            first-turn rows; a call with more requests queues them). Engine only, like the fields below.
        engine_pages: KV pages in the engine's pool, the scratch page included (0: every slot at engine_max_seq_len
            tokens, so nothing is ever preempted; fewer save memory, and a full pool preempts and recomputes).
        engine_page_size: tokens per KV page.
        engine_max_seq_len: the longest prompt + reply the engine holds, in tokens (0: sized by the longest request
            seen, rounded up to engine_page_size x a power of two; a longer one later builds a bigger engine, a
            new compile).
        engine_per_episode: multi-turn episodes run per episode (`rollout.per_episode`): an episode's next turn is
            queued as soon as its env step returns, instead of after every episode's turn. Needs
            engine_max_seq_len > 0, the longest context an episode may reach (one engine holds every turn); a
            turn that would not fit ends its episode as truncated.
        engine_env_overlap: per episode, decode chunks an episode's env step may overlap (0: the env steps
            inside the engine's loop while the other episodes wait; > 0: on a thread of its own, and the next
            turn is queued exactly that many decode chunks after the reply ended, waiting for the env then if it
            is slower, so runs are reproducible whatever the env's timing). Set it near env step seconds /
            decode chunk seconds. Needs engine_per_episode.
        engine_decode_chunk: decode steps per device program, K (0: 8 on GPU / TPU, 1 on the CPU; >= 0). The
            host admits requests, preempts and swaps weights between chunks, so K > 1 saves its per-step work
            (half an H200's decode time at qwen3-0.6b) and costs a finished slot up to K - 1 idle steps.
            Tokens and logprobs do not depend on it.
    """

    max_new_tokens: int = 24
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    prompt_bucket: int = 16
    system_prompt: str = ""
    decode_shrink_steps: int = 0
    backend: str = "auto"
    engine_slots: int = 0
    engine_pages: int = 0
    engine_page_size: int = 16
    engine_max_seq_len: int = 0
    engine_per_episode: bool = False
    engine_env_overlap: int = 0
    engine_decode_chunk: int = 0
