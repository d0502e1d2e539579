"""Mid-training and SFT recipes: the CPU chat preset on generated conversations, nanochat's, and LoRA."""

from __future__ import annotations

from lapheads.train.configs.chat import MidConfig, SFTConfig

MID_PRESETS: dict[str, MidConfig] = {
    "nanochat-mid": MidConfig(
        description=(
            "nanochat v1's mid-training (the paper's LM pipeline): SmolTalk, MMLU auxiliary train, GSM8K train with "
            "calculator calls and identity conversations, packed into the base's sequences, every token trained, "
            "batch 524,288 tokens, one pass, the pre-training LRs (Muon 0.02, embedding 0.2, head 0.004), linear "
            "decay over the last 20%, bf16. Data in --data-dir (the hub's schema) or from the hub; run with torchrun"
        ),
        data="smoltalk,mmlu_aux,gsm8k,identity",
        micro_batch=32,
        total_batch_size=524_288,
        eval_every=150,
    ),
}

SFT_PRESETS: dict[str, SFTConfig] = {
    "nanochat-sft": SFTConfig(
        description=(
            "nanochat's SFT: SmolTalk, MMLU auxiliary train x3 and GSM8K train x4 (calculator calls) as whole "
            "conversations, loss on the assistant's tokens, 32 conversations per step (4 per pass), one pass, LRs at "
            "0.02 of pre-training's decaying linearly to 0, bf16. Data in --data-dir (the hub's schema) or from the hub"
        ),
        data="smoltalk,mmlu_aux*3,gsm8k*4",
        micro_batch=4,
        examples_per_step=32,
    ),
    "lora-sft": SFTConfig(
        description=(
            "The Laplacian-heads authors' LoRA SFT of nanochat bases (yuchongzhang/nanochat runs/lora_sft.sh): "
            "adapters of rank 16, alpha 32, dropout 0.05 on c_q, c_k, c_v, c_proj and c_fc, AdamW LR 2e-4, "
            "nanochat's SFT mixture and batch; the base is frozen"
        ),
        data="smoltalk,mmlu_aux*3,gsm8k*4",
        micro_batch=4,
        examples_per_step=32,
        lora_rank=16,
        lora_alpha=32.0,
        lora_dropout=0.05,
        lora_lr=2e-4,
        init_lr_frac=1.0,
    ),
    "chat-cpu": SFTConfig(
        description=(
            "SFT of the chat-cpu-base model on conversations lapheads generates (arith: word problems with a "
            "calculator call, letters: letter counting with a tool call), 32 conversations per step for 500 steps, "
            "LRs at 0.5 of pre-training's decaying linearly to 0, fp32; validation loss on the held-out arith "
            "problems; at the end, greedy chat evals on the first 300 held-out arith problems and all 168 held-out "
            "letters questions. About 10 minutes on 2 CPU cores"
        ),
        data="arith,letters",
        val_data="arith_test",
        micro_batch=16,
        examples_per_step=32,
        num_iterations=500,
        init_lr_frac=0.5,
        eval_every=100,
        eval_examples=200,
        amp=False,
        eval_tasks="arith,letters",
        eval_max_examples=300,
    ),
}
