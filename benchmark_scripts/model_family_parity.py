#!/usr/bin/env python3
"""Each mlx-lm family the server is checked against: served as mlx-lm serves it, or refused.

For every family of :mod:`veloxquant_mlx.family_models` this builds its small
random-weight model, then:

* loads it as the server does (:meth:`server.harness.RunnerHarness.served`: the
  server's load and assembly); a refusal is recorded with its line;
* otherwise runs two prompts (40 and 29 tokens: past the 16-token windows the
  families state, and of two lengths, so one prefill group pads one row) through
  the engine's own runner, its paged KV batch and the pool's arena, greedy,
  24 tokens each, with the log-probabilities of every step;
* runs the same prompts through mlx-lm's ``generate_step`` on its own load of
  the same folder (its stock caches), greedy;
* records whether the greedy tokens are equal and the largest absolute
  difference of the log-probabilities over every step and row.

A family is served when its tokens are equal and the difference is within
``TOLERANCE`` (float32 on the CPU); a loaded family that differs is a
``mismatch``, which the server must refuse instead. For a refused family the
figure also records what serving it would have given: the same prompts through
the harness's runner over the pool's arena
(:meth:`~server.harness.RunnerHarness.for_model`), on mlx-lm's load with no check
(``unchecked_*``).

Usage:
    python benchmark_scripts/model_family_parity.py            # -> figures/model_families.json
    python benchmark_scripts/model_family_parity.py --families llama gemma3_text --out /tmp/f.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from veloxquant_mlx.family_models import FAMILIES, build_family_model  # noqa: E402

PROMPT_LENGTHS = (40, 29)
N_TOKENS = 24
TOLERANCE = 1e-4  # float32 log-probabilities, max abs difference over every step
FIRST_ID = 5  # prompts use no special token (the tiny tokenizer's ids 0..4)


@dataclass(slots=True)
class Generated:
    """One prompt's greedy tokens and the log-probabilities each was taken from."""

    tokens: list[int]
    logprobs: Any  # numpy (steps, vocab)


@dataclass(slots=True)
class FamilyResult:
    """What figures/model_families.json records of one family."""

    family: str
    model_type: str
    status: str  # "served", "refused" or "mismatch"
    reason: str | None = None
    greedy_tokens_equal: bool | None = None
    max_logprob_diff: float | None = None  # over every step and row
    first_step_logprob_diff: float | None = None  # the prompt's own logits, every row
    unchecked_tokens_equal: bool | None = None  # a refused family, served anyway
    unchecked_max_logprob_diff: float | None = None


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """The parity prompts: seeded token ids, no special tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(FIRST_ID, vocab, n).tolist() for n in PROMPT_LENGTHS]


def mlx_lm_generation(folder: Path, prompt_ids: list[list[int]], n: int) -> list[Generated]:
    """Greedy tokens of each prompt from mlx-lm's ``generate_step`` on its own load."""
    import mlx.core as mx
    import mlx_lm
    import numpy as np
    from mlx_lm.generate import generate_step

    model, _ = mlx_lm.load(str(folder))
    out = []
    for ids in prompt_ids:
        steps = list(generate_step(mx.array(ids), model, max_tokens=n,
                                   sampler=lambda lp: mx.argmax(lp, axis=-1)))
        out.append(Generated([int(t) for t, _ in steps],
                             np.stack([np.array(lp.reshape(-1)) for _, lp in steps])))
    return out


def served_generation(folder: Path, prompt_ids: list[list[int]], n: int) -> list[Generated]:
    """Greedy tokens of each prompt from the engine's parts, as the server builds them.

    The prompts start in one step, so they prefill as one group and decode in one batch.

    Raises:
        server.model_support.UnsupportedModelError: The load refuses the model.
    """
    from server.harness import RunnerHarness
    from server.protocol import SamplingParams
    from server.settings import load_settings

    settings = load_settings(None, overrides={"model": {"path": str(folder)}}, env={})
    with RunnerHarness.served(settings) as harness:
        return _run_rows(harness, prompt_ids, n, SamplingParams(
            max_tokens=n, temperature=0.0, logprobs=True))


def unchecked_generation(folder: Path, prompt_ids: list[list[int]], n: int) -> list[Generated]:
    """:func:`served_generation` with no load-time check: mlx-lm's load, the runner, the arena."""
    import mlx_lm

    from server.harness import RunnerHarness
    from server.protocol import SamplingParams

    model, _ = mlx_lm.load(str(folder))
    with RunnerHarness.for_model(model, 1024) as harness:
        return _run_rows(harness, prompt_ids, n, SamplingParams(
            max_tokens=n, temperature=0.0, logprobs=True))


def _differences(ours: list[Generated], reference: list[Generated]) -> tuple[bool, float, float]:
    """Tokens all equal; largest log-probability difference over all steps, and the first's."""
    pairs = list(zip(ours, reference, strict=True))
    equal = all(a.tokens == b.tokens for a, b in pairs)
    steps = [abs(a.logprobs - b.logprobs).max(axis=1) for a, b in pairs]
    return equal, max(float(s.max()) for s in steps), max(float(s[0]) for s in steps)


def _run_rows(harness: Any, prompt_ids: list[list[int]], n: int,
              params: Any) -> list[Generated]:
    """Start every prompt, prefill them, decode until each has ``n`` tokens; rows leave."""
    import numpy as np

    owners = range(len(prompt_ids))
    got = harness.generate(dict(zip(owners, prompt_ids, strict=True)), params, n)
    harness.finish(owners)
    if any(len(got[o]) != n for o in owners):
        raise RuntimeError(f"rows got {[len(got[o]) for o in owners]} tokens, not {n}")
    return [Generated([s.token for s in got[o]], np.stack([np.array(s.logprobs)
                                                           for s in got[o]]))
            for o in owners]


def compare(family: str, root: Path) -> FamilyResult:
    """Build ``family``'s model under ``root`` and run both paths on it."""
    from server.model_support import UnsupportedModelError

    folder = build_family_model(family, root / family)
    model_type = FAMILIES[family]["model_type"]
    ids = prompts(json.loads((folder / "config.json").read_text())["vocab_size"])
    reference = mlx_lm_generation(folder, ids, N_TOKENS)  # first: before the engine loads
    try:
        served = served_generation(folder, ids, N_TOKENS)
    except UnsupportedModelError as exc:
        equal, diff, _ = _differences(unchecked_generation(folder, ids, N_TOKENS), reference)
        return FamilyResult(family, model_type, "refused", reason=str(exc),
                            unchecked_tokens_equal=equal, unchecked_max_logprob_diff=diff)
    equal, diff, first = _differences(served, reference)
    status = "served" if equal and diff <= TOLERANCE else "mismatch"
    return FamilyResult(family, model_type, status, greedy_tokens_equal=equal,
                        max_logprob_diff=diff, first_step_logprob_diff=first)


def main(argv: list[str] | None = None) -> int:
    """Compare the families asked for, print a table, write the JSON figure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES),
                        default=list(FAMILIES))
    parser.add_argument("--out", type=Path, default=REPO / "figures" / "model_families.json")
    args = parser.parse_args(argv)
    import mlx_lm

    with tempfile.TemporaryDirectory(prefix="model-families-") as tmp:
        results = [compare(family, Path(tmp)) for family in args.families]
    for r in results:
        print(f"{r.family:<20} {r.status:<9} tokens equal: {r.greedy_tokens_equal}  "
              f"max |dlogprob|: {r.max_logprob_diff}  unchecked: {r.unchecked_tokens_equal} "
              f"{r.unchecked_max_logprob_diff}  {r.reason or ''}")
    figure = {"mlx_lm": mlx_lm.__version__, "device": _device(), "tolerance": TOLERANCE,
              "prompt_tokens": list(PROMPT_LENGTHS), "generated_tokens": N_TOKENS,
              "families": [asdict(r) for r in results]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figure, indent=2) + "\n", encoding="utf-8")
    return 1 if any(r.status == "mismatch" for r in results) else 0


def _device() -> str:
    import mlx.core as mx

    return str(mx.default_device())


if __name__ == "__main__":
    raise SystemExit(main())
