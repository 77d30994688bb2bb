#!/usr/bin/env python3
"""Render the performance charts (docs/charts/*.svg) from the benchmark results in figures/.

Every chart reads only its source JSON files (the CHARTS table below), so a
benchmark rerun followed by this script brings docs/performance.md up to date.
The output is deterministic: the same JSON gives byte-identical SVG.

Usage::

    .venv/bin/python scripts/render_charts.py           # write every chart
    .venv/bin/python scripts/render_charts.py --check   # exit 1 if a chart is stale or missing

Needs matplotlib (the ``dev`` extra).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import re
import sys
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import mean
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on CI or a server

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import (  # noqa: E402
    FuncFormatter,
    LogLocator,
    NullFormatter,
    NullLocator,
)

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "figures"
CHARTS_DIR = ROOT / "docs" / "charts"

# Fixed ids, text kept as text (smaller files, no dependence on glyph outlines) and
# no date or version in the metadata: the bytes depend only on the JSON.
STYLE = {
    "svg.hashsalt": "veloxquant-charts",
    "svg.fonttype": "none",
    "font.family": "sans-serif",
    "font.size": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.fontsize": 8,
    "legend.frameon": False,
}
METADATA = {"Date": None, "Creator": "scripts/render_charts.py"}

# One colour per server or variant across every chart, so "ours" reads the same everywhere.
COLORS = {
    "veloxquant": "#1f77b4",
    "llama-server": "#ff7f0e",
    "mlx_lm.server": "#2ca02c",
    "vllm": "#9467bd",
}
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf"]

Json = dict[str, Any]


# ---------------------------------------------------------------------------------------
# Reading the JSON


def load(path: Path) -> Json:
    """One benchmark result file."""
    return json.loads(path.read_text())


def color(name: str, index: int) -> str:
    """The fixed colour of a known server, else the palette's ``index``-th."""
    for key, value in COLORS.items():
        if name.lower().startswith(key):
            return value
    return PALETTE[index % len(PALETTE)]


def machine_label(data: Json) -> str:
    """The machine a result ran on, in words: the GPU's name or the CPU cores."""
    machine = data.get("machine") or data.get("environment") or {}
    if isinstance(machine, str):
        machine = {"platform": machine}
    gpu = (machine.get("device_info") or {}).get("device_name")
    if gpu:
        return gpu
    arch = re.search(r"x86_64|aarch64|arm64", machine.get("platform", ""))
    cpus = machine.get("cpus", data.get("cpus"))
    cores = f"{cpus}-core " if cpus else ""
    return f"{cores}{arch.group(0) if arch else ''} CPU".replace("  ", " ").strip()


def model_label(data: Json) -> str:
    """The model a result ran on: the GGUF's name, or the offline preset and its dtype."""
    model = data.get("model")
    if isinstance(model, str):
        return f"offline '{model}' model"
    if not isinstance(model, dict):
        return ""
    if model.get("gguf"):
        return model["gguf"].removesuffix(".gguf")
    details = [str(model["dtype"]).rsplit(".", 1)[-1]] if model.get("dtype") else []
    if model.get("n_params"):
        details.append(f"{model['n_params'] / 1e9:.1f}B params")
    return f"offline '{model['preset']}' model" + (f" ({', '.join(details)})" if details else "")


def levels_by_server(data: Json) -> dict[str, list[Json]]:
    """Each server's per-concurrency results, in concurrency order."""
    return {name: sorted(server["levels"], key=lambda level: level["concurrency"])
            for name, server in data["servers"].items() if server.get("levels")}


# ---------------------------------------------------------------------------------------
# Drawing helpers


def new_figure(ncols: int, width: float = 5.2, height: float = 3.6) -> tuple[Figure, list[Axes]]:
    """A row of ``ncols`` panels."""
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def title(fig: Figure, text: str) -> None:
    """The figure title, wrapped to the figure's width so a long one stays inside it."""
    chars_per_inch = 11  # at the title's 10-point size
    width = int(fig.get_figwidth() * chars_per_inch)
    fig.suptitle("\n".join(textwrap.wrap(text, width)), fontsize=10)


def concurrency_axis(ax: Axes, levels: Sequence[int]) -> None:
    """A log2 x axis ticked at exactly the measured concurrency levels."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(levels), [str(level) for level in levels])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("concurrent streams")


def log_y(ax: Axes) -> None:
    """A log y axis labelled in plain numbers (0.5, 2, 100), not powers of ten."""
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    narrow = high / low < 100  # under two decades: tick 1-2-5 so the axis has labels at all
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0) if narrow else (1.0,)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def log_if_wide(ax: Axes, values: Sequence[float]) -> None:
    """A log y axis when the values span more than a decade, so small ones stay legible."""
    positive = [v for v in values if v and v > 0]
    if positive and max(positive) / min(positive) > 10:
        log_y(ax)


def headroom(ax: Axes, values: Sequence[float], factor: float = 1.35) -> None:
    """Room above the tallest bar for its label and the legend."""
    ax.set_ylim(0, max(values) * factor)


def bar_labels(ax: Axes, bars: Any, fmt: str = "{:.3g}") -> None:
    """Each bar's value written on it, so a reader needs no ruler."""
    ax.bar_label(bars, labels=[fmt.format(b.get_height()) for b in bars], fontsize=7,
                 padding=2)


def grouped_bars(ax: Axes, groups: Sequence[str], series: dict[str, Sequence[float]],
                 colors: dict[str, str], fmt: str = "{:.3g}") -> None:
    """Bars for each series side by side within each group."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name, color=colors[name])
        bar_labels(ax, bars, fmt)
    ax.set_xticks(range(len(groups)), groups)
    ax.grid(axis="x", visible=False)


def save(fig: Figure, out: Path) -> None:
    """Write the SVG with fixed metadata and release the figure."""
    fig.tight_layout()
    fig.savefig(out, format="svg", metadata=METADATA)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# Charts: each takes its source JSON path(s) and the SVG path to write


def serving_chart(out: Path, path: Path) -> None:
    """Throughput and time to first token by concurrency, one line per server."""
    data = load(path)
    servers = levels_by_server(data)
    fig, (tput, ttft) = new_figure(2)
    for i, (name, levels) in enumerate(servers.items()):
        plot_serving_levels(tput, ttft, name, levels, color(name, i))
    concurrency = sorted({lv["concurrency"] for lvs in servers.values() for lv in lvs})
    for ax in (tput, ttft):
        concurrency_axis(ax, concurrency)
    tput.set_ylim(bottom=0)
    tput.set_ylabel("generated tokens/s (all streams)")
    tput.set_title("throughput")
    ttft.set_ylabel("time to first token (s)")
    ttft.set_title("TTFT: p50 solid, p99 dashed")
    log_if_wide(ttft, [lv["ttft_p99_s"] for lvs in servers.values() for lv in lvs])
    tput.legend()
    load_ = data["load"]
    title(fig, f"{' vs '.join(servers)} on {model_label(data)}, {machine_label(data)}: "
               f"streaming completions, ~{load_['prompt_tokens_target']}-token prompts, "
               f"{load_['max_tokens']} new tokens")
    save(fig, out)


def plot_serving_levels(tput: Axes, ttft: Axes, name: str, levels: list[Json],
                        c: str) -> None:
    """One server's throughput and TTFT p50/p99 lines; levels with errors are marked."""
    xs = [lv["concurrency"] for lv in levels]
    tput.plot(xs, [lv["tok_per_s"] for lv in levels], "o-", color=c, label=name)
    ttft.plot(xs, [lv["ttft_p50_s"] for lv in levels], "o-", color=c, label=f"{name} p50")
    ttft.plot(xs, [lv["ttft_p99_s"] for lv in levels], "s--", color=c, alpha=0.7,
              label=f"{name} p99")
    for lv in levels:
        if lv["errors"]:
            tput.annotate(f"{lv['errors']} errors", (lv["concurrency"], lv["tok_per_s"]),
                          textcoords="offset points", xytext=(4, -10), fontsize=7, color=c)


def kv_memory_chart(out: Path, path: Path) -> None:
    """KV memory (our pool's arena plus growth vs the peer's growth), throughput and TTFT."""
    data = load(path)
    servers = data["servers"]
    names = list(servers)
    colors = {name: color(name, i) for i, name in enumerate(names)}
    fig, (mem, tput, ttft) = new_figure(3, width=4.2)
    plot_kv_memory(mem, servers, colors)
    bars = tput.bar(names, [servers[n]["tok_per_s"] for n in names],
                    color=[colors[n] for n in names])
    bar_labels(tput, bars)
    tput.set_ylabel("generated tokens/s")
    tput.set_title("throughput")
    grouped_bars(ttft, ["p50", "p99"], {n: [servers[n]["ttft_p50_s"], servers[n]["ttft_p99_s"]]
                                        for n in names}, colors)
    headroom(ttft, [servers[n]["ttft_p99_s"] for n in names])
    ttft.set_ylabel("time to first token (s)")
    ttft.set_title("TTFT")
    ttft.legend()
    w = data["workload"]
    concurrency = servers[names[0]]["concurrency"]
    title(fig, f"KV memory under a mixed load on the {model_label(data)}: 1 prompt of "
               f"{w['long_prompt_tokens']} tokens among {w['short_requests']} of "
               f"{w['short_prompt_tokens']}, {w['max_tokens']} new tokens each, concurrency "
               f"{concurrency}; our pool.kv_memory = {w['kv_memory']}")
    save(fig, out)


def plot_kv_memory(ax: Axes, servers: Json, colors: dict[str, str]) -> None:
    """Stacked bars: the preallocated pool (ours only) under the peak growth measured."""
    names = list(servers)
    arena = [servers[n].get("kv_arena_mib", 0.0) for n in names]
    growth = [servers[n]["peak_rss_growth_mib"] for n in names]
    ax.bar(names, arena, color=[colors[n] for n in names], alpha=0.45, hatch="//",
           label="preallocated KV pool")
    bars = ax.bar(names, growth, bottom=arena, color=[colors[n] for n in names],
                  label="peak resident growth during the load")
    ax.bar_label(bars, labels=[f"{servers[n]['kv_memory_mib']:.0f} MiB" for n in names],
                 fontsize=7, padding=2)
    headroom(ax, [servers[n]["kv_memory_mib"] for n in names])
    ax.set_ylabel("KV memory (MiB)")
    ax.set_title("KV memory")
    ax.legend(loc="upper left")


def prefix_cache_chart(out: Path, path: Path) -> None:
    """TTFT p50 by conversation turn per server, and the share of each prompt read from cache."""
    data = load(path)
    fig, (ttft, hit) = new_figure(2)
    for i, (name, server) in enumerate(data["servers"].items()):
        turns = [t["turn"] for t in server["turns"]]
        c = color(name, i) if "off" not in name else PALETTE[3]
        ttft.plot(turns, [t["ttft_p50_s"] for t in server["turns"]], "o-", color=c, label=name)
        hit.plot(turns, [mean(t["cached_tokens"]) / t["prompt_tokens_mean"]
                         for t in server["turns"]], "o-", color=c, label=name)
    log_y(ttft)
    ttft.set_ylabel("time to first token, p50 (s)")
    ttft.set_title("TTFT by turn")
    hit.set_ylabel("prompt tokens answered from cache (share)")
    hit.set_title("prefix reuse by turn")
    for ax in (ttft, hit):
        ax.set_xlabel("conversation turn")
        ax.set_xticks(turns)
    hit.legend(loc="center right")
    w = data["workload"]
    title(fig, f"Multi-turn chat on {model_label(data)}, {machine_label(data)}: "
               f"{w['conversations']} conversations x {w['turns']} turns sharing a "
               f"{w['system_prompt_tokens']}-token system prompt, one request at a time")
    save(fig, out)


def kv_formats_chart(out: Path, path: Path) -> None:
    """KV bytes per token against perplexity, greedy agreement and throughput, per format."""
    data = load(path)
    rows = data["rows"]
    colors = {name: color(name, i) for i, name in enumerate(rows)}
    fig, (ppl, agree, tput) = new_figure(3, width=4.4)
    scatter_rows(ppl, {n: r for n, r in rows.items() if r["perplexity"] is not None},
                 "perplexity", colors)
    ppl.set_ylabel("perplexity (lower is better)")
    ppl.set_title("quality: perplexity (ours)")
    scatter_rows(agree, rows, "token_agreement", colors)
    agree.set_ylabel("greedy agreement with unquantized KV (share)")
    agree.set_title("quality: greedy agreement")
    level = data["load"]["concurrency"][-1]
    bars = tput.barh(list(rows), [r["tok_per_s"][str(level)] for r in rows.values()],
                     color=[colors[n] for n in rows])
    tput.bar_label(bars, fmt="%.1f", fontsize=7, padding=2)
    tput.invert_yaxis()
    tput.margins(x=0.12)  # room for the value labels past the longest bar
    tput.set_xlabel(f"generated tokens/s at concurrency {level}")
    tput.set_title("speed")
    q = data["quality"]
    title(fig, f"KV formats on {model_label(data)}, {machine_label(data)}: perplexity over "
               f"{q['text_tokens']} tokens, greedy agreement over {q['greedy_prompts']} "
               f"prompts x {q['greedy_new_tokens']} tokens")
    save(fig, out)


def scatter_rows(ax: Axes, rows: Json, field: str, colors: dict[str, str]) -> None:
    """One labelled point per format: its KV bytes per token against ``field``."""
    for name, row in rows.items():
        ax.scatter(row["kv_bytes_per_token"], row[field], color=colors[name], s=30)
        ax.annotate(f"{name}", (row["kv_bytes_per_token"], row[field]),
                    textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("KV bytes per token (all layers)")
    ax.margins(x=0.25, y=0.15)


def kv_methods_chart(out: Path, path: Path) -> None:
    """Attention error against stored bits per value for every compression method."""
    data = load(path)
    parts = ("synthetic", "small_model")
    methods = list(dict.fromkeys(r["method"] for part in parts for r in data[part]["rows"]))
    colors = {m: PALETTE[i % len(PALETTE)] for i, m in enumerate(methods)}
    fig, axes = new_figure(2)
    for ax, part in zip(axes, parts, strict=True):
        plot_methods(ax, data[part]["rows"], colors)
        d = data[part]["data"]
        ax.set_title(f"{part}: {d['tokens']} tokens, head_dim {d['head_dim']}")
    axes[0].legend(ncols=2)
    title(fig, f"KV compression methods, {data['meta']['backend'].split(';')[0]}: relative "
               f"error of the attention output against exact float32 attention")
    save(fig, out)


def plot_methods(ax: Axes, rows: list[Json], colors: dict[str, str]) -> None:
    """One line per method over its bit widths; a single-width reference is a flat line."""
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["bits"])
        c = colors[method]
        if len(mine) == 1:
            ax.axhline(mine[0]["attention_rel_error"], color="grey", ls=":",
                       label=f"{method} ({mine[0]['bits_per_value']:g} bits)")
            continue
        ax.plot([r["bits_per_value"] for r in mine], [r["attention_rel_error"] for r in mine],
                "o-", color=c, label=method)
    log_y(ax)
    ax.set_xlabel("stored bits per value")
    ax.set_ylabel("attention output relative error")


def long_prompt_chart(out: Path, path: Path) -> None:
    """Prefill time of one long prompt: our kernels vs MLX's ops, and served vs llama-server."""
    data = load(path)
    fig, (engine, served) = new_figure(2)
    rows = data["engine_prefill"]
    xs = [r["prompt_tokens"] for r in rows]
    engine.plot(xs, [r["mlx_s"] for r in rows], "o-", color=PALETTE[2], label="MLX ops")
    engine.plot(xs, [r["kernel_s"] for r in rows], "o-", color=COLORS["veloxquant"],
                label="our prompt kernels")
    engine.set_title("engine prefill (no HTTP)")
    engine.set_ylabel("prefill time (s)")
    for i, name in enumerate(dict.fromkeys(r["server"] for r in data["served"])):
        mine = [r for r in data["served"] if r["server"] == name]
        served.plot([r["prompt_tokens"] for r in mine], [r["seconds"] for r in mine], "o-",
                    color=color(name, i), label=name)
    served.set_title("served: one completion, max_tokens 1")
    served.set_ylabel("time to first token (s)")
    for ax in (engine, served):
        ax.set_xlabel("prompt tokens")
        ax.legend()
    title(fig, f"{data['what'][0].upper()}{data['what'][1:]}, {machine_label(data)}")
    save(fig, out)


def prefill_stall_chart(out: Path, path: Path) -> None:
    """The running streams' longest freeze and the long prompt's latency per prefill setting."""
    data = load(path)
    settings = list(data["summary"])
    fig, axes = new_figure(2, width=4.6)
    fields = {"max_stream_gap_during_s": "longest gap in any stream (s)",
              "long_prompt_latency_s": "long prompt's latency (s)"}
    for ax, (field, label) in zip(axes, fields.items(), strict=True):
        bars = ax.bar(settings, [data["summary"][s][field] for s in settings],
                      color=[PALETTE[i] for i in range(len(settings))])
        bar_labels(ax, bars)
        for i, s in enumerate(settings):
            rounds = data["runs"][s]  # beside the bar, clear of its label
            ax.plot([i + 0.3] * len(rounds), [r[field] for r in rounds], "k.", ms=4)
        ax.set_ylabel(label)
        ax.grid(axis="x", visible=False)
    axes[0].set_title("freeze while the long prompt prefills")
    axes[1].set_title("cost to the long prompt")
    tokens = data["runs"][settings[0]][0]["long_prompt_tokens"]
    title(fig, f"{data['streams']} greedy streams decoding when a {tokens}-token prompt "
               f"arrives, per batch.max_prefill_s_per_step (bars: best round, dots: "
               f"every round)")
    save(fig, out)


def scoring_stall_chart(out: Path, path: Path) -> None:
    """A stream's worst gap and token count while long prompts are scored, two checkouts."""
    data = load(path)
    sides = [k for k in data if isinstance(data[k], dict) and "worst_gap_s" in data[k]]
    colors = {s: PALETTE[i] for i, s in enumerate(sides)}
    fig, (gaps, tokens) = new_figure(2, width=4.6)
    grouped_bars(gaps, ["worst gap between tokens", "next token after clients hang up"],
                 {s: [data[s]["worst_gap_s"], data[s]["next_token_after_hangup_s"]]
                  for s in sides}, colors)
    gaps.set_ylabel("seconds")
    gaps.legend()
    bars = tokens.bar(sides, [data[s]["tokens_in_window"] for s in sides],
                      color=[colors[s] for s in sides])
    bar_labels(tokens, bars, "{:.0f}")
    tokens.set_ylabel(f"stream tokens in the {data['window_s']:g} s window")
    tokens.grid(axis="x", visible=False)
    title(fig, f"One greedy stream while {data['clients']} clients score "
               f"{data['prompt_tokens']}-token prompts (echo + logprobs, max_tokens 0), "
               f"{model_label(data)}")
    save(fig, out)


def cpu_backend_chart(out: Path, path: Path) -> None:
    """Prompt and decode speed per dtype with MLX's bundled BLAS vs an optimized one."""
    data = load(path)
    runs = data["runs"]
    colors = {name: PALETTE[i] for i, name in enumerate(runs)}
    dtypes = list(next(iter(runs.values()))["models"])
    fig, axes = new_figure(3, width=4.6)
    for ax, field, label in zip(axes[:2], ("prompt_tps", "decode_tps"),
                                ("prompt tokens/s", "decode tokens/s"), strict=True):
        grouped_bars(ax, dtypes, {n: [r["models"][d][field] for d in dtypes]
                                  for n, r in runs.items()}, colors, "{:.0f}")
        ax.set_ylabel(label)
        ax.set_title(label.split()[0])
    log_if_wide(axes[0], [r["models"][d]["prompt_tps"] for r in runs.values() for d in dtypes])
    matmul = list(next(iter(runs.values()))["matmul_gflops"])
    grouped_bars(axes[2], matmul, {n: [r["matmul_gflops"][d] for d in matmul]
                                   for n, r in runs.items()}, colors, "{:.0f}")
    log_if_wide(axes[2], [r["matmul_gflops"][d] for r in runs.values() for d in matmul])
    mkn = "x".join(str(v) for v in data["settings"]["matmul_mkn"])
    axes[2].set_ylabel("GFLOP/s")
    axes[2].set_title(f"matmul {mkn}")
    axes[0].legend()
    s = data["settings"]
    title(fig, f"MLX on a Linux CPU, bundled vs optimized BLAS: {model_label(data)}, "
               f"{s['prompt_tokens']}-token prompt, {s['decode_tokens']} decoded tokens, "
               f"{machine_label(data)}")
    save(fig, out)


def block_pool_chart(out: Path, path: Path) -> None:
    """Allocate+free throughput of our block pool against vLLM's, per call size."""
    data = load(path)
    vs = data["vs_vllm"]
    cases = [k for k in vs if isinstance(vs[k], dict) and "ours_over_vllm" in vs[k]]
    sides = [k for k in vs[cases[0]] if isinstance(vs[cases[0]][k], dict)]
    colors = {s: color(s, i) for i, s in enumerate(sides)}
    fig, (ops, workload) = new_figure(2, width=4.6)
    grouped_bars(ops, [c.replace("_", " ") for c in cases],
                 {s: [vs[c][s]["median"] / 1e6 for c in cases] for s in sides}, colors)
    ops.set_ylabel("block ops/s (millions, median)")
    ops.set_title(f"vs vLLM {vs['vllm_version']} BlockPool")
    ops.legend()
    ref = data["reference_workload"]
    kinds = [k for k in ref if isinstance(ref[k], dict)]
    bars = workload.bar(kinds, [ref[k]["tokens_per_s"] / 1e6 for k in kinds],
                        color=[PALETTE[i] for i in range(len(kinds))])
    bar_labels(workload, bars)
    workload.set_ylabel("KV tokens written/s (millions)")
    workload.set_title("per-token arrays vs the pool")
    workload.grid(axis="x", visible=False)
    title(fig, f"Block pool bookkeeping, CPU time on {machine_label(data)} "
               f"(median of {vs['processes']} processes x {vs['reps_per_process']} reps)")
    save(fig, out)


def soak_chart(out: Path, path: Path) -> None:
    """The server's resident memory after each round of the soak, against its bound."""
    data = load(path)
    rss = data["rss"]
    rounds = list(range(1, len(rss["after_each_round_mib"]) + 1))
    fig, (ax,) = new_figure(1, width=7.0)
    ax.plot(rounds, rss["after_each_round_mib"], "o-", color=COLORS["veloxquant"],
            label="resident memory after the round")
    ax.axhline(rss["after_warmup_mib"], color="grey", ls=":", label="after warm-up")
    ax.axhline(rss["after_warmup_mib"] + rss["bound_mib"], color=PALETTE[3], ls="--",
               label=f"bound: after warm-up + {rss['bound_mib']:g} MiB")
    ax.set_xticks(rounds)
    ax.set_xlabel("round")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right")
    c, srv = data["config"], data["server"]
    title(fig, f"Soak, {machine_label(data)}: {c['requests']} mixed requests in {c['rounds']} "
               f"rounds at concurrency {c['concurrency']}; {srv['http_5xx']:.0f} 5xx, "
               f"{srv['blocks_in_use_after']:.0f} blocks in use after")
    save(fig, out)


# ---------------------------------------------------------------------------------------
# The table: chart file -> (function, source JSON files relative to figures/)

CHARTS: dict[str, tuple[Callable[..., None], tuple[str, ...]]] = {
    "cpu_vs_llama_server.svg": (serving_chart, ("real_model/prompt_kernels_vs_llama.json",)),
    "cpu_vs_mlx_lm.svg": (serving_chart, ("server/results.json",)),
    "gpu_vs_mlx_lm.svg": (serving_chart, ("gpu/results.json",)),
    "kv_memory.svg": (kv_memory_chart, ("server/kv_memory.json",)),
    "prefix_cache_ttft.svg": (prefix_cache_chart, ("prefix_cache/results.json",)),
    "kv_formats.svg": (kv_formats_chart, ("kv_formats/results.json",)),
    "kv_methods.svg": (kv_methods_chart, ("kv_methods/results.json",)),
    "long_prompt.svg": (long_prompt_chart, ("real_model/long_prompt.json",)),
    "prefill_stall.svg": (prefill_stall_chart, ("server/prefill_stall.json",)),
    "scoring_stall.svg": (scoring_stall_chart, ("server/scoring_stall.json",)),
    "cpu_blas.svg": (cpu_backend_chart, ("cpu_backend/results.json",)),
    "block_pool.svg": (block_pool_chart, ("block_pool/results.json",)),
    "soak_memory.svg": (soak_chart, ("reliability/soak.json",)),
}


def render_all(out_dir: Path) -> list[Path]:
    """Render every chart in the table into ``out_dir``; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    matplotlib.rcdefaults()  # a user's matplotlibrc must not change the bytes
    with matplotlib.rc_context(STYLE):
        for name, (chart, sources) in CHARTS.items():
            chart(out_dir / name, *(FIGURES / s for s in sources))
            written.append(out_dir / name)
    return written


def compare(rendered_dir: Path, charts_dir: Path) -> list[str]:
    """How ``charts_dir`` differs from a fresh render in ``rendered_dir``: one line per chart."""
    problems = []
    for name in CHARTS:
        committed = charts_dir / name
        if not committed.exists():
            problems.append(f"{name}: missing")
        elif not filecmp.cmp(rendered_dir / name, committed, shallow=False):
            problems.append(f"{name}: differs from what its JSON gives")
    problems += [f"{p.name}: not in the CHARTS table" for p in sorted(charts_dir.glob("*.svg"))
                 if p.name not in CHARTS]
    return problems


def stale_charts(charts_dir: Path = CHARTS_DIR) -> list[str]:
    """Render into a temporary folder and compare ``charts_dir`` with it."""
    with tempfile.TemporaryDirectory() as tmp:
        render_all(Path(tmp))
        return compare(Path(tmp), charts_dir)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="render to a temporary folder and fail if docs/charts differs")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale_charts()
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("run: python scripts/render_charts.py", file=sys.stderr)
        return 1 if problems else 0
    for path in render_all(CHARTS_DIR):
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
