"""Init-state splits and sampling across tasks, and the per-state history used to skip solved states (stage 8)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np


def split_states(task_ids: Sequence[int], train: int, eval_start: int, eval_count: int
                 ) -> tuple[dict[int, range], list[tuple[int, int]]]:
    """Training ids 0..train-1 per task and held-out eval pairs eval_start..eval_start+eval_count-1."""
    if eval_count and eval_start < train:
        raise ValueError(f"held-out init states start at {eval_start} < train_states {train}: they would overlap")
    return ({int(t): range(train) for t in task_ids},
            [(int(t), i) for t in task_ids for i in range(eval_start, eval_start + eval_count)])


class InitStateSampler:
    """Draws ``(task_id, init_state_id)`` pairs from per-task id lists of any lengths (flattened, not stacked)."""

    def __init__(self, states_per_task: Mapping[int, Sequence[int]], seed: int = 0):
        self.pairs = [(int(t), int(s)) for t, ids in sorted(states_per_task.items()) for s in ids]
        if not self.pairs:
            raise ValueError("no init states to sample from (every task has an empty id list)")
        self.rng = np.random.default_rng(seed)
        self._order: list[int] = []

    def __len__(self) -> int:
        return len(self.pairs)

    def next(self) -> tuple[int, int]:
        """Next pair of a reshuffled pass over all pairs (each pair once per pass)."""
        if not self._order:
            self._order = list(self.rng.permutation(len(self.pairs)))
        return self.pairs[self._order.pop()]

    def put_back(self, states: Sequence[tuple[int, int]]) -> None:
        """Return drawn but unused pairs: the next ``len(states)`` draws give them again, in the same order."""
        index = {p: i for i, p in enumerate(self.pairs)}
        for s in reversed(list(states)):
            self._order.append(index[(int(s[0]), int(s[1]))])

    def sample(self, n: int) -> list[tuple[int, int]]:
        """``n`` pairs (epoch-style without replacement, wrapping into the next pass)."""
        return [self.next() for _ in range(n)]


class InitStateHistory:
    """Per-state record of the last group's rewards; a state whose last K rollouts all succeeded is skipped,
    and re-probed after ``reprobe_after`` skips. Saved / loaded as JSON."""

    def __init__(self, reprobe_after: int = 5):
        if reprobe_after < 1:
            raise ValueError(f"reprobe_after must be >= 1, got {reprobe_after}")
        self.reprobe_after = int(reprobe_after)
        self.last: dict[tuple[int, int], list[float]] = {}
        self.skips: dict[tuple[int, int], int] = {}

    def update(self, state: tuple[int, int], rewards: Sequence[float]) -> None:
        """Record the rewards of the latest group of ``state``."""
        key = (int(state[0]), int(state[1]))
        self.last[key] = [float(r) for r in rewards]
        self.skips[key] = 0

    def solved(self, state: tuple[int, int]) -> bool:
        """True if the last group of ``state`` succeeded every time."""
        r = self.last.get((int(state[0]), int(state[1])))
        return bool(r) and min(r) >= 1.0

    def should_skip(self, state: tuple[int, int]) -> bool:
        """True for a solved state that has not yet been skipped ``reprobe_after`` times (counts the skip)."""
        key = (int(state[0]), int(state[1]))
        if not self.solved(key):
            return False
        if self.skips.get(key, 0) >= self.reprobe_after:
            self.skips[key] = 0
            return False
        self.skips[key] = self.skips.get(key, 0) + 1
        return True

    def to_json(self) -> dict:
        """JSON-ready dict."""
        return {"reprobe_after": self.reprobe_after,
                "states": [{"task_id": t, "init_state_id": s, "rewards": r, "skips": self.skips.get((t, s), 0)}
                           for (t, s), r in sorted(self.last.items())]}

    def load_json(self, data: dict) -> None:
        """Replace the entries with those of :meth:`to_json`'s dict (resume)."""
        self.last = {(int(e["task_id"]), int(e["init_state_id"])): [float(r) for r in e["rewards"]]
                     for e in data["states"]}
        self.skips = {(int(e["task_id"]), int(e["init_state_id"])): int(e.get("skips", 0)) for e in data["states"]}

    def save(self, path: str | Path) -> Path:
        """Write the history as JSON."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "InitStateHistory":
        """Read a history written by :meth:`save` (clear error for a missing or malformed file)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"init-state history {path} does not exist (omit it to start a fresh history)")
        try:
            data = json.loads(path.read_text())
            h = cls(int(data["reprobe_after"]))
            for e in data["states"]:
                key = (int(e["task_id"]), int(e["init_state_id"]))
                h.last[key] = [float(r) for r in e["rewards"]]
                h.skips[key] = int(e.get("skips", 0))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path} is not an init-state history JSON: {err}") from err
        return h
