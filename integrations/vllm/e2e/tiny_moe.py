"""A tiny Qwen3-MoE checkpoint written locally: config, seeded random bf16 weights, byte-level tokenizer.

Nothing comes from a hub. The weights are scaled so that activations and logits have unit-order
spread (rather than the near-uniform logits of a 0.02-std init), which keeps exact bf16 logit ties
rare and makes every MoE layer change the output.

Each token goes to one expert (``num_experts_per_tok=1``), so expert parallelism computes bit for bit
what one rank computes: the token's single expert output comes back unchanged from the rank that
holds the expert (measured: equal logprobs everywhere). With two experts per token, measured on this
model, 2 of 8 greedy streams changed at non-tied logits: most likely each rank rounding its partial
sum to bf16 before the combine adds them (one rank rounds the sum once), amplified by later layers'
routing; a test of "same tokens as TP=1" would then test rounding, not communication.

Run as a script to write one: ``python tiny_moe.py DIR``.
"""

import argparse
import json
import math
from pathlib import Path
from typing import Dict

import torch

#: Shapes chosen for vLLM's CPU kernels: hidden and expert-intermediate sizes are multiples of 32
#: (the CPU grouped GEMM's alignment) and 512 bytes per bf16 row (DeepEP HT's transfer atom).
SHAPE = dict(
    hidden_size=256,
    moe_intermediate_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=1,
    max_position_embeddings=512,
)
#: 256 byte tokens plus the end-of-text token.
EOS_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 257


def build_tokenizer():
    """A byte-level BPE tokenizer without merges: every byte is one token, so any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    vocab[EOS_TOKEN] = len(vocab)
    assert len(vocab) == VOCAB_SIZE
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def build_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, rms_norm_eps=1e-6, tie_word_embeddings=False, decoder_sparse_step=1,
        norm_topk_prob=True, mlp_only_layers=[], eos_token_id=VOCAB_SIZE - 1, pad_token_id=VOCAB_SIZE - 1,
        architectures=["Qwen3MoeForCausalLM"], dtype="bfloat16", **SHAPE)


def build_weights(seed: int) -> Dict[str, torch.Tensor]:
    """Checkpoint tensors in the Hugging Face Qwen3-MoE naming, one tensor per expert projection."""
    generator = torch.Generator().manual_seed(seed)
    hidden, heads, kv_heads, head_dim = (SHAPE[k] for k in ("hidden_size", "num_attention_heads",
                                                            "num_key_value_heads", "head_dim"))
    inter = SHAPE["moe_intermediate_size"]

    def linear(rows: int, columns: int) -> torch.Tensor:   # unit-variance outputs for unit inputs
        return torch.randn(rows, columns, generator=generator) / math.sqrt(columns)

    def norm(size: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(size, generator=generator)

    weights = {"model.embed_tokens.weight": torch.randn(VOCAB_SIZE, hidden, generator=generator),
               "model.norm.weight": norm(hidden),
               # 4x: logits spread over several units, so bf16 ties between the top two are rare.
               "lm_head.weight": 4 * linear(VOCAB_SIZE, hidden)}
    for layer in range(SHAPE["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        weights.update({
            f"{prefix}.input_layernorm.weight": norm(hidden),
            f"{prefix}.post_attention_layernorm.weight": norm(hidden),
            f"{prefix}.self_attn.q_proj.weight": linear(heads * head_dim, hidden),
            f"{prefix}.self_attn.k_proj.weight": linear(kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": linear(kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": linear(hidden, heads * head_dim),
            f"{prefix}.self_attn.q_norm.weight": norm(head_dim),
            f"{prefix}.self_attn.k_norm.weight": norm(head_dim),
            # 2x: routing scores far enough apart that the top-k choice is clear-cut.
            f"{prefix}.mlp.gate.weight": 2 * linear(SHAPE["num_experts"], hidden),
        })
        for expert in range(SHAPE["num_experts"]):
            weights[f"{prefix}.mlp.experts.{expert}.gate_proj.weight"] = linear(inter, hidden)
            weights[f"{prefix}.mlp.experts.{expert}.up_proj.weight"] = linear(inter, hidden)
            weights[f"{prefix}.mlp.experts.{expert}.down_proj.weight"] = linear(hidden, inter)
    return {name: tensor.to(torch.bfloat16).contiguous() for name, tensor in weights.items()}


def write_tiny_moe(directory: Path, seed: int = 0) -> Path:
    """Write config.json, model.safetensors and the tokenizer files into ``directory``; return it."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_config().save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    save_file(build_weights(seed), str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": VOCAB_SIZE - 1}))
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_moe(args.directory, args.seed))


if __name__ == "__main__":
    main()
