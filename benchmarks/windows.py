"""Benchmark: sliding-window attention without a T x T mask (``lapheads.core.masks``) against today's dense mask.

At each length T the window is W = T / 8 keys (the authors' "S" layers use T / 4). Forward (no gradient): the op with
the dense (T, T) bool mask, the op with the ``SlidingWindow`` pattern (FlexAttention, compiled; warm-up excludes the
compile) with and without Laplacian heads. Training (forward + backward): the dense mask against the pattern's banded
path (chunks of T x W work, CPU gradients). Every candidate of one length is timed interleaved in one process
(``lapheads.bench.time_interleaved``); ratios are medians over medians in the same run. Half the heads Laplacian.

    python benchmarks/windows.py                                   # ~5 minutes on 2 cores, machine otherwise idle
    python benchmarks/windows.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse

import torch


def _candidates(t: int, heads: int, dim: int, batch: int):
    from lapheads.core.attention import laplacian_attention
    from lapheads.core.masks import SlidingWindow

    window = SlidingWindow(t // 8)
    dense = window.dense(batch, t, t, "cpu")
    q, k, v = (torch.randn(batch, heads, t, dim) for _ in range(3))
    half = heads // 2

    def forward(mask, laplacian: int):
        with torch.no_grad():
            return laplacian_attention(q, k, v, laplacian, attn_mask=mask)

    trained = [x.clone().requires_grad_() for x in (q, k, v)]

    def train(mask):
        laplacian_attention(*trained, half, attn_mask=mask).sum().backward()
        for x in trained:
            x.grad = None

    forwards = {
        "dense mask": lambda: forward(dense, half),
        "flex, plain": lambda: forward(window, 0),
        "flex, Laplacian": lambda: forward(window, half),
    }
    return forwards, {"dense mask": lambda: train(dense), "banded": lambda: train(window)}


def main(argv: list[str] | None = None) -> str:
    from lapheads.bench import cpu_description, time_interleaved, write_section

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write", default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for t in args.seq_lens:
        forwards, trains = _candidates(t, args.heads, args.head_dim, args.batch)
        fwd = time_interleaved(forwards, args.repeats, warmup=2)
        step = time_interleaved(trains, args.repeats, warmup=1)
        rows.append(
            f"| {t} | {t // 8} | {fwd['dense mask'] * 1e3:.1f} | {fwd['flex, plain'] / fwd['dense mask']:.3f} | "
            f"{fwd['flex, Laplacian'] / fwd['dense mask']:.3f} | {fwd['flex, Laplacian'] / fwd['flex, plain']:.3f} | "
            f"{step['dense mask'] * 1e3:.1f} | {step['banded'] / step['dense mask']:.3f} | "
            f"{step['banded'] * 1e9 / (t * t // 8):.2f} |"
        )
        print(rows[-1], flush=True)
    return write_section(
        "windows.py",
        [
            f"`python benchmarks/windows.py`: batch {args.batch}, {args.heads} heads x {args.head_dim} dims, fp32, "
            f"{args.heads // 2} Laplacian heads unless it says plain, window W = T / 8; median of {args.repeats} "
            f"interleaved rounds, {torch.get_num_threads()} threads. CPU: {cpu_description()}.",
            "",
            "| T | W | dense-mask forward ms | FlexAttention plain / dense | FlexAttention Laplacian / dense | "
            "Laplacian / plain FlexAttention | dense-mask train step ms | banded / dense (train) | "
            "banded ns per T x W |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
        ],
        args.write,
    )


if __name__ == "__main__":
    print(main())
