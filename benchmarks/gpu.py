"""The GPU benchmark: one prepared script for a lent accelerator (about 6 minutes on one H200), writing a table.

Measured side by side in one process (ratios = median time / median time of the k = 0 model or plain SDPA, same
run, interleaved rounds; ``lapheads.bench.time_interleaved``):

1. The op against plain SDPA, forward + backward, bf16, q/k/v from a packed projection and the output reshaped for
   the output projection: T = 1k, 4k, 16k; causal and not; GQA (8 query heads per key/value head); eager and
   ``torch.compile``; peak memory.
2. nanochat GPT training steps (d12 and d20, bf16 autocast, compiled, Muon + AdamW as in training): tokens/s and
   MFU for k = 0 against k = half the heads.
3. ViT-B/16 training steps (224 px, bf16, compiled, AdamW): images/s for k = 0 against k = 12.
4. Attention patterns without a T x T mask (``lapheads.core.masks``): a sliding window (W = T / 8) and packed
   documents (8 per row) through FlexAttention, forward + backward, bf16: plain against half the heads Laplacian,
   and FlexAttention against the dense-mask SDPA path; T = 4k, 16k.

    python benchmarks/gpu.py                           # on the GPU: writes docs/benchmarks-gpu.md
    python benchmarks/gpu.py --smoke                   # tiny shapes, seconds, on the CPU where there is no CUDA

MFU = model FLOPs per token (6 x matmul parameters + 12 x heads x head_dim x T per layer, nanochat's estimate)
x tokens/s / the device's peak bf16 FLOPs (H100/H200: 989 TFLOPs dense).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from lapheads import GPT, GPTConfig, create_vit, laplacian_attention
from lapheads.bench import machine_summary, peak_memory_mib, time_interleaved

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def _peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def _maybe_compile(fn: Callable, compile_: bool, backend: str) -> Callable:
    # fixed shapes per compile: the benchmark measures static-shape kernels, as training does
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend) if compile_ else fn


def op_table(
    seq_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    tokens: int,
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
    backend: str,
) -> list[str]:
    rows = []
    for t in seq_lens:
        batch = max(1, tokens // t)
        for causal in (False, True):
            for kv in sorted({heads, kv_heads}, reverse=True):
                for compile_ in (False, True):
                    packed = torch.randn(
                        batch, t, heads + 2 * kv, head_dim, device=device, dtype=dtype, requires_grad=True
                    )
                    grad = torch.randn(batch, t, heads * head_dim, device=device, dtype=dtype)

                    def split(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
                        q, k, v = x.transpose(1, 2).split([heads, kv, kv], dim=1)
                        return q, k, v

                    gqa = kv != heads

                    def plain_fn(q, k, v, causal: bool = causal, gqa: bool = gqa) -> torch.Tensor:
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

                    def lap_fn(q, k, v, causal: bool = causal) -> torch.Tensor:
                        return laplacian_attention(q, k, v, heads // 2, is_causal=causal)

                    plain, lap = _maybe_compile(plain_fn, compile_, backend), _maybe_compile(lap_fn, compile_, backend)

                    def step(form: Callable) -> Callable[[], None]:
                        def run() -> None:
                            packed.grad = None
                            form(*split(packed)).transpose(1, 2).reshape(batch, t, -1).backward(grad)

                        return run

                    steps = {"sdpa": step(plain), "lapheads": step(lap)}
                    times = time_interleaved(steps, repeats, device=device)
                    memory = {name: peak_memory_mib(run, device) for name, run in steps.items()}
                    mem = " / ".join("n/a" if m is None else f"{m:.0f}" for m in memory.values())
                    rows.append(
                        f"| {t} | {batch} | {'causal' if causal else 'full'} | {heads}/{kv} | "
                        f"{'compiled' if compile_ else 'eager'} | {times['sdpa'] * 1e3:.2f} | "
                        f"{times['lapheads'] / times['sdpa']:.3f} | {mem} |"
                    )
    return [
        "| T | batch | mask | heads/kv | mode | sdpa ms | lapheads ratio | peak MiB sdpa / lapheads |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def gpt_table(
    depths: list[int],
    vocab: int,
    seq_len: int,
    batch: int,
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
    compile_: bool,
    backend: str,
    head_dim: int = 128,
) -> list[str]:
    from lapheads.train.configs.lm import LMConfig
    from lapheads.train.optimizers import build_optimizers

    rows, peak = [], _peak_flops(device)
    for depth in depths:
        steps, flops_per_token = {}, {}
        heads = GPTConfig(depth=depth, vocab_size=vocab, head_dim=head_dim).n_head
        for k in (0, heads // 2):
            torch.manual_seed(0)
            model = GPT(
                GPTConfig(depth=depth, vocab_size=vocab, sequence_len=seq_len, head_dim=head_dim, laplacian_heads=k)
            ).to(device)
            optimizers = build_optimizers(model, LMConfig())
            forward = _maybe_compile(model, compile_, backend)
            tokens = torch.randint(0, vocab, (batch, seq_len + 1), device=device)
            c = model.config
            matmul = sum(p.numel() for p in model.blocks.parameters()) + model.lm_head.weight.numel()
            flops_per_token[k] = 6 * matmul + 12 * c.n_head * (c.n_embd // c.n_head) * seq_len * depth

            def run(
                model: GPT = model,
                optimizers: dict = optimizers,
                forward: Callable = forward,
                tokens: torch.Tensor = tokens,
            ) -> None:
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    loss = forward(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
                for opt in optimizers.values():
                    opt.step()
                model.zero_grad(set_to_none=True)

            steps[k] = run
        times = time_interleaved(steps, repeats, device=device)
        for k, seconds in times.items():
            rate = batch * seq_len / seconds
            mfu = f"{100 * flops_per_token[k] * rate / peak:.1f}%" if peak else "n/a"
            rows.append(f"| d{depth} | {k}/{heads} | {rate:,.0f} | {mfu} | {seconds / times[0]:.3f} |")
    return ["| model | Laplacian heads | tokens/s | MFU | step time ratio |", "|---|---|---|---|---|", *rows]


def vit_table(
    img_size: int,
    batch: int,
    model_kwargs: dict,
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
    compile_: bool,
    backend: str,
) -> list[str]:
    steps = {}
    heads = model_kwargs.get("num_heads", 12)
    for k in (0, heads):
        torch.manual_seed(0)
        model = create_vit("vit_base_patch16_224", k, qk_norm=True, img_size=img_size, **model_kwargs).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        forward = _maybe_compile(model, compile_, backend)
        images = torch.randn(batch, 3, img_size, img_size, device=device)
        labels = torch.randint(0, model.num_classes, (batch,), device=device)

        def run(
            model: torch.nn.Module = model,
            optimizer: torch.optim.Optimizer = optimizer,
            forward: Callable = forward,
            images: torch.Tensor = images,
            labels: torch.Tensor = labels,
        ) -> None:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = F.cross_entropy(forward(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps[k] = run
    times = time_interleaved(steps, repeats, device=device)
    return [
        "| model | Laplacian heads | images/s | step time ratio |",
        "|---|---|---|---|",
        *[
            f"| ViT-B/16 {img_size} px | {k}/{heads} | {batch / s:,.0f} | {s / times[0]:.3f} |"
            for k, s in times.items()
        ],
    ]


def pattern_table(
    seq_lens: list[int], heads: int, head_dim: int, tokens: int, device: torch.device, dtype: torch.dtype, repeats: int
) -> list[str]:
    """Forward + backward of the op through an attention pattern (FlexAttention where it runs) with 0 and half the
    heads Laplacian, and the same pattern as a dense (T, T) mask; on the CPU (--smoke) forward only (FlexAttention
    has no CPU backward)."""
    from lapheads.core.masks import Documents, SlidingWindow

    backward = device.type == "cuda"
    rows = []
    for t in seq_lens:
        batch = max(1, tokens // t)
        documents = torch.arange(t, device=device).div(max(1, t // 8), rounding_mode="floor").expand(batch, t)
        for name, pattern in (("window T/8", SlidingWindow(t // 8)), ("8 documents", Documents(documents))):
            dense = pattern.dense(batch, t, t, device)
            q, k, v = (
                torch.randn(batch, heads, t, head_dim, device=device, dtype=dtype, requires_grad=backward)
                for _ in range(3)
            )

            def step(mask, laplacian: int) -> Callable[[], None]:
                def run() -> None:
                    with torch.set_grad_enabled(backward):
                        out = laplacian_attention(q, k, v, laplacian, attn_mask=mask)
                        if backward:
                            q.grad = k.grad = v.grad = None
                            out.float().sum().backward()

                return run

            steps = {"flex plain": step(pattern, 0), "flex lap": step(pattern, heads // 2), "dense": step(dense, 0)}
            times = time_interleaved(steps, repeats, device=device)
            rows.append(
                f"| {t} | {batch} | {name} | {'fwd + bwd' if backward else 'fwd'} | {times['flex plain'] * 1e3:.2f} | "
                f"{times['flex lap'] / times['flex plain']:.3f} | {times['flex plain'] / times['dense']:.3f} |"
            )
    return [
        "| T | batch | pattern | pass | flex plain ms | Laplacian / plain | flex / dense mask |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto: cuda when available, else cpu (--smoke only)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few rounds (CPU, tests)")
    parser.add_argument("--backend", default=None, help="torch.compile backend (default inductor; smoke: aot_eager)")
    parser.add_argument("--out", default="docs/benchmarks-gpu.md", help="the markdown table ('-' prints only)")
    args = parser.parse_args(argv)
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device; allowed here: --smoke (on the CPU)")
    if device.type == "cpu" and not args.smoke:
        parser.error("the full benchmark is for a CUDA GPU and torch sees none; allowed here: --smoke (the CPU run)")
    args.backend = args.backend or ("aot_eager" if args.smoke else "inductor")
    dtype = torch.bfloat16
    start = time.perf_counter()
    if args.smoke:
        ops = op_table([32], 4, 2, 16, 256, device, dtype, 2, args.backend)
        gpt = gpt_table([2], 64, 32, 2, device, dtype, 2, True, args.backend, head_dim=64)
        vit = vit_table(
            32, 2, dict(patch_size=16, embed_dim=64, depth=1, num_heads=4), device, dtype, 2, True, args.backend
        )
        patterns = pattern_table([64], 4, 16, 128, device, torch.float32, 2)
    else:
        ops = op_table([1024, 4096, 16384], 16, 2, 128, 65536, device, dtype, 10, args.backend)
        gpt = gpt_table([12, 20], 65536, 2048, 16, device, dtype, 10, True, args.backend)
        vit = vit_table(224, 128, {}, device, dtype, 10, True, args.backend)
        patterns = pattern_table([4096, 16384], 16, 128, 32768, device, dtype, 10)
    text = "\n".join(
        [
            "# GPU benchmark (benchmarks/gpu.py)",
            "",
            f"{machine_summary(device)}; bf16; torch {torch.__version__}; {time.perf_counter() - start:.0f} s in all. "
            "Ratios are medians of interleaved rounds in this one run.",
            "",
            "## The op against plain SDPA (forward + backward, half the heads Laplacian)",
            "",
            *ops,
            "",
            "## nanochat GPT training step (compiled, Muon + AdamW)",
            "",
            *gpt,
            "",
            "## ViT-B/16 training step (compiled, AdamW)",
            "",
            *vit,
            "",
            "## Attention patterns without a T x T mask (FlexAttention; half the heads Laplacian)",
            "",
            *patterns,
            "",
        ]
    )
    if args.out != "-":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
