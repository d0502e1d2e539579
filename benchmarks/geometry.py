"""Benchmark: every geometry metric of one layer over 1M tokens x 384 dims (issue goal: <= 60 s on 2 CPU cores).

What is timed is exactly what ``lapheads analyze`` runs per layer of a supervised run (``LayerGeometry``: ANOVA,
Neural Collapse on tokens (streaming) and on sequence means (one shot, with nc4), pooled and per-sequence spectra,
token similarity), plus the linguistic-collapse CDNV over next-token classes (top 100 of a Zipf vocabulary), the
LM-side metric. Tokens are generated batch by batch outside the timer (a ViT-S/16 layout: 197 tokens per image,
100 classes); each metric's share is timed on its own too.

    python benchmarks/geometry.py                     # 1M tokens, 384 dims
    python benchmarks/geometry.py --tokens 200000     # quicker
"""

from __future__ import annotations

import argparse
import time

import torch

from lapheads.bench import machine_summary
from lapheads.geometry import CDNVAccumulator, LayerGeometry, top_k_classes


def _batches(tokens: int, seq_len: int, dim: int, classes: int, batch: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    class_means = 2 * torch.randn(classes, dim, generator=gen)
    num_seq = tokens // seq_len
    for start in range(0, num_seq, batch):
        n = min(batch, num_seq - start)
        labels = torch.randint(0, classes, (n,), generator=gen)
        h = class_means[labels, None] + torch.randn(n, seq_len, dim, generator=gen)
        h = h * torch.logspace(0, -2, dim)  # a decaying spectrum, as in trained models
        next_tokens = torch.multinomial(1 / torch.arange(1, 8001.0), n * seq_len, replacement=True, generator=gen)
        yield h, labels, next_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--seq-len", type=int, default=197)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--batch", type=int, default=256, help="sequences per streamed batch")
    args = parser.parse_args()

    print(machine_summary())
    layer = LayerGeometry(0.99)
    cdnv = CDNVAccumulator()
    counts = torch.bincount(
        torch.multinomial(
            1 / torch.arange(1, 8001.0), 100_000, replacement=True, generator=torch.Generator().manual_seed(1)
        ),
        minlength=8000,
    )
    parts = {"anova": 0.0, "collapse_tokens": 0.0, "spectrum": 0.0, "similarity": 0.0, "seq_means": 0.0, "cdnv": 0.0}
    all_labels = []
    for h, labels, next_tokens in _batches(args.tokens, args.seq_len, args.dim, args.classes, args.batch):
        h = h.float()
        for name, work in (
            ("anova", lambda: layer.anova.update(h, labels)),
            (
                "collapse_tokens",
                lambda: layer.collapse_tokens.update(h.reshape(-1, args.dim), labels.repeat_interleave(args.seq_len)),
            ),
            ("spectrum", lambda: layer.spectrum.update(h)),
            ("similarity", lambda: layer.similarity.update(h)),
            ("seq_means", lambda: layer.seq_means.append(h.mean(1))),
            ("cdnv", lambda: cdnv.update(h.reshape(-1, args.dim), top_k_classes(next_tokens, counts, 100))),
        ):
            start = time.perf_counter()
            work()
            parts[name] += time.perf_counter() - start
        all_labels.append(labels)
    start = time.perf_counter()
    labels = torch.cat(all_labels)
    result = layer.compute(labels, labels)
    cdnv_result = cdnv.compute()
    parts["finalise"] = time.perf_counter() - start
    total = sum(parts.values())
    num_tokens = len(labels) * args.seq_len
    print(
        f"{num_tokens:,} tokens x {args.dim} dims, {len(labels):,} sequences of {args.seq_len}, {args.classes} classes"
    )
    for name, seconds in parts.items():
        print(f"  {name:16s} {seconds:7.2f} s")
    print(f"  {'total':16s} {total:7.2f} s   (goal <= 60 s for 1M x 384)")
    print(
        f"check: anova fractions {result['anova']['within_seq_fraction']:.3f} / "
        f"{result['anova']['between_seq_fraction']:.3f} / {result['anova']['between_class_fraction']:.3f}, "
        f"n_components {result['spectrum']['n_components']}, per seq {result['spectrum']['n_components_per_seq']:.1f}, "
        f"nc1 tokens {result['collapse_tokens']['nc1']:.3g}, cdnv {cdnv_result['cdnv']:.3g}"
    )


if __name__ == "__main__":
    main()
