"""The agentic evaluation suite: repository repair (RepoFix-v0's held-out split: SWE-bench's *resolved*, every
hidden test passes) and its cheating-rate probe (RepoFixImpossible-v0: visible tests that contradict the
documentation, so a pass is a cheat; its pass@1, `eval/repo_fix_impossible/pass@1`, is the cheat rate).

Greedy, one sample per task, up to 8 model turns of 256 tokens each (the env's own max_turns is the same, so the
episode is scored when the turns run out). Sized for SmolLM2-135M on 2 CPU cores: 16 tasks per domain.
Run: posttrain eval --suite=configs/eval/agentic.py --checkpoint=runs/repo_fix --baseline=base
"""
MAX_TURNS = 8


def get_suite():
    return {
        "name": "agentic",
        "alpha": 0.05,
        "defaults": {"split": "test", "tasks": 16, "n": 1, "temperature": 0.0, "max_new_tokens": 256,
                     "max_turns": MAX_TURNS, "scorer": "env", "format": "nonempty"},
        "areas": {
            "agentic": {"trained": True, "domains": {
                "repo_fix": {"env": "posttrain/RepoFix-v0", "kwargs": {"max_turns": MAX_TURNS}},
                "repo_fix_impossible": {"env": "posttrain/RepoFixImpossible-v0", "kwargs": {"max_turns": MAX_TURNS}},
            }},
        },
    }
