"""The target's features and next-token laws for EAGLE training, computed once and kept on disk.

Training a head needs, at every position of every training sequence, the target's hidden states at the head's
three layers (its input) and the target's next-token law (its label). Recomputing them with the target at every
optimiser step made the target's forward ~all of a step's time (SmolLM2: 14 s a step of 8 x 256 tokens on one
core); they do not change while the head trains, so they are computed once here and read back for every epoch.

    DIR/meta.json                   {"aux_layers": [2, 15, 27], "topk": 32, "target": ...}
    DIR/SOURCE-NNNN.safetensors     per shard of sequences:
        tokens [N] int32, lengths [S] int32, index [S] int32 (the row's "index"), answer_start [S] int32,
        aux [N, 3 H] float16 (the layers' input hidden states), top_ids [N, k] int32, top_logp [N, k] float16
        (the target's top-k next-token log-probabilities over its whole vocabulary, at every position)

SmolLM2 at 3 x 576 features: 3.5 kB a position (~0.6 GB for its 1,080 answered instructions). The target runs
through transformers in bfloat16 (``load_hf_target``, 2x our float32 forward on this CPU; its features are within
~1.4 % of the float32 ones and its top-1 is the 4-bit target's at the same rate: labels, not a reference).
Appending: rows already cached (by ``index``) are skipped, so the cache can be built while ``gen`` still writes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

CACHE_TOPK = 32  # labels kept per position: the head learns the law's top, not its tail (as the draft's distill)


@dataclass
class CachedSeq:
    """One cached sequence: the answer's positions are the ones trained on (position i predicts token i + 1)."""

    source: str
    index: int  # the row's "index" (gen: the composed instruction's number)
    ids: torch.Tensor  # [L] long
    answer_start: int  # first answer token (prompt tokens before it)
    aux: torch.Tensor  # [L, F] float16
    top_ids: torch.Tensor  # [L, k] long
    top_logp: torch.Tensor  # [L, k] float16

    @property
    def label_mask(self) -> torch.Tensor:
        """[L] bool: the positions whose next token is an answer token."""
        m = torch.zeros(len(self.ids), dtype=torch.bool)
        m[max(self.answer_start - 1, 0): len(self.ids) - 1] = True
        return m


def _cached_indices(cache: Path, source: str) -> tuple[set[int], int]:
    from safetensors import safe_open

    done: set[int] = set()
    shards = sorted(cache.glob(f"{source}-[0-9][0-9][0-9][0-9].safetensors"))
    for f in shards:
        with safe_open(str(f), "pt") as t:
            done.update(t.get_tensor("index").tolist())
    return done, len(shards)


def build_cache(target: str, rows: list[dict], cache: Path, source: str, aux_layers: tuple[int, ...],
                max_len: int = 512, minutes: float = 60.0, batch: int = 8, dtype: str = "bf16",
                shard_size: int = 128, log=print) -> dict:
    """Append the features and laws of ``rows`` ({"index", "prompt_ids", "answer_ids"}) not cached yet."""
    from safetensors.torch import save_file

    from training.smollm2_draft import load_hf_target

    start = time.perf_counter()
    cache.mkdir(parents=True, exist_ok=True)
    meta = {"aux_layers": list(aux_layers), "topk": CACHE_TOPK, "target": target}
    mfile = cache / "meta.json"
    if mfile.is_file() and json.loads(mfile.read_text())["aux_layers"] != meta["aux_layers"]:
        raise ValueError(f"{cache} holds features of layers {json.loads(mfile.read_text())['aux_layers']}, "
                         f"not {list(aux_layers)}: use another cache directory")
    mfile.write_text(json.dumps(meta))
    done, shard = _cached_indices(cache, source)
    todo = [r for r in rows if r["index"] not in done and r["answer_ids"]]
    if not todo:
        return {"source": source, "cached": len(done), "new": 0}
    teacher = load_hf_target(target)
    if dtype == "bf16":
        teacher = teacher.to(torch.bfloat16)
    buf: list[dict] = []
    n_new = n_pos = 0

    def flush() -> None:
        nonlocal shard, buf
        if not buf:
            return
        save_file({
            "tokens": torch.tensor([t for r in buf for t in r["ids"]], dtype=torch.int32),  # [N]
            "lengths": torch.tensor([len(r["ids"]) for r in buf], dtype=torch.int32),  # [S]
            "index": torch.tensor([r["index"] for r in buf], dtype=torch.int32),  # [S]
            "answer_start": torch.tensor([r["answer_start"] for r in buf], dtype=torch.int32),  # [S]
            "aux": torch.cat([r["aux"] for r in buf]),  # [N, F] float16
            "top_ids": torch.cat([r["top_ids"] for r in buf]),  # [N, k] int32
            "top_logp": torch.cat([r["top_logp"] for r in buf]),  # [N, k] float16
        }, str(cache / f"{source}-{shard:04d}.safetensors"))
        shard += 1
        buf = []

    todo.sort(key=lambda r: len(r["prompt_ids"]) + len(r["answer_ids"]))  # similar lengths pad little
    for b in range(0, len(todo), batch):
        if time.perf_counter() - start > minutes * 60:
            break
        chunk = todo[b: b + batch]
        seqs = [(r["prompt_ids"] + r["answer_ids"])[:max_len] for r in chunk]
        n = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), n, dtype=torch.long)  # [B, n], right-padded: real rows never see the pad
        mask = torch.zeros(len(seqs), n, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        with torch.no_grad():
            out = teacher(ids, attention_mask=mask, output_hidden_states=True)
            # hidden_states[i] is the input of layer i (the residual stream), what workers/models/llama.py captures
            aux = torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1).to(torch.float16)  # [B, n, F]
            top = torch.log_softmax(out.logits.float(), dim=-1).topk(CACHE_TOPK, dim=-1)  # [B, n, k]
        for i, (r, s) in enumerate(zip(chunk, seqs, strict=True)):
            m = len(s)
            buf.append({"ids": s, "index": r["index"], "answer_start": min(len(r["prompt_ids"]), m),
                        "aux": aux[i, :m].clone(), "top_ids": top.indices[i, :m].to(torch.int32),
                        "top_logp": top.values[i, :m].to(torch.float16)})
            n_new += 1
            n_pos += m
        if len(buf) >= shard_size:
            flush()
            log(f"cache {source}: {n_new}/{len(todo)} sequences, {n_pos} positions, "
                f"{time.perf_counter() - start:.0f} s")
    flush()
    return {"source": source, "cached": len(done) + n_new, "new": n_new, "positions": n_pos,
            "seconds": round(time.perf_counter() - start, 1)}


def read_cache(cache: Path, sources: list[str]) -> dict[str, list[CachedSeq]]:
    """Every cached sequence of ``sources``, shard by shard (index order within a shard is length order)."""
    from safetensors.torch import load_file

    out: dict[str, list[CachedSeq]] = {}
    for src in sources:
        seqs: list[CachedSeq] = []
        for f in sorted(cache.glob(f"{src}-[0-9][0-9][0-9][0-9].safetensors")):
            t = load_file(str(f))
            off = 0
            for n, a, i in zip(t["lengths"].tolist(), t["answer_start"].tolist(), t["index"].tolist(), strict=True):
                sl = slice(off, off + n)
                seqs.append(CachedSeq(src, i, t["tokens"][sl].long(), a, t["aux"][sl], t["top_ids"][sl].long(),
                                      t["top_logp"][sl]))
                off += n
        out[src] = seqs
    return out


def cache_meta(cache: Path) -> dict:
    return json.loads((cache / "meta.json").read_text())
