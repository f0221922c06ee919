"""RolloutBatch assembly from sampled episodes: packed rows (a prompt then its G completions, each attending to the
prompt and itself) or one sample per row, advantages and metrics. Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from posttrain.rollout.episodes import Sample
from posttrain.types import RolloutBatch


def _round_up(x: int, m: int) -> int:
    return max(m, -(-x // m) * m)


# (rewards_N float32, valid_N bool, group_size) -> an object with `.advantages` (float32 [N]) and `.zero_std_P`
# (bool [P]: groups without signal); samples of a group are contiguous
AdvantageFn = Callable[[np.ndarray, np.ndarray, int], Any]


def sample_arrays(samples: Sequence[Sample], advantage_fn: AdvantageFn, *, group_size: int, overlong_filter: bool):
    """Per-sample rewards, validity, advantages, per-group zero-std flags, and policy-token flags (numpy)."""
    rewards = np.asarray([s.reward for s in samples], np.float32)
    valid = np.asarray([s.counts and s.completion_len > 0 for s in samples])
    adv = advantage_fn(rewards, valid, group_size)
    advantages = np.asarray(adv.advantages, np.float32)
    policy_ok = valid & ~(overlong_filter & np.asarray([s.truncated for s in samples]))
    return rewards, valid, advantages, np.asarray(adv.zero_std_P), policy_ok


def assemble(samples: Sequence[Sample], advantage_fn: AdvantageFn, *, group_size: int, pad_id: int = 0,
             packed: bool = True, overlong_filter: bool = False, prompt_bucket: int = 16,
             completion_bucket: int = 8, row_bucket: int = 32, row_multiple: int = 1) -> tuple[RolloutBatch, dict]:
    """Builds the (numpy) RolloutBatch, rows padded to a multiple of `row_multiple`, and the rollout metrics.

    Raises ValueError when the samples are not complete contiguous groups of `group_size`."""
    G = group_size
    if len(samples) % G or any(samples[i].group != samples[i - i % G].group for i in range(len(samples))):
        raise ValueError(f"{len(samples)} samples are not complete contiguous groups of {G}")
    rewards, valid, advantages, zero_std, policy_ok = sample_arrays(
        samples, advantage_fn, group_size=G, overlong_filter=overlong_filter)
    single_turn = all(len(s.segments) == 1 for s in samples)
    C = _round_up(max(s.completion_len for s in samples), completion_bucket)
    if packed and single_turn:
        arrays = _packed(samples, G, C, pad_id, prompt_bucket, row_bucket)
    else:
        arrays = _unpacked(samples, C, pad_id, prompt_bucket)
    arrays["loss_mask_NxC"] &= policy_ok[:, None]
    n_extra_rows = (-arrays["tokens_RxL"].shape[0]) % row_multiple
    spr = len(samples) // arrays["tokens_RxL"].shape[0]
    per_sample = {"advantages_N": advantages, "rewards_N": rewards, "valid_N": valid,
                  "truncated_N": np.asarray([s.truncated for s in samples]),
                  "group_id_N": np.asarray([s.group for s in samples], np.int32)}
    arrays.update(per_sample)
    if n_extra_rows:
        arrays = {k: _pad_rows(v, n_extra_rows * (spr if k.endswith(("_NxC", "_N")) else 1),
                               -1 if k == "routed_experts_RxLxLmxk" else 0) for k, v in arrays.items()}
    return RolloutBatch(**arrays), rollout_metrics(samples, rewards, zero_std, G)


def _pad_rows(x, n, fill=0):
    """Appends n rows of `fill` (0: segment 0 (padding), no loss mask, invalid, advantage 0; -1: no replay)."""
    return np.concatenate([x, np.full((n,) + x.shape[1:], fill, x.dtype)])


def _packed(samples, G, C, pad_id, prompt_bucket, row_bucket):
    """Packed rows: each prompt then its G completions back to back; width rounded to `row_bucket`."""
    P = len(samples) // G
    Lpb = _round_up(max(len(samples[p * G].prompt_ids) for p in range(P)), prompt_bucket)
    used = max(sum(len(samples[p * G + g].segments[0][0]) for g in range(G)) for p in range(P))
    L = min(Lpb + _round_up(used, row_bucket), Lpb + G * C)
    a = _empty(P, L, len(samples), C, pad_id)
    routed = _routed_experts(samples, P, L)
    for p in range(P):
        prompt = samples[p * G].prompt_ids
        lp = len(prompt)
        _put_routing(routed, p, 0, samples[p * G].routing, 0, lp)
        a["tokens_RxL"][p, :lp] = prompt
        a["positions_RxL"][p, :lp] = np.arange(lp)
        a["segment_ids_RxL"][p, :lp] = 1
        start = Lpb
        for g in range(G):
            n = p * G + g
            tokens, logp, _ = samples[n].segments[0]
            k = len(tokens)
            a["tokens_RxL"][p, start:start + k] = tokens
            a["positions_RxL"][p, start:start + k] = lp + np.arange(k)
            a["segment_ids_RxL"][p, start:start + k] = 1
            a["branch_ids_RxL"][p, start:start + k] = g + 1
            a["targets_NxC"][n, :k] = tokens
            a["score_pos_NxC"][n, :k] = np.concatenate([[lp - 1], start + np.arange(k - 1)]) if k else []
            a["loss_mask_NxC"][n, :k] = True
            a["logp_sample_NxC"][n, :k] = logp
            _put_routing(routed, p, start, samples[n].routing, lp, k)
            start += k
    if routed is not None:
        a["routed_experts_RxLxLmxk"] = routed
    return a


def _unpacked(samples, C, pad_id, prompt_bucket):
    N = len(samples)
    L = _round_up(max(len(s.prompt_ids) + s.completion_len for s in samples), prompt_bucket)
    a = _empty(N, L, N, C, pad_id)
    routed = _routed_experts(samples, N, L)
    for n, s in enumerate(samples):
        lp = len(s.prompt_ids)
        tokens = np.concatenate([s.prompt_ids] + [t for t, _, _ in s.segments]).astype(np.int32)
        a["tokens_RxL"][n, :len(tokens)] = tokens
        a["positions_RxL"][n, :len(tokens)] = np.arange(len(tokens))
        a["segment_ids_RxL"][n, :len(tokens)] = 1
        k = len(tokens) - lp
        a["targets_NxC"][n, :k] = tokens[lp:]
        a["score_pos_NxC"][n, :k] = lp - 1 + np.arange(k)
        a["loss_mask_NxC"][n, :k] = np.concatenate([np.full(len(t), pol) for t, _, pol in s.segments])
        a["logp_sample_NxC"][n, :k] = np.concatenate([lp_ for _, lp_, _ in s.segments])
        _put_routing(routed, n, 0, s.routing, 0, len(tokens))
    if routed is not None:
        a["routed_experts_RxLxLmxk"] = routed
    return a


def _routed_experts(samples, R, L):
    """The [R, L, Lm, k] routing-replay array, all -1 (route normally), when the samples carry routing."""
    ref = next((s.routing for s in samples if s.routing is not None), None)
    return None if ref is None else np.full((R, L) + ref.shape[1:], -1, np.int32)


def _put_routing(routed, row, start, routing, offset, n):
    """routed[row, start:start + n] = routing[offset:offset + n] (as far as `routing` reaches)."""
    if routed is not None and routing is not None:
        part = routing[offset:offset + n]
        routed[row, start:start + len(part)] = part


def _empty(R, L, N, C, pad_id):
    return {"tokens_RxL": np.full((R, L), pad_id, np.int32), "positions_RxL": np.zeros((R, L), np.int32),
            "segment_ids_RxL": np.zeros((R, L), np.int32), "branch_ids_RxL": np.zeros((R, L), np.int32),
            "targets_NxC": np.full((N, C), pad_id, np.int32), "score_pos_NxC": np.zeros((N, C), np.int32),
            "loss_mask_NxC": np.zeros((N, C), bool), "logp_sample_NxC": np.zeros((N, C), np.float32)}


def rollout_metrics(samples: Sequence[Sample], rewards, zero_std, group_size: int) -> dict:
    """reward/*, frac_zero_std_groups, response_length/*, env/*_rate (standard names: docs/design.md)."""
    lengths = np.asarray([sum(len(t) for t, _, pol in s.segments if pol) for s in samples], np.float32)
    m = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
         "frac_zero_std_groups": float(np.mean(zero_std)),
         "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
         "response_length/clip_ratio": float(np.mean([s.truncated for s in samples]))}
    for domain in sorted({s.domain for s in samples}):
        if domain:
            m[f"reward/{domain}/mean"] = float(np.mean([s.reward for s in samples if s.domain == domain]))
    statuses = [s.status for s in samples]
    for status in ("timeout", "infra_error", "runtime_error"):
        m[f"env/{status}_rate"] = statuses.count(status) / len(statuses)
    return m


def random_batch(seed: int, advantage_fn: AdvantageFn, *, prompts: int, group_size: int, prompt_len: int, completion_len: int,
                 vocab_size: int, packed: bool = True, row_multiple: int = 1) -> RolloutBatch:
    """A (numpy) RolloutBatch of random tokens with the real layout, for benchmarks, memory plans and tests."""
    rng = np.random.default_rng(seed)
    hi = max(2, vocab_size)
    samples = []
    for p in range(prompts):
        prompt = rng.integers(1, hi, prompt_len).astype(np.int32).tolist()
        for _ in range(group_size):
            toks = rng.integers(1, hi, completion_len).astype(np.int32)
            samples.append(Sample(domain="random", group=p, prompt_ids=prompt,
                                  segments=[(toks, -rng.random(completion_len).astype(np.float32), True)],
                                  reward=float(rng.random() < 0.3), status="ok", done=True))
    return assemble(samples, advantage_fn, group_size=group_size, packed=packed, row_multiple=row_multiple)[0]
