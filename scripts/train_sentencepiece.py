"""Train a SentencePiece model on a local corpus (default: the stdlib corpus).

    python scripts/train_sentencepiece.py --output_prefix=/tmp/lctx_spm \
        --vocab_size=8192 [--text_glob='/data/books/*.txt'] [--max_mb=20]

Writes <prefix>.model and <prefix>.vocab, with pad=0, bos=1, eos=2 (lctx's own layout;
any model with BOS and EOS loads, e.g. Llama 2's with no pad); load it with
lctx.data.make_tokenizer('sentencepiece', '<prefix>.model').
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lctx.data import corpus  # noqa: E402


def main(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--output_prefix", required=True)
  p.add_argument(
    "--text_glob",
    default=corpus.DEFAULT_CORPUS,
    help="directory or glob of text files; 'stdlib' = default corpus",
  )
  p.add_argument("--vocab_size", type=int, default=8192)
  p.add_argument("--model_type", default="bpe", choices=["bpe", "unigram"])
  p.add_argument(
    "--max_mb",
    type=float,
    default=20.0,
    help="stop reading the corpus after this many MB (training time)",
  )
  p.add_argument("--max_sentence_length", type=int, default=16384)
  args = p.parse_args(argv)

  import sentencepiece as spm  # pylint: disable=g-import-not-at-top

  # One line per sentencepiece input; long lines are cut so spm keeps them.
  lines, total = [], 0
  for _, data in corpus.iter_documents(args.text_glob):
    text = data.decode("utf-8", errors="replace")
    for line in text.splitlines():
      if line.strip():
        lines.append(line[: args.max_sentence_length])
        total += len(line)
    if total > args.max_mb * 1e6:
      break
  os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(lines),
    model_prefix=args.output_prefix,
    vocab_size=args.vocab_size,
    model_type=args.model_type,
    pad_id=0,
    bos_id=1,
    eos_id=2,
    unk_id=3,
    byte_fallback=True,
    character_coverage=1.0,
    max_sentence_length=args.max_sentence_length,
    # Code and books need exact whitespace: no NFKC, no space collapsing.
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True,
    split_digits=True,
    num_threads=2,
    minloglevel=2,
  )
  print(f"wrote {args.output_prefix}.model ({len(lines)} lines, {total / 1e6:.1f} MB)")


if __name__ == "__main__":
  main()
