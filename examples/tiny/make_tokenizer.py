"""Train the embedded tiny tokenizer: byte-level BPE, digits as single tokens (~270 ids).

    python examples/tiny/make_data.py        # first: the tokenizer is trained on train.jsonl
    python examples/tiny/make_tokenizer.py   # writes realhf/assets/tiny/tokenizer*.json

Why it looks the way it does:

- **Digits are single tokens** so that the tiny model sees every number digit by digit;
  arithmetic is much easier to learn than over multi-digit tokens.
- **Merges are learned only inside runs of ASCII letters** (training pre-splits every other
  character).  Punctuation never merges, so ``tokenize(prompt) + tokenize(answer) ==
  tokenize(prompt + answer)`` for every problem (the prompt ends in ``.``, the answer starts
  with ``\\``): the prompt/answer boundary of SFT data is the one generation starts from.
- **The saved pipeline is the qwen2 one** (NFC normaliser, the qwen2 split regex that isolates
  single digits, ByteLevel without its own regex, ByteLevel decoder).  The tiny model is a
  qwen2 checkpoint, and transformers 5's ``AutoTokenizer`` on a qwen2 directory builds a
  ``Qwen2Tokenizer`` that keeps our vocabulary and merges but installs that pipeline whatever
  ``tokenizer_class`` says.  Saving the same pipeline makes ``AutoTokenizer`` give exactly the
  ids of ``tokenizers.Tokenizer.from_file("tokenizer.json")`` with or without a config.json
  next to it (and with transformers 4.x, which honours ``tokenizer_class``).  With letter-only
  merges the two pre-splits give the same tokens on the task's text anyway.
- **Special tokens**: ``<|endoftext|>`` (EOS, id 0) and ``<|pad|>`` (id 1); no BOS is added.
- **Chat template**: a turn renders as its bare content and an assistant turn is followed by
  EOS, so ``apply_chat_template([user p], add_generation_prompt=True) == p`` and a (user p,
  assistant a) conversation is ``p + a + EOS`` — the same ids as the raw prompts SFT and RL use.

Output is deterministic: the same data gives byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Iterator, List

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT_DIR = os.path.join(REPO_ROOT, "realhf", "assets", "tiny")
DEFAULT_DATA_DIR = os.path.join(DEFAULT_OUT_DIR, "data")

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN]
MODEL_MAX_LENGTH = 2048

# The qwen2 pre-tokenizer split: English contractions, an optional non-letter prefix plus a
# letter run, ONE digit, punctuation runs (with trailing newlines), newline runs, other spaces.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Renders each turn as its content; assistant turns end with EOS.  Generation needs no header.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def corpus(data_dir: str) -> Iterator[str]:
    """Prompts and answers of the SFT split (the text the model is trained on)."""
    path = os.path.join(data_dir, "sft.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found; run examples/tiny/make_data.py first")
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            yield rec["prompt"]
            yield rec["answer"]


def _qwen2_pipeline(tok: Tokenizer):
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = None


def train_tokenizer(texts: List[str], vocab_size: int = 270) -> Tokenizer:
    """Byte-level BPE over ``texts`` with merges only inside ASCII letter runs."""
    tok = Tokenizer(models.BPE())
    # Training split: every character that is not an ASCII letter stands alone, so no merge
    # can join digits or punctuation.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[^A-Za-z]"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    _qwen2_pipeline(tok)
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json: the class to load, special tokens and the chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


def save(tok: Tokenizer, out_dir: str):
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja.

    The chat template is in both places transformers looks (4.x: tokenizer_config.json,
    5.x: chat_template.jinja).
    """
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=True)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(), f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)


def make_tokenizer(
    data_dir: str = DEFAULT_DATA_DIR, out_dir: str = DEFAULT_OUT_DIR, vocab_size: int = 270
) -> Tokenizer:
    """Train on ``data_dir``'s SFT split and save into ``out_dir``; returns the tokenizer."""
    tok = train_tokenizer(list(corpus(data_dir)), vocab_size)
    save(tok, out_dir)
    return tok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="directory holding sft.jsonl")
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR, help="where the tokenizer files go")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=270,
        help="upper bound; training stops when no pair is left",
    )
    args = p.parse_args(argv)
    tok = make_tokenizer(args.data_dir, args.out_dir, args.vocab_size)
    print(f"wrote a {tok.get_vocab_size()}-token tokenizer to {args.out_dir}")


if __name__ == "__main__":
    main()
