"""Worker of test_parallel_start (torchrun, 2 gloo ranks): the data-parallel pieces of the warm start.

1. ``validation_success`` sums the ranks' success counts: with 5 states scored by a fixed rule (odd ids succeed),
   rank 0 rolls out 3 (2 successes) and rank 1 2 (1 success); both must report the global rate 3/5, not the mean
   of their rates (2/3 + 1/2) / 2 = 7/12.
2. ``sft_to_plateau`` with ``info``: each rank trains on its half of the windows; both ranks must take the same
   decisions and end with the same weights. Each rank saves its curve and weights to ``<out>/rank<r>.pt``.
"""

import sys
from pathlib import Path

import numpy as np
import torch

import pi0.ript.warm_start as ws
from pi0.ript.update import OptimizerConfig
from pi0.ript.utils.dist_utils import cleanup_distributed, setup_distributed
from pi0.ript.warm_start import (Plateau, TinyArenaConfig, arena_expert_demos, arena_runner, demo_norm_stats,
                                 demo_windows, sft_to_plateau, tiny_arena_policy, validation_success)

info = setup_distributed("gloo", "cpu", timeout_s=120)
torch.set_num_threads(1)
out = Path(sys.argv[1])
cfg = TinyArenaConfig(image_size=28, depth=1, action_horizon=4, n_action_steps=2, num_steps=2)
torch.manual_seed(0)  # the same initial weights on both ranks
demos = arena_expert_demos([(4, 0), (4, 1)], 4, 2, resolution=32)
policy = tiny_arena_policy(cfg, demo_norm_stats(demos))
init = {k: v.clone() for k, v in policy.model.state_dict().items()}
windows = demo_windows(policy, demos)

real = ws.evaluate_episodes
ws.evaluate_episodes = lambda runner, pol, states, seed=0, **k: np.array([float(i % 2) for _, i in states])
val = validation_success(None, policy, [(4, 7), (4, 8), (4, 9), (4, 11), (4, 12)], seed=0, info=info)
ws.evaluate_episodes = real

runner = arena_runner(2, replan_steps=2, resolution=32, max_steps=4)
try:
    curve = sft_to_plateau(policy, windows[info.rank::2], OptimizerConfig(lr=1e-2, minibatch_size=4), 6,
                           Plateau([(4, 7), (4, 8), (4, 9)], every=2, patience=5), runner, log=False, info=info)
finally:
    runner.close()
torch.save({"val": val, "curve": curve, "state": policy.model.state_dict(), "init": init, "windows": len(windows)},
           out / f"rank{info.rank}.pt")
cleanup_distributed()
