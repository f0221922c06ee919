"""configs/reasoning_mix.py with a small train task pool per domain, so that a 20-minute run revisits its tasks and
the pass-rate band (issue 23 item 4, `posttrain.scheduling.stats`) has something to skip (issue 23 acceptance 4).

reasoning_mix draws from 10,000 train tasks per domain: the ~240 groups of its 20 training minutes never visit a
task twice, so the band (which skips a task whose last `tasks.band_visits` visits were all correct or all wrong)
never skips. Here each domain has `TRAIN_TASKS` train tasks (seed 0); everything else but train.steps is
reasoning_mix's: the same six domains, priorities and caps, step shape, 20-minute training budget, the same
held-out eval (30 test-split tasks per domain, greedy, never in any train split: `eval/<domain>/pass@1` and their
mean `eval/pass@1`, before and after training). The band is one flag, `tasks.band_visits` (`BAND_VISITS` here; 0
turns it off): a run with it and one without, at equal training wall time, compare `frac_zero_std_groups`
(metrics.jsonl, per step), the band's `tasks/skipped_frac` (the share of fresh draws it skipped; 0 without it)
and the held-out pass@1 at the end (the train command's last line: `eval_end`).

  band on:  posttrain train --config=configs/reasoning_mix_band.py --workdir=runs/mix_band --noprogress
  band off: posttrain train --config=configs/reasoning_mix_band.py --config.tasks.band_visits=0
            --workdir=runs/mix_noband --noprogress

The all-wrong side of the band has its own count: --config.tasks.band_fail_visits=0 skips only tasks whose last
visits all passed (-1, the default: band_visits for both sides).

One domain's pool: --config.env.train.reasoning_gym/chain_sum.kwargs.size=32 (domain keys are settable).
"""
import importlib.util
import pathlib

TRAIN_TASKS = 8    # per domain. An estimate, not a measurement: at reasoning_mix's ~19 s a step on 2 cores (60 steps
# in 1150 s) and about twice that on one core (two runs side by side, one pinned per core), ~30 steps of 4 groups
# give each domain ~20-26 groups (the arithmetic three 0.6 a step, the others ~0.7), so each of 8 tasks is visited
# ~3 times and the band acts from its second visit on; at 16 tasks most would be visited once or twice
BAND_VISITS = 1    # skip a task after one visit whose 8 samples all passed or all failed (10% re-checked)


def _reasoning_mix():
    path = pathlib.Path(__file__).with_name("reasoning_mix.py")
    spec = importlib.util.spec_from_file_location("reasoning_mix", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def get_config():
    c = _reasoning_mix().get_config()
    for spec in c.env.train.values():
        spec.kwargs.size = TRAIN_TASKS
    c.tasks.band_visits = BAND_VISITS
    c.train.steps = 200  # more than 20 minutes hold (~30-60), so train.max_train_seconds (1150) ends both runs at
    # equal training wall time; the cosine schedule spans these 200 steps (lr >= ~0.8 of its peak by step 60)
    c.train.workdir = "runs/reasoning_mix_band"
    return c
