"""Worker of test_fsdp (torchrun, 2 gloo ranks): an FSDP2-sharded PolicyUpdate step equals the single-process step on
the union of the ranks' windows (rank 1 has none: it pads with zero-weighted minibatches and joins every collective);
a sharded checkpoint (weights gathered, optimizer by torch.distributed.checkpoint) resumes to the same next step.

argv: <out dir> <precision: float32 | bf16>. Rank 0 writes ``<out>/result.pt``.
"""

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pi0.policies.pi0 import PI0Policy
from pi0.ript.objectives import FlowMatchingObjective
from pi0.ript.update import OptimizerConfig, PolicyUpdate
from pi0.ript.utils.dist_utils import cleanup_distributed, setup_distributed
from pi0.ript.utils.fsdp import (full_state_dict, load_sharded_optimizer, save_policy, save_sharded_optimizer,
                                 shard_model)
from pi0.ript.warm_start import TinyArenaConfig, arena_runner, collect_expert_demos, demo_norm_stats, tiny_arena_policy



def main(out: Path, precision: str) -> None:
    info = setup_distributed("gloo", "cpu", timeout_s=120)
    torch.set_num_threads(1)
    cfg = TinyArenaConfig(depth=2, width=32)
    with arena_runner(2, cfg.n_action_steps, max_steps=10) as runner:
        demos = collect_expert_demos(runner, [(4, 0), (4, 1), (4, 2)], cfg.action_horizon)
    policy = tiny_arena_policy(cfg, demo_norm_stats(demos))
    objective = FlowMatchingObjective(policy)
    windows = [w for e, c in demos for w in objective.demo_windows(e, c)]
    mine = windows if info.rank == 0 else []
    opt = OptimizerConfig(lr=1e-3, epochs=1, minibatch_size=4, grad_accum_steps=2)
    ref = None
    if info.is_main and precision == "float32":  # the single-process reference on the union of the data (rank 0's)
        ref_policy = copy.deepcopy(policy)
        ref_update = PolicyUpdate(FlowMatchingObjective(ref_policy), opt, seed=0)
        ref_st = ref_update.step(windows)
        ref = {"after": {k: v.clone() for k, v in ref_policy.model.state_dict().items()}, "steps": ref_st["steps"]}

    shard_model(policy.model, info, precision)
    update = PolicyUpdate(objective, opt, seed=0, info=info)
    st = update.step(mine)
    after = full_state_dict(policy.model)
    save_sharded_optimizer(policy.model, update.optimizer, out / "optimizer")
    save_policy(policy, out / "policy", info)
    rngs = update.state_dict()
    rngs.pop("optimizer")
    st2 = update.step(mine)
    again = full_state_dict(policy.model)

    # resume: the saved weights, sharded again, the sharded optimizer state and the RNGs -> the same second step
    resumed = PI0Policy.from_pretrained(out / "policy")
    resumed.model.float()
    shard_model(resumed.model, info, precision)
    upd2 = PolicyUpdate(FlowMatchingObjective(resumed), opt, seed=0, info=info)
    load_sharded_optimizer(resumed.model, upd2.optimizer, out / "optimizer")
    upd2.generator.set_state(rngs["generator"])
    upd2.rng.bit_generator.state = rngs["rng"]
    upd2.step(mine)
    resumed_after = full_state_dict(resumed.model)
    if info.is_main:
        torch.save({"ref": ref, "after": after, "again": again, "resumed": resumed_after, "steps": st["steps"],
                    "steps2": st2["steps"], "loss": st.get("loss"), "skipped": st["skipped_steps"]}, out / "result.pt")
    print(f"rank {info.rank} steps {int(st['steps'])} windows {len(mine)}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    cleanup_distributed()  # after main()'s FSDP2 modules are dropped: its gc.collect() frees them and their group
