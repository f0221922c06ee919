"""Multi-turn tool use: the policy may run fenced Python blocks in the sandbox (PythonTool-v0) before answering."""
from posttrain.config import default_config, env_spec


def get_config():
    c = default_config()
    c.env.max_turns = 3
    c.env.train = {"tool": env_spec("posttrain/PythonTool-v0", max_turns=c.env.max_turns)}  # the env's limit too
    c.env.eval = {}
    c.env.num_workers = 2
    c.rl.packed = False
    c.sampling.max_new_tokens = 256
    c.optim.lr = 1e-6
    c.train.steps = 100
    c.train.workdir = "runs/tool"
    return c
