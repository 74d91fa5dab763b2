"""python -m training.eagle_capture: the target's answers and their EAGLE training features in one pass (a CPU).

training/eagle_cache.py runs the target twice per token: once to write an answer (``training.smollm2_draft gen``),
once more to read its features and laws. Here the answer's own decode steps are kept instead: transformers'
``generate`` returns every step's hidden states and logits, and those are what a teacher-forced pass would give
(checked: equal bits on an unpadded row), so each token costs one forward. Batches of answers are written in
training/eagle_cache.py's shard layout, so ``python -m training.eagle --cache DIR`` trains from them.

    OMP_NUM_THREADS=1 python -m training.eagle_capture --target smollm2 --cache runs/eagle_cap/cache --minutes 60
    python -m training.eagle --target smollm2 --work runs/eagle_cap --cache runs/eagle_cap/cache --docs 0 ...

What is written: training/eagle_online.py's plan (each training instruction answered greedily, then sampled copies
by temperature; a few self-written instructions), in that fixed order, so a later run with the same arguments
resumes after the rows already cached. The target runs in bfloat16 (as eagle_cache.py's; ~1.7x float32 here).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from training.eagle_cache import CACHE_TOPK
from training.eagle_online import GenConfig, left_padded, sampling, self_written_instructions, temperature_groups


def plan(tok: Any, cfg: GenConfig, asks: list[str]) -> list[tuple[int, list[int], float]]:
    """(instruction index, prompt ids, temperature) of every answer, in the order they are written (the order of
    training/eagle_online.py's ``write_data``)."""
    from training.smollm2_draft import _chat_ids, compose_prompts, is_heldout

    train = [(i, _chat_ids(tok, p)) for i, p in enumerate(compose_prompts()) if not is_heldout(i)]
    if cfg.instructions is not None:
        train = train[: cfg.instructions]
    groups = temperature_groups(cfg)
    out: list[tuple[int, list[int], float]] = []
    for g, (t, n) in enumerate(groups):
        out += [(i, p, t) for _ in range(n) for i, p in train]
        if g == 1 or len(groups) == 1:
            own = [(100_000 + j, _chat_ids(tok, x)) for j, x in enumerate(asks)]
            out += [(i, p, t2) for t2 in (0.0, 0.8) for i, p in own]
    return out


@torch.no_grad()
def capture(model: torch.nn.Module, prompts: list[list[int]], temperature: float, max_tokens: int, eos: int,
            aux_layers: tuple[int, ...], seed: int) -> list[dict]:
    """Answer ``prompts`` in one batch; per row the sequence, its features [L, F] and next-token laws [L, k]."""
    ids, mask = left_padded(prompts, eos)  # [B, n] each
    n = ids.shape[1]
    torch.manual_seed(seed)
    o = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, eos_token_id=eos,
                       pad_token_id=eos, output_hidden_states=True, output_logits=True, return_dict_in_generate=True,
                       **sampling(temperature))
    # step 0: the prompt's hidden states [B, n, H] per layer; step s >= 1: the token written at step s - 1 [B, 1, H]
    feats = torch.cat([torch.cat([h[i] for i in aux_layers], -1) for h in o.hidden_states], dim=1)  # [B, n + S - 1, F]
    tops = [torch.log_softmax(lg.float(), dim=-1).topk(CACHE_TOPK, dim=-1) for lg in o.logits]  # per step [B, k]
    top_v, top_i = torch.stack([t.values for t in tops], 1), torch.stack([t.indices for t in tops], 1)  # [B, S, k]
    answers = o.sequences[:, n:].tolist()
    rows = []
    for r, p in enumerate(prompts):
        a = answers[r][: answers[r].index(eos) + 1] if eos in answers[r] else answers[r]
        m, plen = len(a), len(p)
        aux = torch.zeros(plen + m, feats.shape[-1], dtype=torch.float16)  # the last token is never fed: zeros
        aux[: plen + m - 1] = feats[r, n - plen: n + m - 1]
        top_ids = torch.zeros(plen + m, CACHE_TOPK, dtype=torch.int32)  # prompt rows: never scored
        top_lp = torch.zeros(plen + m, CACHE_TOPK, dtype=torch.float16)
        top_ids[plen - 1: plen + m - 1] = top_i[r, :m].to(torch.int32)  # position plen-1+j predicts a_j
        top_lp[plen - 1: plen + m - 1] = top_v[r, :m].to(torch.float16)
        rows.append({"ids": p + a, "answer_start": plen, "aux": aux, "top_ids": top_ids, "top_logp": top_lp})
    return rows


def run(target: str, cache: Path, cfg: GenConfig, log=print) -> dict:
    from safetensors.torch import save_file

    from training.eagle_layout import head_config_dict
    from training.smollm2_draft import load_hf_target
    from workers.eagle.head_config import EagleHeadConfig
    from workers.gguf_loader import resolve_model_path
    from workers.loader import load_tokenizer
    from workers.model_config import ModelConfig

    start = time.perf_counter()
    path = resolve_model_path(target)
    tcfg = ModelConfig.from_pretrained(path)
    aux = tuple(EagleHeadConfig.from_dict(head_config_dict(tcfg)).aux_layers(tcfg.num_layers))
    tok = load_tokenizer(path)
    model = load_hf_target(path).to(torch.bfloat16)
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "meta.json").write_text(json.dumps({"aux_layers": list(aux), "topk": CACHE_TOPK, "target": path}))
    shards = sorted(cache.glob("gen-[0-9][0-9][0-9][0-9].safetensors"))
    asks_file = cache / "self_instruct.json"
    if not asks_file.is_file():  # written once, so a resumed run's plan is the same
        asks_file.write_text(json.dumps(self_written_instructions(model, tok, cfg, start + cfg.minutes * 60)))
    todo = plan(tok, cfg, json.loads(asks_file.read_text()))
    done = len(shards) * cfg.batch
    n_pos = 0
    for b in range(done, len(todo), cfg.batch):
        if time.perf_counter() - start > cfg.minutes * 60:
            break
        chunk = todo[b: b + cfg.batch]
        groups: dict[float, list[int]] = {}
        for j, (_, _, t) in enumerate(chunk):
            groups.setdefault(t, []).append(j)
        rows: list[dict | None] = [None] * len(chunk)
        for t, js in groups.items():
            for j, row in zip(js, capture(model, [chunk[j][1] for j in js], t, cfg.max_tokens, tok.eos_token_id,
                                          aux, cfg.seed + b + int(100 * t)), strict=True):
                rows[j] = row
        save_file({
            "tokens": torch.tensor([t for r in rows for t in r["ids"]], dtype=torch.int32),  # [N]
            "lengths": torch.tensor([len(r["ids"]) for r in rows], dtype=torch.int32),  # [S]
            "index": torch.tensor([i for i, _, _ in chunk], dtype=torch.int32),  # [S]
            "answer_start": torch.tensor([r["answer_start"] for r in rows], dtype=torch.int32),  # [S]
            "temperature": torch.tensor([t for _, _, t in chunk], dtype=torch.float32),  # [S]
            "aux": torch.cat([r["aux"] for r in rows]),  # [N, F] float16
            "top_ids": torch.cat([r["top_ids"] for r in rows]),  # [N, k] int32
            "top_logp": torch.cat([r["top_logp"] for r in rows]),  # [N, k] float16
        }, str(cache / f"gen-{b // cfg.batch:04d}.safetensors"))
        n_pos += sum(len(r["ids"]) for r in rows)
        log(f"capture: {b + len(chunk)}/{len(todo)} answers, {n_pos} positions this run, "
            f"{time.perf_counter() - start:.0f} s")
    return {"planned": len(todo), "cached": min(len(todo), len(sorted(cache.glob("gen-*.safetensors"))) * cfg.batch),
            "positions_this_run": n_pos, "seconds": round(time.perf_counter() - start)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m training.eagle_capture", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--cache", required=True, help="the feature cache to write (training/eagle_cache.py's layout)")
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--samples", type=int, default=GenConfig.samples)
    ap.add_argument("--self-instruct", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64, help="answers per generate call (and per shard)")
    ap.add_argument("--instructions", type=int, default=None, help="only the first N training instructions")
    a = ap.parse_args(argv)
    cfg = GenConfig(minutes=a.minutes, samples=a.samples, self_instruct=a.self_instruct, max_tokens=a.max_tokens,
                    batch=a.batch, instructions=a.instructions)
    print(json.dumps(run(a.target, Path(a.cache), cfg)), flush=True)


if __name__ == "__main__":
    main()
