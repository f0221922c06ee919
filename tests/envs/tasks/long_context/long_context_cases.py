"""Task generation shared by the long-context tests: every family's task maker, by name."""
import random

from envs.tasks.long_context import codebase, doc_questions, lengths, synthetic

FAMILIES = {"doc_analysis": (doc_questions.make_task, doc_questions.TYPES),
            "synthetic": (synthetic.make_task, synthetic.TYPES),
            "codebase": (codebase.make_task, codebase.TYPES)}


def generate(family, n, target_tokens, count_tokens=lengths.approx_tokens, *, split="test", depth=None, seed=0,
             start=0):
    """Tasks `start`..`start + n - 1` of a split as `env.GeneratedTasks` makes them, with any token counter."""
    make, types = FAMILIES[family]
    tasks = []
    for i in range(start, start + n):
        task_seed = lengths.task_seed(split, i, seed)
        d = random.Random(f"depth:{task_seed}").random() if depth is None else depth
        tasks.append(make(task_seed, target_tokens=target_tokens, depth=d, count_tokens=count_tokens,
                          kind=types[i % len(types)]))
    return tasks
