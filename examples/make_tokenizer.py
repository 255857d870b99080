"""Train the small byte-level BPE tokenizer shipped in examples/tokenizer/ (1,024 tokens; the
package ships it as portapipe/assets/tokenizer-1k.json, a link to it).

    python examples/make_tokenizer.py [OUT_DIR]

Trained on the Shakespeare corpus shipped with portapipe, with the `tokenizers` library
(`pip install 'portapipe[data]'`); nothing is downloaded. Running it again writes the same file.
"""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from portapipe.data.shipped import DEFAULT_CORPUS


def main(out: Path) -> None:
    text = gzip.decompress(DEFAULT_CORPUS.read_bytes()).decode("utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.split("\n\n"), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    print(f"{out / 'tokenizer.json'}: {tok.get_vocab_size()} tokens")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("tokenizer"))
