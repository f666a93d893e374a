"""Build small Llama checkpoints (random weights, fixed seed) and a tiny tokenizer, locally.

Nothing is downloaded: the model is ``transformers``' ``LlamaForCausalLM`` with random weights,
saved with ``save_pretrained``; the tokenizer is a byte-level BPE trained with ``tokenizers`` on
the paragraphs of ``corpus.txt`` beside this file. Used by the real-engine tests, the HTTP
end-to-end run and the P/D benchmark.

The defaults are the smallest shape vLLM's CPU attention backend takes (head size 32).
"""

from __future__ import annotations

import json
import os
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus.txt")

#: the test model (issue 17): 2 layers, 4 query heads of 32, 2 KV heads, vocabulary 512
TINY: dict[str, int] = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "num_hidden_layers": 2, "intermediate_size": 256, "vocab_size": 512}


def build_model(path: str, seed: int = 0, tokenizer: bool = False, dtype: str = "float32",
                **shape: int) -> str:
    """Write a random-weight Llama to ``path`` (once: an existing, complete one is kept).

    ``shape`` overrides :data:`TINY`'s fields. Weights are drawn with ``initializer_range``
    0.1 rather than 0.02 so that greedy choices are far apart (a tie broken differently by
    rounding would make two correct engines disagree). With ``tokenizer`` a tokenizer trained on
    :data:`CORPUS` is saved beside it (vocabulary size = the model's).
    """
    cfg_kw: dict[str, Any] = {**TINY, **shape}
    stamp = os.path.join(path, "kvx-tinymodel.json")
    want = {"seed": seed, "tokenizer": tokenizer, "dtype": dtype, **cfg_kw}
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == want:
                return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(path, exist_ok=True)
    vocab = int(cfg_kw["vocab_size"])
    config = LlamaConfig(**cfg_kw, max_position_embeddings=4096, initializer_range=0.1,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         torch_dtype=dtype)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(path)
    if tokenizer:
        build_tokenizer(path, vocab)
    with open(stamp, "w") as f:
        json.dump(want, f)
    return path


def build_tokenizer(path: str, vocab_size: int) -> None:
    """Train a byte-level BPE of ``vocab_size`` tokens on :data:`CORPUS`; save it to ``path``
    so that ``AutoTokenizer.from_pretrained(path)`` (and so vLLM) loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2: the model's pad, bos, eos
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with open(CORPUS, encoding="utf-8") as f:
        paragraphs = [p.strip() for p in f.read().split("\n\n") if p.strip()]
    tok.train_from_iterator(paragraphs, trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens, the model {vocab_size}")
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "<pad>", "model_max_length": 4096, "add_bos_token": False}, f)
    with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, f)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--tokenizer", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden-size", type=int)
    ap.add_argument("--layers", type=int)
    a = ap.parse_args()
    kw = {}
    if a.hidden_size:
        kw.update(hidden_size=a.hidden_size, intermediate_size=2 * a.hidden_size,
                  num_attention_heads=a.hidden_size // 32, num_key_value_heads=max(1, a.hidden_size // 64))
    if a.layers:
        kw["num_hidden_layers"] = a.layers
    print(build_model(a.path, seed=a.seed, tokenizer=a.tokenizer, **kw))
