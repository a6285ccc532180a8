"""Write the randomly initialised tiny qwen2 model that `quickstart sft` trains from scratch.

    python examples/tiny/make_model.py --out /tmp/tiny-init

Architecture (see ../shared/reference/tiny_task_notes.md for why this size): qwen2,
hidden 256, 4 layers, 4 query heads of head_dim 64 (so vLLM's CPU build could serve it),
2 KV heads, intermediate 512, tied embeddings, vocabulary = the tiny tokenizer's.
The tokenizer files of realhf/assets/tiny are copied next to the weights so the
directory is a complete HuggingFace checkpoint. Deterministic for a given --seed.
"""

import argparse
import os

import torch
import transformers

from realhf.impl.model.conversion.hf import save_tokenizer

ASSETS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "realhf", "assets", "tiny"
)


def tiny_config(vocab_size: int, eos_id: int, pad_id: int) -> transformers.Qwen2Config:
    return transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    tok = transformers.AutoTokenizer.from_pretrained(ASSETS)
    torch.manual_seed(args.seed)
    model = transformers.Qwen2ForCausalLM(tiny_config(len(tok), tok.eos_token_id, tok.pad_token_id))
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    save_tokenizer(ASSETS, args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote a random tiny qwen2 ({n / 1e6:.2f}M parameters) to {args.out}")


if __name__ == "__main__":
    main()
