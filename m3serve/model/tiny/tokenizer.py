"""The offline tokenizer that tiny test checkpoints ship.

It owns a small, deterministic byte-level BPE in the real MiniMax-M3 shape: an o200k-style
pre-tokenizer regex, byte-level alphabet, BPE merges trained on a built-in corpus, and the 64
MiniMax special tokens in the top 64 ids of the vocabulary at the same offsets as in the real
200064-token vocabulary (so with ``vocab_size=200064`` the special ids equal the real ones).
It also writes the HF-style tokenizer directory (``tokenizer.json``, configs, chat template).
"""

from __future__ import annotations

import importlib.resources
import json
import pathlib
import re

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from m3serve.model.special_tokens import THINK_END, THINK_START, TOOL_NAMESPACE

REAL_SPECIAL_BASE = 200000
NUM_SPECIAL_SLOTS = 64
BYTE_ALPHABET_SIZE = 256
MIN_VOCAB_SIZE = BYTE_ALPHABET_SIZE + NUM_SPECIAL_SLOTS
MODEL_MAX_LENGTH = 524288

BOS_TOKEN = "]~!b["
EOS_TOKEN = "[e~["
PAD_TOKEN = "]!p~["

# Offsets are the real ids minus REAL_SPECIAL_BASE; unlisted slots get reserved placeholders.
_NAMED_SPECIALS: dict[str, int] = {
    PAD_TOKEN: 0,
    "]~b]": 19,
    EOS_TOKEN: 20,
    "]!d~[": 21,
    "]<]image[>[": 25,
    "]<]video[>[": 26,
    "]<]start of image[>[": 29,
    "]<]end of image[>[": 30,
    "]<]start of video[>[": 31,
    "]<]end of video[>[": 32,
    "]<]vision pad[>[": 33,
    BOS_TOKEN: 34,
    "<think>": 50,
    "</think>": 51,
    "<tool_call>": 52,
    "</tool_call>": 53,
    "]<]frame[>[": 54,
    "]<]start of frame[>[": 55,
    "]<]end of frame[>[": 56,
    "<|content_altered_placeholder|>": 57,
    TOOL_NAMESPACE: 58,
    THINK_START: 59,
    THINK_END: 60,
}


def _all_special_tokens() -> dict[str, int]:
    by_offset = {offset: token for token, offset in _NAMED_SPECIALS.items()}
    slots = (by_offset.get(i, f"]<]reserved_{i}[>[") for i in range(NUM_SPECIAL_SLOTS))
    return {token: offset for offset, token in enumerate(slots)}


SPECIAL_TOKENS: dict[str, int] = _all_special_tokens()

# o200k-style split: cased words with contractions, 1-3 digit groups, punctuation runs,
# newline runs, and whitespace that leaves its last space to prefix the next word.
_PRETOKENIZE_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# Training text: enough variety (prose, code, JSON, chat and tool-call shapes, digits,
# whitespace runs, non-ASCII) that a few thousand merges exist; special tokens are cut out
# before training, exactly as encode cuts them out before the BPE model sees the text.
TRAINING_CORPUS = """\
The quick brown fox jumps over the lazy dog. The five boxing wizards jump quickly.
A tiny model does not need a large vocabulary; it needs a stable, deterministic one, so that
tests written today still pass tomorrow. We train merges on this short text and nothing else.
It's a small world, isn't it? They're here, we've seen them, I'm sure you'll agree, he'd say.
Numbers matter too: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 4096 65536 3.14159 2.71828 -17 +5.
Dates like 2024-01-15 and 2026-03-31, times like 09:30:00, prices like $19.99 and €42,50.
Whitespace runs:    four spaces,\t\ttwo tabs, and a blank line follows.

    Indented text keeps its leading spaces.
        Deeper indentation, too.
Café, naïve, résumé, jalapeño, Übermaß, straße, smörgåsbord, façade, coöperate.
日本語のテキストも少し含めます。東京は日本の首都です。こんにちは、世界！
中文也可以：你好，世界。今天天气很好，我们去公园散步吧。
한국어 문장도 있습니다. Русский текст тоже есть: привет, мир! Ελληνικά: γειά σου κόσμε.
Emoji: 😀 🚀 🎉 👍🏽 ❤️ 🇯🇵 — and symbols: © ® ™ ° ± × ÷ → ← ↔ ≤ ≥ ≠ ∞ √ ∑ π.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class Request:
    def __init__(self, rid: str, prompt: str, max_tokens: int = 128) -> None:
        self.rid = rid
        self.prompt = prompt
        self.max_tokens = max_tokens

    def __repr__(self) -> str:
        return f"Request(rid={self.rid!r}, max_tokens={self.max_tokens})"


for i in range(10):
    if i % 2 == 0:
        print(i, "is even")
    else:
        print(i, "is odd")

const server = http.createServer((req, res) => {
  res.writeHead(200, { "Content-Type": "application/json" });
  res.end(JSON.stringify({ ok: true, path: req.url }));
});
server.listen(8080, () => console.log("listening on :8080"));

#!/usr/bin/env bash
set -euo pipefail
for f in *.txt; do echo "$f"; wc -l "$f"; done
grep -rn "TODO" src/ | sort | uniq -c > /tmp/todo.log 2>&1 || true

SELECT id, name, created_at FROM users WHERE active = 1 ORDER BY created_at DESC LIMIT 10;

{"model": "MiniMax-M3.1", "messages": [{"role": "user", "content": "Hello!"}], "stream": true}
{"id": "chatcmpl-123", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": \
"stop", "message": {"role": "assistant", "content": "Hi there."}}], "usage": {"prompt_tokens": 9, \
"completion_tokens": 3, "total_tokens": 12}}
{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather \
in a city.", "parameters": {"type": "object", "properties": {"location": {"type": "string"}, \
"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}
[1, 2, 3, null, true, false, -0.5, 1e-6, {"nested": {"deeper": [[], {}]}}]

]~!b[]~b]system
You are a helpful assistant.[e~[
]~b]user
What's the weather like in Beijing today? Please answer in Celsius.[e~[
]~b]ai
<mm:think>The user wants the weather in Beijing. I should call the weather tool.</mm:think>
]<]minimax[>[<tool_call>
]<]minimax[>[<invoke name="get_weather">]<]minimax[>[<location>Beijing]<]minimax[>[</location>\
]<]minimax[>[<unit>celsius]<]minimax[>[</unit>]<]minimax[>[</invoke>
]<]minimax[>[</tool_call>[e~[
]~b]tool
<response>{"temperature": 21, "condition": "sunny", "humidity": 0.35}</response>[e~[
]~b]ai
</mm:think>It is sunny in Beijing, about 21 °C with low humidity.[e~[
]~b]user
Thanks! Can you search for flights from Shanghai to Tokyo next Friday?[e~[
]~b]ai
</mm:think>Sure, let me look that up.
]<]minimax[>[<tool_call>
]<]minimax[>[<invoke name="search_flights">]<]minimax[>[<origin>Shanghai]<]minimax[>[</origin>\
]<]minimax[>[<destination>Tokyo]<]minimax[>[</destination>]<]minimax[>[<passengers>\
]<]minimax[>[<item>]<]minimax[>[<name>Ada]<]minimax[>[</name>]<]minimax[>[</item>\
]<]minimax[>[</passengers>]<]minimax[>[<nonstop>true]<]minimax[>[</nonstop>]<]minimax[>[</invoke>
]<]minimax[>[</tool_call>[e~[
<tools>
<tool>{"name": "read_file", "description": "Read a file from disk.", "parameters": {"type": \
"object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}</tool>
</tools>
User: Summarize the following paragraph in one sentence, please.
Assistant: Certainly. The paragraph argues that small, careful steps beat large, risky ones.
Q: How many legs does a spider have? A: Eight. Q: And an insect? A: Six.
Markdown: # Heading ## Subheading - bullet one - bullet two **bold** _italic_ `code` [link](url)
| column a | column b |
|----------|----------|
| 1        | 2        |
Error: ValueError: invalid literal for int() with base 10: 'abc' at line 17, column 4.
Traceback (most recent call last):
  File "main.py", line 3, in <module>
    raise RuntimeError("something went wrong")
RuntimeError: something went wrong
https://example.com/path/to/page?query=value&limit=20#section-2 user@example.org 192.168.0.1
"""

_SPECIAL_SPLIT = re.compile("|".join(re.escape(t) for t in sorted(SPECIAL_TOKENS, key=len)[::-1]))


def special_base(vocab_size: int) -> int:
    """First special-token id in a vocabulary of ``vocab_size`` (the top 64 ids are specials)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    return vocab_size - NUM_SPECIAL_SLOTS


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """Special token string -> id in a vocabulary of ``vocab_size``."""
    base = special_base(vocab_size)
    return {token: base + offset for token, offset in SPECIAL_TOKENS.items()}


def _untrained_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _train_base(base_size: int) -> Tokenizer:
    tokenizer = _untrained_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=base_size,
        min_frequency=0,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    fragments = [part for part in _SPECIAL_SPLIT.split(TRAINING_CORPUS) if part]
    tokenizer.train_from_iterator(fragments, trainer=trainer)
    return tokenizer


def _pad_base_vocab(tokenizer: Tokenizer, base_size: int) -> Tokenizer:
    # The corpus runs out of merges long before very large vocabularies (e.g. the real 200064);
    # the rest of the base ids become entries no merge produces, so encode never emits them
    # but a random model may still sample them and they decode to readable text.
    spec = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    for token_id in range(len(vocab), base_size):
        vocab[f"<|unused_{token_id}|>"] = token_id
    return Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))


def _add_specials(tokenizer: Tokenizer) -> None:
    ordered = sorted(SPECIAL_TOKENS, key=SPECIAL_TOKENS.__getitem__)
    added = [AddedToken(t, special=True, normalized=False) for t in ordered]
    # Added tokens take the next free ids in order, which lands offset k at base + k.
    tokenizer.add_special_tokens(added)


def build_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Build the deterministic tiny tokenizer with exactly ``vocab_size`` ids."""
    base_size = special_base(vocab_size)
    tokenizer = _train_base(base_size)
    if tokenizer.get_vocab_size() < base_size:
        tokenizer = _pad_base_vocab(tokenizer, base_size)
    if tokenizer.get_vocab_size() != base_size:
        raise RuntimeError(f"base vocab is {tokenizer.get_vocab_size()}, expected {base_size}")
    _add_specials(tokenizer)
    return tokenizer


def _tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
    }


def _write_json(path: pathlib.Path, data: object) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def write_tokenizer_files(out_dir: pathlib.Path, vocab_size: int) -> None:
    """Write an HF-loadable tokenizer directory (tokenizer.json, configs, chat template)."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(vocab_size).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config())
    special_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    _write_json(out_dir / "special_tokens_map.json", special_map)
    template = importlib.resources.files("m3serve.model.tiny").joinpath("chat_template.jinja")
    (out_dir / "chat_template.jinja").write_text(template.read_text(encoding="utf-8"))
