"""The base of the tiny smoke configs (configs/tiny.py and others, the tests' `tiny_config`): seconds on a CPU."""
from posttrain.config.load import default_config, env_spec


def tiny_base(preset: str = "tiny-dense", workdir: str = "runs/tiny"):
    """The ConfigDict of a tiny run of `preset` (a `posttrain.model.presets` name), written to `workdir`.

    A 320-id vocabulary, one-digit Arithmetic-v0, 4 prompts x 4 samples of up to 8 tokens, 3 steps, no pre-flight."""
    c = default_config()
    c.model.preset = preset
    c.model.overrides = {"vocab_size": 320}
    c.env.train = {"arithmetic": env_spec("posttrain/Arithmetic-v0", split="train", digits=1, num_test=20)}
    c.env.eval = {"arithmetic": env_spec("posttrain/Arithmetic-v0", split="test", digits=1, num_test=20)}
    c.rl.group_size = 4
    c.rl.prompts_per_step = 4
    c.sampling.max_new_tokens = 8
    c.optim.lr = 1e-3
    c.eval.num_tasks = 20
    c.eval.max_new_tokens = 8
    c.train.steps = 3
    c.train.workdir = workdir
    c.checkpoint.every_steps = 2
    c.train.machine = "cpu-1:24GB"
    c.train.preflight_prompt_len = 0  # a tiny step fits any host, and the check's compile would double a tiny run's
    # start-up (the slow test of tests/posttrain/recipes/test_preflight.py checks that the tiny configs fit)
    return c
