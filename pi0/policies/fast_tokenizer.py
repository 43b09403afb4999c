"""FAST action tokenizer: per-dimension DCT over an action chunk, scale + round, then byte-level BPE.

Our own implementation of the FAST scheme (Pertsch et al. 2025), fitted locally with the ``tokenizers``
library; the saved directory has the published tokenizer's layout (physical-intelligence/fast):
``processor_config.json`` (scale, vocab_size, min_token, time_horizon, action_dim) + ``tokenizer.json``
(a byte-level BPE over the string whose characters are the shifted integer DCT coefficients) +
``tokenizer_config.json`` / ``special_tokens_map.json``.

Encoding of one chunk (T, D): c = round(dct(chunk, axis=time, norm="ortho") * scale); the (T, D) array is
flattened frequency-major (all dims of frequency 0, then frequency 1, ...); each value v becomes the
character chr(max(v - min_token, 0)); the string is BPE-encoded. Decoding inverts every step and never
raises: a malformed token sequence gives a best-effort chunk and ``ok = False``.

CLI::

    python -m pi0.policies.fast_tokenizer fit --data chunks.npy --out DIR [--scale 10 --vocab_size 1024]
    python -m pi0.policies.fast_tokenizer roundtrip --tokenizer DIR --data chunks.npy
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from scipy.fft import dct, idct

log = logging.getLogger(__name__)

PROCESSOR_CONFIG = "processor_config.json"
TOKENIZER_JSON = "tokenizer.json"
REPLACEMENT_CHAR = 0xFFFD  # what a byte-level decoder emits for an invalid UTF-8 byte sequence


def _tokenizers():
    """Import the ``tokenizers`` library with an actionable error."""
    try:
        import tokenizers
    except ImportError as e:  # pragma: no cover - pinned in requirements.lock
        raise ImportError("the FAST tokenizer needs the `tokenizers` package: pip install tokenizers") from e
    return tokenizers


def dct_coefficients(chunks: np.ndarray, scale: float) -> np.ndarray:
    """(B, T, D) or (T, D) float chunks -> rounded, scaled DCT-II (ortho) coefficients, same shape, int64.

    as in the FAST paper / published processor: DCT over the time axis for every action dim, times scale, rounded.
    """
    chunks = np.asarray(chunks, dtype=np.float64)
    return np.around(dct(chunks, axis=-2, norm="ortho") * scale).astype(np.int64)


def coefficients_to_chunk(coeffs: np.ndarray, scale: float) -> np.ndarray:
    """(..., T, D) integer coefficients -> (..., T, D) float chunk via the orthonormal inverse DCT."""
    return idct(np.asarray(coeffs, dtype=np.float64) / scale, axis=-2, norm="ortho")


def clean_up_tokenization(text: str) -> str:
    """transformers' ``PreTrainedTokenizerBase.clean_up_tokenization``: drop the space before . ? ! , and
    English contractions (applied by the published FAST processor when its config sets the flag)."""
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                     (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(old, new)
    return text


@dataclass
class DecodeResult:
    """Decoded chunks (B, T, D) float64, ``ok`` (B,) bool (False = malformed input, chunk is best effort)
    and one human-readable ``problems`` string per sample ('' when ok)."""

    actions: np.ndarray
    ok: np.ndarray
    problems: list[str]


class FASTTokenizer:
    """DCT + BPE action tokenizer (published FAST format)."""

    def __init__(self, bpe, scale: float = 10.0, vocab_size: int = 1024, min_token: int = 0,
                 time_horizon: int | None = None, action_dim: int | None = None,
                 clean_up_tokenization_spaces: bool = False):
        self.bpe = bpe  # tokenizers.Tokenizer
        self.scale = float(scale)
        self.vocab_size = int(vocab_size)
        self.min_token = int(min_token)
        self.time_horizon = time_horizon
        self.action_dim = action_dim
        # tokenizer_config.json's flag: the published processor decodes through transformers'
        # PreTrainedTokenizerFast, which then applies clean_up_tokenization to the decoded string.
        self.clean_up_tokenization_spaces = bool(clean_up_tokenization_spaces)

    # ------------------------------------------------------------------ encode
    @property
    def bpe_vocab_size(self) -> int:
        """Number of BPE tokens actually in the vocabulary (ids are 0 .. bpe_vocab_size - 1)."""
        return self.bpe.get_vocab_size()

    def to_string(self, coeffs: np.ndarray) -> str:
        """(T, D) int coefficients -> the BPE input string (frequency-major, shifted by min_token, clipped at 0)."""
        return "".join(map(chr, np.maximum(coeffs.reshape(-1) - self.min_token, 0).tolist()))

    def encode(self, chunks: np.ndarray) -> list[list[int]]:
        """(B, T, D) or (T, D) action chunk(s) (already normalized) -> one list of token ids per chunk."""
        chunks = np.asarray(chunks)
        if chunks.ndim == 2:
            chunks = chunks[None]
        if chunks.ndim != 3:
            raise ValueError(f"FAST encode expects (T, D) or (B, T, D) chunks, got shape {chunks.shape}")
        if not np.isfinite(chunks).all():
            raise ValueError("FAST encode: action chunk contains NaN or inf")
        coeffs = dct_coefficients(chunks, self.scale)
        return [self.bpe.encode(self.to_string(c)).ids for c in coeffs]

    __call__ = encode

    # ------------------------------------------------------------------ decode
    def decode_one(self, tokens: Sequence[int], time_horizon: int, action_dim: int) -> tuple[np.ndarray, str]:
        """Token ids -> ((T, D) chunk, problem description or '') ; never raises.

        Best effort on malformed input: unknown ids are dropped, undecodable bytes count as coefficient 0,
        a coefficient string that is too short is zero-padded (missing high frequencies), one too long is cut.
        """
        n = time_horizon * action_dim
        problems = []
        try:
            ids = [int(t) for t in tokens]
        except (TypeError, ValueError):
            return np.zeros((time_horizon, action_dim)), "tokens are not integers"
        valid = [t for t in ids if 0 <= t < self.bpe_vocab_size]
        if len(valid) != len(ids):
            problems.append(f"{len(ids) - len(valid)} token id(s) outside [0, {self.bpe_vocab_size})")
        try:
            text = self.bpe.decode(valid)
        except Exception as e:  # noqa: BLE001 - a rollout must never crash on a bad sequence
            return np.zeros((time_horizon, action_dim)), f"BPE decode failed: {e}"
        codes = np.array([ord(ch) for ch in text], dtype=np.int64)
        bad = codes == REPLACEMENT_CHAR
        if bad.any():
            problems.append(f"{int(bad.sum())} undecodable byte sequence(s)")
        coeffs = np.where(bad, 0, codes + self.min_token)
        if coeffs.size != n:
            problems.append(f"{coeffs.size} coefficients, expected {n} = {time_horizon} x {action_dim}")
            coeffs = np.concatenate([coeffs, np.zeros(max(0, n - coeffs.size), np.int64)])[:n]
        if not valid:
            problems.append("empty token sequence")
        chunk = coefficients_to_chunk(coeffs.reshape(time_horizon, action_dim), self.scale)
        return chunk, "; ".join(problems)

    def decode_text(self, ids: Sequence[int]) -> str:
        """BPE ids -> the coefficient string, as the published processor's ``bpe_tokenizer.decode`` gives it.

        Raises what the ``tokenizers`` library raises (e.g. OverflowError for a negative id); ids past the
        vocabulary are skipped by the library.
        """
        text = self.bpe.decode([int(t) for t in ids], skip_special_tokens=False)
        return clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def decode_openpi(self, tokens: Sequence[int], time_horizon: int, action_dim: int) -> tuple[np.ndarray, str]:
        """Token ids -> ((T, D) chunk, problem or ''), exactly as the published processor's ``decode``.

        as in physical-intelligence/fast UniversalActionProcessor.decode: chars -> ord + min_token, reshape
        (-1, D), which must be (T, D); any failure gives a zero coefficient array (a zero chunk).
        """
        try:
            codes = np.array([ord(ch) for ch in self.decode_text(tokens)], dtype=np.int64) + self.min_token
            coeffs = codes.reshape(-1, action_dim)
            if coeffs.shape != (time_horizon, action_dim):
                raise ValueError(f"{codes.size} coefficients, expected {time_horizon} x {action_dim}")
            problem = ""
        except Exception as e:  # noqa: BLE001 - as the published decode: never raise, give zeros
            coeffs, problem = np.zeros((time_horizon, action_dim)), f"FAST decode failed ({e}): zero chunk"
        return coefficients_to_chunk(coeffs, self.scale), problem

    def decode(self, tokens: Iterable[Sequence[int]], time_horizon: int | None = None,
               action_dim: int | None = None) -> DecodeResult:
        """B token lists -> DecodeResult((B, T, D) chunks, ok (B,), problems); never raises on bad tokens."""
        t = time_horizon or self.time_horizon
        d = action_dim or self.action_dim
        if t is None or d is None:
            raise ValueError("FAST decode needs time_horizon and action_dim (pass them or save them in the config)")
        outs = [self.decode_one(tok, t, d) for tok in tokens]
        actions = np.stack([o[0] for o in outs]) if outs else np.zeros((0, t, d))
        problems = [o[1] for o in outs]
        return DecodeResult(actions, np.array([not p for p in problems], dtype=bool), problems)

    # ------------------------------------------------------------------ fit / save / load
    @classmethod
    def fit(cls, chunks: Sequence[np.ndarray] | np.ndarray, scale: float = 10.0, vocab_size: int = 1024,
            time_horizon: int | None = None, action_dim: int | None = None,
            min_frequency: int = 2) -> "FASTTokenizer":
        """Fit the BPE vocabulary on action chunks (each (T, D), normalized) -> a tokenizer.

        As in the published fit: min_token = min of all rounded coefficients; the initial alphabet is every
        character of the coefficient range. We also add the 256 byte-level characters so that ANY integer
        (also outside the fitted range) stays encodable and the round trip is lossless.
        """
        tk = _tokenizers()
        arrs = [np.asarray(c, dtype=np.float64) for c in chunks]
        if not arrs:
            raise ValueError("FASTTokenizer.fit: no action chunks given")
        if any(a.ndim != 2 for a in arrs):
            raise ValueError("FASTTokenizer.fit: every chunk must be (T, D)")
        coeffs = [dct_coefficients(a, scale).reshape(-1) for a in arrs]
        flat = np.concatenate(coeffs)
        min_token, max_token = int(flat.min()), int(flat.max())
        alphabet = [chr(i) for i in range(max_token - min_token + 1)]
        byte_alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(set(byte_alphabet)):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the 256 byte-level base characters")
        if max_token - min_token + 100 > vocab_size:
            log.warning("coefficient range %d is close to vocab_size %d: few merges left; raise vocab_size "
                        "or lower scale", max_token - min_token, vocab_size)
        bpe = tk.Tokenizer(tk.models.BPE())
        bpe.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = tk.decoders.ByteLevel()
        bpe.post_processor = tk.processors.ByteLevel(trim_offsets=False)
        trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                         special_tokens=[], initial_alphabet=alphabet + byte_alphabet,
                                         max_token_length=10000)
        shift = lambda c: "".join(map(chr, (c - min_token).tolist()))  # noqa: E731
        bpe.train_from_iterator((shift(c) for c in coeffs), trainer=trainer)
        t0, d0 = arrs[0].shape
        return cls(bpe, scale, vocab_size, min_token, time_horizon or t0, action_dim or d0)

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write processor_config.json + tokenizer.json (+ HF tokenizer_config / special_tokens_map)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        cfg = dict(action_dim=self.action_dim, min_token=self.min_token, processor_class="UniversalActionProcessor",
                   scale=self.scale, time_horizon=self.time_horizon, vocab_size=self.vocab_size)
        (directory / PROCESSOR_CONFIG).write_text(json.dumps(cfg, indent=2))
        self.bpe.save(str(directory / TOKENIZER_JSON))
        (directory / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast",
             "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces}, indent=2))
        (directory / "special_tokens_map.json").write_text("{}")
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "FASTTokenizer":
        """Load a directory written by ``save_pretrained`` (or the published tokenizer's files)."""
        directory = Path(directory)
        missing = [f for f in (PROCESSOR_CONFIG, TOKENIZER_JSON) if not (directory / f).is_file()]
        if missing:
            raise FileNotFoundError(f"FAST tokenizer directory {directory} lacks {missing}; fit one with "
                                    f"`python -m pi0.policies.fast_tokenizer fit --data chunks.npy --out {directory}`")
        try:
            cfg = json.loads((directory / PROCESSOR_CONFIG).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{directory / PROCESSOR_CONFIG} is not valid JSON: {e}") from e
        tok_cfg_path = directory / "tokenizer_config.json"
        if not tok_cfg_path.is_file():
            log.warning("%s has no tokenizer_config.json: assuming clean_up_tokenization_spaces=False (the published "
                        "FAST tokenizer sets it; copy its tokenizer_config.json beside tokenizer.json)", directory)
        try:
            tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.is_file() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{tok_cfg_path} is not valid JSON: {e}") from e
        bpe = _tokenizers().Tokenizer.from_file(str(directory / TOKENIZER_JSON))
        return cls(bpe, scale=cfg.get("scale", 10.0), vocab_size=cfg.get("vocab_size", 1024),
                   min_token=cfg.get("min_token", 0), time_horizon=cfg.get("time_horizon"),
                   action_dim=cfg.get("action_dim"),
                   clean_up_tokenization_spaces=tok_cfg.get("clean_up_tokenization_spaces", False))


def synthetic_chunks(n: int, horizon: int, dim: int, seed: int = 0, noise: float = 0.0) -> np.ndarray:
    """(n, horizon, dim) smooth random chunks in about [-1, 1] (sums of low-frequency sines) + optional noise."""
    rng = np.random.default_rng(seed)
    t = np.linspace(0, 1, horizon)[None, :, None]
    amp = rng.uniform(-0.5, 0.5, (n, 1, dim, 3))
    freq = rng.uniform(0.2, 1.5, (n, 1, dim, 3))
    phase = rng.uniform(0, 2 * np.pi, (n, 1, dim, 3))
    x = (amp * np.sin(2 * np.pi * freq * t[..., None] + phase)).sum(-1)
    return x + noise * rng.standard_normal(x.shape)


def _load_chunks(path: str) -> np.ndarray:
    """.npy / .npz (first array) of shape (N, T, D) with clear errors."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--data {p} does not exist (expected a .npy/.npz array of shape (N, T, D))")
    arr = np.load(p)
    if isinstance(arr, np.lib.npyio.NpzFile):
        arr = arr[arr.files[0]]
    if arr.ndim != 3:
        raise ValueError(f"--data {p}: expected (N, T, D) normalized action chunks, got shape {arr.shape}")
    return arr


def main(argv: list[str] | None = None) -> None:
    """CLI: ``fit`` a tokenizer on (N, T, D) chunks, or report the ``roundtrip`` error of one."""
    ap = argparse.ArgumentParser(prog="python -m pi0.policies.fast_tokenizer", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit a FAST tokenizer on normalized action chunks")
    f.add_argument("--data", required=True, help=".npy/.npz with (N, T, D) normalized action chunks")
    f.add_argument("--out", required=True)
    f.add_argument("--scale", type=float, default=10.0)
    f.add_argument("--vocab_size", type=int, default=1024)
    r = sub.add_parser("roundtrip", help="token count and reconstruction error on chunks")
    r.add_argument("--tokenizer", required=True)
    r.add_argument("--data", required=True)
    args = ap.parse_args(argv)
    chunks = _load_chunks(args.data)
    if args.cmd == "fit":
        tok = FASTTokenizer.fit(list(chunks), scale=args.scale, vocab_size=args.vocab_size)
        tok.save_pretrained(args.out)
        print(f"fitted on {len(chunks)} chunks {chunks.shape[1:]}: {tok.bpe_vocab_size} tokens, "
              f"min_token {tok.min_token} -> {args.out}")
    else:
        tok = FASTTokenizer.from_pretrained(args.tokenizer)
        ids = tok.encode(chunks)
        res = tok.decode(ids, chunks.shape[1], chunks.shape[2])
        err = np.abs(res.actions - chunks)
        print(f"{len(chunks)} chunks: mean {np.mean([len(i) for i in ids]):.1f} tokens/chunk "
              f"({chunks.shape[1] * chunks.shape[2]} values), max abs error {err.max():.4g}, "
              f"mean abs error {err.mean():.4g}, malformed {int((~res.ok).sum())}")


if __name__ == "__main__":
    main()
