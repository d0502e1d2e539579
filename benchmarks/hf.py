"""Benchmark: lapheads attention inside a Hugging Face Llama, forward + backward, against transformers' SDPA.

One process, interleaved rounds (ratios = median time / median time of ``attn_implementation="sdpa"``):

* ``sdpa``        transformers' own SDPA attention (the floor);
* ``lapheads k=0``  the registered "lapheads" attention with no Laplacian head (the adapter's own cost);
* ``lapheads k=2``  2 of 9 heads Laplacian per layer (SmolLM-135M's head layout: 9 query heads, 3 kv heads).

    python benchmarks/hf.py                       # a SmolLM-135M-shaped model, 4 layers, batch 4 x 256 tokens
    python benchmarks/hf.py --layers 2 --repeats 10
"""

from __future__ import annotations

import argparse
import copy

import torch
import transformers

import lapheads.integrations.hf as lhf
from lapheads.bench import machine_summary, time_interleaved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=args.layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    base = transformers.LlamaForCausalLM(config).to(args.device)
    base.set_attn_implementation("sdpa")
    models = {
        "sdpa": base,
        "lapheads k=0": lhf.enable(copy.deepcopy(base), 0),
        "lapheads k=2": lhf.enable(copy.deepcopy(base), 2),
    }
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len), device=args.device)

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()

        return run

    times = time_interleaved({name: step(m) for name, m in models.items()}, args.repeats, device=args.device)
    print(
        f"# HF Llama (SmolLM-135M heads: 9 q / 3 kv, dim 576) x {args.layers} layers, batch {args.batch} x "
        f"{args.seq_len}, forward + backward; {machine_summary(args.device)}"
    )
    print("| attention | ms / step | vs sdpa |\n|---|---|---|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / times['sdpa']:.3f}x |")


if __name__ == "__main__":
    main()
