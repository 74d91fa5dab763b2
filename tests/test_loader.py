"""Checkpoint directories: config parsing, safetensors (single / sharded / per-rank slices), tokenizer."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.helpers_models import make_tiny_checkpoint
from workers.attention import DenseCausalContext
from workers.distributed import TPGroup
from workers.loader import iter_weights, load_model, load_tokenizer
from workers.model_config import ModelConfig
from workers.models.registry import model_class_for, supported_architectures
from workers.weight_files import safetensors_files

IDS = torch.tensor([3, 14, 15, 9, 26, 53])


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(IDS, torch.arange(len(IDS)), DenseCausalContext()))


def edit_config(path: str, **changes) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        raw = json.load(f)
    raw.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del raw[key]
    with open(file, "w") as f:
        json.dump(raw, f)


def test_single_file_checkpoint_loads_every_weight(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, family="qwen2", vocab_size=64)
    assert [os.path.basename(f) for f in safetensors_files(path)] == ["model.safetensors"]
    model = load_model(path)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        q = f.get_tensor("model.layers.1.self_attn.q_proj.bias")
    attn = model.model.layers[1].self_attn
    torch.testing.assert_close(attn.qkv_proj.bias[:attn.qkv_proj.q_size], q, atol=0, rtol=0)
    assert attn.o_proj.bias is None  # Qwen2: q/k/v bias only
    assert not model.training


def test_sharded_checkpoint_equals_single_file(tmp_path) -> None:
    single = make_tiny_checkpoint(tmp_path / "one", vocab_size=64, seed=3)
    sharded = make_tiny_checkpoint(tmp_path / "many", vocab_size=64, seed=3, max_shard_size="40KB")
    files = safetensors_files(sharded)
    assert len(files) > 1 and os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    torch.testing.assert_close(logits_of(load_model(sharded)), logits_of(load_model(single)), atol=0, rtol=0)


def test_missing_directory_or_config_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_missing_weight_files_are_a_clear_error(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, vocab_size=64)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(path)


def test_unknown_architecture_lists_the_supported_ones(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, vocab_size=64)
    edit_config(path, architectures=["FancyForCausalLM"])
    config = ModelConfig.from_pretrained(path)
    with pytest.raises(ValueError, match="FancyForCausalLM") as err:
        model_class_for(config)
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in supported_architectures() and arch in str(err.value)
    with pytest.raises(ValueError, match="not supported"):
        load_model(path)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_config_without_architectures_loads_by_model_type(tmp_path, family: str) -> None:
    path = make_tiny_checkpoint(tmp_path, family=family, vocab_size=64)
    reference = load_model(path)
    edit_config(path, architectures=None)
    config = ModelConfig.from_pretrained(path)
    assert config.architecture == {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    assert torch.equal(logits_of(load_model(path)), logits_of(reference))
    edit_config(path, model_type="vit")
    with pytest.raises(ValueError, match="no 'architectures' entry and model_type 'vit'"):
        ModelConfig.from_pretrained(path)


def test_tokenizer_is_none_without_files_and_loads_with_them(tmp_path) -> None:
    bare = make_tiny_checkpoint(tmp_path / "bare", vocab_size=64)
    assert load_tokenizer(bare) is None
    full = make_tiny_checkpoint(tmp_path / "tok", vocab_size=128, with_tokenizer=True)
    tok = load_tokenizer(full)
    ids = tok("hi there").input_ids
    assert max(ids) < 128 and tok.decode(ids) == "hi there"
    assert tok.eos_token_id == ModelConfig.from_pretrained(full).eos_token_ids[0] == 2


def test_checkpoint_dtype_is_kept_unless_overridden(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, family="qwen3", vocab_size=64, dtype=torch.bfloat16)
    assert ModelConfig.from_pretrained(path).dtype == torch.bfloat16
    assert load_model(path).model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    model = load_model(path, dtype=torch.float32)
    assert model.model.norm.weight.dtype == torch.float32
    edit_config(path, dtype=None, torch_dtype=None)  # undeclared: the stored tensors decide
    assert load_model(path).lm_head.weight.dtype == torch.bfloat16


def test_config_fields_and_legacy_spellings(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, family="mistral", vocab_size=64, sliding_window=32,
                                max_position_embeddings=128)
    # transformers v4 spelling: rope_theta / rope_scaling at top level, "type" instead of "rope_type".
    edit_config(path, rope_parameters=None, rope_theta=25000.0, rope_scaling={"type": "linear", "factor": 2.0})
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 7]}, f)
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.architecture, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("MistralForCausalLM", 4, 2, 16)
    assert cfg.rope_theta == 25000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.eos_token_ids == (2, 7) and cfg.bos_token_id == 1
    assert cfg.max_model_len == 32  # the sliding window is exact while sequences fit in it
    assert not cfg.qk_norm and not cfg.attention_bias and not cfg.tie_word_embeddings


def test_unsupported_rope_type_is_refused(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, vocab_size=64)
    edit_config(path, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                       "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_pretrained(path)


def test_missing_and_unexpected_tensors_are_reported(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, vocab_size=64)
    file = os.path.join(path, "model.safetensors")
    with safe_open(file, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    model = model_class_for(ModelConfig.from_pretrained(path))(ModelConfig.from_pretrained(path))
    partial = {k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate_up_proj\.weight:1"):
        model.load_weights(partial.items())
    with pytest.raises(KeyError, match="extra.weight"):
        model.load_weights([*tensors.items(), ("model.extra.weight", torch.zeros(1))])
    save_file({**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}, file)
    load_model(path)  # old checkpoints' RoPE tables are ignored


class RecordingSlice:
    def __init__(self, inner, log: list, name: str) -> None:
        self.inner, self.log, self.name = inner, log, name

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        out = self.inner[index]
        self.log.append((self.name, tuple(out.shape), tuple(self.inner.get_shape())))
        return out


def test_each_rank_reads_only_its_shard_from_disk(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path, vocab_size=64)
    config = ModelConfig.from_pretrained(path)
    model = model_class_for(config)(config, TPGroup(1, 2, None))  # loading needs no process group
    log: list = []
    model.load_weights((name, RecordingSlice(src, log, name)) for name, src in iter_weights(path))
    for name, read, stored in log:
        if "norm" in name:
            assert read == stored
        else:  # q/k/v, gate/up, embed, head: half the rows; o/down: half the columns
            assert read[0] * read[-1] * 2 == stored[0] * stored[-1], name


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_model_config_crosses_to_a_worker_as_json_unchanged(tmp_path, family: str) -> None:
    """The controller hands its workers the config it read (JSON through the draft process's start line): the
    same ModelConfig comes out, dtype and EOS ids included."""
    path = make_tiny_checkpoint(tmp_path / family, family=family, vocab_size=64, seed=0)
    cfg = ModelConfig.from_pretrained(path)
    back = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and back.dtype == cfg.dtype and isinstance(back.eos_token_ids, tuple)
    half = ModelConfig.from_dict({**cfg.to_dict(), "dtype": "bfloat16"})
    assert half.dtype == torch.bfloat16
