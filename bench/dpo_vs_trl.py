"""One DPO setting, two trainers: posttrain's `posttrain dpo` recipe vs TRL's `DPOTrainer`, seconds per step and
peak memory on this CPU (the setting, the data and how each figure is measured: bench/_offline_vs_trl.py).

    python bench/dpo_vs_trl.py --json            # SmolLM2-135M-Instruct (the default GGUF), 8 rows x 4 steps (minutes)
    python bench/dpo_vs_trl.py --json --quick    # seconds: a tiny random preset, 2 rows x 2 steps

DPO's reference logprobs are cached on both sides (posttrain: computed once before the first step; TRL:
precompute_ref_log_probs=True), and posttrain's SFT step on the same pairs (both replies as 2 x rows
conversations) is timed too: `dpo_over_sft_step` = the DPO step's seconds / that SFT step's.
Prints one JSON object: posttrain_step_s, trl_step_s, ratio (posttrain / TRL: below 1 is faster), peak RSS of
each side and peak_memory_ratio, tokens_per_step of each side, the settings.
"""
from __future__ import annotations

import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

import _offline_vs_trl as common  # noqa: E402


def main(argv=None) -> None:
    common.main(__file__, "dpo", __doc__.split("\n")[0], argv)


if __name__ == "__main__":
    main()
