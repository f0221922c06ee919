"""Multi-turn tool use: the policy may run fenced Python blocks in the sandbox (PythonTool-v0) before answering."""
from posttrain.config import default_config, env_spec


def get_config():
    c = default_config()
    c.train.machine = "cpu-1:24GB"      # the 2-core, 24 GB CPU machine
    c.env.max_turns = 3
    c.env.train = {"tool": env_spec("posttrain/PythonTool-v0", max_turns=c.env.max_turns)}  # the env's limit too
    c.env.eval = {}
    c.env.num_workers = 2
    c.rl.packed = False
    c.sampling.max_new_tokens = 256
    # 64 unpacked rows of up to 3 turns: with no remat and one microbatch the step's compiled peak is 60.0 GiB (the
    # OOM at the first update); saving matmul outputs only and 8 accumulation microbatches (8 rows each, the same
    # gradient) bring it to 7.0 GiB (`posttrain.runs.preflight`, 128 prompt tokens)
    c.model.remat = "dots"
    c.rl.num_microbatches = 8
    c.optim.lr = 1e-6
    c.train.steps = 100
    c.train.workdir = "runs/tool"
    return c
