"""PaliGemma prompt tokenizer in openpi's pi0 format, from a LOCAL sentencepiece model (no download).

Also builds a small offline sentencepiece model (the embedded default) with the same special ids as
PaliGemma's tokenizer: pad=0, eos=1, bos=2, unk=3.
"""

from __future__ import annotations

import io
import logging
import warnings
from pathlib import Path

import sentencepiece as spm
import torch

log = logging.getLogger(__name__)


def clean_prompt(text: str) -> str:
    """as in openpi tokenizer.py PaligemmaTokenizer: strip, '_' and newlines become spaces."""
    return text.strip().replace("_", " ").replace("\n", " ")


class PaligemmaTokenizer:
    """Prompt -> (tokens, mask): [bos] + encode(cleaned) + encode("\\n"), right-padded with 0 to ``max_len``."""

    def __init__(self, model_path: str | Path, max_len: int = 48):
        model_path = Path(model_path)
        if not model_path.is_file():
            raise FileNotFoundError(
                f"tokenizer model not found at {model_path}. pi0 needs PaliGemma's sentencepiece model "
                f"(paligemma_tokenizer.model) as a local file; nothing is downloaded."
            )
        self.model_path = model_path
        self.max_len = max_len
        self.sp = spm.SentencePieceProcessor(model_file=str(model_path))

    @property
    def vocab_size(self) -> int:
        """Number of pieces in the sentencepiece model."""
        return self.sp.get_piece_size()

    def encode_one(self, prompt: str, state_bins: list[int] | None = None) -> tuple[list[int], list[bool]]:
        """One prompt -> (ids, mask) lists of length ``max_len``; over-long prompts are truncated with a warning.

        as in openpi tokenizer.py PaligemmaTokenizer.tokenize: pi0 format ``[bos] + cleaned + "\n"``; with
        ``state_bins`` the pi0.5 discrete-state format ``[bos] + "Task: {cleaned}, State: {bins};\nAction: "``.
        """
        if state_bins is None:
            ids = self.sp.encode(clean_prompt(prompt), add_bos=True) + self.sp.encode("\n")
        else:
            text = f"Task: {clean_prompt(prompt)}, State: {' '.join(map(str, state_bins))};\nAction: "
            ids = self.sp.encode(text, add_bos=True)
        n = len(ids)
        if n > self.max_len:
            # as openpi does: warn and truncate to the token budget.
            warnings.warn(
                f"prompt is {n} tokens, longer than max_token_len={self.max_len}; truncating: {prompt[:60]!r}...",
                stacklevel=3,
            )
            ids, n = ids[: self.max_len], self.max_len
        return ids + [0] * (self.max_len - n), [True] * n + [False] * (self.max_len - n)

    def __call__(self, prompts: list[str], state_bins: list[list[int]] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """list of B prompts (+ B discretised states, pi0.5 format) -> tokens (B, max_len) long, mask (B, max_len)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        pairs = [self.encode_one(p, None if state_bins is None else state_bins[i]) for i, p in enumerate(prompts)]
        return (torch.tensor([p[0] for p in pairs], dtype=torch.long),
                torch.tensor([p[1] for p in pairs], dtype=torch.bool))


# A small corpus of manipulation instructions for the offline tokenizer of the embedded tiny model.
_CORPUS = [
    "pick up the black bowl between the plate and the ramekin and place it on the plate",
    "pick up the alphabet soup and place it in the basket",
    "open the top drawer of the cabinet", "put the bowl on the stove", "put the wine bottle on top of the cabinet",
    "turn on the stove", "push the plate to the front of the stove", "put the cream cheese in the bowl",
    "open the middle drawer of the cabinet and put the bowl inside", "put both moka pots on the stove",
    "push the red block onto the blue target", "move the green block to the yellow zone",
    "put the yellow and white mug in the microwave and close it", "stack the blue block on the red block",
    "pick up the ketchup and place it in the basket", "put the black bowl in the bottom drawer and close it",
]


def build_tokenizer_model(out_path: str | Path, vocab_size: int = 400) -> Path:
    """Train a tiny BPE sentencepiece model offline (deterministic, ~0.1 s) and write it to ``out_path``."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    sentences = [s for s in _CORPUS for _ in range(4)] + [s.upper() for s in _CORPUS]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3, user_defined_symbols=["\n"],
        normalization_rule_name="identity", add_dummy_prefix=False, num_threads=1, minloglevel=2,
        hard_vocab_limit=False, split_by_whitespace=True, remove_extra_whitespaces=False,
    )
    out_path.write_bytes(buf.getvalue())
    return out_path
