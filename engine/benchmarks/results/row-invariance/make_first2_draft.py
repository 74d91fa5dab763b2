"""How /tmp/q4inv/smollm2-first2 (the draft of compare-real-pair.txt) was made: the SmolLM2 Q4_1 target's first
2 layers, dequantized to float32 by transformers, saved as an HF directory (untrained: acceptance 0.01)."""

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from workers.gguf_loader import resolve_model_path

path = resolve_model_path("smollm2")
d, f = os.path.dirname(path), os.path.basename(path)
full = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
full.model.layers = full.model.layers[:2]
cfg = full.config
cfg.num_hidden_layers = 2
if getattr(cfg, "layer_types", None):
    cfg.layer_types = cfg.layer_types[:2]
if hasattr(cfg, "quantization_config"):
    del cfg.quantization_config  # a GGUF-loaded model refuses save_pretrained; a plain copy does not
draft = LlamaForCausalLM(cfg)
draft.load_state_dict(full.state_dict())
out = "/tmp/q4inv/smollm2-first2"
draft.save_pretrained(out)
AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)
