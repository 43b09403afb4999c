"""``PI0FASTPolicy``: pi0-FAST with openpi's policy I/O (normalization, FAST prompt format, action chunks).

Prompt format (as in openpi tokenizer.py FASTTokenizer): prefix = BOS + "Task: <prompt>, State: <s_1 ... s_n>;\\n"
with the normalized state discretised into 256 bins over [-1, 1]; postfix = "Action: " + action tokens + "|" +
EOS. FAST token t maps to PaliGemma id ``vocab_size - 1 - fast_skip_tokens - t`` (the end of the vocabulary).
The prefix is bidirectional (ar 0, no loss); the postfix is causal (ar 1) and carries the loss.

Directory format: model.safetensors + config.json (``"model_type": "pi0fast"``) + norm_stats.json +
tokenizer.model + fast_tokenizer/ (processor_config.json + tokenizer.json, the published FAST layout).
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pi0.models.config import CAMERA_KEYS, config_from_dict
from pi0.policies.fast_tokenizer import FASTTokenizer, synthetic_chunks
from pi0.models.init import check_init_mode, scratch_init_
from pi0.models.pi0fast import PALIGEMMA_EOS_TOKEN, PI0FASTModel, Pi0FASTConfig
from pi0.policies.normalize import MODES, NormStats, discretize_state, normalize, unnormalize
from pi0.policies.base import PretrainedPolicy
from pi0.policies.io import Observation, PolicyIO
from pi0.policies.tokenizer import PaligemmaTokenizer

MODEL_TYPE = "pi0fast"
FAST_DIR = "fast_tokenizer"
# How decoded tokens become a chunk: "openpi" (as openpi serves: zeros for a malformed output) or "best_effort".
DECODING_MODES = ("openpi", "best_effort")


class FASTPromptTokenizer:
    """Text + state + FAST action tokens <-> PaliGemma token sequences (openpi's pi0_fast layout)."""

    def __init__(self, text: PaligemmaTokenizer, fast: FASTTokenizer, vocab_size: int, skip: int = 128,
                 max_len: int = 250):
        self.text, self.fast, self.vocab_size, self.skip, self.max_len = text, fast, vocab_size, skip, max_len
        self.sp = text.sp
        self.action_prefix = self.sp.encode("Action: ")
        self.bar = self.sp.encode("|")
        lowest = int(self.to_pg(fast.bpe_vocab_size - 1))
        # a stand-in text tokenizer smaller than the model vocab must not share ids with the action range;
        # PaliGemma's own (full-vocab) tokenizer overlaps it by design, as in openpi, but not the 4 special ids.
        floor = text.vocab_size if text.vocab_size < vocab_size else 4
        if lowest < floor:
            raise ValueError(f"FAST vocab ({fast.bpe_vocab_size}) does not fit in ids [{floor}, "
                             f"{vocab_size - 1 - skip}] of the model vocab ({vocab_size}): use a smaller FAST vocab "
                             f"or a larger model vocab")

    def to_pg(self, fast_ids: Any) -> Any:
        """FAST ids -> PaliGemma ids (openpi _act_tokens_to_paligemma_tokens; the map is its own inverse)."""
        return self.vocab_size - 1 - self.skip - np.asarray(fast_ids)

    def tokenize(self, prompt: str, state: np.ndarray, actions: np.ndarray | None
                 ) -> tuple[list[int], list[bool], list[int], list[bool]]:
        """One sample -> (tokens, mask, ar, loss) lists of length max_len (right-padded, truncated with a warning)."""
        cleaned = prompt.lower().strip().replace("_", " ")
        state_str = " ".join(map(str, discretize_state(np.asarray(state)).tolist()))
        prefix = self.sp.encode(f"Task: {cleaned}, State: {state_str};\n", add_bos=True)
        postfix: list[int] = []
        if actions is not None:
            act = self.to_pg(self.fast.encode(np.asarray(actions)[None])[0]).tolist()
            postfix = self.action_prefix + act + self.bar + [PALIGEMMA_EOS_TOKEN]
        tokens = prefix + postfix
        ar, loss = [0] * len(prefix) + [1] * len(postfix), [False] * len(prefix) + [True] * len(postfix)
        n = len(tokens)
        if n > self.max_len:
            warnings.warn(f"pi0-FAST sequence is {n} tokens > max_token_len {self.max_len}; truncating", stacklevel=2)
            tokens, ar, loss, n = tokens[: self.max_len], ar[: self.max_len], loss[: self.max_len], self.max_len
        pad = self.max_len - n
        return tokens + [0] * pad, [True] * n + [False] * pad, ar + [0] * pad, loss + [False] * pad

    def batch(self, prompts: list[str], states: np.ndarray, actions: np.ndarray | None = None
              ) -> dict[str, torch.Tensor]:
        """B prompts, (B,S) normalized states, optional (B,T,D) normalized actions -> (B, max_len) tensors."""
        rows = [self.tokenize(p, s, None if actions is None else actions[i])
                for i, (p, s) in enumerate(zip(prompts, states))]
        cols = list(zip(*rows))
        return dict(tokens=torch.tensor(cols[0], dtype=torch.long), token_mask=torch.tensor(cols[1]),
                    token_ar_mask=torch.tensor(cols[2], dtype=torch.long), token_loss_mask=torch.tensor(cols[3]))

    def extract_actions(self, output: Any, horizon: int, dim: int, mode: str = "openpi"
                        ) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """(B, steps) decoded ids (array or lists) -> ((B, H, D) normalized chunks, ok (B,), problems); never raises.

        ``mode="openpi"`` gives openpi's chunk (``extract_actions_openpi``: zeros when the output holds no
        "Action: " or does not decode); ``"best_effort"`` the token-space chunk of ``diagnose``. Either way
        ``ok``/``problems`` come from ``diagnose`` plus openpi's failure, if any.
        """
        if mode not in DECODING_MODES:
            raise ValueError(f"action decoding mode must be one of {DECODING_MODES}, got {mode!r}")
        rows = output.tolist() if isinstance(output, (np.ndarray, torch.Tensor)) else [list(r) for r in output]
        chunks, oks, problems = [], [], []
        for row in rows:
            chunk, probs = self.diagnose(row, horizon, dim)
            if mode == "openpi":
                chunk, failure = self.extract_actions_openpi(row, horizon, dim)
                if failure and failure not in probs:
                    probs.append(failure)
            chunks.append(chunk)
            oks.append(not probs)
            problems.append("; ".join(probs))
        return np.stack(chunks), np.array(oks, dtype=bool), problems

    def extract_actions_openpi(self, row: list[int], horizon: int, dim: int) -> tuple[np.ndarray, str]:
        """One decoded row -> ((H, D) normalized chunk, failure or ''), exactly as openpi serves it.

        as in openpi tokenizer.py FASTTokenizer.extract_actions (+ ExtractFASTActions): decode the ids to text;
        no "Action: " -> zeros; else the text between the first "Action: " and the next "|", stripped,
        re-encoded, mapped to FAST ids and decoded by the FAST processor (any failure -> zeros).
        """
        try:
            text = self.sp.decode([int(t) for t in row])
        except Exception as e:  # noqa: BLE001 - an id outside the text vocabulary
            return np.zeros((horizon, dim)), f"output does not decode as text ({e}): zero chunk"
        if "Action: " not in text:
            return np.zeros((horizon, dim)), "no 'Action: ' in the decoded output: zero chunk"
        raw = self.sp.encode(text.split("Action: ")[1].split("|")[0].strip())
        return self.fast.decode_openpi(self.to_pg(np.asarray(raw, dtype=np.int64)).tolist(), horizon, dim)

    def diagnose(self, row: list[int], horizon: int, dim: int) -> tuple[np.ndarray, list[str]]:
        """One decoded row -> (best-effort (H, D) chunk, problems): a token-space reading of the output.

        After "Action: ", up to "|" / EOS; ids outside the FAST range are dropped and flagged; a missing
        "Action: " is flagged and decoding is attempted anyway.
        """
        lo, hi = self.to_pg(self.fast.bpe_vocab_size - 1), self.to_pg(0)
        probs = []
        if PALIGEMMA_EOS_TOKEN in row:
            row = row[: row.index(PALIGEMMA_EOS_TOKEN)]
        else:
            probs.append("no EOS (token budget exhausted)")
        k = len(self.action_prefix)
        if row[:k] == self.action_prefix:
            row = row[k:]
        else:
            probs.append("no 'Action: ' prefix")
        for i in range(len(row) - len(self.bar) + 1):
            if row[i:i + len(self.bar)] == self.bar:
                row = row[:i]
                break
        acts = [t for t in row if lo <= t <= hi]
        if len(acts) != len(row):
            probs.append(f"{len(row) - len(acts)} non-action token(s)")
        res = self.fast.decode([self.to_pg(acts).tolist()], horizon, dim)
        if res.problems[0]:
            probs.append(res.problems[0])
        return res.actions[0], probs


@dataclass
class FASTPolicyConfig:
    """Everything ``PI0FASTPolicy`` needs besides weights, norm stats and tokenizers (this is config.json)."""

    model: Pi0FASTConfig = field(default_factory=Pi0FASTConfig)
    n_action_steps: int = 5
    normalization: str = "quantile"  # openpi uses quantile normalization for pi0-FAST
    delta_action_dims: int = 0
    image_keys: tuple[str, ...] = CAMERA_KEYS
    temperature: float = 0.0
    action_decoding: str = "openpi"  # see DECODING_MODES; "openpi" gives a zero chunk for a malformed output
    model_type: str = MODEL_TYPE

    def __post_init__(self) -> None:
        if self.model_type != MODEL_TYPE:
            raise ValueError(f"model_type must be {MODEL_TYPE!r} for a pi0-FAST config, got {self.model_type!r}")
        if self.normalization not in MODES:
            raise ValueError(f"normalization must be one of {MODES}, got {self.normalization!r}")
        if not 1 <= self.n_action_steps <= self.model.action_horizon:
            raise ValueError(f"n_action_steps must be in [1, {self.model.action_horizon}], got {self.n_action_steps}")
        if len(self.image_keys) != self.model.num_cameras:
            raise ValueError(f"{len(self.image_keys)} image_keys for num_cameras={self.model.num_cameras}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.action_decoding not in DECODING_MODES:
            raise ValueError(f"action_decoding must be one of {DECODING_MODES}, got {self.action_decoding!r}")
        self.image_keys = tuple(self.image_keys)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; ``model_type`` first so loaders can dispatch."""
        d = dataclasses.asdict(self)
        return {"model_type": MODEL_TYPE, **d, "model": self.model.to_dict(), "image_keys": list(self.image_keys)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "FASTPolicyConfig":
        """Inverse of ``to_dict``; unknown keys raise ValueError naming them. A config.json written before
        ``action_decoding`` existed decoded best effort, and loads so."""
        return config_from_dict(cls, {"action_decoding": "best_effort", **data}, {"model": Pi0FASTConfig})


class PI0FASTPolicy(PretrainedPolicy, PolicyIO, nn.Module):
    """pi0-FAST with openpi's policy I/O and the same API as ``PI0Policy``."""

    MODEL_TYPE = MODEL_TYPE
    config_class, model_config_class, model_class = FASTPolicyConfig, Pi0FASTConfig, PI0FASTModel

    def __init__(self, config: FASTPolicyConfig, norm_stats: NormStats, tokenizer: PaligemmaTokenizer,
                 fast_tokenizer: FASTTokenizer, model: PI0FASTModel | None = None):
        super().__init__()
        self.config, self.norm_stats = config, norm_stats
        self.tokenizer, self.fast_tokenizer = tokenizer, fast_tokenizer
        self.model = model if model is not None else PI0FASTModel(config.model)
        for key in ("state", "actions"):
            if key not in norm_stats:
                raise ValueError(f"norm stats lack '{key}'")
        if config.normalization == "quantile" and norm_stats["actions"].q01 is None:
            raise ValueError("quantile normalization needs q01/q99 in norm_stats.json (or set normalization='zscore')")
        m = config.model
        if config.action_decoding == "openpi" and tokenizer.vocab_size < m.vocab_size:
            raise ValueError(f"action_decoding='openpi' reads the decoded ids as text, but the text tokenizer has "
                             f"{tokenizer.vocab_size} pieces for a model vocab of {m.vocab_size} (a stand-in?): "
                             f"pass PaliGemma's tokenizer, or for a model of your own set \"action_decoding\": "
                             f"\"best_effort\" in its config.json (or load_policy(dir, action_decoding='best_effort'))")
        self.prompt = FASTPromptTokenizer(tokenizer, fast_tokenizer, m.vocab_size, m.fast_skip_tokens, m.max_token_len)
        self._queue: collections.deque[torch.Tensor] = collections.deque()

    @classmethod
    def build(cls, config: FASTPolicyConfig, norm_stats: NormStats, tokenizer: PaligemmaTokenizer | str | Path,
              fast_tokenizer: FASTTokenizer | None = None, model: PI0FASTModel | None = None) -> "PI0FASTPolicy":
        """Constructor that accepts a tokenizer path and fits a stand-in FAST tokenizer when none is given."""
        if not isinstance(tokenizer, PaligemmaTokenizer):
            tokenizer = PaligemmaTokenizer(tokenizer, config.model.max_token_len)
        if fast_tokenizer is None:
            m = config.model
            floor = tokenizer.vocab_size if tokenizer.vocab_size < m.vocab_size else 4
            room = m.vocab_size - m.fast_skip_tokens - floor
            fast_tokenizer = FASTTokenizer.fit(list(synthetic_chunks(256, m.action_horizon, norm_stats["actions"].dim)),
                                               vocab_size=min(1024, room))
        return cls(config, norm_stats, tokenizer, fast_tokenizer, model)

    # ------------------------------------------------------------------ inputs
    def prepare_inputs(self, observation: Observation, actions: torch.Tensor | None = None) -> dict[str, Any]:
        """Validate an observation (+ raw (B,H,A) actions for training) -> model inputs."""
        images, masks, state, prompts = self.observation_inputs(observation)
        b, dev = state.shape[0], self.device
        mode = self.config.normalization
        norm_state = normalize(state, self.norm_stats["state"], mode).numpy()
        norm_actions = None
        if actions is not None:
            actions = torch.as_tensor(actions)
            h = self.config.model.action_horizon
            if actions.shape != (b, h, self.action_dim):
                raise ValueError(f"actions must be (B, {h}, {self.action_dim}), got {tuple(actions.shape)}")
            if self.config.delta_action_dims:
                d = self.config.delta_action_dims
                actions = actions.clone().double()
                actions[..., :d] -= state[:, None, :d].double()
            norm_actions = normalize(actions, self.norm_stats["actions"], mode).numpy()
        toks = {k: v.to(dev) for k, v in self.prompt.batch(prompts, norm_state, norm_actions).items()}
        return dict(images=images, img_masks=masks, raw_state=state, **toks)

    # ------------------------------------------------------------------ training
    def compute_loss(self, observation: Observation, actions: torch.Tensor) -> torch.Tensor:
        """Observation + raw env actions (B,H,A) -> per-sample cross-entropy (B,) on the postfix tokens."""
        inp = self.prepare_inputs(observation, actions)
        return self.model.compute_loss(inp["images"], inp["img_masks"], inp["tokens"], inp["token_mask"],
                                       inp["token_ar_mask"], inp["token_loss_mask"])

    # ------------------------------------------------------------------ acting
    @torch.no_grad()
    def predict_action_chunk_with_info(self, observation: Observation, noise: Any = None,
                                       generator: torch.Generator | None = None) -> dict[str, Any]:
        """Observation -> dict(actions (B,H,A) float32, actions_f64, output_tokens, ok (B,), problems, inputs).

        ``noise`` is accepted (and ignored) so flow-policy callers work unchanged. A malformed decoded
        sequence never raises: ``ok`` is False, ``problems`` says why, and the chunk follows
        ``config.action_decoding`` (openpi: zeros in normalized space, then the output transforms).
        """
        inp = self.prepare_inputs(observation)
        was_training = self.model.training
        self.model.eval()
        out = self.model.sample_tokens(inp["images"], inp["img_masks"], inp["tokens"], inp["token_mask"],
                                       self.config.model.max_decoding_steps, self.config.temperature, generator)
        self.model.train(was_training)
        norm, ok, problems = self.prompt.extract_actions(out.cpu().numpy(), self.config.model.action_horizon,
                                                         self.action_dim, self.config.action_decoding)
        # as in openpi Policy.infer: the model-input state is float32 (8-D, unpadded; the model never reads it).
        model_state = normalize(inp["raw_state"], self.norm_stats["state"], self.config.normalization).float()
        acts = self.postprocess_actions(torch.from_numpy(norm), model_state)
        return dict(actions=acts.float(), actions_f64=acts, model_actions=torch.from_numpy(norm).float(),
                    output_tokens=out, ok=ok, problems=problems, noise=noise, state=model_state,
                    lang_tokens=inp["tokens"], lang_masks=inp["token_mask"])

    def postprocess_actions(self, chunks: torch.Tensor, model_state: torch.Tensor) -> torch.Tensor:
        """Normalized chunks (B,H,A) + model-space state (B,S) -> env actions (B,H,A) float64.

        as in openpi's output transforms: Unnormalize (actions, and the state too), then AbsoluteActions adds the
        round-tripped state to the first ``delta_action_dims`` dims.
        """
        mode = self.config.normalization
        acts = unnormalize(chunks, self.norm_stats["actions"], mode)
        d = self.config.delta_action_dims
        if d:
            acts[..., :d] += unnormalize(model_state, self.norm_stats["state"], mode)[:, None, :d]
        return acts

    @torch.no_grad()
    def predict_action_chunk(self, observation: Observation, noise: Any = None) -> torch.Tensor:
        """Observation -> unnormalized env action chunk (B, H, action_dim) float32."""
        return self.predict_action_chunk_with_info(observation, noise)["actions"]

    def reset(self) -> None:
        """Clear the action queue (call at every episode start)."""
        self._queue.clear()

    @torch.no_grad()
    def select_action(self, observation: Observation) -> torch.Tensor:
        """Next env action (B, action_dim); a new chunk is decoded every ``n_action_steps`` calls."""
        if not self._queue:
            chunk = self.predict_action_chunk(observation)
            self._queue.extend(chunk[:, : self.config.n_action_steps].transpose(0, 1))
        return self._queue.popleft()

    # ------------------------------------------------------------------ persistence (the rest: PretrainedPolicy)
    def _save_extras(self, directory: Path) -> None:
        """The FAST tokenizer, in the published layout, under fast_tokenizer/."""
        self.fast_tokenizer.save_pretrained(directory / FAST_DIR)

    @classmethod
    def _load_extras(cls, directory: Path, config: FASTPolicyConfig) -> dict[str, Any]:
        """{"fast_tokenizer": the FAST tokenizer of the directory}."""
        return {"fast_tokenizer": FASTTokenizer.from_pretrained(directory / FAST_DIR)}

    @classmethod
    def random_init(cls, config: FASTPolicyConfig, norm_stats: NormStats, tokenizer: PaligemmaTokenizer,
                    fast_tokenizer: FASTTokenizer | None = None, seed: int = 0, std: float = 0.02,
                    init: str = "noisy") -> "PI0FASTPolicy":
        """A randomly initialised policy: ``init="noisy"`` (embedded default / tests: N(0, std) weights, noisy
        norms) or ``"scratch"`` (to train from scratch: :func:`pi0.models.init.scratch_init_`)."""
        check_init_mode(init)
        gen = torch.Generator().manual_seed(seed)
        model = PI0FASTModel(config.model)
        with torch.no_grad():
            if init == "scratch":
                scratch_init_(model, gen)
            else:
                for _, p in model.named_parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * (std if p.ndim > 1 else 0.1))
        return cls.build(config, norm_stats, tokenizer, fast_tokenizer, model).eval()
