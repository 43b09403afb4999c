"""Worker of test_no_deadlock: rank 1 has no windows (all its groups filtered); both ranks must finish together.

It also checks that ``cleanup_distributed`` really frees the process group after model init imported torch._dynamo
(a group that survives keeps gloo threads alive into interpreter shutdown, which can abort the process).
"""

import sys

import torch
import torch.distributed as dist

from pi0.ript.objectives import FlowMatchingObjective
from pi0.ript.update import OptimizerConfig, PolicyUpdate
from pi0.ript.utils.dist_utils import cleanup_distributed, setup_distributed
from pi0.ript.warm_start import TinyArenaConfig, arena_runner, collect_expert_demos, demo_norm_stats, tiny_arena_policy

info = setup_distributed("gloo", "cpu", timeout_s=60)
torch.set_num_threads(1)
cfg = TinyArenaConfig(depth=1, width=32)
runner = arena_runner(2, cfg.n_action_steps, max_steps=10)
demos = collect_expert_demos(runner, [(4, 0), (4, 1)], cfg.action_horizon)
runner.close()
policy = tiny_arena_policy(cfg, demo_norm_stats(demos))
adapter = FlowMatchingObjective(policy)
windows = [w for e, c in demos for w in adapter.demo_windows(e, c)] if info.rank == 0 else []
opt = PolicyUpdate(adapter, OptimizerConfig(epochs=2, minibatch_size=2), info=info)
st = opt.step(windows)
flat = torch.cat([p.detach().reshape(-1) for p in policy.model.parameters()])
ref = flat.clone()
dist.broadcast(ref, 0)
same = bool(torch.equal(flat, ref))
dist.barrier()  # neither rank tears gloo down while the other still talks to it
group = dist.group.WORLD
cleanup_distributed()
released = sys.getrefcount(group) == 2  # this name and getrefcount's argument: nothing else holds the group
print(f"rank {info.rank} steps {int(st['steps'])} windows {len(windows)} params_equal {same} released {released}",
      flush=True)
del group
sys.exit(0 if same and st["steps"] > 0 else 1)
