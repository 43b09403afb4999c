"""Typed configuration of the pi0 model: Gemma / SigLIP variants, sizes and precision.

Every config is a plain dataclass that round-trips through ``to_dict`` / ``from_dict`` (that is what
``config.json`` of a checkpoint holds). Unknown keys or bad values raise ``ValueError`` at load time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

# as in openpi gemma.py get_config(): (width, depth, mlp_dim, num_heads, num_kv_heads, head_dim)
GEMMA_VARIANTS: dict[str, tuple[int, int, int, int, int, int]] = {
    "dummy": (64, 4, 128, 8, 1, 16),
    "gemma_300m": (1024, 18, 4096, 8, 1, 256),
    "gemma_2b": (2048, 18, 16_384, 8, 1, 256),
}

# as in big_vision vit.py decode_variant(): name -> (width, depth, mlp_dim, num_heads)
SIGLIP_VARIANTS: dict[str, tuple[int, int, int, int]] = {
    "mu": (32, 1, 128, 2),
    "Ti": (192, 12, 768, 3),
    "S": (384, 12, 1536, 6),
    "M": (512, 12, 2048, 8),
    "B": (768, 12, 3072, 12),
    "L": (1024, 24, 4096, 16),
    "So400m": (1152, 27, 4304, 16),
    "H": (1280, 32, 5120, 16),
    "g": (1408, 40, 6144, 16),
    "g-opt": (1536, 40, 6144, 16),
    "G": (1664, 48, 8192, 16),
    "G-opt": (1536, 48, 8192, 16),
    "e": (1792, 56, 15360, 16),
}

PALIGEMMA_VOCAB_SIZE = 257_152
DTYPES = ("float32", "bfloat16")
BF16_PRECISIONS = ("openpi", "high")  # Pi0Config.bf16_precision
CAMERA_KEYS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")


def check_keys(cls: type, data: dict[str, Any]) -> None:
    """Raise a ValueError naming every key of ``data`` that ``cls`` does not have."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown key(s) {unknown}; valid keys are {sorted(known)}")


def config_from_dict(cls: type, data: dict[str, Any], nested: dict[str, type] | None = None) -> Any:
    """``cls(**data)`` (a config's ``from_dict``): unknown keys raise ValueError naming them, and a dict under a key
    of ``nested`` becomes that config class (by its ``from_dict`` when it has one)."""
    data = dict(data)
    check_keys(cls, data)
    for key, sub in (nested or {}).items():
        if isinstance(data.get(key), dict):
            data[key] = sub.from_dict(data[key]) if hasattr(sub, "from_dict") else config_from_dict(sub, data[key])
    return cls(**data)


class DictConfig:
    """``to_dict`` / ``from_dict`` of a config dataclass; ``NESTED`` names its fields that hold other configs."""

    NESTED: ClassVar[dict[str, type]] = {}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready nested dict."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        """Inverse of ``to_dict``; unknown keys raise ValueError naming them."""
        return config_from_dict(cls, data, cls.NESTED)


@dataclass(frozen=True)
class GemmaConfig:
    """One Gemma transformer (the VLM backbone or the action expert)."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    variant: str = "custom"

    @classmethod
    def from_variant(cls, name: str) -> "GemmaConfig":
        """Config of a named openpi Gemma variant (``gemma_2b``, ``gemma_300m``, ``dummy``)."""
        if name not in GEMMA_VARIANTS:
            raise ValueError(f"unknown Gemma variant {name!r}; choose one of {sorted(GEMMA_VARIANTS)}")
        return cls(*GEMMA_VARIANTS[name], variant=name)

    def __post_init__(self) -> None:
        for f in ("width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim"):
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"GemmaConfig.{f} must be positive, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")


@dataclass(frozen=True)
class SiglipConfig:
    """SigLIP ViT image encoder, named like big_vision (``So400m/14``)."""

    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    patch_size: int = 14
    image_size: int = 224
    variant: str = "custom"

    @classmethod
    def from_variant(cls, name: str, image_size: int = 224) -> "SiglipConfig":
        """Config of a big_vision variant string such as ``So400m/14`` or ``mu/14``."""
        base, _, patch = name.partition("/")
        if base not in SIGLIP_VARIANTS or not patch.isdigit():
            raise ValueError(
                f"unknown SigLIP variant {name!r}; expected '<name>/<patch>' with name in {sorted(SIGLIP_VARIANTS)}"
            )
        return cls(*SIGLIP_VARIANTS[base], patch_size=int(patch), image_size=image_size, variant=name)

    @property
    def num_patches(self) -> int:
        """Tokens per image: (image_size / patch_size) ** 2."""
        return (self.image_size // self.patch_size) ** 2

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.width % self.num_heads:
            raise ValueError(f"SigLIP width {self.width} is not divisible by num_heads {self.num_heads}")


@dataclass(frozen=True)
class Pi0Config(DictConfig):
    """The whole pi0 model: PaliGemma (SigLIP + Gemma) + a Gemma action expert + flow-matching heads."""

    NESTED: ClassVar[dict[str, type]] = {"paligemma": GemmaConfig, "action_expert": GemmaConfig,
                                         "vision": SiglipConfig}

    paligemma: GemmaConfig = field(default_factory=lambda: GemmaConfig.from_variant("gemma_2b"))
    action_expert: GemmaConfig = field(default_factory=lambda: GemmaConfig.from_variant("gemma_300m"))
    vision: SiglipConfig = field(default_factory=lambda: SiglipConfig.from_variant("So400m/14"))
    vocab_size: int = PALIGEMMA_VOCAB_SIZE
    action_dim: int = 32
    action_horizon: int = 50
    max_token_len: int = 48
    num_cameras: int = 3
    dtype: str = "float32"
    # What dtype="bfloat16" does to the parameters openpi's mixed precision keeps in float32 storage (norm scales,
    # the action/time heads, SigLIP's patch and position embeddings): "openpi" rounds their values through bf16, as
    # openpi's serving restores every parameter as bfloat16 (restore_params(dtype=bfloat16)) and then computes the
    # heads in float32 on those bf16 values; "high" keeps their float32 values (a higher precision than openpi
    # serves with, so the rounding differs from openpi's bf16 output: tests/test_pi05.py measures both).
    bf16_precision: str = "openpi"
    # "sdpa": torch scaled_dot_product_attention (fused; 2x faster on CPU, same results to ~1e-6);
    # "eager": openpi's attention written out (float32 logits, BIG_NEG mask, float32 softmax).
    attn_implementation: str = "sdpa"
    # RL (CFG-style advantage conditioning): a learned, zero-initialised "optimality" embedding added to the
    # state token of the suffix. Off by default, so converted checkpoints load strictly and compute as before.
    optimality_condition: bool = False
    # RL (PPO): a value head V(observation) on detached features (pi0: the state token's expert output; pi0.5: the
    # mean prefix output), the per-decision baseline of ``algo.value_baseline``. Off by default, like the condition.
    value_head: bool = False
    # pi0.5 (openpi Pi0Config(pi05=True)): no state token; the action tokens are action_in_proj(x_t) alone and the
    # time enters through adaptive RMSNorms in the action expert (time_mlp_in/out -> adaRMS condition).
    pi05: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.bf16_precision not in BF16_PRECISIONS:
            raise ValueError(f"bf16_precision must be one of {BF16_PRECISIONS}, got {self.bf16_precision!r}")
        if self.attn_implementation not in ("eager", "sdpa"):
            raise ValueError(f"attn_implementation must be 'eager' or 'sdpa', got {self.attn_implementation!r}")
        a, b = self.paligemma, self.action_expert
        for f in ("depth", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(a, f) != getattr(b, f):
                raise ValueError(
                    f"the VLM and the action expert must share {f} for joint attention: "
                    f"{getattr(a, f)} != {getattr(b, f)}"
                )
        for f in ("vocab_size", "action_dim", "action_horizon", "max_token_len", "num_cameras"):
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"Pi0Config.{f} must be positive, got {getattr(self, f)}")

    @classmethod
    def tiny(cls, **overrides: Any) -> "Pi0Config":
        """The embedded default for tests and demos: openpi's ``dummy`` Gemma and SigLIP ``mu/14``."""
        kw: dict[str, Any] = dict(
            paligemma=GemmaConfig.from_variant("dummy"),
            action_expert=GemmaConfig.from_variant("dummy"),
            vision=SiglipConfig.from_variant("mu/14"),
            vocab_size=1024,
        )
        kw.update(overrides)
        return cls(**kw)
