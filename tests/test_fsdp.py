"""FSDP2 (pi0.ript.utils.fsdp) on CPU: 2 gloo ranks under torchrun.

- one sharded PolicyUpdate step equals the single-process step on the same windows (rank 1 has none: it pads with
  zero-weighted minibatches, so it joins every forward/backward collective and nothing deadlocks);
- the sharded checkpoint (gathered float32 weights + torch.distributed.checkpoint optimizer shards) resumes to the
  same next step, in float32 and with bf16 compute;
- stage 10 with algo.fsdp=true trains, checkpoints and resumes to the uninterrupted run's weights.
"""

import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO, TINY_TRAIN, torchrun

TINY = TINY_TRAIN + ["algo.fsdp=true", "algo.opt.weight_decay=0.1", "algo.opt.epochs=2"]


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_sharded_step_matches_single_process_and_resumes(tmp_path, precision):
    out = torchrun(str(REPO / "tests" / "dist_fsdp_worker.py"), str(tmp_path), precision, timeout=300)
    reports = sorted(re.findall(r"rank (\d) steps (\d+) windows (\d+)", out))
    assert [r[0] for r in reports] == ["0", "1"] and reports[1][2] == "0", out  # rank 1 had no windows
    assert reports[0][1] == reports[1][1] != "0"  # and still took every optimizer step with rank 0
    r = torch.load(tmp_path / "result.pt", weights_only=False)
    assert r["skipped"] == 0 and all(v.dtype == torch.float32 for v in r["after"].values())  # float32 masters
    moved = _max_diff(r["again"], r["after"])
    assert moved > 1e-4  # the second step changed the weights ...
    assert _max_diff(r["again"], r["resumed"]) == 0.0  # ... and the resumed run took exactly the same step
    assert (tmp_path / "optimizer" / ".metadata").is_file()
    assert {p.name for p in (tmp_path / "optimizer").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    if precision == "float32":
        ref = r["ref"]
        assert ref["steps"] == r["steps"]
        # AdamW's first step is lr * g / (|g| + eps) per element: sum-order noise shows where |g| ~ eps; 2% of a step
        assert _max_diff(r["after"], ref["after"]) <= 0.02 * 1e-3


@pytest.mark.slow
def test_stage10_fsdp_resume_reproduces_uninterrupted_run(tmp_path):
    from safetensors.torch import load_file
    common = ["10_train_with_distributed.py", "--config_path", "debug_distributed_train", *TINY,
              f"logging.out_dir={tmp_path}", "logging.plot=false"]
    out = torchrun(*common, "logging.run_name=full", "algo.iterations=2", timeout=300)
    assert "iter 2: success" in out
    torchrun(*common, "logging.run_name=cut", "algo.iterations=1", timeout=300)
    torchrun(*common, "logging.run_name=cut", "algo.iterations=2", "--resume", timeout=300)
    ck = tmp_path / "cut" / "checkpoints" / "iter_0001"
    assert (ck / "optimizer" / ".metadata").is_file() and not (ck / "optimizer.pt").exists()
    full, cut = (load_file(str(tmp_path / n / "final" / "model.safetensors")) for n in ("full", "cut"))
    one = load_file(str(ck / "model.safetensors"))
    assert all(v.dtype == torch.float32 for v in one.values())  # the float32 masters
    assert _max_diff(full, cut) <= 1e-6
    assert _max_diff(full, one) > 0  # the second iteration changed the weights


def test_fsdp_without_torchrun_is_a_one_line_user_error(tmp_path):
    r = subprocess.run([sys.executable, "10_train_with_distributed.py", "--config_path", "debug_distributed_train",
                        "algo.fsdp=true", f"logging.out_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "algo.fsdp" in r.stderr and "torchrun" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_setup_distributed_names_a_cuda_device_in_a_plain_process(monkeypatch):
    """A plain process (no torchrun) with device=cuda: world 1, no group, the device named (cuda:0 where CUDA is).

    A function-local ``import torch._dynamo`` once made ``torch`` a local name there, so every CUDA run raised
    UnboundLocalError before any work (found on the first GPU lease)."""
    from pi0.ript.utils.dist_utils import setup_distributed

    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    info = setup_distributed("auto", "cuda")
    assert (info.rank, info.world_size, info.enabled) == (0, 1, False)
    assert info.device == ("cuda:0" if torch.cuda.is_available() else "cuda")
