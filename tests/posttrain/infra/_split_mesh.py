"""Split meshes on 8 fake CPU devices (run by test_reshard.py in a subprocess; XLA_FLAGS set by the caller): the
tiny model's sampler on a 2-device rollout submesh (tensor 2) fed by the rollout queue's weight transfer from the
6-device learner mesh (data 3 x fsdp 2), against the unsplit sampler on all 8 devices (fsdp 8), two policy
versions; the resharded params; the transfer bytes; and `posttrain plan` of the split topology. Writes one JSON
object to argv[1]."""
import dataclasses
import functools
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # tests/: helpers

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from helpers import random_model, tiny_config  # noqa: E402
from posttrain.infra import mesh as mesh_lib, reshard  # noqa: E402
from posttrain.infra.partitioning import use_rules  # noqa: E402
from posttrain.model.tokenizer import Tokenizer  # noqa: E402
from posttrain.recipes import plan  # noqa: E402
from posttrain.config.plan import make_run_plan  # noqa: E402
from posttrain.rollout.queue import RolloutQueue  # noqa: E402
from posttrain.rollout.rollouter import Rollouter  # noqa: E402

BATCH = {"rl.prompts_per_step": 6, "rl.packed": False}  # 24 rows: they split over 6 and over 8 devices
SPLIT = {"mesh.rollout": 2, "mesh.data": 3, **BATCH}  # learner 6 = data 3 x fsdp 2, rollout 2 = tensor 2


@dataclasses.dataclass(frozen=True)
class Traj:
    records: tuple
    oldest_version: int | None = None  # `Trajectories.oldest_version`: None, no partial rollouts here


class Producer:
    """What the queue drives (`Rollouter.collect`'s contract): one real `Rollouter.sample_fn` call per step."""

    def __init__(self, rollouter, prompts, lengths, devices):
        self.r, self.prompts, self.lengths, self.devices = rollouter, prompts, lengths, devices
        self.settings, self.on_rollout = rollouter.settings, []

    def collect(self, step, policy, rng, policy_version=None, gate=None):  # no gate: split meshes
        self.on_rollout.append(reshard.on_devices((policy, rng), self.devices))
        return Traj((sample(self.r, policy, rng, step, self.prompts, self.lengths),))

    def state_dict(self):
        return {}

    def status(self, step, version):
        return {}


def sample(rollouter, policy, rng, step, prompts, lengths):
    st = rollouter.settings
    out = rollouter.sample_fn(policy, st.sampling_config.params())(prompts, lengths, jax.random.fold_in(rng, step),
                                                                  st.objective.group_size)
    return {"tokens": np.asarray(out.tokens_NxLg).tolist(), "logp": np.asarray(out.logp_NxLg).tolist()}


def main(out_path):
    work = tempfile.mkdtemp()
    split_cfg, full_cfg = tiny_config(work, **SPLIT), tiny_config(work, **BATCH)
    split, full = make_run_plan(split_cfg), make_run_plan(full_cfg)
    learner, rollout = mesh_lib.split_meshes(split.mesh_shape, split.rollout_mesh_shape)
    everything, _ = mesh_lib.split_meshes(full.mesh_shape, None)
    _, graphdef, state = random_model("tiny-dense", vocab_size=320)
    v0 = (state,)
    v1 = jax.tree.map(lambda x: x * 1.01, v0)  # the next policy version
    tok = Tokenizer.byte_level()
    make = functools.partial(Rollouter, graphdef=graphdef, tokenizer=tok, runner=None, scheduler=None,
                             train_specs={}, advantage_fn=None)
    rng = np.random.default_rng(0)
    P, Lp = split.config.rl.prompts_per_step, 8
    prompts = rng.integers(3, 300, (P, Lp)).astype(np.int32)
    lengths = rng.integers(2, Lp + 1, P).astype(np.int32)
    put = lambda tree, mesh: jax.device_put(tree, mesh_lib.state_shardings(tree, mesh, split.rules))
    key = jax.random.key(0)
    with use_rules(split.rules):
        ref = make(settings=full.rollout_settings, mesh=everything)  # unsplit: the sampler on all 8, learner layout
        unsplit = [sample(ref, put(v, everything), key, s, prompts, lengths) for s, v in enumerate((v0, v1))]
        producer = Producer(make(settings=split.rollout_settings, mesh=rollout), prompts, lengths, set(rollout.devices.flat))
        learner_key = jax.device_put(key, NamedSharding(learner, PartitionSpec()))
        on_learner = put(v1, learner)
        q = RolloutQueue(producer, start=0, steps=2, policy=put(v0, learner), rng=learner_key,
                         sync=functools.partial(reshard.onto, mesh=rollout, rules=split.rules))
        b0, _ = q.get(0)
        (synced, synced_key), sync_s = q.snapshot(on_learner, learner_key)
        q.publish(1, (synced, synced_key))
        b1, _ = q.get(1)
        q.close()
    shardings = mesh_lib.state_shardings(on_learner, rollout, split.rules)
    report = plan.plan_train_step(split_cfg, "cpu-8", prompt_len=16)
    leaves = jax.tree_util.tree_leaves_with_path(synced)
    result = {
        "learner_mesh": dict(learner.shape), "rollout_mesh": dict(rollout.shape),
        "learner_devices": sorted(d.id for d in learner.devices.flat),
        "rollout_devices": sorted(d.id for d in rollout.devices.flat),
        "tokens_equal": [b.trajectories.records[0]["tokens"] == u["tokens"] for b, u in zip((b0, b1), unsplit)],
        "logp_max_diff": max(float(np.abs(np.subtract(b.trajectories.records[0]["logp"], u["logp"])).max())
                             for b, u in zip((b0, b1), unsplit)),
        "producer_on_rollout": producer.on_rollout, "sync_s": sync_s,
        "params_equal": all(np.array_equal(np.asarray(a), np.asarray(b))
                            for a, b in zip(jax.tree.leaves(synced), jax.tree.leaves(on_learner))),
        "synced_on_rollout": reshard.on_devices((synced, synced_key), rollout.devices.flat),
        "specs": {jax.tree_util.keystr(p): [a if a is None or isinstance(a, str) else list(a) for a in x.sharding.spec]
                  for p, x in leaves},
        "shard_shapes": {jax.tree_util.keystr(p): list(x.addressable_shards[0].data.shape) for p, x in leaves},
        "leaves": {jax.tree_util.keystr(p): [list(x.shape), str(x.dtype)] for p, x in leaves},
        "transfer_bytes": reshard.transfer_bytes(on_learner, shardings, learner.devices.flat),
        "transfer_bytes_same_devices": reshard.transfer_bytes(
            on_learner, mesh_lib.state_shardings(on_learner, learner, split.rules), learner.devices.flat),
        "same_devices_untouched": reshard.onto(on_learner, learner) is on_learner,
        "plan": {k: v for k, v in report.items() if k != "largest_buffers"},
    }
    pathlib.Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
