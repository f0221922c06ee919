"""Effective context length (RULER-style): each long-context family scored greedily at every length bucket.

Domains `<family>@<bucket>`; a bucket whose prompts, reply and chat template exceed the model's positions is listed
as skipped. Prompt lengths are counted by TOKENIZER ("": 4 characters a token; a tokenizer.json path: its tokens).
The report (context_length.json / .md, context_heatmap.png) and its rules: docs/evaluation.md.

Run: posttrain eval --suite=configs/eval/long_context.py --checkpoint=RUN --baseline=base
"""
FAMILIES = {"doc_analysis": "posttrain/DocAnalysis-v0", "synthetic": "posttrain/LongSynthetic-v0",
            "codebase": "posttrain/CodebaseQA-v0"}
BUCKETS = {**{f"{k}k": k << 10 for k in (1, 2, 4, 8, 16, 32, 64, 128)}, "1M": 1 << 20}
TOKENIZER = ""
LONG = 8 << 10  # from this bucket on, 15 tasks a bucket (generation and sampling grow with the length)


def get_suite():
    return {
        "name": "long_context",
        "alpha": 0.05,
        # 32 new tokens: the longest gold reply, a variable-tracking list in <answer> tags, is 28 of SmolLM2's tokens
        "defaults": {"split": "test", "temperature": 0.0, "max_new_tokens": 32, "scorer": "env",
                     "format": "answer_tag"},
        "areas": {family: {"domains": {
            f"{family}@{label}": {"env": env_id, "kwargs": {"target_tokens": tokens, "tokenizer": TOKENIZER},
                                  "tasks": 30 if tokens < LONG else 15}
            for label, tokens in BUCKETS.items()}} for family, env_id in FAMILIES.items()},
    }
