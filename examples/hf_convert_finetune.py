"""Convert a pretrained Hugging Face LM to Laplacian heads and fine-tune it, once per ``init``; report loss curves.

Offline (the default) the "pretrained" model is a small Llama built from a config and first trained with plain
attention on the embedded Shakespeare (characters); with ``--model NAME`` it is a hub model (online) and the text is
tokenised with its tokenizer. Then, from the same weights and the same batches:

* ``control``  k = 0 (plain attention, fine-tuned the same way);
* ``switch``   k heads turned Laplacian as they are;
* ``signflip`` k heads Laplacian with their W_O columns negated (the P V term kept exactly);
* ``blend``    k heads moved from plain attention (lambda = 0) to Laplacian (lambda = 1) over --blend-steps.

    python examples/hf_convert_finetune.py --out runs/hf-convert   # 2 min 21 s, 2 threads (docs/results.md)
    python examples/hf_convert_finetune.py --model HuggingFaceTB/SmolLM2-135M --steps 300 --out runs/smollm

Writes OUT/curves.json (loss per step per init, and the validation loss at the end) and OUT/curves.png.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
import transformers

import lapheads.integrations.hf as lhf
from lapheads.data.text import shakespeare_plays
from lapheads.data.tokenizers import Tokenizer


def batches(ids: torch.Tensor, seq_len: int, batch: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(ids) - seq_len - 1, (batch,), generator=generator)
        yield torch.stack([ids[s : s + seq_len] for s in starts.tolist()])


def train(model, data, steps: int, lr: float, on_step=None) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for step in range(steps):
        if on_step is not None:
            on_step(step)
        x = next(data)
        loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@torch.no_grad()
def validation_loss(model, ids: torch.Tensor, seq_len: int) -> float:
    model.eval()
    chunks = ids[: (len(ids) // seq_len) * seq_len].view(-1, seq_len)[:32]
    return float(model(chunks, labels=chunks).loss)


def main() -> None:
    from lapheads.hardware import apply_thread_policy

    apply_thread_policy("auto")  # the CPUs other processes leave free, as the CLI picks them
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a hub model name (online); default: a small Llama, offline")
    parser.add_argument("--laplacian-heads", default="2")
    parser.add_argument("--pretrain-steps", type=int, default=400, help="offline model: plain-attention steps first")
    parser.add_argument("--steps", type=int, default=150, help="fine-tuning steps per init")
    parser.add_argument("--blend-steps", type=int, default=100)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--out", default="runs/hf-convert")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plays = shakespeare_plays(args.data_root)
    train_text = "\n\n".join(t for i, (_, t) in enumerate(plays) if i % 10 != 9)
    val_text = "\n\n".join(t for i, (_, t) in enumerate(plays) if i % 10 == 9)[:200_000]
    torch.manual_seed(0)
    if args.model:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        encode = lambda text: torch.tensor(tokenizer(text[:5_000_000])["input_ids"])  # noqa: E731
        pretrained = transformers.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa")
    else:
        tokenizer = Tokenizer.char(train_text)
        encode = lambda text: torch.tensor(tokenizer.encode(text))  # noqa: E731
        config = transformers.LlamaConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=args.seq_len,
        )
        pretrained = transformers.LlamaForCausalLM(config)
        pretrained.set_attn_implementation("sdpa")
    train_ids, val_ids = encode(train_text), encode(val_text)
    pre_losses = []
    if not args.model:
        pre_losses = train(
            pretrained, batches(train_ids, args.seq_len, args.batch, seed=0), args.pretrain_steps, args.lr
        )
    curves: dict[str, dict] = {
        "pretrain": {"loss": pre_losses, "val_loss": validation_loss(pretrained, val_ids, args.seq_len)}
    }
    for init in ("control", "switch", "signflip", "blend"):
        model = copy.deepcopy(pretrained)
        spec = 0 if init == "control" else args.laplacian_heads
        lhf.enable(model, spec, init="switch" if init == "control" else init)
        start = validation_loss(model, val_ids, args.seq_len)
        schedule = lhf.BlendSchedule(model, args.blend_steps) if init == "blend" else None
        torch.manual_seed(1)
        losses = train(model, batches(train_ids, args.seq_len, args.batch, seed=1), args.steps, args.lr, schedule)
        curves[init] = {
            "loss": losses,
            "val_loss_at_conversion": start,
            "val_loss": validation_loss(model, val_ids, args.seq_len),
        }
        print(
            f"{init:9s} val loss at conversion {start:.4f}, after {args.steps} steps "
            f"{curves[init]['val_loss']:.4f} (control: k = 0)"
        )
    (out / "curves.json").write_text(json.dumps({"args": vars(args), "curves": curves}, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for init in ("control", "switch", "signflip", "blend"):
        ax.plot(curves[init]["loss"], label=f"{init} (val {curves[init]['val_loss']:.3f})")
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("training loss (nats)")
    ax.set_title(f"Converted to {args.laplacian_heads} Laplacian heads per layer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=120)
    print(f"curves: {out / 'curves.json'}, {out / 'curves.png'}")


if __name__ == "__main__":
    main()
