"""The converted openpi pi0 on a CUDA GPU: float32 parity and bf16 against openpi's own bf16 noise floor.

Marked ``cuda`` and skipped without a GPU; ``bench/gpu_suite.py`` runs them on a lent machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import PI0_TINY, model_inputs
from pi0.modeling_pi0 import PI0Policy

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cuda_inputs(ref):
    return {k: ([x.cuda() for x in v] if isinstance(v, list) else v.cuda()) for k, v in model_inputs(ref).items()}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_float32_parity_on_cuda(converted_tiny, pi0_reference, attn):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = PI0Policy.from_pretrained(converted_tiny, device="cuda", attn_implementation=attn).model
    ref = pi0_reference
    actions = model.sample_actions(**_cuda_inputs(ref), noise=torch.from_numpy(ref["noise"]).cuda(),
                                   num_steps=int(ref["num_steps"]))
    assert np.abs(actions.cpu().numpy() - ref["actions"]).max() < 1e-4


def test_bfloat16_on_cuda_within_openpis_bf16_floor(converted_tiny, pi0_reference):
    """bf16 compute on the GPU is as far from openpi's float32 actions as openpi's own bf16 serving is (x1.5)."""
    ref = pi0_reference
    bf16_ref = np.load(PI0_TINY / "reference_bf16.npz")["actions"]
    floor = np.abs(bf16_ref - ref["actions"]).max()
    model = PI0Policy.from_pretrained(converted_tiny, device="cuda", dtype="bfloat16").model
    actions = model.sample_actions(**_cuda_inputs(ref), noise=torch.from_numpy(ref["noise"]).cuda(),
                                   num_steps=int(ref["num_steps"])).float().cpu().numpy()
    err = np.abs(actions - ref["actions"]).max()
    print(f"bf16 on cuda: max |ours - openpi f32| = {err:.3e}, openpi's bf16 floor {floor:.3e}, ratio {err / floor:.2f}")
    assert 1e-4 < err <= 1.5 * floor


def test_pi05_parity_and_cuda_graph_on_cuda(tmp_path):
    """pi0.5 (openpi_pi05_tiny) on the GPU: float32 parity, and the CUDA-graph fast sampler equal to eager."""
    import subprocess
    import sys

    from conftest import GOLDEN, REPO
    from pi0.models.fast_sampler import FastSampler
    from pi0.policies import load_policy

    torch.backends.cuda.matmul.allow_tf32 = False
    fix = GOLDEN / "openpi_pi05_tiny"
    out = tmp_path / "pi05"
    r = subprocess.run([sys.executable, str(REPO / "convert_pi0_to_hf_lerobot.py"), "--checkpoint_dir",
                        str(fix / "checkpoint" / "params"), "--output_path", str(out), "--openpi_config", "pi05_libero",
                        "--action_horizon", "50", "--max_token_len", "64", "--tokenizer",
                        str(GOLDEN / "openpi_pi05_libero_policy_tiny" / "tokenizer.model")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    ref = dict(np.load(fix / "reference.npz"))
    model = load_policy(out, device="cuda").model
    inp, noise = _cuda_inputs(ref), torch.from_numpy(ref["noise"]).cuda()
    eager = model.sample_actions(**inp, noise=noise, num_steps=10)
    assert np.abs(eager.cpu().numpy() - ref["actions"]).max() < 1e-4
    fast = FastSampler(model, cuda_graph=True)
    for _ in range(2):  # capture, then replay
        torch.testing.assert_close(fast(**inp, noise=noise, num_steps=10), eager, atol=1e-5, rtol=0)
    assert fast.graph_error is None
