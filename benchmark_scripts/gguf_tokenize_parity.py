"""Prompt tokens from GGUF vocabularies: ours against llama.cpp's own ``llama-server``.

A GGUF's tokenizer is rebuilt by ``veloxquant_mlx.gguf`` (byte-level BPE split
as its ``tokenizer.ggml.pre`` name says, or SentencePiece). The model was trained
on the tokens its original tokenizer made, which llama.cpp reproduces; any
difference means the model reads a prompt it was not trained on. This writes
small random-weight files that carry SmolLM2's real vocabulary and merges under
each pre-tokenizer name of the table, plus a SentencePiece file trained here the
way Llama's was, serves each with both servers on loopback, and compares their
``POST /tokenize`` over a fixed set of texts (spaces, newlines, digits, accents,
scripts, emoji, code, control characters, special tokens) and seeded random
mixtures. Writes ``figures/gguf/tokenize_parity.json``.

    .venv/bin/python benchmark_scripts/gguf_tokenize_parity.py \\
        --llama-server ~/.cache/veloxquant-peers/llama.cpp-0.3.36/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmark_scripts")]
DEFAULT_OUT = ROOT / "figures" / "gguf" / "tokenize_parity.json"
PRE_NAMES = ["smollm", "default", "gpt-2", "llama-bpe", "smaug-bpe", "qwen2",
             "deepseek-r1-qwen", "tekken"]

FIXED_TEXTS = [
    "", " ", "   ", "\n", "\n\n\n", "\t", " \t\n ", "Hi", " Hi", "Hi ", "  two  spaces  ",
    "one\ntwo", "para\n\nbreak\n", "tab\tsep\t\tx", "crlf\r\nend\r\n",
    "0123456789", "pi is 3.14159, e is 2,718", "x = 12 + 345 * 6789", "v2.10.3-rc1",
    "It's we're they've I'd you'll", "DON'T SHOUT", "'s alone", "quote \"x\" and `y`",
    "brackets (a) [b] {c} <d>", "punct!!! ??? ... ;;", "email me@example.org",
    "https://example.org/a/b?c=1&d=2#e", "#tag @user $5 75% ^ ~ |",
    "café naïve façade Ångström", "Straße Œuvre ø", "Ελληνικά и русский", "日本語の文章。",
    "中文，你好！", "한국어", "emoji 🎉🚀 👩‍💻 🇯🇵", "∑∫√ ≠ ≤ →", "zero\u200bwidth",
    "e\u0301 combining", "ﬁ ligature Ａ wide", "nul\x00bell\x07esc\x1b",
    "def f(x):\n    return x ** 2\n", "{\"k\": [1, 2, null], \"s\": \"v\"}",
    "CamelCaseName snake_case_name", "HTTPServerError XMLHttpRequest",
    "a" * 120, "ab " * 40, " " * 30 + "end", "start" + " " * 30,
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", "x<|im_end|>y",
    "<|endoftext|>", "<s>", "</s>", "<unk>", "<tool>", "a<tool>b", " <tool> ", "<0x41>",
]


def texts(seed: int = 11, random_count: int = 80) -> list[str]:
    """The fixed texts, then seeded random strings over a mixed alphabet."""
    rng = random.Random(seed)
    alphabet = list("abcxyz ABCXYZ 0189 \n\t.,!?'\"-_/é日😀<>|")
    mixed = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 48)))
             for _ in range(random_count)]
    return FIXED_TEXTS + mixed


def smollm2_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """SmolLM2's tokens, token types and merges, from the shipped GGUF."""
    import gguf

    from veloxquant_mlx.gguf import smollm2_gguf_path

    reader = gguf.GGUFReader(str(smollm2_gguf_path()))

    def field(key: str) -> list:
        part = reader.fields[key]
        return [part.parts[i] for i in part.data]

    tokens = [bytes(p).decode() for p in field("tokenizer.ggml.tokens")]
    merges = [bytes(p).decode() for p in field("tokenizer.ggml.merges")]
    types = [int(p[0]) for p in field("tokenizer.ggml.token_type")]
    return tokens, types, merges


def write_files(work: Path) -> dict[str, Path]:
    """One small F16 file per pre-tokenizer name, and the SentencePiece one."""
    from tests.gguf import synth

    bpe = smollm2_vocabulary()
    files = {pre: synth.write_model(work / f"bpe-{pre}.gguf", synth.Spec("F16", bpe=bpe, pre=pre))
             for pre in PRE_NAMES}
    files["sentencepiece"] = synth.write_model(
        work / "spm.gguf", synth.Spec("F16", tokenizer_model="llama",
                                      spm=synth.sentencepiece_vocabulary(synth.train_sentencepiece())))
    return files


def compare(path: Path, llama_server: Path, work: Path) -> dict:
    """Serve ``path`` with both servers and compare their tokens text by text."""
    from benchmark_server import wait_up
    from server_process import ServerProcess, free_port

    port = free_port()
    llama = subprocess.Popen([str(llama_server), "-m", str(path), "--host", "127.0.0.1",
                              "--port", str(port), "--threads", "1", "--ctx-size", "512",
                              "--no-webui"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        theirs = f"http://127.0.0.1:{port}"
        with ServerProcess(work / f"{path.stem}.log", ["--model", str(path)],
                           {"VELOXQUANT_HOME": str(work / "home")},
                           startup_timeout_s=300) as ours:
            wait_up(theirs, llama)
            differing = []
            checked = texts()
            for text in checked:
                a = httpx.post(ours.base_url + "/tokenize", json={"prompt": text},
                               timeout=60).json()["tokens"]
                b = httpx.post(theirs + "/tokenize", json={"content": text,
                               "add_special": True}, timeout=60).json()["tokens"]
                if a != b:
                    differing.append({"text": text, "ours": a, "llama.cpp": b})
    finally:
        llama.terminate()
        llama.wait(30)
    return {"texts": len(checked), "differing": len(differing), "examples": differing[:5]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-server", type=Path, required=True)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()

    import platform

    from benchmark_revisions import checkout_revision

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        results = {}
        for name, path in write_files(work).items():
            results[name] = compare(path, args.llama_server, work)
            print(f"{name:18s} {results[name]['differing']} of {results[name]['texts']} texts "
                  "tokenized differently", flush=True)
    out = {"benchmark": "benchmark_scripts/gguf_tokenize_parity.py",
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "revision": checkout_revision(ROOT), "machine": {"platform": platform.platform()},
           "compared": "POST /tokenize (ours) vs llama-server POST /tokenize add_special=true",
           "vocabularies": {"bpe": "SmolLM2-135M-Instruct's, under each tokenizer.ggml.pre name",
                            "sentencepiece": "BPE trained as in tests/gguf/test_spm.py"},
           "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["differing"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
