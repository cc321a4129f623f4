"""Build the bundled byte-level BPE (``bundled/k3-bpe/``) in the release's layout::

    python -m k3core.tokenizer.build_bpe OUTDIR      # the checked-in copy: k3core/tokenizer/bundled/k3-bpe

Owns: the training corpus (generated here, seeded, offline), the training (``tokenizers``' BPE
trainer over Kimi's ``pat_str``), and writing ``tiktoken.model``, ``tokenizer.json`` and
``tokenizer_config.json`` (with K3's special tokens and a K3-style chat template). Does not own:
loading them (``k3core.tokenizer.load_tokenizer``).

What holds, and why:
- Deterministic: the corpus is a function of fixed seeds and of the bundled datasets
  (``k3core/rl/bundled``), and the trainer breaks ties between equal pair counts by the pair, so
  the same files come out of every run.
- Ids: byte ``b`` is id ``b``; the merge learned ``k``-th makes id ``256 + k``. That id is also the
  token's tiktoken rank: tiktoken merges the adjacent pair whose joined bytes have the lowest rank,
  so ranks in merge order replay the trainer's merges (the tests check both encoders agree).
- The demo tasks stay cheap: ``rev:abcd=`` (reverse letters a-h) and ``12+34=``. No base token is
  a run of two or more of a-h (English gives BPE "he", "ed", "each": ``drop_letter_runs`` removes
  them and the merges built on them), so a reversal costs one token per letter; the corpus holds
  few reversal strings; numbers merge up to three digits, as ``pat_str`` allows and as in the
  release. ``main`` prints how the demo strings tokenize.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from k3core.tokenizer.pattern import KIMI_PAT_STR
from k3core.tokenizer.specials import K3_SPECIAL_OFFSETS, NUM_SPECIAL, special_names

N_BASE = 2048
BUNDLED_DATA = Path(__file__).resolve().parents[1] / "rl" / "bundled"

# The tool declarations are rendered with sorted keys by the template itself: the release sorts them in
# its Python tokenizer class, which SGLang and transformers do not run (no remote code), so a template
# that relied on it would render other bytes there than here.
K3_CHAT_TEMPLATE = """\
{%- macro render_content(message) -%}
{%- if message.content is string -%}
{{ message.content }}
{%- elif message.content is not none -%}
{%- for part in message.content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':'), sort_keys=True) }}<|im_end|>
{%- endif -%}
{%- if messages | length == 0 or messages[0].role != 'system' -%}
<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'tool' -%}
<|im_system|>tool<|im_middle|>{{ '## Return of ' ~ message.tool_call_id ~ '\\n' }}{{ render_content(message) }}<|im_end|>
{%- elif message.role in ['system', 'user', 'assistant'] -%}
<|im_{{ message.role }}|>{{ message.role }}<|im_middle|>{{ render_content(message) }}
{%- if message.role == 'assistant' and message.tool_calls -%}
<|tool_calls_section_begin|>
{%- for call in message.tool_calls -%}
<|tool_call_begin|>{{ call.id if call.id else 'functions.' ~ call.function.name ~ ':' ~ loop.index0 }}<|tool_call_argument_begin|>
{%- if call.function.arguments is string -%}{{ call.function.arguments }}{%- else -%}{{ call.function.arguments | tojson }}{%- endif -%}
<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- endif -%}
<|im_end|>
{%- else -%}
{{ raise_exception('unknown chat role ' ~ message.role ~ ': use system, user, assistant or tool') }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}
"""

# Plain words for English-like text (fixed here: text gathered from the repo would change with it).
WORDS = """the of and to in is it that for on with as was at by be this from or have an are not but
they which one you all were we when there can your more their has if will each about how up out them
then she many some so these would other into her two make him time look more write go see number no
way could people my than first water been call who oil its now find long down day did get come made
may part over new sound take only little work know place year live me back give most very after
thing our just name good sentence man think say great where help through much before line right
too mean old any same tell boy follow came want show also around form three small set put end does
another well large must big even such because turn here why ask went men read need land different
home us move try kind hand picture again change off play spell air away animal house point page
letter mother answer found study still learn should world high every near add food between own
below country plant last school father keep tree never start city earth eye light thought head
under story saw left few while along might close something seem next hard open example begin life
always those both paper together got group often run important until children side feet car mile
night walk white sea began grow took river four carry state once book hear stop without second
later miss idea enough eat face watch far really almost let above girl sometimes mountain cut young
talk soon list song being leave family model token reward policy value gradient train step batch
loss expert router layer attention weight checkpoint rollout sample prompt answer score""".split()

CJK = "我们的模型学习了很多中文字符今天天气很好你好世界这是一个测试大语言模型强化学习训练数据"
KANA = "こんにちはありがとうございますテキストのトークン化カタカナひらがな"
ACCENTED = "café naïve résumé über straße façade crème brûlée São Paulo Ångström señor déjà vu".split()
EMOJI = ["😀", "👍", "🚀", "🎉", "❤️", "🤖"]
TOOL_NAMES = ["get_weather", "search_web", "run_python", "read_file", "add_numbers", "lookup_user"]
CITIES = ["Paris", "Tokyo", "Beijing", "New York", "Berlin", "São Paulo", "London", "Cairo"]


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
    if rng.random() < 0.3:
        words[0] = words[0].capitalize()
    if rng.random() < 0.1:
        words.insert(rng.randrange(len(words)), rng.choice(["don't", "it's", "we're", "I'm", "they've", "you'll"]))
    if rng.random() < 0.08:
        words.insert(rng.randrange(len(words)), rng.choice(ACCENTED))
    if rng.random() < 0.04:
        words.append(rng.choice(EMOJI))
    return " ".join(words) + rng.choice([".", ".", ".", "?", "!", ",", ":"])


def _tool_arguments(rng: random.Random) -> dict:
    return rng.choice([
        {"city": rng.choice(CITIES), "unit": rng.choice(["celsius", "fahrenheit"])},
        {"query": " ".join(rng.choice(WORDS) for _ in range(3)), "limit": rng.randint(1, 20)},
        {"code": f"print({rng.randint(0, 99)} + {rng.randint(0, 99)})"},
        {"path": f"/data/{rng.choice(WORDS)}.txt"},
        {"a": rng.randint(0, 999), "b": rng.randint(0, 999)},
    ])


def _chat_turns(rng: random.Random) -> list[str]:
    """The pieces of a chat as the template writes them between its special tokens (which are
    added tokens, never learned, and split the text where they stand)."""
    name, index = rng.choice(TOOL_NAMES), rng.randint(0, 3)
    args = json.dumps(_tool_arguments(rng), ensure_ascii=False)
    return [
        "system", "You are a helpful assistant.", "user", _sentence(rng), "assistant", _sentence(rng),
        "tool_declare", json.dumps([{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}],
                                   separators=(",", ":")),
        f"functions.{name}:{index}", args, "tool", f"## Return of functions.{name}:{index}\n", _sentence(rng),
    ]


def _bundled_rows() -> list[str]:
    import pyarrow.parquet as pq

    rows = [r["prompt"] + r["answer"] for r in map(json.loads, (BUNDLED_DATA / "math.jsonl").read_text().splitlines())]
    rows += [r["prompt"] + r["answer"] + "\n" + r["tests"] for r in pq.read_table(BUNDLED_DATA / "code.parquet").to_pylist()]
    return rows


def corpus(seed: int = 0) -> list[str]:
    """The training texts: a function of ``seed`` and the bundled datasets only."""
    rng = random.Random(seed)
    texts = _bundled_rows() * 4
    texts += [" ".join(_sentence(rng) for _ in range(rng.randint(1, 4))) for _ in range(6000)]
    texts += [piece for _ in range(800) for piece in _chat_turns(rng)]
    texts += [f"{rng.randint(0, 99)}+{rng.randint(0, 99)}={rng.randint(0, 198)}" for _ in range(300)]
    # few reversal strings: enough that the format is known, too few for BPE to merge letter runs
    texts += ["rev:" + "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 8))) + "=" for _ in range(40)]
    texts += ["".join(rng.sample(CJK, rng.randint(2, 8))) + rng.choice(["。", "，", "！"]) for _ in range(600)]
    texts += ["".join(rng.sample(KANA, rng.randint(3, 8))) for _ in range(300)]
    texts += ["    " * rng.randint(0, 3) + "x = " + str(rng.randint(0, 999)) + "\n" * rng.randint(1, 3) for _ in range(300)]
    return texts


def byte_to_unicode() -> dict[int, str]:
    """The byte-level alphabet of ``tokenizers``' ByteLevel (GPT-2's): printable bytes stand for
    themselves, the other bytes for the code points 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def is_letter_run(token: bytes) -> bool:
    """Two or more letters of the reversal demo's alphabet (a-h), nothing else."""
    return len(token) > 1 and set(token) <= set(b"abcdefgh")


def drop_letter_runs(merges: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The merges without those making a run of a-h, nor any merge built on a dropped token: what
    is left is still a BPE (every part of a kept merge is a byte or an earlier kept merge), and
    ``rev:abcd=`` -> ``dcba`` costs one token per letter."""
    dropped, kept = set(), []
    for a, b in merges:
        if a in dropped or b in dropped or is_letter_run(a + b):
            dropped.add(a + b)
        else:
            kept.append((a, b))
    return kept


def train_merges(texts: list[str], n_base: int = N_BASE, spare: int = 400) -> list[tuple[bytes, bytes]]:
    """The ``n_base - 256`` first merges the trainer learned, as byte strings, after
    ``drop_letter_runs`` (it trains ``spare`` merges more, so the drop leaves enough)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=n_base + spare, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    to_byte = {c: b for b, c in byte_to_unicode().items()}
    merges = json.loads(tok.to_str())["model"]["merges"]
    as_bytes = lambda s: bytes(to_byte[c] for c in s)
    merges = [(as_bytes(a), as_bytes(b)) for a, b in (m.split(" ") if isinstance(m, str) else m for m in merges)]
    kept = drop_letter_runs(merges)
    if len(kept) < n_base - 256:
        raise RuntimeError(f"only {len(kept)} merges left after dropping letter runs; raise spare ({spare})")
    return kept[:n_base - 256]


def ranks_from_merges(merges: list[tuple[bytes, bytes]]) -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for a, b in merges:
        if a + b in ranks:
            raise ValueError(f"merge {a!r} + {b!r} repeats token {a + b!r}")
        ranks[a + b] = len(ranks)
    return ranks


def hf_tokenizer_json(ranks: dict[bytes, int], merges: list[tuple[bytes, bytes]], specials: dict[str, int]) -> str:
    """``tokenizer.json``: the same BPE for ``tokenizers`` (ids = ranks; ``ignore_merges`` as in
    tiktoken, which takes a whole piece that is a token as it is), specials as added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    u = byte_to_unicode()
    text = lambda bs: "".join(u[b] for b in bs)
    model = models.BPE(vocab={text(t): i for t, i in ranks.items()}, merges=[(text(a), text(b)) for a, b in merges],
                       ignore_merges=True)
    tok = Tokenizer(model)
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False)
                            for name, _ in sorted(specials.items(), key=lambda kv: kv[1])])
    for name, i in specials.items():
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special token {name} landed at id {tok.token_to_id(name)}, not {i}")
    return json.dumps(json.loads(tok.to_str()), ensure_ascii=False, indent=1) + "\n"


def tokenizer_config(specials: dict[str, int]) -> dict:
    entry = lambda name: {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
    return {
        "added_tokens_decoder": {str(i): entry(name) for name, i in sorted(specials.items(), key=lambda kv: kv[1])},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": K3_CHAT_TEMPLATE,
    }


def write_tiktoken_model(ranks: dict[bytes, int], path: Path) -> None:
    import base64

    lines = [f"{base64.b64encode(t).decode()} {i}" for t, i in sorted(ranks.items(), key=lambda kv: kv[1])]
    path.write_text("\n".join(lines) + "\n")


def build(outdir: str | Path, seed: int = 0, n_base: int = N_BASE) -> Path:
    """Train on ``corpus(seed)`` and write the three files into ``outdir``."""
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    merges = train_merges(corpus(seed), n_base)
    ranks = ranks_from_merges(merges)
    specials = special_names(len(ranks), {len(ranks) + k: name for k, name in K3_SPECIAL_OFFSETS.items()}, NUM_SPECIAL)
    write_tiktoken_model(ranks, out / "tiktoken.model")
    (out / "tokenizer.json").write_text(hf_tokenizer_json(ranks, merges, specials), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(specials), ensure_ascii=False, indent=2)
                                               + "\n", encoding="utf-8")
    return out


def demo_report(directory: Path) -> str:
    """How the demo's strings tokenize, and how many base tokens are runs of letters a-h."""
    from k3core.tokenizer import load_tokenizer

    tok = load_tokenizer(directory)
    lines = [f"{len(tok.encoding._mergeable_ranks)} base tokens + {tok.vocab_size - tok.n_base} special ids"]
    for s in ("rev:abcdefgh=", "dcba", "hgfedcba", "12+34=", "46"):
        ids = tok.encode(s)
        lines.append(f"{s!r:>18} -> {len(ids)} tokens {[tok.decode([i]) for i in ids]}")
    runs = sorted(t.decode() for t in tok.encoding._mergeable_ranks if is_letter_run(t))
    lines.append(f"{len(runs)} base tokens are runs of a-h: {runs}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m k3core.tokenizer.build_bpe OUTDIR", file=sys.stderr)
        return 2
    out = build(argv[0])
    print(demo_report(out))
    for f in sorted(out.iterdir()):
        print(f"{f.name}: {f.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
