"""Benchmark: Laplacian heads against plain SDPA, forward + backward, time and peak memory.

Forms compared side by side in one process (ratios = median time / median time of plain SDPA in the same run):

* ``sdpa``      plain ``F.scaled_dot_product_attention`` (no Laplacian head): the floor.
* ``copy``      plain SDPA, then one fresh copy of its output: the least any combine costs that must write a new
                output (SDPA keeps its own output for its backward, so the combine cannot overwrite it).
* ``lapheads``  ``lapheads.laplacian_attention``: fused SDPA + one sign-flip pass (a custom autograd.Function).
* ``where``     fused SDPA then ``torch.where(mask, v - y, y)``: the simplest mask form.
* ``cat``       fused SDPA then ``torch.cat([y_A, v_L - y_L])``: the authors' form (copies y).
* ``naive``     ``lapheads.laplacian_attention_reference``: materialise P, multiply by (I - P) explicitly.
* with ``--kinds``: ``negated``, ``centring``, ``mix`` (the same trailing heads of that head kind, through the op;
                ``local`` is an ordinary head in the op, its extra matmul lives in the module), and
                ``gated-laplacian``: the op, then those heads' gates (a Linear of the layer's input to one logit per
                gated head, ``lapheads.core.kinds.gate_heads``), as a module runs them; the whole steps then add a
                model whose Laplacian heads are gated.

Then fixed training shapes where the op's per-call overhead shows most (ViT-S at B = 4, T = 197 and B = 16,
T = 256, 2 of 6 heads Laplacian): the op (on the CPU its compiled training node where ``lapheads kernel build`` has
built it, ``lapheads.core.native``), the op on its Python node, and ``copy`` against plain SDPA as medians of
round-by-round ratios with a 95% interval. Then whole training steps (forward, backward, optimizer step) of a
timm ViT built with ``LaplacianAttention`` (0, 1 and 3 of 3 heads Laplacian) and of ``lapheads.GPT`` (0, 2 and 4
of 4 heads Laplacian); their ratios are medians of round-by-round ratios to k = 0 with a distribution-free 95%
interval (``lapheads.bench.interleaved_ratios``), so a bar of a percent is judged by its interval, not by one
number.

    python benchmarks/attention.py                      # full table (a few minutes on 2 CPU cores)
    python benchmarks/attention.py --seq-lens 256 1024 --repeats-scale 0.3   # quicker
    python benchmarks/attention.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

from lapheads import LaplacianAttention, laplacian_attention, laplacian_attention_reference
from lapheads.bench import interleaved_ratios, machine_summary, peak_memory_mib, time_interleaved
from lapheads.core import native
from lapheads.core.kinds import gate_heads

HEADS, HEAD_DIM = 6, 64  # ViT-S attention: 6 heads of 64
TOKENS_PER_BATCH = 4096  # batch = 4096 // T, so every T does comparable work per call and T = 4096 still fits
REPEATS = {64: 200, 256: 60, 1024: 15, 4096: 5}


def _where_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    y = F.scaled_dot_product_attention(q, k, v)
    return torch.where(mask.view(1, -1, 1, 1), v - y, y)


def _cat_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_lap: int) -> torch.Tensor:
    y = F.scaled_dot_product_attention(q, k, v)
    split = q.shape[1] - n_lap
    return torch.cat([y[:, :split], v[:, split:] - y[:, split:]], dim=1)


KINDS = ("negated", "centring", "mix")


def kind_forms(n_lap: int, device: torch.device, dtype: torch.dtype) -> dict[str, Callable[..., torch.Tensor]]:
    """The op with the trailing ``n_lap`` heads of each other head kind (mix at a Laplacian-like point)."""
    mix = (
        torch.full((HEADS,), 0.9, device=device, dtype=dtype),
        torch.full((HEADS,), -1.1, device=device, dtype=dtype),
    )
    forms = {
        kind: lambda q, k, v, kinds=("ordinary",) * (HEADS - n_lap) + (kind,) * n_lap: laplacian_attention(
            q, k, v, kinds, mix=mix
        )
        for kind in KINDS
    }
    gate = torch.zeros(n_lap, HEADS * HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
    gated = torch.arange(HEADS - n_lap, HEADS, device=device)

    def gated_laplacian(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        x = q.transpose(1, 2).flatten(2)  # stands in for the layer's input (B, T, C): a view, as wide
        return gate_heads(laplacian_attention(q, k, v, n_lap), F.linear(x, gate), gated)

    forms["gated-laplacian"] = gated_laplacian
    return forms


def attention_forms(n_lap: int) -> dict[str, Callable[..., torch.Tensor]]:
    mask = torch.arange(HEADS) >= HEADS - n_lap
    return {
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
        "copy": lambda q, k, v: F.scaled_dot_product_attention(q, k, v).clone(),
        "lapheads": lambda q, k, v: laplacian_attention(q, k, v, n_lap),
        "where": lambda q, k, v: _where_form(q, k, v, mask.to(q.device)),
        "cat": lambda q, k, v: _cat_form(q, k, v, n_lap),
        "naive": lambda q, k, v: laplacian_attention_reference(q, k, v, n_lap),
    }


def bench_op(
    seq_len: int,
    n_lap: int,
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
    compile_forms: bool = False,
    kinds: bool = False,
) -> dict[str, dict]:
    """q, k, v as a model makes them (views of one packed (B, T, 3, H, D) projection) and each form's output
    reshaped to (B, T, H * D) for the output projection, as in timm's Attention and the GPT."""
    batch = max(1, TOKENS_PER_BATCH // seq_len)
    gen = torch.Generator().manual_seed(seq_len)
    packed = torch.randn(batch, seq_len, 3, HEADS, HEAD_DIM, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(batch, seq_len, HEADS * HEAD_DIM, generator=gen).to(device, dtype)
    forms = attention_forms(n_lap)
    if kinds:
        forms.update(kind_forms(n_lap, device, dtype))
    if compile_forms:  # compiled plain SDPA against the compiled op: the same compiler on both sides
        forms = {name: torch.compile(forms[name], fullgraph=True) for name in ("sdpa", "lapheads")}

    def step(form: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            packed.grad = None
            q, k, v = packed.permute(2, 0, 3, 1, 4).unbind(0)
            form(q, k, v).transpose(1, 2).reshape(batch, seq_len, -1).backward(grad)

        return run

    steps = {name: step(form) for name, form in forms.items()}
    times = time_interleaved(steps, repeats, device=device)
    result = {}
    for name, run in steps.items():
        result[name] = {
            "seconds": times[name],
            "ratio": times[name] / times["sdpa"],
            "peak_mib": peak_memory_mib(run, device),
        }
    return {"batch": batch, "forms": result}


#: training shapes whose op cost is a fixed per-call overhead more than bandwidth: ViT-S at a small batch
#: (B = 4, T = 197: 196 patches + CLS) and a medium one, 2 of 6 heads Laplacian
FIXED_SHAPES = ((4, 197, 2), (16, 256, 2))


def bench_fixed_shapes(device: torch.device, dtype: torch.dtype, repeats: int) -> dict[tuple[int, int, int], dict]:
    """The op against plain SDPA at :data:`FIXED_SHAPES`, forward + backward with the model's reshapes, as the median
    of round-by-round ratios with a distribution-free 95% interval (``interleaved_ratios``)."""
    results = {}
    for batch, seq_len, n_lap in FIXED_SHAPES:
        gen = torch.Generator().manual_seed(batch * seq_len)
        packed = torch.randn(batch, seq_len, 3, HEADS, HEAD_DIM, generator=gen).to(device, dtype).requires_grad_()
        grad = torch.randn(batch, seq_len, HEADS * HEAD_DIM, generator=gen).to(device, dtype)

        def step(form: Callable[..., torch.Tensor], packed=packed, grad=grad, b=batch, t=seq_len) -> Callable[[], None]:
            def run() -> None:
                packed.grad = None
                q, k, v = packed.permute(2, 0, 3, 1, 4).unbind(0)
                form(q, k, v).transpose(1, 2).reshape(b, t, -1).backward(grad)

            return run

        forms = attention_forms(n_lap)
        steps = {name: step(forms[name]) for name in ("sdpa", "copy", "lapheads")}
        if device.type == "cpu" and native.module() is not None:  # the same op on its Python node, side by side
            steps["python node"] = step(lambda q, k, v, n=n_lap: _on_python_node(q, k, v, n))
        results[(batch, seq_len, n_lap)] = interleaved_ratios(steps, "sdpa", repeats, warmup=10, device=device)
    return results


def _on_python_node(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_lap: int) -> torch.Tensor:
    """The op with its compiled CPU node switched off: the node is chosen in forward, and backward follows it."""
    with native.disabled():
        return laplacian_attention(q, k, v, n_lap)


def _ratio_cell(r: dict | None) -> str:
    return "-" if r is None else f"{r['ratio']:.3f} [{r['ratio_low']:.3f}, {r['ratio_high']:.3f}]"


def _fixed_lines(fixed: dict[tuple[int, int, int], dict]) -> list[str]:
    lines = [
        "",
        f"Fixed training shapes, {HEADS} heads x {HEAD_DIM}, forward + backward with the reshapes (median of "
        "round-by-round ratios to plain SDPA, 95% interval; lapheads = the op as it runs here, `python node` = the "
        "same op with its compiled CPU node off, `copy` = SDPA plus one copy of its output, the floor of any combine "
        "that writes a new output):",
        "",
        "| B | T | Laplacian heads | lapheads / sdpa | python node / sdpa | copy / sdpa | sdpa ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for (batch, seq_len, n_lap), r in fixed.items():
        lines.append(
            f"| {batch} | {seq_len} | {n_lap} | {_ratio_cell(r['lapheads'])} | {_ratio_cell(r.get('python node'))} "
            f"| {_ratio_cell(r['copy'])} | {r['sdpa']['seconds'] * 1e3:.2f} |"
        )
    return lines


def bench_vit_step(
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
    batch: int = 64,
    compile_model: bool = False,
    gated: bool = False,
) -> dict[str, float]:
    """A whole ViT training step (6 layers, 192 dim, 3 heads, patch 4, 32 px) with 0, 1 and 3 Laplacian heads, and
    with ``gated`` 3 gated Laplacian heads (each model ``torch.compile``-d when ``compile_model``)."""
    steps = {}
    for n_lap in (0, 1, 3, "gated-laplacian:3") if gated else (0, 1, 3):
        torch.manual_seed(0)
        model = VisionTransformer(
            img_size=32,
            patch_size=4,
            embed_dim=192,
            depth=6,
            num_heads=3,
            num_classes=10,
            attn_layer=LaplacianAttention,
        ).to(device)
        for block in model.blocks:
            block.attn.set_laplacian_heads(n_lap)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        images = torch.randn(batch, 3, 32, 32, device=device)
        labels = torch.randint(0, 10, (batch,), device=device)
        if compile_model:
            model = torch.compile(model)

        def run(model: torch.nn.Module = model, optimizer: torch.optim.Optimizer = optimizer) -> None:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps[f"vit {n_lap}/3 Laplacian" if isinstance(n_lap, int) else f"vit {n_lap}"] = run
    return interleaved_ratios(steps, "vit 0/3 Laplacian", repeats, device=device)


def bench_gpt_step(
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
    batch: int = 16,
    arch: str = "nanochat-2025",
    compile_model: bool = False,
    gated: bool = False,
) -> dict[str, float]:
    """A whole GPT training step (shakespeare-cpu size: depth 4, 256 dim, 4 heads of 64, T = 256, Muon + AdamW as
    in training) with 0, 2 and 4 Laplacian heads per layer (and with ``gated`` 4 gated Laplacian heads), in the
    ``arch`` family (2026: sliding windows of 128 in the S layers, value embeddings, smear, ...); each model
    ``torch.compile``-d when ``compile_model``."""
    from lapheads.models.gpt import GPT, GPTConfig
    from lapheads.train.configs.lm import LMConfig
    from lapheads.train.optimizers import build_optimizers

    steps = {}
    for n_lap in (0, 2, 4, "gated-laplacian:4") if gated else (0, 2, 4):
        torch.manual_seed(0)
        model = GPT(
            GPTConfig(
                depth=4,
                vocab_size=320,
                sequence_len=256,
                aspect_ratio=64,
                head_dim=64,
                laplacian_heads=n_lap,
                arch=arch,
            )
        ).to(device)
        optimizers = build_optimizers(model, LMConfig(arch=arch))
        tokens = torch.randint(0, 320, (batch, 257), device=device)
        if compile_model:
            model = torch.compile(model)

        def run(model: torch.nn.Module = model, optimizers: dict = optimizers) -> None:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            for opt in optimizers.values():
                opt.step()
            model.zero_grad(set_to_none=True)

        steps[f"gpt {n_lap}/4 Laplacian" if isinstance(n_lap, int) else f"gpt {n_lap}"] = run
    return interleaved_ratios(steps, "gpt 0/4 Laplacian", repeats, device=device)


STEP_HEADER = ["| model | ms/step | ratio, median of rounds [95% CI] |", "|---|---|---|"]


def _step_row(name: str, r: dict[str, float]) -> str:
    interval = "" if math.isnan(r["ratio_low"]) else f" [{r['ratio_low']:.3f}, {r['ratio_high']:.3f}]"
    return f"| {name} | {r['seconds'] * 1e3:.1f} | {r['ratio']:.3f}{interval} |"


def markdown(
    op_results: dict[int, dict],
    vit: dict | None,
    header: str,
    gpt: dict | None = None,
    gpt_arch: str = "nanochat-2025",
    fixed: dict | None = None,
) -> str:
    forms = list(next(iter(op_results.values()))["forms"])
    lines = [
        header,
        "",
        "Forward + backward of attention alone (ratio = median time / median plain-SDPA time, same run):",
        "",
    ]
    lines.append(
        "| T | batch | "
        + " | ".join(f"{f} ratio" for f in forms)
        + " | sdpa ms | "
        + " | ".join(f"{f} peak MiB" for f in forms)
        + " |"
    )
    lines.append("|" + "---|" * (3 + 2 * len(forms)))
    for t, res in op_results.items():
        row = res["forms"]
        ratios = " | ".join(f"{row[f]['ratio']:.3f}" for f in forms)
        mems = " | ".join("n/a" if row[f]["peak_mib"] is None else f"{row[f]['peak_mib']:.0f}" for f in forms)
        lines.append(f"| {t} | {res['batch']} | {ratios} | {row['sdpa']['seconds'] * 1e3:.2f} | {mems} |")
    if fixed:
        lines += _fixed_lines(fixed)
    if vit:
        lines += [
            "",
            "Whole ViT training step (forward, backward, AdamW):",
            "",
            *STEP_HEADER,
        ]
        lines += [_step_row(name, r) for name, r in vit.items()]
    if gpt:
        lines += [
            "",
            f"Whole GPT training step (forward, backward, Muon + AdamW), {gpt_arch}:",
            "",
            *STEP_HEADER,
        ]
        lines += [_step_row(name, r) for name, r in gpt.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--laplacian-heads", type=int, default=3, help=f"Laplacian heads of {HEADS}")
    parser.add_argument("--repeats-scale", type=float, default=1.0, help="multiply the number of timed rounds")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--skip-vit", action="store_true")
    parser.add_argument("--skip-gpt", action="store_true")
    parser.add_argument("--skip-fixed", action="store_true", help="skip the fixed training shapes (ViT-S B = 4, ...)")
    parser.add_argument("--gpt-arch", default="nanochat-2025", choices=["nanochat-2025", "nanochat-2026"])
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile on sdpa and lapheads in the op table, and on each model"
    )
    parser.add_argument("--kinds", action="store_true", help="add the other head kinds to the op table")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    op_results = {}
    for t in args.seq_lens:
        repeats = max(3, round(REPEATS.get(t, 10) * args.repeats_scale))
        op_results[t] = bench_op(
            t, args.laplacian_heads, device, dtype, repeats, compile_forms=args.compile, kinds=args.kinds
        )
        print(f"T={t}: " + ", ".join(f"{n} {r['ratio']:.3f}x" for n, r in op_results[t]["forms"].items()), flush=True)
    fixed = None if args.skip_fixed else bench_fixed_shapes(device, dtype, max(20, round(200 * args.repeats_scale)))
    vit_repeats = gpt_repeats = max(3, round(20 * args.repeats_scale))  # 20 rounds: a 95% interval from 6th to 15th
    vit = (
        None
        if args.skip_vit
        else bench_vit_step(device, dtype, vit_repeats, compile_model=args.compile, gated=args.kinds)
    )
    gpt = (
        None
        if args.skip_gpt
        else bench_gpt_step(
            device, dtype, gpt_repeats, arch=args.gpt_arch, compile_model=args.compile, gated=args.kinds
        )
    )
    header = (
        f"{machine_summary(device)}; {args.dtype}; {HEADS} heads x {HEAD_DIM} dims, "
        f"{args.laplacian_heads} Laplacian, batch x T = {TOKENS_PER_BATCH} tokens, q/k/v from a packed projection and "
        f"the output reshaped to (B, T, H*D){', torch.compile' if args.compile else ', eager'}"
    )
    if device.type == "cpu":
        header += f"; the op's CPU training node: {'compiled' if native.module() else 'Python'}"
    table = markdown(op_results, vit, header, gpt, args.gpt_arch, fixed)
    print(table)
    return table


if __name__ == "__main__":
    main()
