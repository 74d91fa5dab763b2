"""A draft with a trimmed vocabulary: its embedding and head rows cover a subset of the target's token ids.

A draft checkpoint directory may carry ``draft_vocab_map.json``:

    {"target_vocab_size": 49152,       # the full vocabulary the map's ids live in
     "ids": [0, 1, 2, 13, ...],         # ids[r] = the full-vocabulary id of the draft's row r (distinct)
     "fallback_row": 0}                 # the draft row an input id outside ``ids`` is fed as

The draft model itself is an ordinary checkpoint whose ``vocab_size`` is ``len(ids)``. The draft worker feeds it
``to_local(ids)`` and turns its logits back into the full vocabulary with ``-inf`` at every id outside the map
(``to_full``), before any sampling transform: every probability computed from them (softmax, top-k, top-p,
min-p) is then an exact 0 off the map, and the tokens drawn are full-vocabulary ids. So q is the law the draft
really samples from, defined over the target's whole vocabulary, and verification needs nothing new.

JSON rather than a tensor in the weights file: it is read without executing anything, and it is readable.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

MAP_FILE = "draft_vocab_map.json"


@dataclass(frozen=True)
class DraftVocabMap:
    ids: torch.Tensor  # [Vd] int64: the full-vocabulary id of each draft row
    local: torch.Tensor  # [Vt] int64: the draft row of each full-vocabulary id (fallback_row where unmapped)
    target_vocab_size: int
    fallback_row: int
    local_list: list[int]  # ``local`` as a host list: indexing a tensor per token is slow

    @staticmethod
    def build(ids: list[int], target_vocab_size: int, fallback_row: int = 0) -> DraftVocabMap:
        """Check and index a map (also used by training/ to write one)."""
        if not ids:
            raise ValueError("draft vocabulary map: 'ids' is empty")
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < target_vocab_size for i in ids):
            raise ValueError(f"draft vocabulary map: every id must be an int in [0, {target_vocab_size})")
        if len(set(ids)) != len(ids):
            raise ValueError("draft vocabulary map: 'ids' has duplicates (each draft row is one token)")
        if not 0 <= fallback_row < len(ids):
            raise ValueError(f"draft vocabulary map: fallback_row {fallback_row} is not a row in [0, {len(ids)})")
        idx = torch.tensor(ids, dtype=torch.long)  # [Vd]
        local = torch.full((target_vocab_size,), fallback_row, dtype=torch.long)  # [Vt]
        local[idx] = torch.arange(len(ids))
        return DraftVocabMap(idx, local, target_vocab_size, fallback_row, local.tolist())

    @staticmethod
    def load(model_path: str) -> DraftVocabMap | None:
        """The map of a draft checkpoint directory; None when it has none (a full or prefix vocabulary)."""
        path = os.path.join(model_path, MAP_FILE)
        if not os.path.isdir(model_path) or not os.path.isfile(path):
            return None
        with open(path) as f:
            raw = json.load(f)
        if not isinstance(raw, dict) or not isinstance(raw.get("ids"), list) \
                or not isinstance(raw.get("target_vocab_size"), int):
            raise ValueError(f"{path}: expected an object with 'ids' (list of ints) and 'target_vocab_size' (int)")
        return DraftVocabMap.build(raw["ids"], raw["target_vocab_size"], int(raw.get("fallback_row", 0)))

    def save(self, model_path: str) -> None:
        with open(os.path.join(model_path, MAP_FILE), "w") as f:
            json.dump({"target_vocab_size": self.target_vocab_size, "fallback_row": self.fallback_row,
                       "ids": self.ids.tolist()}, f)

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    def to_local(self, tokens: list[int]) -> list[int]:
        """Full-vocabulary ids -> draft rows (ids outside the map, or past it, -> the fallback row)."""
        local, fb = self.local_list, self.fallback_row
        n = len(local)
        return [local[t] if 0 <= t < n else fb for t in tokens]

    def to_full(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, Vd] draft logits -> [N, Vt]: the same values at the mapped ids, -inf elsewhere (probability 0)."""
        if logits.shape[0] == 0:  # no logit nodes this forward (the runner returns [0, 0])
            return logits.new_empty((0, self.target_vocab_size))
        out = torch.full((logits.shape[0], self.target_vocab_size), float("-inf"), dtype=logits.dtype,
                         device=logits.device)  # [N, Vt]
        out[:, self.ids.to(logits.device)] = logits
        return out
