"""Language-model evaluations: ARC-Easy/Challenge, MMLU, GSM8K, HumanEval and validation bits per byte.

Design choices:

* **Multiple choice as nanochat scores it**: the question is rendered with its lettered choices ("Multiple Choice
  question: ... - choice=A ..."), and the model's logits at the answer position are restricted to the answer
  letters; the highest letter is the prediction. No generation, so even tiny models get a well-defined score
  (chance = 1 / number of choices).
* **GSM8K by final-answer match**: greedy generation, then the number after "####" (or the last number) compared
  with the reference's "#### N" as a number.
* **HumanEval by execution**: completions (cut at the Codex stop sequences) are run with the task's tests in
  :mod:`lapheads.sandbox`; pass@k uses the unbiased estimator of Chen et al. (2021) over n samples.
* **Data in the hub's schema**: a local ``DATA_DIR/<task>.jsonl`` or ``.parquet`` (or a ``DATA_DIR/<task>/``
  folder of them) is read first; otherwise ``datasets.load_dataset`` fetches the hub dataset when online.
* **Base or chat prompts**: prompts are plain text after BOS by default; ``chat=True`` wraps them in the chat
  tokens the SFT stage will use.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lapheads.apps.penalties import Penalties
from lapheads.data.benchmarks import HUB_DATASETS, LETTERS, load_task, render_mc, usable_rows
from lapheads.data.images import DataError
from lapheads.data.text import validation_windows
from lapheads.data.tokenizers import Tokenizer
from lapheads.distributed import Distributed
from lapheads.errors import InputError
from lapheads.evals.options import LMEvalOptions
from lapheads.models.gpt import GPT
from lapheads.runs import RunDir
from lapheads.runs.layout import external_report_dir
from lapheads.sandbox import ExecutionResult, containment, require_boundary, score_solution

log = logging.getLogger(__name__)

__all__ = [
    "LM_BENCHMARKS",
    "LoadedLM",
    "load_lm",
    "stream_text",
    "extract_number",
    "pass_at_k",
    "run_evals",
    "score_gsm8k",
    "score_completions",
    "score_humaneval",
    "score_multiple_choice",
]

#: what ``lapheads eval lm --benchmarks`` scores (benchmarks, not training tasks: those are lapheads.tasks)
LM_BENCHMARKS = ("val_bpb", *HUB_DATASETS)
HUMANEVAL_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")


# ----------------------------------------------------------------------------------------------------------------
# Prompts


def _prompt_ids(tokenizer: Tokenizer, text: str, chat: bool) -> list[int]:
    if not chat:
        return tokenizer.encode(text, bos=True)
    return (
        [tokenizer.bos_id, tokenizer.special_id("<|user_start|>")]
        + tokenizer.encode(text)
        + [tokenizer.special_id("<|user_end|>"), tokenizer.special_id("<|assistant_start|>")]
    )


def _answer_tokens(tokenizer: Tokenizer, letters: str) -> tuple[str, list[int]]:
    """The text that ends a base-model prompt and the single-token ids of the letters after it."""
    for suffix, form in (("\nAnswer:", " {}"), ("\nAnswer: ", "{}")):
        ids = [tokenizer.encode(form.format(letter)) for letter in letters]
        if all(len(i) == 1 for i in ids):
            return suffix, [i[0] for i in ids]
    raise DataError(f"the {tokenizer.kind} tokenizer has no single-token answer letters; allowed: char, bpe, gpt2")


def multiple_choice_item(benchmark: str, row: dict[str, Any]) -> tuple[str, list[str], int]:
    if benchmark == "mmlu":
        return row["question"], list(row["choices"]), int(row["answer"])
    labels = list(row["choices"]["label"])
    return row["question"], list(row["choices"]["text"]), labels.index(row["answerKey"])


# ----------------------------------------------------------------------------------------------------------------
# Scoring


@torch.no_grad()
def _last_logits(model: GPT, sequences: list[list[int]], device: torch.device) -> torch.Tensor:
    """Logits at the last position of each sequence (right-padded batch; causal, so padding cannot leak)."""
    length = max(len(s) for s in sequences)
    if length > model.config.sequence_len:
        raise InputError(
            f"a prompt of {length} tokens is longer than the model's sequence_len "
            f"{model.config.sequence_len}; allowed: --max-prompt-tokens to skip long items"
        )
    batch = torch.zeros(len(sequences), length, dtype=torch.long)
    for i, s in enumerate(sequences):
        batch[i, : len(s)] = torch.tensor(s)
    logits = model(batch.to(device))
    last = torch.tensor([len(s) - 1 for s in sequences], device=device)
    return logits[torch.arange(len(sequences), device=device), last]


def score_multiple_choice(
    model: GPT,
    tokenizer: Tokenizer,
    task: str,
    rows: list[dict[str, Any]],
    *,
    chat: bool = False,
    batch_size: int = 16,
    progress: bool = True,
) -> dict[str, Any]:
    """Accuracy of the letter with the highest logit among the answer letters (ARC, MMLU)."""
    device = model.lm_head.weight.device
    items = [multiple_choice_item(task, row) for row in rows]
    correct, skipped, predictions = 0, 0, []
    for start in tqdm(range(0, len(items), batch_size), desc=task, disable=not progress, leave=False):
        chunk = items[start : start + batch_size]
        prompts, letter_ids = [], []
        for question, choices, _ in chunk:
            suffix, ids = _answer_tokens(tokenizer, LETTERS[: len(choices)])
            prompts.append(_prompt_ids(tokenizer, render_mc(question, choices) + ("" if chat else suffix), chat))
            letter_ids.append(ids)
        keep = [i for i, p in enumerate(prompts) if len(p) <= model.config.sequence_len]
        skipped += len(prompts) - len(keep)
        if not keep:
            continue
        logits = _last_logits(model, [prompts[i] for i in keep], device)
        for row_logits, i in zip(logits, keep):
            choice = int(row_logits[torch.tensor(letter_ids[i], device=device)].argmax())
            predictions.append(choice)
            correct += choice == chunk[i][2]
    scored = len(items) - skipped
    return {
        "accuracy": correct / max(scored, 1),
        "n": scored,
        "skipped_too_long": skipped,
        "chance": sum(1 / len(c) for _, c, _ in items) / max(len(items), 1),
    }


def extract_number(text: str) -> str | None:
    """The answer number of a GSM8K solution: after "####" if present, else the last number; commas and $ dropped."""
    marked = re.search(r"####\s*(-?[\d,\.]+)", text)
    if marked:
        found = marked.group(1)
    else:
        numbers = re.findall(r"-?\d[\d,]*\.?\d*", text)
        if not numbers:
            return None
        found = numbers[-1]
    found = found.replace(",", "").rstrip(".")
    try:
        value = float(found)
    except ValueError:
        return None
    return str(int(value)) if value == int(value) else str(value)


def _generate(
    model: GPT,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    num_samples: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[str]:
    device = model.lm_head.weight.device
    room = model.config.sequence_len - len(prompt_ids)
    if room <= 0:
        return [""] * num_samples
    ids = torch.tensor([prompt_ids] * num_samples, device=device)
    out = model.generate(
        ids,
        min(max_new_tokens, room),
        temperature=temperature,
        top_k=None if temperature == 0 else 50,
        generator=torch.Generator(device).manual_seed(seed),
        stop_token=tokenizer.bos_id,
    )
    texts = []
    for row in out[:, len(prompt_ids) :].tolist():
        if tokenizer.bos_id in row:
            row = row[: row.index(tokenizer.bos_id)]
        texts.append(tokenizer.decode(row))
    return texts


def score_gsm8k(
    model: GPT,
    tokenizer: Tokenizer,
    rows: list[dict[str, Any]],
    *,
    chat: bool = False,
    max_new_tokens: int = 256,
    progress: bool = True,
    generate: Callable[..., list[str]] | None = None,
) -> dict[str, Any]:
    """Fraction of problems whose generated final number equals the reference's "#### N"."""
    generate = generate or _generate
    correct = 0
    for row in tqdm(rows, desc="gsm8k", disable=not progress, leave=False):
        prompt = _prompt_ids(tokenizer, f"Question: {row['question']}\n" + ("" if chat else "Answer:"), chat)
        completion = generate(model, tokenizer, prompt, max_new_tokens)[0].split("\nQuestion:")[0]
        answer = extract_number(completion)
        correct += answer is not None and answer == extract_number(row["answer"])
    return {"accuracy": correct / max(len(rows), 1), "n": len(rows)}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c pass (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise InputError(f"pass@{k} needs at least {k} samples; got n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def humaneval_solution(row: dict[str, Any], completion: str) -> str:
    """The solution HumanEval scores: prompt + completion, cut at the first stop sequence (as the paper's harness)."""
    cut = min([completion.find(s) for s in HUMANEVAL_STOPS if s in completion] or [len(completion)])
    return f"{row['prompt']}{completion[:cut]}\n"


def score_humaneval_solution(
    row: dict[str, Any], solution: str, timeout: float = 10.0, unsafe_code_execution: bool = False
) -> ExecutionResult:
    """``solution`` against the row's tests, the verdict computed outside the solution's process
    (:func:`lapheads.sandbox.score_solution`; the prompt is the tests' context: its helpers and imports)."""
    return score_solution(
        solution, row["test"], row["entry_point"], context=row["prompt"], timeout=timeout,
        unsafe_code_execution=unsafe_code_execution,
    )  # fmt: skip


#: the longest HumanEval completion generated, in tokens
HUMANEVAL_MAX_NEW_TOKENS = 256


def humaneval_ks(num_samples: int) -> tuple[int, ...]:
    """The k of pass@k reported for n = ``num_samples`` completions per problem: 1, 10 and 100, up to n."""
    return tuple(k for k in (1, 10, 100) if k <= num_samples)


def score_humaneval(
    model: GPT,
    tokenizer: Tokenizer,
    rows: list[dict[str, Any]],
    *,
    num_samples: int = 1,
    progress: bool = True,
    unsafe_code_execution: bool = False,
) -> dict[str, Any]:
    """pass@k (:func:`humaneval_ks`) over n = ``num_samples`` completions per problem, generated greedily when
    n = 1, else sampled at 0.8 (problem i's samples seeded by i), then scored by :func:`score_completions`."""
    require_boundary(unsafe_code_execution, "HumanEval")  # before any generation
    temperature = 0.0 if num_samples == 1 else 0.8
    completions = [
        _generate(
            model,
            tokenizer,
            tokenizer.encode(row["prompt"], bos=True),
            HUMANEVAL_MAX_NEW_TOKENS,
            num_samples=num_samples,
            temperature=temperature,
            seed=i,
        )
        for i, row in enumerate(tqdm(rows, desc="humaneval", disable=not progress, leave=False))
    ]
    return score_completions(
        rows, completions, ks=humaneval_ks(num_samples), progress=progress, unsafe_code_execution=unsafe_code_execution
    )


def score_completions(
    rows: list[dict[str, Any]],
    completions: list[list[str]],
    *,
    ks: tuple[int, ...] = (1,),
    timeout: float = 10.0,
    progress: bool = True,
    unsafe_code_execution: bool = False,
) -> dict[str, Any]:
    """pass@k of given HumanEval completions (one list per row), each run against its row's tests for at most
    ``timeout`` seconds. Without bubblewrap the code runs only with ``unsafe_code_execution``
    (:func:`lapheads.sandbox.require_boundary`); the result says which held it."""
    require_boundary(unsafe_code_execution, "HumanEval")
    results, statuses = {k: [] for k in ks}, {"passed": 0, "failed": 0, "timeout": 0}
    for row, samples in zip(tqdm(rows, desc="humaneval tests", disable=not progress, leave=False), completions):
        outcomes = [
            score_humaneval_solution(row, humaneval_solution(row, s), timeout, unsafe_code_execution) for s in samples
        ]
        for outcome in outcomes:
            statuses[outcome.status] += 1
        passed = sum(o.passed for o in outcomes)
        for k in ks:
            results[k].append(pass_at_k(len(samples), passed, k))
    return {
        **{f"pass@{k}": sum(v) / max(len(v), 1) for k, v in results.items()},
        "n": len(rows),
        "samples": statuses,
        "sandbox": containment(),  # every result says whether a boundary held the code
        "unsafe_code_execution": unsafe_code_execution,
    }


# ----------------------------------------------------------------------------------------------------------------
# Whole runs


@torch.no_grad()
def evaluate_bpb(
    model: GPT,
    tokens: np.ndarray,
    token_bytes: torch.Tensor,
    dist_: Distributed,
    *,
    seq_len: int,
    max_tokens: int,
    batch_size: int,
    amp: bool,
) -> float:
    """Bits per byte of ``model`` on the first ``max_tokens`` of ``tokens`` (targets with 0 bytes left out)."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=dist_.device)
    token_bytes = token_bytes.to(dist_.device)
    windows = list(validation_windows(tokens, seq_len, max_tokens, dist_.rank, dist_.world_size))
    for start in range(0, len(windows), batch_size):
        chunk = windows[start : start + batch_size]
        x = torch.cat([w[0] for w in chunk]).to(dist_.device)
        y = torch.cat([w[1] for w in chunk]).to(dist_.device)
        with torch.autocast(dist_.device.type, dtype=torch.bfloat16, enabled=amp):
            nats = model(x, y, loss_reduction="none").view_as(y).double()
        nbytes = token_bytes[y]
        totals += torch.stack([(nats * (nbytes > 0)).sum(), nbytes.sum().double()])
    dist_.all_reduce_sum(totals)
    model.train(was_training)
    return float(totals[0] / (math.log(2) * totals[1].clamp_min(1)))


@dataclass
class LoadedLM:
    """A language model to evaluate or sample from, whichever source it came from.

    Attributes:
        model, tokenizer: the model (eval mode) and its tokenizer.
        shards: the run's token shards (validation bpb), or None (a nanochat checkpoint, a copied run).
        sequence_len, eval_tokens, batch_size: the validation-bpb settings of the source.
        report_dir: where evaluation results of this model are written.
        name: what to call it in messages.
    """

    model: GPT
    tokenizer: Tokenizer
    shards: Any
    sequence_len: int
    eval_tokens: int
    batch_size: int
    report_dir: Path
    name: str


def load_lm(
    run_dir: str | Path | None = None,
    *,
    nanochat: str | Path | None = None,
    step: int | None = None,
    tokenizer_dir: str | Path | None = None,
    device: str = "auto",
) -> LoadedLM:
    """An LM run directory's latest checkpoint, or a nanochat checkpoint folder (``nanochat=``, ``step=``).

    A nanochat checkpoint's tokenizer is ``tokenizer_dir/tokenizer.pkl``, by default nanochat's own layout
    (``<base>/base_checkpoints/<tag>/`` beside ``<base>/tokenizer/``); results go to
    ``runs/nanochat-<tag>-step<N>/``, never into nanochat's folder.
    """
    if (run_dir is None) == (nanochat is None):
        raise InputError("give one model: a RUN_DIR or --nanochat DIR")
    if run_dir is not None:
        from lapheads.runs import load_gpt_run, load_token_shards

        record, model, tokenizer = load_gpt_run(run_dir, device, step)
        config = record["config"]
        if record.get("tokens"):  # a pre-training run names the token shards it trained on; chat stages have none
            return LoadedLM(
                model,
                tokenizer,
                load_token_shards(run_dir),
                config["sequence_len"],
                config["eval_tokens"],
                config["micro_batch"],
                RunDir(run_dir).report_dir,
                str(run_dir),
            )
        return LoadedLM(
            model, tokenizer, None, model.config.sequence_len, 0, 8, RunDir(run_dir).report_dir, str(run_dir)
        )
    from lapheads.runs import load_nanochat_model

    folder = Path(nanochat)
    model, tokenizer, meta = load_nanochat_model(folder, step, device, tokenizer_dir)
    name = f"nanochat-{folder.resolve().name}-step{meta['step']}"
    return LoadedLM(model, tokenizer, None, model.config.sequence_len, 0, 8, external_report_dir(name), name)


def stream_text(
    lm: LoadedLM,
    prompt: str,
    max_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
    top_p: float | None = None,
    penalties: Penalties | None = None,
    min_p: float | None = None,
) -> Iterator[str]:
    """Yield ``prompt``, then the text each new token completes as soon as it is sampled (``lapheads.apps.batching``'s
    decoder, a batch of one; :class:`lapheads.apps.detokenize.IncrementalText`: a few tokens decoded a token, and a
    character spread over several byte tokens comes out whole once its last byte arrives); ``top_p``, ``min_p`` and
    ``penalties`` (logit biases, repetition, frequency and presence penalties) as the server takes them."""
    from lapheads.apps.batching import Generation, decode_steps
    from lapheads.apps.detokenize import IncrementalText

    model, tokenizer = lm.model, lm.tokenizer
    ids = tokenizer.encode(prompt, bos=True)
    steps = min(max_tokens, model.config.sequence_len - len(ids))
    if steps < 0:
        raise InputError(f"the prompt has {len(ids)} tokens; allowed: at most sequence_len {model.config.sequence_len}")
    yield prompt
    if steps == 0:
        return
    text = IncrementalText(tokenizer.decode)  # the continuation's text: the prompt's ended on a whole character
    pieces: list[str] = []
    generation = Generation(
        tuple(ids), steps, temperature, top_k or None, top_p, seed, penalties=penalties or Penalties(), min_p=min_p
    )
    for _ in decode_steps(model, [generation], lambda index, token, logits: pieces.append(text.add(token))):
        yield from filter(None, pieces)
        pieces.clear()
    rest = text.flush()  # a character cut short by the length: U+FFFD, as decoding the whole text shows it
    if rest:
        yield rest


def run_evals(options: LMEvalOptions, progress: bool = True) -> dict[str, Any]:
    """Evaluate an LM run's latest checkpoint (or a nanochat checkpoint: ``options.nanochat``) on
    ``options.benchmarks``; writes eval_lm.json into the source's report directory (see :func:`load_lm`)."""
    from lapheads.io import atomic_write_text

    benchmarks, max_examples, chat = options.benchmark_names, options.max_examples, options.chat
    unknown = [b for b in benchmarks if b not in LM_BENCHMARKS]
    if unknown or not benchmarks:
        raise InputError(f"unknown benchmark(s) {', '.join(unknown) or '(none)'}; allowed: {', '.join(LM_BENCHMARKS)}")
    if "humaneval" in benchmarks:  # before any data or model is read
        require_boundary(options.unsafe_code_execution, "HumanEval")
    rows, unusable = {}, {}
    for benchmark in benchmarks:  # every benchmark's data before any scoring: fail early
        if benchmark != "val_bpb":
            kept, unusable[benchmark] = usable_rows(benchmark, load_task(benchmark, options.data_dir))
            rows[benchmark] = kept[:max_examples]
            if unusable[benchmark]:  # scored as wrong they would lower the accuracy without a word
                shown = ", ".join(map(str, unusable[benchmark][:5])) + (", ..." if len(unusable[benchmark]) > 5 else "")
                log.warning(
                    f"lapheads: {benchmark}: {len(unusable[benchmark])} item(s) with unusable ground truth left out "
                    f"(rows {shown})"
                )
    lm = load_lm(
        options.run_dir,
        nanochat=options.nanochat,
        step=options.step,
        tokenizer_dir=options.nanochat_tokenizer,
        device=options.device,
    )
    model, tokenizer = lm.model, lm.tokenizer
    results: dict[str, Any] = {}
    for benchmark in benchmarks:
        if benchmark == "val_bpb":
            if lm.shards is None:
                raise DataError(
                    f"val_bpb needs lapheads token shards of the model's own tokenizer, which {lm.name} "
                    "does not have (a nanochat checkpoint, or a run copied without its data)"
                )
            dist_ = Distributed(device=model.lm_head.weight.device)
            results[benchmark] = {
                "bpb": evaluate_bpb(
                    model,
                    lm.shards.val,
                    tokenizer.token_bytes(),
                    dist_,
                    seq_len=lm.sequence_len,
                    max_tokens=lm.eval_tokens,
                    batch_size=lm.batch_size,
                    amp=False,
                )
            }
        elif benchmark in ("arc_easy", "arc_challenge", "mmlu"):
            results[benchmark] = score_multiple_choice(
                model, tokenizer, benchmark, rows[benchmark], chat=chat, progress=progress
            )
        elif benchmark == "gsm8k":
            results[benchmark] = score_gsm8k(model, tokenizer, rows[benchmark], chat=chat, progress=progress)
        else:
            results[benchmark] = score_humaneval(
                model,
                tokenizer,
                rows[benchmark],
                num_samples=options.num_samples,
                progress=progress,
                unsafe_code_execution=options.unsafe_code_execution,
            )
    for benchmark, left_out in unusable.items():
        results[benchmark]["unusable"] = len(left_out)
    out = lm.report_dir / "eval_lm.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps({"tasks": results, "max_examples": max_examples, "chat": chat}, indent=1) + "\n")
    return results
