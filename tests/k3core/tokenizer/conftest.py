"""Shared inputs of the tokenizer tests: a corpus that exercises the pre-tokenizer and the special
tokens, and the bundled BPE in its three loaders."""

import pytest

from k3core.tokenizer import BUNDLED_K3_BPE

CORPUS = [
    "Hello, World! The quick brown fox jumps over the lazy dog.",
    "我们的模型学习了很多中文字符。今天天气很好",
    "日本語のテキストとカタカナ、ひらがな。漢字かな混じり文",
    "café naïve résumé über straße façade São Paulo Ångström",
    "emoji 😀👍🚀 ❤️ 👨‍👩‍👧 and flags 🇫🇷",
    "whitespace    runs\t\ttabs\n\n\nnewlines \r\n crlf   \n  trailing   ",
    "digits 1 12 123 1234 12345 3.14159 -42 1,000,000",
    "contractions: I'm you're he's we've they'll I'd don't CAN'T WON'T It'S",
    "mixed Case: camelCase PascalCase snake_case SCREAMING_CASE iPhone McDonald",
    "specials: <|im_end|> exactly, <|im_end| truncated, [BOS] and [EOS]x and <|im_user|>user",
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
    "rev:abcdefgh=hgfedcba 12+34=46 (x+2)(x+3)=x^2+5x+6",
    "def f(x):\n    return x % 4  # modulo\n",
    '{"city": "Paris", "unit": "celsius", "nested": {"a": [1, 2, 3]}}',
    "Ελληνικά кириллица العربية עברית हिन्दी 한국어",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="session")
def bundled():
    return BUNDLED_K3_BPE


@pytest.fixture(scope="session")
def corpus():
    return CORPUS
