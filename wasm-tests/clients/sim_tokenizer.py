"""A tiny Hugging Face tokenizer that counts like `kvroute-sim`, built offline with `tokenizers`.

The simulator counts a text prompt as ceil(bytes / 4) (`filter/core/src/request.rs`) and streams
`" tok"` per generated token. This tokenizer's vocabulary is exactly what those two rules make
one token of: every 4-byte word `[a-z]{3} ` (the simulator's own workload alphabet,
`simulator/src/tokens.rs`, 26^3 = 17,576 entries) and `" tok"`. A pre-tokenizer splits text into
those pieces; anything else is one `[UNK]` per character, so a foreign text still counts about
right but does not decode. Decoding concatenates (`Fuse`), so decode(encode(text)) == text for
text made of vocabulary pieces.

With `aiperf --prompt-corpus random` the prompts are random vocabulary tokens, so a prompt of N
client-side tokens is 4N bytes, which the simulator counts as N; the streamed output of N tokens
is N `" tok"` pieces. No network: `build(dir)` writes `tokenizer.json` and
`tokenizer_config.json`, which `transformers.AutoTokenizer.from_pretrained(dir)` loads.

Run: `python sim_tokenizer.py DIR` (needs the `tokenizers` package).
"""

import itertools
import json
import os
import string
import sys

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

UNK = "[UNK]"
STREAMED = " tok"


def vocabulary():
    words = ("".join(w) + " " for w in itertools.product(string.ascii_lowercase, repeat=3))
    return {token: i for i, token in enumerate([UNK, STREAMED, *words])}


def build(directory):
    tokenizer = Tokenizer(models.WordLevel(vocabulary(), unk_token=UNK))
    # Alternation order matters: " tok" before the catch-all, a 4-byte word before anything.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[a-z]{3} | tok|[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([UNK])
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": UNK, "model_max_length": 131072,
              "clean_up_tokenization_spaces": False}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return tokenizer


def self_check(tokenizer):
    prompt = "abc def ghi "
    assert tokenizer.encode(prompt).ids == [vocabulary()[w] for w in ("abc ", "def ", "ghi ")]
    assert len(tokenizer.encode(STREAMED * 7).ids) == 7
    assert len(tokenizer.encode("abc " + STREAMED * 2 + "xyz ").ids) == 4
    assert tokenizer.decode(tokenizer.encode(prompt + STREAMED).ids) == prompt + STREAMED


if __name__ == "__main__":
    self_check(build(sys.argv[1]))
    print(f"{sys.argv[1]}: {len(vocabulary())} tokens")
