"""posttrain environments: gymnasium text environments with verifiable rewards (no JAX here).

Importing this package registers every id in `ENTRY_POINTS` with gymnasium (idempotent), so
``gymnasium.make("posttrain/Arithmetic-v0")`` works after ``import envs``; docs/environments.md.
"""
import gymnasium

ENTRY_POINTS = {
    "posttrain/Arithmetic-v0": "envs.tasks.arithmetic:ArithmeticEnv",
    "posttrain/CodebaseQA-v0": "envs.tasks.long_context.env:CodebaseQAEnv",
    "posttrain/DocAnalysis-v0": "envs.tasks.long_context.env:DocAnalysisEnv",
    "posttrain/GSM8K-v0": "envs.tasks.gsm8k:GSM8KEnv",
    "posttrain/HumanEval-v0": "envs.tasks.humaneval:HumanEvalEnv",
    "posttrain/LongSynthetic-v0": "envs.tasks.long_context.env:LongSyntheticEnv",
    "posttrain/PythonTool-v0": "envs.tasks.python_tool:PythonToolEnv",
    "posttrain/ReasoningGym-v0": "envs.tasks.reasoning_gym:ReasoningGymEnv",
    "posttrain/RepoFix-v0": "envs.tasks.repo_fix.env:RepoFixEnv",
    "posttrain/RepoFixImpossible-v0": "envs.tasks.repo_fix.impossible:RepoFixImpossibleEnv",
    "posttrain/TaskFile-v0": "envs.tasks.task_file:TaskFileEnv",
    "posttrain/Terminal-v0": "envs.tasks.terminal:TerminalEnv",
}


def register_all() -> None:
    """Register every id in ENTRY_POINTS with gymnasium; ids already registered are left alone."""
    for env_id, entry_point in ENTRY_POINTS.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(env_id, entry_point=entry_point)


register_all()
