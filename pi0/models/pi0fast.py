"""pi0-FAST: PaliGemma as an autoregressive prefix-LM over FAST action tokens (PyTorch port of openpi pi0_fast.py).

``PI0FASTModel`` is the network with openpi's model-level API (``compute_loss`` / ``sample_tokens``), built
from our SigLIP / Gemma modules (``pi0.models.paligemma_with_expert.PaliGemma``). ``PI0FASTPolicy`` (in
``pi0.policies.pi0fast``) wraps it with normalization, the FAST prompt format and the action-chunk API.

Sequence layout (as in openpi pi0_fast.py embed_inputs): the image tokens of every camera (ar 0, mask =
that camera's mask), then the text tokens with the caller's ``token_ar_mask``: a bidirectional prefix
(prompt + discretised state) followed by a causal postfix ("Action: " + action tokens + "|" + EOS).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pi0.models.attention import apply_rope, attention, make_attn_mask
from pi0.models.config import DTYPES, PALIGEMMA_VOCAB_SIZE, DictConfig, GemmaConfig, SiglipConfig
from pi0.models.paligemma_with_expert import KVCache, PaliGemma

PALIGEMMA_EOS_TOKEN = 1  # as in openpi pi0_fast.py


@dataclass(frozen=True)
class Pi0FASTConfig(DictConfig):
    """The pi0-FAST network: SigLIP + one Gemma (no action expert) + the FAST token budget."""

    NESTED: ClassVar[dict[str, type]] = {"paligemma": GemmaConfig, "vision": SiglipConfig}

    paligemma: GemmaConfig = field(default_factory=lambda: GemmaConfig.from_variant("gemma_2b"))
    vision: SiglipConfig = field(default_factory=lambda: SiglipConfig.from_variant("So400m/14"))
    vocab_size: int = PALIGEMMA_VOCAB_SIZE
    action_dim: int = 32
    action_horizon: int = 32  # openpi Pi0FASTConfig default (LIBERO: 10)
    max_token_len: int = 250
    num_cameras: int = 3
    max_decoding_steps: int = 256
    fast_skip_tokens: int = 128  # as in openpi FASTTokenizer: the last 128 PaliGemma ids are special tokens
    dtype: str = "float32"
    attn_implementation: str = "eager"
    # Position of the token decoded at step s is prefill_len + s + decode_position_offset. openpi's
    # pi0_fast.py sample_actions uses 1 (one position skipped after the prefix; still so at commit 15a9616, a
    # fix proposed upstream was not merged), while its compute_loss trains contiguous positions. A converted
    # openpi checkpoint must decode as openpi serves it (1: the converter writes it); a model trained by
    # this project's own loss decodes with 0 (scripts/sft_pi0fast_arena.py writes it).
    decode_position_offset: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attn_implementation not in ("eager", "sdpa"):
            raise ValueError(f"attn_implementation must be 'eager' or 'sdpa', got {self.attn_implementation!r}")
        for f in ("vocab_size", "action_dim", "action_horizon", "max_token_len", "num_cameras", "max_decoding_steps"):
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"Pi0FASTConfig.{f} must be positive, got {getattr(self, f)}")

    @classmethod
    def tiny(cls, **overrides: Any) -> "Pi0FASTConfig":
        """Embedded default for tests and demos: Gemma 'dummy' (depth 2) and SigLIP mu/14, vocab 1024."""
        kw: dict[str, Any] = dict(paligemma=dataclasses.replace(GemmaConfig.from_variant("dummy"), depth=2),
                                  vision=SiglipConfig.from_variant("mu/14"), vocab_size=1024, action_dim=7,
                                  action_horizon=10, max_token_len=128, max_decoding_steps=48)
        kw.update(overrides)
        return cls(**kw)


class PI0FASTModel(nn.Module):
    """SigLIP + Gemma prefix-LM with tied input/output embeddings (openpi Pi0FAST)."""

    def __init__(self, cfg: Pi0FASTConfig):
        super().__init__()
        self.cfg = cfg
        self.paligemma = PaliGemma(cfg)  # type: ignore[arg-type]  # uses .vision, .paligemma, .vocab_size
        if cfg.dtype == "bfloat16":
            for name, p in self.named_parameters():
                if not any(m in name for m in ("norm", "patch_embedding", "position_embedding")):
                    p.data = p.data.to(torch.bfloat16)

    @property
    def lm(self) -> nn.Module:
        """The Gemma decoder (embed_tokens, layers, norm)."""
        return self.paligemma.language_model.model

    @property
    def compute_dtype(self) -> torch.dtype:
        """Activation dtype."""
        return torch.bfloat16 if self.cfg.dtype == "bfloat16" else torch.float32

    # ------------------------------------------------------------------ pieces
    def embed_inputs(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], tokens: torch.Tensor,
                     token_mask: torch.Tensor, token_ar_mask: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """C x (B,3,224,224) images, C x (B,) masks, (B,L) tokens/mask/ar -> emb (B,T,D), mask (B,T), ar (B,T).

        as in openpi pi0_fast.py embed_inputs: every camera is embedded (also masked ones: their tokens
        keep their slots and, at decode time, openpi's range mask can see them), image ar = 0.
        """
        pg = self.paligemma
        embs, masks, ars = [], [], []
        for img, m in zip(images, img_masks):
            tok = pg.multi_modal_projector(pg.vision_tower(img, self.compute_dtype))  # (B, P, D)
            embs.append(tok.to(self.compute_dtype))
            masks.append(m.bool()[:, None].expand(-1, tok.shape[1]))
            ars.append(torch.zeros(tok.shape[:2], dtype=torch.long, device=tok.device))
        embs.append(self.lm.embed(tokens).to(self.compute_dtype))
        masks.append(token_mask.bool())
        ars.append(torch.zeros_like(tokens) if token_ar_mask is None else token_ar_mask.long())
        return torch.cat(embs, 1), torch.cat(masks, 1), torch.cat(ars, 1)

    def transformer(self, x: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                    kv_cache: KVCache | None = None, pad_keys_to: int | None = None) -> tuple[torch.Tensor, KVCache]:
        """Gemma layers. x (B,T,D), mask (B,T,S), positions (B,T) -> (final-normed (B,T,D), per-layer k/v).

        ``kv_cache`` keys/values are prepended; ``pad_keys_to`` appends zero keys/values up to that length,
        as openpi's prefill attends over its whole (zero-initialised) cache: masked rows then average over it.
        """
        new_cache: KVCache = []
        for i, layer in enumerate(self.lm.layers):
            q, k, v, _ = layer.start(x)
            # as in openpi gemma_fast.py Attention: RoPE on q and k, then q *= head_dim**-0.5.
            q = apply_rope(q, positions) * torch.tensor(q.shape[-1] ** -0.5, dtype=q.dtype)
            k = apply_rope(k, positions)
            if kv_cache is not None:
                k, v = torch.cat([kv_cache[i][0], k], 1), torch.cat([kv_cache[i][1], v], 1)
            new_cache.append((k, v))
            if pad_keys_to is not None and pad_keys_to > k.shape[1]:
                pad = pad_keys_to - k.shape[1]
                k, v = F.pad(k, (0, 0, 0, 0, 0, pad)), F.pad(v, (0, 0, 0, 0, 0, pad))
            x = layer.finish(x, attention(q, k, v, mask, self.cfg.attn_implementation))
        return self.lm.norm(x), new_cache

    def logits(self, pre_logits: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, V) float32 through the tied embedding (openpi Embedder.decode)."""
        return (pre_logits @ self.lm.embed_tokens.weight.to(pre_logits.dtype).T).float()

    # ------------------------------------------------------------------ training
    def compute_loss(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], tokens: torch.Tensor,
                     token_mask: torch.Tensor, token_ar_mask: torch.Tensor, token_loss_mask: torch.Tensor
                     ) -> torch.Tensor:
        """Per-sample next-token cross-entropy (B,) over ``token_loss_mask[:, 1:]``.

        as in openpi pi0_fast.py compute_loss: one pass over images + tokens without the last token,
        positions 0..T-2 (arange, padding included), logits only for the last L-1 positions.
        """
        emb, mask, ar = self.embed_inputs(images, img_masks, tokens, token_mask, token_ar_mask)
        attn = make_attn_mask(mask, ar)[:, :-1, :-1]
        t = emb.shape[1] - 1
        positions = torch.arange(t, device=emb.device)[None].expand(emb.shape[0], -1)
        pre, _ = self.transformer(emb[:, :-1], attn, positions)
        targets = tokens[:, 1:].long()
        logp = torch.log_softmax(self.logits(pre[:, -targets.shape[1]:]), dim=-1)
        token_logp = logp.gather(-1, targets[..., None])[..., 0]  # (B, L-1)
        loss_mask = token_loss_mask[:, 1:].float()
        return -(token_logp * loss_mask).sum(-1) / loss_mask.sum(-1).clamp(min=1)

    # ------------------------------------------------------------------ decoding
    @staticmethod
    def right_align(x: torch.Tensor, mask: torch.Tensor, attn: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Roll each sample so its last valid token ends the sequence: x (B,T,D), mask (B,T), attn (B,T,T).

        as in openpi pi0_fast.py left_to_right_align: roll by -(index of the last valid token + 1).
        """
        b, t = mask.shape
        ar = torch.arange(t, device=mask.device)
        seqlen = (mask.long() * ar).max(-1).values + 1  # (B,)
        idx = (ar[None] + seqlen[:, None]) % t  # new[i] = old[(i + seqlen) % T]
        x = x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))
        attn = attn.gather(1, idx[..., None].expand(-1, -1, t)).gather(2, idx[:, None, :].expand(-1, t, -1))
        return x, mask.gather(1, idx), attn

    @torch.no_grad()
    def sample_tokens(self, images: list[torch.Tensor], img_masks: list[torch.Tensor], tokens: torch.Tensor,
                      token_mask: torch.Tensor, max_decoding_steps: int | None = None, temperature: float = 0.0,
                      generator: torch.Generator | None = None, use_kv_cache: bool = True,
                      early_stop: bool = True) -> torch.Tensor:
        """Decode (B, max_decoding_steps) long tokens after the prefix (greedy when temperature == 0).

        as in openpi pi0_fast.py sample_actions: right-align the prefix, prefill a KV cache of size
        prefix + steps, then one token per step; stop early once every sample has emitted EOS (openpi waits for
        all to emit it at the same step; the output is the same, since a sample's slots after its own EOS are 0 as
        when openpi serves it alone) (``early_stop=False``: always decode the whole budget, for benchmarks). Decoded tokens attend to cache slots [prefix_start, current) where
        prefix_start = T - sum(prefix_mask) (openpi's range mask). ``use_kv_cache=False`` recomputes the
        whole sequence every step (the benchmark baseline; the same tokens unless a camera is masked, whose
        fully-masked prefix rows then average over decoded keys instead of openpi's zero cache padding).
        """
        steps = int(max_decoding_steps or self.cfg.max_decoding_steps)
        emb, mask, ar = self.embed_inputs(images, img_masks, tokens, token_mask, None)
        emb, mask, attn = self.right_align(emb, mask, make_attn_mask(mask, ar))
        b, t = mask.shape
        dev = emb.device
        prefill_len = mask.long().sum(-1)  # (B,)
        prefix_start = t - prefill_len
        positions = torch.cumsum(mask.long(), 1) - 1
        attn = F.pad(attn, (0, steps))  # (B, T, T + steps): the cache size
        pre, cache = self.transformer(emb, attn, positions, pad_keys_to=t + steps)
        last_logit = self.logits(pre[:, -1])  # (B, V)
        out = torch.zeros(b, steps, dtype=torch.long, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)  # emitted EOS at some step
        all_pos, all_emb = positions, emb
        for step in range(steps):
            if temperature > 0.0:
                probs = torch.softmax(last_logit / temperature, -1)
                token = torch.multinomial(probs, 1, generator=generator)[:, 0]
            else:
                token = last_logit.argmax(-1)
            out[:, step] = token
            done |= token == PALIGEMMA_EOS_TOKEN
            if (early_stop and bool(done.all())) or step == steps - 1:
                break
            tok_emb = self.lm.embed(token[:, None]).to(self.compute_dtype)  # (B, 1, D)
            pos = (prefill_len + step + self.cfg.decode_position_offset)[:, None]
            keys = torch.arange(t + step + 1, device=dev)
            step_mask = (keys[None] >= prefix_start[:, None])[:, None, :]  # (B, 1, T + step + 1)
            if use_kv_cache:
                x, cache = self.transformer(tok_emb, step_mask, pos, kv_cache=cache)
                last_logit = self.logits(x[:, -1])
            else:
                all_emb, all_pos = torch.cat([all_emb, tok_emb], 1), torch.cat([all_pos, pos], 1)
                last_logit = self._recompute_last(all_emb, all_pos, attn, prefix_start, t, steps)
        # Slots after a sample's first EOS are 0, as when openpi serves that sample alone (batch 1): the
        # decoded output of a sample does not depend on what it was batched with.
        eos = (out == PALIGEMMA_EOS_TOKEN).long()
        return out.masked_fill((torch.cumsum(eos, 1) - eos) > 0, 0)

    def _recompute_last(self, emb: torch.Tensor, positions: torch.Tensor, prefix_attn: torch.Tensor,
                        prefix_start: torch.Tensor, t: int, steps: int) -> torch.Tensor:
        """No-cache decoding step: rerun prefix + decoded tokens (B, n, D) -> last logits (B, V)."""
        n = emb.shape[1]
        keys = torch.arange(t + steps, device=emb.device)  # the cache size, as in the cached path
        rows = torch.arange(t, n, device=emb.device)
        dec_rows = (keys[None, None] >= prefix_start[:, None, None]) & (keys[None, None] <= rows[None, :, None])
        mask = torch.cat([prefix_attn, dec_rows], 1)  # (B, n, T + steps)
        pre, _ = self.transformer(emb, mask, positions, pad_keys_to=t + steps)
        return self.logits(pre[:, -1])
