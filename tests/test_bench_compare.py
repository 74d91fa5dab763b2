"""``bench compare`` pieces: the random pair of a given shape (--random-shape), and unseeded sampled runs."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

from benchmarks.compare import main as compare_main
from benchmarks.engine_runs import engine_run
from benchmarks.random_pair import make_random_pair, parse_shape


def test_random_shape_is_checked() -> None:
    assert parse_shape("1024,12,32000") == (1024, 12, 32000)
    for bad in ("1024,12", "1024,x,3", "1000,2,10", "0,1,1"):
        with pytest.raises(ValueError, match="--random-shape"):
            parse_shape(bad)


def test_random_pair_draft_is_the_targets_first_layer(tmp_path) -> None:
    target, draft = make_random_pair(str(tmp_path), 64, 3, 128)
    t = load_file(os.path.join(target, "model.safetensors"))
    d = load_file(os.path.join(draft, "model.safetensors"))
    assert {k.split(".")[2] for k in d if k.startswith("model.layers.")} == {"0"}
    assert all((d[k] == t[k]).all() for k in d)  # shared, not re-drawn
    with open(os.path.join(draft, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["num_hidden_layers"] == 1
    # bench compare runs on it end to end (adaptive, and adaptive with a tree on its menu, included) and writes its
    # rows, and the decode step against the memory floor.
    out = tmp_path / "c.json"
    assert compare_main(["--random-shape", "64,3,128", "--random-dir", str(tmp_path / "pairs"), "--batches", "1",
                         "--temperatures", "0", "--max-tokens", "4", "--num-prompts", "1", "--repeats", "1",
                         "--skip-hf", "--modes",
                         "specserve_nospec,specserve_adaptive,specserve_adaptive_tree", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["results"]
    assert {r["mode"] for r in rows} == {"specserve_nospec", "specserve_adaptive", "specserve_adaptive_tree"}
    assert all(r["tok_s"] > 0 for r in rows)
    floor = result["summary"]
    assert floor["decode_step_s"] > 0 and floor["step_over_floor"] > 0
    # The target's float32 parameters: embedding and head 128 x 64 each; per layer q, k, v, o 64 x 64 (one head of
    # 64, one KV head), gate, up, down 64 x 128, two norms of 64; the final norm.
    assert floor["weight_bytes"] == 4 * (2 * 128 * 64 + 3 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64)


def _greedy_agreement(target: str, draft: str) -> float:
    """How often the draft's greedy pick equals the target's along the target's own greedy continuation."""
    import torch
    from transformers import AutoModelForCausalLM

    t, d = (AutoModelForCausalLM.from_pretrained(p).eval() for p in (target, draft))
    prompts = torch.randint(3, t.config.vocab_size, (4, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        seq = t.generate(prompts, max_new_tokens=24, do_sample=False, pad_token_id=0)
        picks_t, picks_d = (m(seq).logits[:, 7:-1].argmax(-1) for m in (t, d))
    return (picks_t == picks_d).float().mean().item()


def test_random_pair_draft_accepts(tmp_path) -> None:
    # Adaptive speculation on a larger shape needs a pair whose draft agrees with the target often; an unscaled
    # random target (deep_scale = head_scale = 1) disagrees with its own first layer nearly always.
    accepting = _greedy_agreement(*make_random_pair(str(tmp_path / "a"), 256, 6, 2048))
    plain = _greedy_agreement(*make_random_pair(str(tmp_path / "p"), 256, 6, 2048, deep_scale=1.0, head_scale=1.0))
    assert accepting > 0.6 and plain < 0.3, (accepting, plain)


@pytest.mark.parametrize("seeded", [True, False])
def test_unseeded_runs_send_no_seed(seeded: bool) -> None:
    sent = []

    class FakeLLM:
        engine = SimpleNamespace(reset_stats=lambda: None, pipeline=None)

        def generate(self, prompts, params):
            sent.extend(params)
            return [SimpleNamespace(token_ids=[1]) for _ in prompts]

    engine_run(FakeLLM(), [[[1, 2]], [[3]]], 4, 0.8, None, seeded=seeded)
    assert [p.seed for p in sent] == ([0, 1000] if seeded else [None, None])


def test_the_adaptive_ratios_are_also_paired_within_each_repeat() -> None:
    """The machine's speed moves between repeats: adaptive 100 then 50 tokens per CPU-second, a fixed chain 50
    then 100 in the other order. The ratio of medians is 1.0 whatever happened within each repeat; the paired one
    shows each repeat's 2.0 and 0.5."""
    from benchmarks.compare_report import Row, paired

    a = Row("specserve_adaptive", 0.8, 1, tokens=100, cpu_seconds=[1.0, 2.0, 1.0])
    k = Row("specserve_k6", 0.8, 1, tokens=100, cpu_seconds=[2.0, 1.0, 1.0])
    assert paired(a, k) == " [per repeat 2.00, 0.50, 1.00: median 1.00]"
    assert paired(Row("x", 0.0, 1, tokens=1, cpu_seconds=[1.0]), Row("y", 0.0, 1, tokens=1, cpu_seconds=[1.0])) == ""


def test_prompts_for_a_model_without_a_tokenizer(tmp_path) -> None:
    """The random pair has no tokenizer: a prompt file's text lines are skipped (they crashed the run), its token-id
    lines are kept where they fit the vocabulary, and with none left the prompts are random ids."""
    from benchmarks.compare import load_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "def f():"}\n{"prompt_token_ids": [5, 6, 7]}\n{"prompt_token_ids": [5, 900]}\n')
    assert load_prompts(str(path), None, 100, 3, 16) == [[5, 6, 7]] * 3
    path.write_text('{"prompt": "def f():"}\n')
    random_ids = load_prompts(str(path), None, 100, 2, 16)
    assert len(random_ids) == 2 and all(0 < t < 100 for ids in random_ids for t in ids)


class _SteppingEngine:
    """An engine whose every step takes ``step_s`` and finishes each request after ``steps`` of them."""

    def __init__(self, name: str, step_s: float, steps: int, log: list[str]) -> None:
        self.name, self.step_s, self.steps, self.log = name, step_s, steps, log
        self.stats, self.times = SimpleNamespace(), SimpleNamespace(as_dict=dict)
        self.pipeline, self.config, self.left = None, SimpleNamespace(speculative=None), {}

    def reset_stats(self) -> None:
        pass

    def add_request(self, request_id, prompt, params) -> None:
        self.left[request_id] = (self.steps, prompt)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.left)

    def step_finished(self):
        import time

        time.sleep(self.step_s)
        self.log.append(self.name)
        self.left = {k: (n - 1, p) for k, (n, p) in self.left.items()}
        done = [SimpleNamespace(request_id=k, token_ids=[len(p)] * self.steps) for k, (n, p) in self.left.items()
                if n == 0]
        self.left = {k: v for k, v in self.left.items() if v[0] > 0}
        return done


def test_lockstep_alternates_the_modes_and_times_each_by_its_own_steps() -> None:
    """``--lockstep``: one step of each mode in turn (the order rotating), each mode's seconds the sum of its own
    steps only (a slow mode beside a fast one does not slow the fast one's figure), outputs in prompt order."""
    from benchmarks.compare_report import Row
    from benchmarks.engine_runs import engine_lockstep

    log: list[str] = []
    llms = {"slow": SimpleNamespace(engine=_SteppingEngine("slow", 0.03, 3, log)),
            "fast": SimpleNamespace(engine=_SteppingEngine("fast", 0.002, 5, log))}
    rows = {m: Row(m, 0.0, 2) for m in llms}
    outs = engine_lockstep(llms, [[[1], [1, 2]], [[1, 2, 3]]], 4, 0.0, rows)
    # group 1: slow fast, fast slow, slow fast, then fast alone twice; group 2 alike
    assert log == ["slow", "fast", "fast", "slow", "slow", "fast", "fast", "fast"] * 2
    assert outs == {"slow": [[1] * 3, [2] * 3, [3] * 3], "fast": [[1] * 5, [2] * 5, [3] * 5]}
    assert 0.18 <= rows["slow"].seconds[0] < 0.3, rows["slow"].seconds
    assert rows["fast"].seconds[0] < 0.1, rows["fast"].seconds  # ~0.02 s; the whole run took ~0.2 s
    assert len(rows["fast"].cpu_seconds) == 1


def test_lockstep_on_the_random_pair_keeps_greedy_outputs(tmp_path) -> None:
    """End to end: no speculation, a chain and the adaptive policy stepping in turn in one process, the pipelined
    mode (which drafts between steps) alone; and two engines stepping in turn give the same greedy tokens."""
    out = tmp_path / "c.json"
    assert compare_main(["--random-shape", "64,3,128", "--random-dir", str(tmp_path / "pairs"), "--batches", "3",
                         "--temperatures", "0", "--max-tokens", "6", "--num-prompts", "3", "--repeats", "2",
                         "--skip-hf", "--skip-floor", "--lockstep", "--modes",
                         "specserve_nospec,specserve_chain,specserve_adaptive,specserve_pipelined",
                         "--json", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"specserve_nospec", "specserve_chain", "specserve_adaptive", "specserve_pipelined"}
    assert all(len(r["cpu_seconds"]) == 2 and r["tok_cpu_s"] > 0 for r in rows.values())
    # The same engines' outputs, stepping in turn.
    from benchmarks.compare_report import Row
    from benchmarks.engine_runs import engine_lockstep
    from engine.llm import LLM

    target, draft = (str(tmp_path / "pairs" / "64x3x128-accepting" / m) for m in ("target", "draft"))
    chain = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "adaptive": False}
    llms = {"nospec": LLM(target, "none", max_num_seqs=3, num_kv_tokens=256),
            "chain": LLM(target, chain, max_num_seqs=3, num_kv_tokens=256)}
    try:
        outs = engine_lockstep(llms, [[[5, 6, 7], [8, 9]], [[10, 11, 12, 13]]], 6, 0.0,
                               {m: Row(m, 0.0, 2) for m in llms})
    finally:
        for llm in llms.values():
            llm.shutdown()
    assert outs["nospec"] == outs["chain"] and [len(o) for o in outs["chain"]] == [6, 6, 6], outs
