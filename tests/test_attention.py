"""Attention masks, positions, RoPE and the attention kernel against hand-computed tensors."""

import math

import torch

from pi0.models.attention import BIG_NEG, apply_rope, attention, make_attn_mask, make_positions


def test_make_attn_mask_prefix_state_actions():
    # 2 prefix tokens (one padded), then a state token (ar=1), then 2 action tokens (ar=1, 0).
    input_mask = torch.tensor([[1, 0, 1, 1, 1]], dtype=torch.bool)
    ar = torch.tensor([0, 0, 1, 1, 0])
    expected = torch.tensor([[
        [1, 0, 0, 0, 0],  # prefix token sees the valid prefix only
        [0, 0, 0, 0, 0],  # padded token sees nothing
        [1, 0, 1, 0, 0],  # state token: prefix + itself
        [1, 0, 1, 1, 1],  # action tokens: prefix + state + the whole action block
        [1, 0, 1, 1, 1],
    ]], dtype=torch.bool)
    assert torch.equal(make_attn_mask(input_mask, ar), expected)


def test_make_attn_mask_causal_and_batched_ar():
    input_mask = torch.ones(2, 3, dtype=torch.bool)
    ar = torch.tensor([[1, 1, 1], [0, 0, 0]])  # row 0 fully causal, row 1 fully bidirectional
    m = make_attn_mask(input_mask, ar)
    assert torch.equal(m[0], torch.tril(torch.ones(3, 3, dtype=torch.bool)))
    assert torch.equal(m[1], torch.ones(3, 3, dtype=torch.bool))


def test_make_positions_skips_padding_and_offsets():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [0, 1, 1, 1, 0, 1]], dtype=torch.bool)
    assert make_positions(mask).tolist() == [[0, 1, 1, 1, 2, 3], [-1, 0, 1, 2, 2, 3]]
    offset = torch.tensor([10, 3])
    assert make_positions(torch.ones(2, 3, dtype=torch.bool), offset).tolist() == [[10, 11, 12], [3, 4, 5]]


def test_rope_hand_computed():
    # head_dim 4: frequencies 1/10000**(0/4) = 1 and 1/10000**(2/4) = 0.01; split-half pairs (0,2), (1,3).
    x = torch.tensor([[[[1.0, 2.0, 3.0, 4.0]]]])
    pos = torch.tensor([[2]])
    a0, a1 = 2.0, 2.0 * 0.01
    expected = torch.tensor([
        1 * math.cos(a0) - 3 * math.sin(a0), 2 * math.cos(a1) - 4 * math.sin(a1),
        3 * math.cos(a0) + 1 * math.sin(a0), 4 * math.cos(a1) + 2 * math.sin(a1),
    ])
    torch.testing.assert_close(apply_rope(x, pos)[0, 0, 0], expected, atol=1e-6, rtol=0)
    assert torch.equal(apply_rope(x, torch.tensor([[0]])), x)  # position 0 is the identity


def test_attention_matches_naive_and_masks():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, 4, 8, generator=g)  # 4 heads share 2 kv heads
    k = torch.randn(1, 5, 2, 8, generator=g)
    v = torch.randn(1, 5, 2, 8, generator=g)
    mask = torch.tensor([[[1, 1, 0, 0, 0], [1, 1, 1, 0, 1], [0, 0, 0, 0, 0]]], dtype=torch.bool)
    out = attention(q, k, v, mask)
    for t in range(2):
        for n in range(4):
            kv = n // 2
            logits = (q[0, t, n] @ k[0, :, kv].T).masked_fill(~mask[0, t], float("-inf"))
            ref = torch.softmax(logits, -1) @ v[0, :, kv]
            torch.testing.assert_close(out[0, t, n], ref, atol=1e-5, rtol=1e-5)
    # A fully masked query (padding) gets a uniform average, not NaN (openpi's BIG_NEG semantics).
    torch.testing.assert_close(out[0, 2, 0], v[0, :, 0].mean(0), atol=1e-5, rtol=1e-5)
    assert BIG_NEG > -float("inf")
    torch.testing.assert_close(attention(q, k, v, mask, "sdpa")[:, :2], out[:, :2], atol=1e-5, rtol=1e-5)


def test_sdpa_gradients_match_eager_for_grouped_heads():
    """The fused path (on CPU: K key/value heads served to N query heads inside the kernel) trains like openpi's
    written-out attention: the same outputs and the same gradients for q, k and v, also with one kv head (MQA)."""
    for kv_heads in (2, 1):
        g = torch.Generator().manual_seed(kv_heads)
        q = torch.randn(2, 6, 4, 8, generator=g)
        k, v = torch.randn(2, 7, kv_heads, 8, generator=g), torch.randn(2, 7, kv_heads, 8, generator=g)
        mask = torch.rand(2, 6, 7, generator=g) > 0.4
        mask[..., 0] = True  # no fully masked query
        w = torch.randn(2, 6, 4, 8, generator=g)
        grads = []
        for impl in ("eager", "sdpa"):
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            out = attention(*leaves, mask, impl)
            (out * w).sum().backward()
            grads.append([out.detach()] + [x.grad for x in leaves])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
