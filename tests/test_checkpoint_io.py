"""Streaming safetensors writer / positioned-read loader against the safetensors library, and lazy loading."""

import json
import struct

import pytest
import torch
from safetensors import safe_open
from torch import nn

from pi0.utils.checkpoint_io import SafetensorsWriter, load_safetensors_into, read_safetensors_header
from pi0.modeling_pi0 import PI0Policy, param_storage_dtype
from pi0.policies.presets import tiny_policy


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"b.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),  # odd byte count before an f32 tensor
            "a.bias": torch.randn(7, generator=g), "c": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "empty": torch.zeros(0, 4)}


def test_writer_output_reads_back_with_safetensors(tmp_path):
    tensors, path = _tensors(), tmp_path / "m.safetensors"
    with SafetensorsWriter(path, {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}) as w:
        for k in ["c", "empty", "b.weight", "a.bias"]:  # any write order
            w.write(k, tensors[k] if k != "c" else tensors[k].numpy())
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(tensors) and f.metadata() == {"format": "pt"}
        for k, t in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == t.dtype and torch.equal(got, t), k
    (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert header_len % 8 == 0
    entries = read_safetensors_header(path)
    for e in entries.values():  # f32 first: every tensor starts aligned to its item size
        assert e.start % e.dtype.itemsize == 0
    assert entries["a.bias"].start < entries["b.weight"].start


def test_writer_refuses_wrong_or_missing_tensors(tmp_path):
    path = tmp_path / "m.safetensors"
    w = SafetensorsWriter(path, {"x": (torch.float32, (2, 2)), "y": (torch.bfloat16, (3,))})
    with pytest.raises(ValueError, match="declared"):
        w.write("x", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="declared"):
        w.write("y", torch.zeros(3))  # float32 data for a bf16 slot
    w.write("x", torch.ones(2, 2))
    with pytest.raises(ValueError, match="never wrote.*'y'"):
        w.close()
    assert not path.exists() and not list(tmp_path.iterdir())


def test_header_reader_names_truncation(tmp_path):
    path = tmp_path / "m.safetensors"
    with SafetensorsWriter(path, {"x": (torch.float32, (100,))}) as w:
        w.write("x", torch.ones(100))
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    with pytest.raises(ValueError, match="truncated or corrupt.*data ends at byte"):
        read_safetensors_header(path)
    path.write_bytes(struct.pack("<Q", 10) + b"{not json}" + data[18:])
    with pytest.raises(ValueError, match="bad header"):
        read_safetensors_header(path)


def test_load_into_casts_and_checks(tmp_path):
    path = tmp_path / "m.safetensors"
    src = nn.Linear(4, 3)
    with SafetensorsWriter(path, {f"m.{k}": (t.dtype, tuple(t.shape)) for k, t in src.state_dict().items()}) as w:
        for k, t in src.state_dict().items():
            w.write(f"m.{k}", t)
    dst = nn.Linear(4, 3).to(torch.bfloat16)
    dst.bias.data = dst.bias.data.float()  # mixed: one direct read, one cast
    load_safetensors_into(dst, path, prefix="m.")
    assert torch.equal(dst.weight, src.weight.detach().to(torch.bfloat16))
    assert torch.equal(dst.bias, src.bias.detach())
    with pytest.raises(ValueError, match=r"missing 1 key\(s\), e.g. \['extra'\]"):
        load_safetensors_into(nn.ParameterDict({"weight": nn.Parameter(torch.zeros(3, 4)),
                                                "bias": nn.Parameter(torch.zeros(3)),
                                                "extra": nn.Parameter(torch.zeros(1))}), path, prefix="m.")


@pytest.mark.parametrize("precision", ["openpi", "high"])
def test_from_pretrained_dtype_override_is_exact_cast(tmp_path, precision):
    pol = tiny_policy(seed=3)
    pol.save_pretrained(tmp_path / "p")
    loaded = PI0Policy.from_pretrained(tmp_path / "p", dtype="bfloat16", bf16_precision=precision)
    assert json.loads((tmp_path / "p" / "config.json").read_text())["model"]["dtype"] == "float32"
    want = dict(pol.model.named_parameters())
    rounded = 0
    for name, p in loaded.model.named_parameters():
        assert p.dtype == param_storage_dtype(name, "bfloat16"), name
        w = want[name].detach()
        if precision == "openpi":  # float32-stored parameters hold bf16 values, as openpi's serving restores them
            w = w.to(torch.bfloat16)
            rounded += p.dtype == torch.float32 and not torch.equal(p, want[name].detach())
        assert torch.equal(p, w.to(p.dtype)), name
    assert (rounded > 0) == (precision == "openpi")


def test_random_init_bf16_dtypes_and_seed():
    a, b, c = tiny_policy(seed=5, dtype="bfloat16"), tiny_policy(seed=5, dtype="bfloat16"), tiny_policy(seed=6)
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert p.dtype == param_storage_dtype(name, "bfloat16") and torch.equal(p, q), name
    w = a.model.paligemma_with_expert.experts[0].layers[0].mlp.up_proj.weight
    assert w.dtype == torch.bfloat16 and 0.015 < w.float().std() < 0.025  # N(0, 0.02)
    assert not torch.equal(w.float(), c.model.paligemma_with_expert.experts[0].layers[0].mlp.up_proj.weight.float())


def test_set_dtype_bf16_precision_openpi_rounds_and_high_keeps_float32_values():
    """openpi's serving restores every parameter as bf16 ("openpi", the default); its training keeps float32 params
    (RIPTTrainer's precision=bf16 uses "high")."""
    want = dict(tiny_policy(seed=3).model.named_parameters())
    for precision in ("openpi", "high"):
        m = tiny_policy(seed=3).model.set_dtype("bfloat16", bf16_precision=precision)
        assert m.cfg.bf16_precision == precision
        w, p = want["action_in_proj.weight"].detach(), m.action_in_proj.weight
        assert p.dtype == torch.float32
        assert torch.equal(p, w.to(torch.bfloat16).float() if precision == "openpi" else w)
        assert not torch.equal(w.to(torch.bfloat16).float(), w)  # the rounding is visible
