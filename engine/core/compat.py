"""Start-up checks that a draft can serve a target: same tokenizer, a vocabulary that fits."""

from __future__ import annotations

from workers.loader import load_tokenizer
from workers.model_config import ModelConfig
from workers.vocab_map import DraftVocabMap


def check_draft_compatible(target_dir: str, draft_dir: str, target_config: ModelConfig, dcfg: ModelConfig) -> None:
    vmap = DraftVocabMap.load(draft_dir)
    if vmap is not None:  # a trimmed-vocabulary draft: its map must be over the target's vocabulary
        if vmap.target_vocab_size != target_config.vocab_size or vmap.size != dcfg.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary map ({vmap.size} ids of a "
                             f"{vmap.target_vocab_size}-token vocabulary) does not fit a {dcfg.vocab_size}-row "
                             f"draft for a target of {target_config.vocab_size} tokens")
    elif dcfg.vocab_size > target_config.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocabulary ({dcfg.vocab_size} tokens) is larger "
                         f"than the target's ({target_config.vocab_size}); the draft must share the target's "
                         "tokenizer")
    t_tok, d_tok = load_tokenizer(target_dir), load_tokenizer(draft_dir)
    if t_tok is None or d_tok is None:
        return  # token-id prompts with no tokenizer on one side: only the vocabulary size can be checked
    t_vocab, d_vocab = t_tok.get_vocab(), d_tok.get_vocab()
    differing = [tok for tok, i in d_vocab.items() if t_vocab.get(tok) != i]
    if differing:
        raise ValueError(f"speculative_config.model: the draft's tokenizer differs from the target's "
                         f"({len(differing)} tokens map to other ids, e.g. {differing[:3]!r}); speculative "
                         "decoding needs the same tokenizer")
