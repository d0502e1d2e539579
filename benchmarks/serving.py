"""Benchmark: N requests decoded together (``lapheads.apps.batching``) against the same N one after another.

The engine under ``lapheads serve``'s generation: N requests of one model (a d4 GPT, 256 wide, half its heads
Laplacian, sequence_len 512; prompts of 24-40 tokens, 64 sampled tokens each, every request its own seed), decoded
as one batch against decoded one at a time, interleaved in one process (``lapheads.bench.time_interleaved``).
Throughput = generated tokens / wall seconds; the ratio is the batch's throughput over the serial one's, at N = 1, 4
and 8. The token counts of both ways are the same by construction (the same seeds: tests/apps/test_batching.py).

    python benchmarks/serving.py                                   # ~2 minutes on 2 cores, machine otherwise idle
    python benchmarks/serving.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse

import torch


def _requests(n: int, vocab: int, max_tokens: int):
    from lapheads.apps.batching import Generation

    g = torch.Generator().manual_seed(n)
    lengths = torch.randint(24, 41, (n,), generator=g).tolist()
    return [
        Generation(tuple(torch.randint(1, vocab, (length,), generator=g).tolist()), max_tokens, 0.8, 50, None, seed)
        for seed, length in enumerate(lengths)
    ]


def main(argv: list[str] | None = None) -> str:
    from lapheads.apps.batching import generate_together
    from lapheads.bench import cpu_description, time_interleaved, write_section
    from lapheads.models.gpt import GPT, GPTConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    shape = dict(depth=args.depth, vocab_size=8192, sequence_len=512, head_dim=64)
    config = GPTConfig(**shape, laplacian_heads=GPTConfig(**shape).n_head // 2)  # half the heads Laplacian
    model = GPT(config).eval()
    with torch.no_grad():  # non-zero output projections, so generation is not a constant
        for p in model.parameters():
            p.normal_(0, 0.02)
    rows = []
    for n in args.clients:
        requests = _requests(n, config.vocab_size, args.max_tokens)
        tokens = sum(len(g.tokens) for g in generate_together(model, requests))
        times = time_interleaved(
            {
                "together": lambda: generate_together(model, requests),
                "one by one": lambda: [generate_together(model, [r]) for r in requests],
            },
            args.repeats,
            warmup=1,
        )
        rows.append(
            f"| {n} | {tokens} | {tokens / times['one by one']:.0f} | {tokens / times['together']:.0f} | "
            f"{times['one by one'] / times['together']:.2f} |"
        )
        print(rows[-1], flush=True)
    return write_section(
        "serving.py",
        [
            f"`python benchmarks/serving.py`: a d{args.depth} GPT ({config.n_embd} wide, {config.n_head // 2} of "
            f"{config.n_head} heads Laplacian), {args.max_tokens} sampled tokens per request, fp32; median of {args.repeats} interleaved "
            f"rounds, {torch.get_num_threads()} threads. CPU: {cpu_description()}.",
            "",
            "| requests | tokens | one by one, tokens/s | together, tokens/s | together / one by one |",
            "|---|---|---|---|---|",
            *rows,
        ],
        args.write,
    )


if __name__ == "__main__":
    print(main())
