"""Records tests/golden/smollm2_greedy_200.npz: transformers' greedy replies to the quickstart's 200 held-out prompts.

    .venv/bin/python scripts/record_greedy_fixture.py [--out tests/golden/smollm2_greedy_200.npz] [--batch 50]

The fixture of issue 25 acceptance 1 ("greedy tokens equal the recorded fixture on >= 199 of 200 prompts, any
difference at a top-2 logit gap < 1e-4"; tests/posttrain/generate/test_engine_fixture.py compares the engine).
Prompts: configs/quickstart.py's eval env (posttrain/Arithmetic-v0, split "test", digits 2: its 200 fixed tasks),
each task's first observation rendered as the training and eval rollouts render it (`episodes.chat_prompt`:
the GGUF's chat template, no system turn), token ids from posttrain's tokenizer. Replies: the peer, independent of
posttrain's model code: `transformers.AutoModelForCausalLM.from_pretrained(<dir>, gguf_file=<SmolLM2-135M-Instruct
GGUF>)` (the same dequantized weights), float32 on the CPU, `generate(do_sample=False,
max_new_tokens=24, eos_token_id=<the tokenizer's stop ids>)` (the quickstart's eval budget), prompts batched by
equal length (no padding, so no attention mask enters the numbers), each reply cut after its first stop token.
Each generated token also records its step's top-2 logit gap (largest minus second-largest raw logit, float32).

File (np.savez_compressed, ~20 KB): prompt_ids / reply_ids int32 (all prompts / replies concatenated),
prompt_offsets / reply_offsets int64 [201] (row i is ids[offsets[i]:offsets[i+1]]), gap float32 (aligned with
reply_ids), max_new_tokens, stop_ids int32, task_ids (str), versions (str: transformers, torch, model file).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

DEFAULT_OUT = ROOT / "tests" / "golden" / "smollm2_greedy_200.npz"


def quickstart_prompts(tokenizer) -> tuple[list[str], list[list[int]]]:
    """(task ids, prompt token ids) of configs/quickstart.py's eval env, rendered as its rollouts render them."""
    import gymnasium

    import envs  # noqa: F401  (registers posttrain/*-v0)
    from configs.quickstart import get_config
    from posttrain.rollout.episodes import chat_prompt

    spec = get_config().env.eval["arithmetic"]
    env = gymnasium.make(spec.id, **spec.kwargs.to_dict()).unwrapped
    ids, prompts = [], []
    for i in range(env.task_source.num_tasks):
        observation, info = env.reset(options={"task": env.task_source.get_task(i)})
        ids.append(info["task_id"])
        prompts.append(chat_prompt(tokenizer, observation, "", info))
    return ids, prompts


def pack(rows) -> tuple[np.ndarray, np.ndarray]:
    """(concatenated int32 ids, int64 offsets [n + 1]) of ragged rows."""
    offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    flat = np.concatenate([np.asarray(r, np.int32) for r in rows]) if rows else np.zeros((0,), np.int32)
    return flat, offsets


def unpack(flat: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """The rows of `pack`."""
    return [flat[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def generate(model_path: pathlib.Path, prompts, stop_ids, max_new_tokens: int, batch: int):
    """(replies, gaps) from transformers' greedy `generate`, batched by equal prompt length (see the module doc)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                              dtype=torch.float32).eval()
    replies, gaps = [None] * len(prompts), [None] * len(prompts)
    t0 = time.perf_counter()
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for rows in by_len.values():
        for s in range(0, len(rows), batch):
            idx = rows[s:s + batch]
            ids = torch.tensor([prompts[i] for i in idx])
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids),
                                     pad_token_id=int(stop_ids[0]), return_dict_in_generate=True,
                                     output_logits=True)
            logits = torch.stack(out.logits, 1).float()  # [B, steps, V]
            top2 = logits.topk(2, dim=-1).values
            gap = (top2[..., 0] - top2[..., 1]).numpy()
            new = out.sequences[:, ids.shape[1]:].tolist()
            print(f"  {len(idx)} prompts of {ids.shape[1]} tokens: {time.perf_counter() - t0:.1f} s", flush=True)
            for j, i in enumerate(idx):
                reply = []
                for t in new[j]:
                    reply.append(int(t))
                    if t in stop_ids:
                        break
                replies[i], gaps[i] = reply, gap[j, :len(reply)].astype(np.float32)
    return replies, gaps


def main(argv=None) -> pathlib.Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--batch", type=int, default=50, help="prompts per generate call (equal lengths only)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    import torch
    import transformers

    from posttrain.checkpoints.gguf import default_model_path
    from posttrain.checkpoints.load import load_pretrained

    if args.threads:  # torch's OpenMP threads slow down badly on a loaded machine
        torch.set_num_threads(args.threads)
    model_path = pathlib.Path(default_model_path())
    tokenizer = load_pretrained(model_path).tokenizer
    task_ids, prompts = quickstart_prompts(tokenizer)
    stop_ids = tuple(int(s) for s in tokenizer.stop_ids)
    t = time.perf_counter()
    replies, gaps = generate(model_path, prompts, stop_ids, args.max_new_tokens, args.batch)
    seconds = time.perf_counter() - t
    prompt_ids, prompt_offsets = pack(prompts)
    reply_ids, reply_offsets = pack(replies)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    np.savez_compressed(args.out, prompt_ids=prompt_ids, prompt_offsets=prompt_offsets, reply_ids=reply_ids,
                        reply_offsets=reply_offsets, gap=np.concatenate(gaps), max_new_tokens=args.max_new_tokens,
                        stop_ids=np.asarray(stop_ids, np.int32), task_ids=np.asarray(task_ids),
                        versions=np.asarray([f"transformers {transformers.__version__}",
                                             f"torch {torch.__version__}", model_path.name]))
    g = np.concatenate(gaps)
    print(f"{args.out}: {len(prompts)} prompts, {len(reply_ids)} reply tokens, {seconds:.1f} s; top-2 gap min "
          f"{g.min():.3g}, steps with gap < 1e-4: {int((g < 1e-4).sum())}, < 1e-2: {int((g < 1e-2).sum())}; "
          f"{os.path.getsize(args.out)} bytes")
    return pathlib.Path(args.out)


if __name__ == "__main__":
    main()
