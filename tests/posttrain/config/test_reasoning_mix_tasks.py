"""configs/reasoning_mix.py's task scheduling (issue 23 acceptance 6): the config loads into a run plan with the job
scheduler on, the arithmetic domains first up to their cap, a floor for every domain, exact counts over 200 steps
of a fake runner; an env.domains selection drops the policies of the domains it leaves out."""
import importlib.util
import pathlib
import sys

import pytest

from posttrain.config import from_config_dict, to_dict
from posttrain.config.plan import make_run_plan
from posttrain.scheduling.scheduler import JobScheduler
from posttrain.scheduling.domain_rules import resolve_policies

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scheduling"))
from scheduler_fakes import FakeRunner, Source  # noqa: E402

CONFIG = pathlib.Path(__file__).resolve().parents[3] / "configs" / "reasoning_mix.py"
STEPS = 200


@pytest.fixture(scope="module")
def mix():
    spec = importlib.util.spec_from_file_location("reasoning_mix", CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, from_config_dict(module.get_config())


def test_the_plan_has_priorities_caps_and_floors(mix, tmp_path):
    module, cfg = mix
    plan = make_run_plan(cfg, workdir=str(tmp_path / "run"))
    names = sorted(cfg.env.train)
    policies = resolve_policies(names, plan.scheduler.policies)
    arithmetic = {n for n in names if n.split("/")[1] in module.ARITHMETIC}
    assert arithmetic and arithmetic != set(names) and cfg.tasks.enabled
    for n in names:
        p = policies[n]
        assert (p.priority, p.max_share, p.min_share) == ((1, 0.15, 0.05) if n in arithmetic else (0, 1.0, 0.05))
    assert not (tmp_path / "run").exists()  # a plan writes nothing

    sched = JobScheduler({n: Source(50, n) for n in names}, plan.scheduler)
    P = cfg.rl.prompts_per_step
    groups = {n: 0 for n in names}
    for log in FakeRunner(sched, seed=0).run(STEPS, P):
        for t in log.tickets:
            groups[t.domain] += 1
    assert sum(groups.values()) == STEPS * P
    for n in arithmetic:  # filled first: the cap binds, exactly floor(steps x P x max_share)
        assert groups[n] == int(STEPS * P * 0.15)
    rest = (STEPS * P - sum(groups[n] for n in arithmetic)) / (len(names) - len(arithmetic))
    for n in set(names) - arithmetic:  # the others share the rest by weight (1 each), above the floor
        assert abs(groups[n] - rest) < 1 and groups[n] >= int(STEPS * P * 0.05)


def test_a_domain_selection_drops_the_policies_of_left_out_domains(mix):
    module, cfg = mix
    others = sorted(n for n in cfg.env.train if n.split("/")[1] not in module.ARITHMETIC)
    raw = to_dict(cfg)
    raw["env"]["domains"] = others[0]
    cut = from_config_dict(raw)
    assert sorted(cut.env.train) == [others[0]] and dict(cut.tasks.policies) == {"reasoning_gym/*": {"min_share": 0.05}}


def test_the_band_variant_revisits_a_small_pool_and_its_band_skips(mix):
    """configs/reasoning_mix_band.py (issue 23 acceptance 4): reasoning_mix with TRAIN_TASKS train tasks per domain
    and the band on, nothing else changed but train.steps; over 35 steps of a fake runner (tasks solved always,
    never, or half the time) the band skips draws and lowers the zero-variance groups, and band_visits=0 skips none."""
    _, base = mix
    spec = importlib.util.spec_from_file_location("reasoning_mix_band", CONFIG.with_name("reasoning_mix_band.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = from_config_dict(module.get_config())
    assert {n: s.kwargs["size"] for n, s in cfg.env.train.items()} == dict.fromkeys(base.env.train, module.TRAIN_TASKS)
    assert cfg.tasks.band_visits == module.BAND_VISITS >= 1
    raw, want = to_dict(cfg), to_dict(base)
    for d in (raw, want):
        d["tasks"].pop("band_visits"), d["train"].pop("workdir"), d["train"].pop("steps")
        for s in d["env"]["train"].values():
            s["kwargs"].pop("size")
    assert raw == want
    zero_std, skipped = {}, {}
    for band in (module.BAND_VISITS, 0):
        raw = to_dict(cfg)
        raw["tasks"]["band_visits"] = band
        plan = make_run_plan(from_config_dict(raw), workdir="/nonexistent")
        sched = JobScheduler({n: Source(module.TRAIN_TASKS, n) for n in cfg.env.train}, plan.scheduler)
        runner = FakeRunner(sched, seed=0, pass_prob=lambda d, i, s: (0.0, 1.0, 0.5)[i % 3])
        logs, fracs = [], []
        for step in range(35):
            logs.append(runner.step(step, cfg.rl.prompts_per_step))
            fracs.append(sched.metrics()["tasks/skipped_frac"])
        groups = [{a.reward for a in log.attempts if a.ticket.ticket_id == t.ticket_id} for log in logs
                  for t in log.tickets]
        zero_std[band], skipped[band] = sum(len(g) == 1 for g in groups) / len(groups), sum(fracs) / len(fracs)
    assert skipped[0] == 0.0 and skipped[module.BAND_VISITS] > 0.1
    assert zero_std[module.BAND_VISITS] < zero_std[0] - 0.1, zero_std
