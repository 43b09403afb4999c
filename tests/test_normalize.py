"""z-score and quantile (un)normalization against hand-computed values; norm_stats.json errors."""

import json

import numpy as np
import pytest
import torch

from pi0.policies.normalize import Stats, load_norm_stats, normalize, save_norm_stats, unnormalize

S = Stats(mean=np.array([1.0, -2.0]), std=np.array([2.0, 0.5]), q01=np.array([-1.0, 0.0]), q99=np.array([3.0, 1.0]))


def test_zscore_hand_computed_and_padding():
    x = torch.tensor([[3.0, -1.0, 7.0]])  # third dim is padding: untouched
    out = normalize(x, S)
    expected = torch.tensor([[(3 - 1) / (2 + 1e-6), (-1 + 2) / (0.5 + 1e-6), 7.0]], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(unnormalize(out, S), x.double(), rtol=0, atol=1e-12)


def test_quantile_hand_computed():
    x = torch.tensor([[3.0, 0.0]])  # q99 of dim 0 -> ~1, q01 of dim 1 -> -1
    out = normalize(x, S, "quantile")
    expected = torch.tensor([[(3 + 1) / (4 + 1e-6) * 2 - 1, (0 - 0) / (1 + 1e-6) * 2 - 1]], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(unnormalize(out, S, "quantile"), x.double(), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="mode"):
        normalize(x, S, "minmax")


def test_roundtrip_file_and_errors(tmp_path):
    p = tmp_path / "norm_stats.json"
    save_norm_stats({"state": S, "actions": S}, p)
    loaded = load_norm_stats(p)
    np.testing.assert_array_equal(loaded["actions"].q99, S.q99)
    assert json.loads(p.read_text())["norm_stats"]["state"]["std"] == [2.0, 0.5]
    with pytest.raises(FileNotFoundError, match="norm stats not found"):
        load_norm_stats(tmp_path / "missing.json")
    p.write_text(json.dumps({"norm_stats": {"state": {"mean": [0.0], "std": [1.0]}}}))
    with pytest.raises(ValueError, match="no 'actions' entry"):
        load_norm_stats(p)
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_norm_stats(p)
