"""Per-token mask cost of the grammar libraries on the default model's 49,152-token vocabulary.

For each library that imports here (llguidance, xgrammar, outlines-core) it
times, on the SmolLM2 tokenizer:

- setup: the tokenizer index the library builds once per vocabulary;
- compile: each of the five schemas of ``structured_schemas.py`` plus
  ``json_object`` (any JSON object), once each;
- mask, one row: walk each schema's example document token by token, timing
  the mask of every step (the mask must allow the document's next token, and
  EOS at the end, else the run is reported as wrong);
- mask, 16 rows: 16 matchers (the six grammars in turn) stepped together,
  timing the batch's masks per step with the library's batched call.

Only llguidance is a project dependency. xgrammar imports torch at the top
level (a multi-gigabyte install on Linux), so to measure all three::

    python -m venv /tmp/grammar-env
    /tmp/grammar-env/bin/pip install llguidance xgrammar outlines-core transformers
    /tmp/grammar-env/bin/python benchmark_scripts/benchmark_grammar_libs.py \
        --tokenizer-dir "$(.venv/bin/python -c 'from server.model_loader import \
        resolve_model_path as r; from server.settings import load_settings as l; \
        print(r(l(None, env={}).model))')"

Writes ``figures/structured/grammar_libs.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_schemas import CASES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "figures" / "structured" / "grammar_libs.json"
ITEM_SEP, KEY_SEP = ", ", ": "  # the separators every library is held to
BATCH = 16
REPEATS = 5  # walks per document (the first ones also warm the library's caches)


def default_tokenizer_dir() -> Path:
    from server.model_loader import resolve_model_path
    from server.settings import load_settings

    return resolve_model_path(load_settings(None, env={}).model)


def documents() -> list[tuple[str, dict, str]]:
    """(name, schema, document text) for the five schemas and json_object."""
    out = [(c.name, c.schema, json.dumps(c.example, separators=(ITEM_SEP, KEY_SEP)))
           for c in CASES]
    out.append(("json_object", {"type": "object"},
                json.dumps({"note": "free form", "tags": ["a", "b"], "n": {"x": 1}},
                           separators=(ITEM_SEP, KEY_SEP))))
    return out


def allowed(bitmask: np.ndarray, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


class Library:
    """What the benchmark needs of a library: compile, new matcher, fill, consume."""

    name = ""

    def compile(self, schema: dict) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matcher: Any, bitmask: np.ndarray, row: int) -> None: ...
    def fill_batch(self, matchers: list[Any], bitmask: np.ndarray) -> None: ...
    def consume(self, matcher: Any, token: int) -> bool: ...


class LLGuidance(Library):
    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, eos: int) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=eos)
        self.executor = llguidance.LLExecutor()
        self.options = {"whitespace_flexible": False, "item_separator": ITEM_SEP,
                        "key_separator": KEY_SEP}

    def compile(self, schema: dict) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=self.options)
        matcher = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, bitmask: np.ndarray, row: int) -> None:
        v = bitmask[row]
        matcher.unsafe_compute_mask_ptr(v.ctypes.data, v.nbytes)

    def fill_batch(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                              bitmask.ctypes.data, bitmask.shape[1] * 4,
                                              bitmask.shape[0])

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)


class XGrammar(Library):
    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, eos: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.batcher = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict) -> Any:
        return self.compiler.compile_json_schema(schema, any_whitespace=False,
                                                 separators=(ITEM_SEP, KEY_SEP))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: np.ndarray, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)


class OutlinesCore(Library):
    """Regex-based: a JSON schema becomes a regex, the regex an index over the vocabulary."""

    name = "outlines-core"

    def __init__(self, hf_tokenizer: Any, eos: int) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc, self.to_regex = outlines_core, build_regex_from_schema
        # Byte-level BPE: each token's characters stand for bytes (GPT-2's table).
        bytes_of = {c: b for b, c in _bytes_to_unicode().items()}
        vocab: dict[bytes, list[int]] = {}
        special = set(hf_tokenizer.all_special_ids)
        for token, tid in hf_tokenizer.get_vocab().items():
            if tid in special:
                continue
            vocab.setdefault(bytes(bytes_of[ch] for ch in token), []).append(tid)
        self.vocab = outlines_core.Vocabulary(eos, vocab)

    def compile(self, schema: dict) -> Any:
        if schema == {"type": "object"}:
            raise NotImplementedError("a regex cannot express JSON of any nesting depth")
        # An optional space around separators admits the ", " / ": " documents.
        regex = self.to_regex(json.dumps(schema), whitespace_pattern="[ ]?")
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matcher: Any, bitmask: np.ndarray, row: int) -> None:
        v = bitmask[row]
        matcher.write_mask_into(v.ctypes.data, v.size, v.itemsize)

    def fill_batch(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        for i, m in enumerate(matchers):
            self.fill(m, bitmask, i)

    def consume(self, matcher: Any, token: int) -> bool:
        matcher.advance(token)
        return True


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + \
        list(range(0xAE, 0x100))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def walk_one(lib: Library, compiled: Any, ids: list[int], eos: int, vocab: int) -> dict:
    """Mask, check and consume each token of one document; per-step mask times in µs."""
    bitmask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
    matcher, times = lib.matcher(compiled), []
    for token in ids + [eos]:
        _, s = timed(lambda m=matcher: lib.fill(m, bitmask, 0))
        times.append(s * 1e6)
        if not allowed(bitmask, 0, token):
            return {"error": f"token {token} refused at step {len(times) - 1}"}
        if token != eos and not lib.consume(matcher, token):
            return {"error": f"token {token} not consumed at step {len(times) - 1}"}
    return {"steps": len(times), "mask_us": times}


def walk_batch(lib: Library, compiled: list[Any], docs: list[list[int]], steps: int,
               vocab: int) -> list[float]:
    """16 matchers stepped together; the batched mask time of each step, in ms.

    A row that finished its document starts it again with a fresh matcher, so
    all 16 rows are live at every step (as in a full decode batch).
    """
    grammars = [i % len(compiled) for i in range(BATCH)]
    matchers = [lib.matcher(compiled[g]) for g in grammars]
    at = [0] * BATCH
    bitmask = np.zeros((BATCH, (vocab + 31) // 32), dtype=np.int32)
    times = []
    for _ in range(steps):
        _, s = timed(lambda: lib.fill_batch(matchers, bitmask))
        times.append(s * 1e3)
        for i, g in enumerate(grammars):
            lib.consume(matchers[i], docs[g][at[i]])
            at[i] += 1
            if at[i] == len(docs[g]):
                matchers[i], at[i] = lib.matcher(compiled[g]), 0
    return times


def measure(lib_cls: type[Library], hf_tokenizer: Any, eos: int, vocab: int) -> dict:
    module = {"llguidance": "llguidance", "xgrammar": "xgrammar",
              "outlines-core": "outlines_core"}[lib_cls.name]
    try:
        __import__(module)
    except Exception as exc:  # not installed here (xgrammar needs torch)
        return {"available": False, "why": f"{type(exc).__name__}: {exc}"}
    lib, setup_s = timed(lambda: lib_cls(hf_tokenizer, eos))
    out: dict[str, Any] = {"available": True, "version": importlib.metadata.version(lib_cls.name),
                           "setup_ms": round(setup_s * 1e3, 1), "compile_ms": {}, "docs": {}}
    compiled, docs = [], []
    for name, schema, text in documents():
        try:
            grammar, s = timed(lambda schema=schema: lib.compile(schema))
        except Exception as exc:
            out["compile_ms"][name] = f"unsupported: {type(exc).__name__}: {exc}"[:200]
            continue
        out["compile_ms"][name] = round(s * 1e3, 2)
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        walks = [walk_one(lib, grammar, ids, eos, vocab) for _ in range(REPEATS)]
        walk = next((w for w in walks if "error" in w), walks[-1])
        if "error" in walk:
            out["docs"][name] = walk
            continue
        # Per step, the fastest of the repeats: what a warm matcher costs there.
        us = [min(w["mask_us"][i] for w in walks) for i in range(walk["steps"])]
        walk.pop("mask_us")
        walk.update(mask_us_mean=round(statistics.fmean(us), 1),
                    mask_us_p50=round(statistics.median(us), 1),
                    mask_us_max=round(max(us), 1))
        out["docs"][name] = walk
        compiled.append(grammar)
        docs.append(ids)
    all_us = [d["mask_us_mean"] * d["steps"] for d in out["docs"].values() if "steps" in d]
    steps = sum(d["steps"] for d in out["docs"].values() if "steps" in d)
    out["mask_us_per_token_one_row"] = round(sum(all_us) / max(steps, 1), 1)
    batch = walk_batch(lib, compiled, docs, 200, vocab)[1:]  # the first step warms up
    out["mask_ms_per_step_16_rows"] = {"mean": round(statistics.fmean(batch), 3),
                                       "p50": round(statistics.median(batch), 3),
                                       "max": round(max(batch), 3)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer-dir", type=Path, default=None,
                   help="the model folder (default: the server's default model)")
    p.add_argument("--libs", nargs="+", default=["llguidance", "xgrammar", "outlines-core"])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    from transformers import AutoTokenizer

    folder = args.tokenizer_dir or default_tokenizer_dir()
    hf = AutoTokenizer.from_pretrained(str(folder))
    eos, vocab = hf.eos_token_id, len(hf)
    libs = {c.name: c for c in (LLGuidance, XGrammar, OutlinesCore)}
    results = {name: measure(libs[name], hf, eos, vocab) for name in args.libs}
    report = {"tokenizer": str(folder.name), "vocab": vocab, "batch_rows": BATCH,
              "machine": {"platform": platform.platform(), "python": platform.python_version()},
              "libraries": results}
    try:  # keep results measured elsewhere (another environment) for libs not run now
        old = json.loads(args.out.read_text())["libraries"]
        report["libraries"] = {**{k: v for k, v in old.items() if v.get("available")},
                               **{k: v for k, v in results.items()
                                  if v.get("available") or k not in old}}
    except (OSError, ValueError, KeyError):
        pass
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, r in results.items():
        if not r["available"]:
            print(f"{name:14s} not installed: {r['why'][:80]}")
            continue
        print(f"{name:14s} setup {r['setup_ms']:8.1f} ms  "
              f"one row {r['mask_us_per_token_one_row']:7.1f} us/token  "
              f"16 rows {r['mask_ms_per_step_16_rows']['mean']:6.3f} ms/step  "
              f"compile {r['compile_ms']}")
        for doc, d in r["docs"].items():
            if "error" in d:
                print(f"   {doc}: WRONG {d['error']}")


if __name__ == "__main__":
    main()
