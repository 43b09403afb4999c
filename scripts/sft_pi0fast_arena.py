"""Supervised fine-tuning of a tiny pi0-FAST on the arena's scripted-expert demonstrations, then evaluation.

Adds: pi0-FAST training (cross-entropy on the action-token postfix) end to end: expert demos through the
rollout engine (``ArenaExpertPolicy`` + ``RolloutRunner``), norm stats and a FAST tokenizer fitted on them,
a tiny from-scratch pi0-FAST, and success rates of the trained policy vs a random policy on the same
init states (also through the runner, via ``pi0.policies.libero.Pi0ChunkPolicy``).

    python scripts/sft_pi0fast_arena.py                                  # defaults (CPU, ~20-30 min)
    python scripts/sft_pi0fast_arena.py --init_from outputs/sft_pi0fast_arena/policy --lr 5e-4 \
        --out_dir outputs/sft_fast2                                      # 4000 more steps (bench/README.md: 10% vs 0%)
    python scripts/sft_pi0fast_arena.py --policy_dir outputs/sft_fast2/policy --eval_inits 100   # evaluate only

Single process (no torchrun). Writes <out_dir>/policy (PI0FASTPolicy directory), results.json, TensorBoard logs.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from pi0.models.config import SiglipConfig
from pi0.envs import EnvSpec
from pi0.policies.fast_tokenizer import FASTTokenizer
from pi0.modeling_pi0fast import Pi0FASTConfig
from pi0.policies.normalize import Stats, normalize
from pi0.policies.libero import Pi0ChunkPolicy
from pi0.policies.pi0fast import FASTPolicyConfig, PI0FASTPolicy
from pi0.policies.presets import tiny_tokenizer
from pi0.rollout import RolloutRunner, RunnerConfig
from pi0.rollout.policies import RandomChunkPolicy, collect_expert_demos
from pi0.transforms import libero_client_obs
from pi0.utils.cli import parse_config


@dataclass
class Config:
    """SFT options."""

    task_ids: list[int] = field(default_factory=lambda: [4])  # arena tasks (4: push the yellow block left)
    demo_inits: int = 400  # expert episodes per task (init states 0..demo_inits-1)
    eval_inits: int = 20  # evaluation init states per task (demo_inits .. demo_inits+eval_inits-1: unseen)
    eval_seen: bool = False  # evaluate on the demo init states 0..eval_inits-1 instead (layouts seen in training)
    policy_dir: str = ""  # evaluate this saved PI0FASTPolicy only (no demos, no training)
    init_from: str = ""  # continue training this saved PI0FASTPolicy (fitted on the same demos) instead of a fresh one
    expert_noise: float = 0.0  # > 0: the demos execute a noisy expert, labelled with clean chunks (DART)
    horizon: int = 10  # action chunk length
    replan_steps: int = 5  # executed actions per chunk at evaluation
    image_size: int = 56  # policy image size (SigLIP mu/14: 16 tokens per camera)
    resolution: int = 64  # arena render resolution
    fast_vocab: int = 400
    max_token_len: int = 112  # prompt + state text (~60 tiny-tokenizer tokens) + "Action: " + FAST tokens + "|" EOS
    max_decoding_steps: int = 96
    train_steps: int = 4000
    batch_size: int = 32
    lr: float = 1e-3
    init: str = "scratch"  # PI0FASTPolicy.random_init mode ("noisy" = the parity init, which barely learns to see)
    num_envs: int = 10
    seed: int = 0
    out_dir: str = "outputs/sft_pi0fast_arena"


def collect_demos(cfg: Config, spec: EnvSpec) -> dict[str, np.ndarray]:
    """Expert episodes -> arrays: image/wrist (N,S,S,3) uint8, state (N,8), actions (N,H,7), prompt (N,).

    One row per decision point (every ``replan_steps`` steps, as at evaluation), labelled with the noise-free
    expert chunk from that state (``pi0.rollout.policies.collect_expert_demos``, shared with pi0's warm start).
    """
    inits = [(t, i) for t in cfg.task_ids for i in range(cfg.demo_inits)]
    with RolloutRunner(spec, None, RunnerConfig(num_envs=cfg.num_envs, replan_steps=cfg.replan_steps,
                                                use_subprocess=False)) as r:
        demos = collect_expert_demos(r, inits, cfg.horizon, cfg.expert_noise, cfg.seed)
    rows = []
    for ep, chunks in demos:
        for d, chunk in zip(ep.decisions, chunks):
            c = libero_client_obs(d.obs, cfg.image_size)
            rows.append((c["image"], c["wrist_image"], c["state"], np.asarray(chunk, np.float64), ep.prompt))
    print(f"demos: {len(demos)} expert episodes, success {np.mean([e.success for e, _ in demos]):.0%}, "
          f"{len(rows)} chunks")
    cols = list(zip(*rows))
    return dict(image=np.stack(cols[0]), wrist=np.stack(cols[1]), state=np.stack(cols[2]),
                actions=np.stack(cols[3]), prompt=np.array(cols[4]))


def stats_of(x: np.ndarray) -> Stats:
    """Per-dim mean/std/q01/q99 of (N, D) data (constant dims get a unit range)."""
    q01, q99 = np.quantile(x, 0.01, 0), np.quantile(x, 0.99, 0)
    flat = q99 - q01 < 1e-6
    return Stats(x.mean(0), np.maximum(x.std(0), 1e-6), np.where(flat, q01 - 1, q01), np.where(flat, q99 + 1, q99))


def build_policy(cfg: Config, demos: dict[str, np.ndarray]) -> PI0FASTPolicy:
    """Norm stats + FAST tokenizer fitted on the demos, a tiny random pi0-FAST with two cameras."""
    norm = {"state": stats_of(demos["state"]), "actions": stats_of(demos["actions"].reshape(-1, 7))}
    acts = normalize(torch.from_numpy(demos["actions"]), norm["actions"], "quantile").numpy()
    fast = FASTTokenizer.fit(list(acts), scale=10.0, vocab_size=cfg.fast_vocab)
    # decode_position_offset=0: decoded tokens take the positions compute_loss trains them at (the default 1
    # reproduces openpi 15a9616's inference for the parity fixtures; with it this model decodes 90% malformed chunks)
    model = Pi0FASTConfig.tiny(vision=SiglipConfig.from_variant("mu/14", cfg.image_size), num_cameras=2,
                               action_horizon=cfg.horizon, max_decoding_steps=cfg.max_decoding_steps,
                               max_token_len=cfg.max_token_len, decode_position_offset=0)
    # best-effort decoding: the small stand-in text tokenizer has no pieces for the action ids, so openpi's
    # text-based extraction cannot read them (a converted openpi checkpoint uses "openpi").
    pcfg = FASTPolicyConfig(model=model, n_action_steps=cfg.replan_steps, image_keys=("base_0_rgb", "left_wrist_0_rgb"),
                            action_decoding="best_effort")
    policy = PI0FASTPolicy.random_init(pcfg, norm, tiny_tokenizer(), fast, seed=cfg.seed, init=cfg.init)
    n_act = [len(t) for t in fast.encode(acts)]
    print(f"FAST: {fast.bpe_vocab_size} tokens, {np.mean(n_act):.1f} (max {max(n_act)}) tokens per chunk of "
          f"{acts.shape[1] * acts.shape[2]} values")
    return policy


def train(cfg: Config, policy: PI0FASTPolicy, demos: dict[str, np.ndarray], writer: SummaryWriter) -> float:
    """AdamW on the per-sample pi0-FAST loss over random demo batches -> final mean loss."""
    opt = torch.optim.AdamW(policy.model.parameters(), lr=cfg.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, total_steps=cfg.train_steps, pct_start=0.1)
    rng = np.random.default_rng(cfg.seed)
    chw = lambda x: torch.from_numpy(x.transpose(0, 3, 1, 2).copy())  # noqa: E731
    policy.model.train()
    losses = []
    for step in tqdm(range(cfg.train_steps), desc="sft"):
        idx = rng.integers(0, len(demos["state"]), cfg.batch_size)
        obs = {"image": {"base_0_rgb": chw(demos["image"][idx]), "left_wrist_0_rgb": chw(demos["wrist"][idx])},
               "state": torch.from_numpy(demos["state"][idx]), "prompt": demos["prompt"][idx].tolist()}
        loss = policy.compute_loss(obs, torch.from_numpy(demos["actions"][idx])).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        writer.add_scalar("train/loss", loss.item(), step)
    policy.model.eval()
    return float(np.mean(losses[-20:]))


def evaluate(cfg: Config, spec: EnvSpec, chunk_policy, name: str) -> dict[str, float]:
    """Success rate over the held-out init states of every task."""
    first = 0 if cfg.eval_seen else cfg.demo_inits
    inits = [(t, first + i) for t in cfg.task_ids for i in range(cfg.eval_inits)]
    t0 = time.perf_counter()
    with RolloutRunner(spec, chunk_policy, RunnerConfig(num_envs=cfg.num_envs, replan_steps=cfg.replan_steps,
                                                      use_subprocess=False)) as r:
        eps = r.run(inits)
    out = {"success_rate": float(np.mean([e.success for e in eps])), "episodes": len(eps),
           "wall_s": time.perf_counter() - t0}
    print(f"{name}: success {out['success_rate']:.1%} over {len(eps)} episodes ({out['wall_s']:.0f}s)")
    return out


def main(argv: list[str] | None = None) -> dict:
    """Collect demos, fit, train, evaluate trained vs random; write results.json and the policy."""
    cfg = parse_config(Config, argv, __doc__)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_layouts = max(50, cfg.demo_inits + cfg.eval_inits)  # layout k of a task is a pure function of (task, k)
    spec = EnvSpec("arena-v0", {"render_on_demand": True, "resolution": cfg.resolution, "num_init_states": n_layouts})
    if cfg.policy_dir:
        policy, final_loss = PI0FASTPolicy.from_pretrained(cfg.policy_dir), float("nan")
    else:
        demos = collect_demos(cfg, spec)
        policy = PI0FASTPolicy.from_pretrained(cfg.init_from) if cfg.init_from else build_policy(cfg, demos)
        with SummaryWriter(str(out / "tb")) as writer:
            final_loss = train(cfg, policy, demos, writer)
        policy.save_pretrained(out / "policy")
    random_res = evaluate(cfg, spec, RandomChunkPolicy(cfg.horizon, 7, seed=cfg.seed), "random policy")
    trained_res = evaluate(cfg, spec, Pi0ChunkPolicy(policy), "trained pi0-FAST")
    results = {"config": asdict(cfg), "final_train_loss": final_loss, "random": random_res, "trained": trained_res}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"final train loss {final_loss:.3f}; success trained {trained_res['success_rate']:.1%} vs random "
          f"{random_res['success_rate']:.1%} -> {out}/results.json")
    return results


if __name__ == "__main__":
    main()
