"""The demo's text: a public-domain corpus shipped in ``examples/data/``, a byte tokenizer, batches.

Nothing is downloaded: the corpus is plain ASCII text in the repo (see ``data/README.md``) and
the tokenizer maps each UTF-8 byte to its value, plus two special ids.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import numpy as np

DATA_DIR = pathlib.Path(__file__).resolve().parent / "data"
TRAIN_FILE = "kjv_genesis_1-37.txt"  # fine-tuning text
EVAL_FILE = "kjv_ruth.txt"  # held-out text for the logit comparisons


def load_text(name: str) -> str:
    """The text of one corpus file in ``examples/data/`` (UTF-8)."""
    path = DATA_DIR / name
    if not path.is_file():
        available = sorted(p.name for p in DATA_DIR.glob("*.txt"))
        raise ValueError(f"no corpus file named {name!r} in {DATA_DIR}; available: {available}")
    return path.read_text(encoding="utf-8")


@dataclass(frozen=True)
class ByteTokenizer:
    """Bytes 0..255 are their own ids; ``bos_id`` = 256 and ``eos_id`` = 257 mark documents.

    ``vocab_size`` (258) is what the model's embedding needs. Decoding drops special ids and
    replaces invalid UTF-8 (it never raises), so any id sequence a model emits can be shown.
    """

    bos_id: int = 256
    eos_id: int = 257

    @property
    def vocab_size(self) -> int:
        return 258

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
        """``text`` → int64 ids [n], optionally framed by BOS/EOS."""
        ids = list(text.encode("utf-8"))
        ids = ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids) -> str:
        """int ids [n] → text; special ids are dropped."""
        raw = bytes(int(i) for i in np.asarray(ids).ravel() if 0 <= int(i) < 256)
        return raw.decode("utf-8", errors="replace")


def sample_batches(
    tokens: np.ndarray, *, batch_size: int, seq_len: int, steps: int, seed: int
) -> np.ndarray:
    """Random windows of ``seq_len + 1`` tokens, the same for a given seed.

    tokens: int64 [n] with n > seq_len + 1. Returns int64 [steps, batch_size, seq_len + 1];
    inputs are ``[..., :-1]``, targets ``[..., 1:]`` (or pass the whole window as ``labels`` to
    a transformers causal LM, which shifts internally).
    """
    for name, v in (("batch_size", batch_size), ("seq_len", seq_len), ("steps", steps)):
        if int(v) < 1:
            raise ValueError(f"{name} must be a positive integer; got {v!r}")
    n = len(tokens)
    if n < seq_len + 2:
        raise ValueError(f"tokens has {n} entries; need more than seq_len + 1 = {seq_len + 1}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, n - seq_len - 1, size=(steps, batch_size))
    return tokens[starts[..., None] + np.arange(seq_len + 1)]
