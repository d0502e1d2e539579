"""Benchmark: a training step in fp32 against bf16 autocast on this CPU, per model family, and what ``amp auto``
chooses here.

ViT: the fmnist-cpu model (6 layers, 192 dim, 3 heads of which 3 Laplacian, patch 7 on 28 px), AdamW. GPT: the
shakespeare-cpu model (depth 4, 256 dim, 4 heads of which 2 Laplacian, sequence 256), AdamW. Both precisions are
timed interleaved in one process (``lapheads.bench.time_interleaved``), forward + backward + optimizer step.
Where the CPU has no native bf16 a bf16 step is an order of magnitude slower, so the default batches are small.

    python benchmarks/precision.py                                 # ~3 minutes on 2 cores, machine otherwise idle
    python benchmarks/precision.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse

import torch


def _vit(batch: int):
    from lapheads.models.vit import create_vit

    model = create_vit("vit_fmnist_patch4", 3, patch_size=7, img_size=28, in_chans=1, num_classes=10)
    images, labels = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    return model, lambda: torch.nn.functional.cross_entropy(model(images), labels)


def _gpt(batch: int):
    from lapheads.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(depth=4, vocab_size=128, sequence_len=256, aspect_ratio=64, head_dim=64, laplacian_heads=2))
    tokens = torch.randint(0, 128, (batch, 257))
    return model, lambda: model(tokens[:, :-1], tokens[:, 1:])


def main(argv: list[str] | None = None) -> str:
    from lapheads.bench import cpu_description, time_interleaved, write_section
    from lapheads.hardware import choose_precision

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vit-batch", type=int, default=32)
    parser.add_argument("--gpt-batch", type=int, default=2)
    parser.add_argument("--write", default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for family, (model, loss_fn), shape in (
        ("ViT (fmnist-cpu)", _vit(args.vit_batch), f"batch {args.vit_batch}, 28 px"),
        ("GPT (shakespeare-cpu)", _gpt(args.gpt_batch), f"batch {args.gpt_batch} x 256 tokens"),
    ):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(bf16: bool, loss_fn=loss_fn, opt=opt) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = loss_fn()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        times = time_interleaved({"fp32": lambda: step(False), "bf16": lambda: step(True)}, args.repeats, warmup=1)
        rows.append(
            f"| {family} | {shape} | {times['fp32']:.3f} | {times['bf16']:.3f} | {times['bf16'] / times['fp32']:.1f}x |"
        )
        print(rows[-1], flush=True)
    choice = choose_precision("auto", "cpu")
    return write_section(
        "precision.py",
        [
            f"`python benchmarks/precision.py`: training step (forward + backward + AdamW), median of {args.repeats} "
            f"interleaved rounds, {torch.get_num_threads()} threads. CPU: {cpu_description()}. "
            f"`amp auto` here: **{choice.reason}**.",
            "",
            "| model | shape | fp32 s/step | bf16 autocast s/step | bf16 / fp32 |",
            "|---|---|---|---|---|",
            *rows,
        ],
        args.write,
    )


if __name__ == "__main__":
    print(main())
