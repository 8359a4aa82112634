"""A random Llama and a tokenizer built locally (no model hub), for vLLM tests and benchmarks.

``python tiny_model.py DIR [--hidden N --layers N --intermediate N --vocab N --shards-of SIZE]``
writes ``config.json``, the safetensors weights (float32) and a tokenizer into ``DIR``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CORPUS = (
    "the a an of to in and is was for on with as by at from that this it be are or not have "
    "streamer loads tensors from storage into memory fast every byte checked model weights "
    "vllm serves language models quickly on many devices token text cold start time"
)


def build_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer trained on a tiny corpus, saved for ``AutoTokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = CORPUS.split()
    corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": 2048,
                "clean_up_tokenization_spaces": False,
            }
        )
    )


def build(
    directory: str | Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 2,
    intermediate: int = 128,
    vocab: int = 512,
    shard_size: str | None = None,
    seed: int = 0,
) -> Path:
    """Writes the model into ``directory`` (head_dim = hidden / heads must be >= 32 for CPU attention)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory, vocab)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # wider weights than the default init: random text, not one repeated token
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.5)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(str(directory), safe_serialization=True, **kwargs)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--shard-size", help="e.g. 500MB: several shards and an index")
    args = parser.parse_args()
    build(
        args.directory,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        intermediate=args.intermediate,
        vocab=args.vocab,
        shard_size=args.shard_size,
    )
    print(args.directory)


if __name__ == "__main__":
    main()
