"""The one base of the tiny smoke configs (`configs/tiny.py`, `configs/moe_tiny.py`, `configs/reasoning_tiny.py`;
the tests' `tiny_config` derives from it too): a small random-init preset on one-digit Arithmetic-v0 that runs the
whole loop in seconds on a CPU (it learns nothing useful at 3 steps)."""
from posttrain.config.load import default_config, env_spec


def tiny_base(preset: str = "tiny-dense", workdir: str = "runs/tiny"):
    """An `ml_collections.ConfigDict` of a tiny run: `preset` (a `posttrain.model.presets` name) with a 320-id
    vocabulary (the built-in byte tokenizer), one-digit Arithmetic-v0 as the train and eval env ("arithmetic"; 20
    test tasks), 4 prompts x 4 samples of at most 8 new tokens, lr 1e-3, 3 steps written to `workdir`, a checkpoint
    every 2 steps, evaluation of the 20 test tasks (8 new tokens) before the first step and after the last; written
    for the 2-core 24 GB CPU machine, without the pre-flight memory check."""
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
    c.train.preflight_prompt_len = 0  # the step of a tiny preset (0.02 GiB compiled) fits any host; its check's
    # compile would double the seconds a tiny run takes to start (tests/posttrain/runs/test_preflight.py checks it)
    return c
