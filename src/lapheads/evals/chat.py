"""Chat evaluations of an SFT (or mid-trained) model, after nanochat's ``chat_eval.py``.

Design choices:

* **Every task is a conversation**: the item is rendered as a user turn and the model answers after
  ``<|assistant_start|>``, as in chat.
* **Categorical tasks** (ARC-Easy/Challenge, MMLU): nanochat's multiple-choice prompt; the logits of the first
  answer position are restricted to the answer letters and the highest letter is the prediction (no sampling).
* **Generative tasks**: GSM8K and the generated ``arith`` / ``letters`` (held-out split) by the number after
  "####" in a greedy reply, with the calculator tool; HumanEval by running the reply's code (a fenced block if the
  reply has one) with the task's tests in the sandbox, pass@k over ``num_samples`` samples at temperature 0.8.
* **ChatCORE**, nanochat's summary: each task's accuracy centred on its chance level, (acc - chance) / (1 - chance),
  averaged over the tasks evaluated (chance: 1 / number of choices for categorical tasks, 0 for generative ones).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from tqdm.auto import tqdm

from lapheads.apps.chat import ChatEngine
from lapheads.data.benchmarks import load_task, usable_rows
from lapheads.data.conversations import render_for_completion
from lapheads.data.images import DataError
from lapheads.data.turns import gsm8k_conversation, mc_conversation
from lapheads.errors import InputError
from lapheads.evals.lm import (
    LETTERS,
    extract_number,
    humaneval_ks,
    humaneval_solution,
    multiple_choice_item,
    pass_at_k,
    score_humaneval_solution,
)
from lapheads.evals.options import ChatEvalOptions

log = logging.getLogger(__name__)

__all__ = ["CHAT_BENCHMARKS", "chatcore", "run_chat_evals", "score_categorical", "score_generative"]

CATEGORICAL = ("arc_easy", "arc_challenge", "mmlu")
GENERATIVE = ("gsm8k", "humaneval", "arith", "letters")
#: what ``lapheads eval chat --benchmarks`` scores
CHAT_BENCHMARKS = (*CATEGORICAL, *GENERATIVE)


@torch.no_grad()
def score_categorical(
    engine: ChatEngine,
    benchmark: str,
    rows: list[dict[str, Any]],
    progress: bool = True,
) -> dict[str, Any]:
    """Accuracy of the answer letter with the highest logit after ``<|assistant_start|>``."""
    model, tokenizer = engine.model, engine.tokenizer
    device = model.lm_head.weight.device
    letter_ids = []
    for letter in LETTERS:
        ids = tokenizer.encode(letter)
        if len(ids) != 1:
            raise DataError(
                f"the {tokenizer.kind} tokenizer writes the letter {letter} as {len(ids)} tokens; "
                "allowed: single-token letters"
            )
        letter_ids.append(ids[0])
    correct, skipped, chance = 0, 0, 0.0
    for row in tqdm(rows, desc=benchmark, disable=not progress, leave=False):
        question, choices, answer = multiple_choice_item(benchmark, row)
        prompt = render_for_completion(tokenizer, mc_conversation(question, choices, answer))
        chance += 1 / len(choices)
        if len(prompt) > model.config.sequence_len:
            skipped += 1
            continue
        logits = model(torch.tensor([prompt], device=device))[0, -1]
        correct += int(logits[torch.tensor(letter_ids[: len(choices)], device=device)].argmax()) == answer
    scored = len(rows) - skipped
    return {
        "accuracy": correct / max(scored, 1),
        "n": scored,
        "skipped_too_long": skipped,
        "chance": chance / max(len(rows), 1),
    }


def _code_of(reply: str) -> str:
    fenced = re.search(r"```(?:python)?\n(.*?)(?:```|$)", reply, re.S)
    return fenced.group(1) if fenced else reply


def score_generative(
    engine: ChatEngine,
    benchmark: str,
    rows: list[dict[str, Any]],
    *,
    num_samples: int = 1,
    max_tokens: int = 256,
    progress: bool = True,
    unsafe_code_execution: bool = False,
) -> dict[str, Any]:
    """GSM8K / arith / letters: final-number accuracy of greedy replies; HumanEval: pass@k of the replies' code
    (without bubblewrap only with ``unsafe_code_execution``: :func:`lapheads.sandbox.require_boundary`)."""
    from lapheads.sandbox import containment, require_boundary

    if benchmark == "humaneval":
        require_boundary(unsafe_code_execution, "HumanEval")
        ks = humaneval_ks(num_samples)
        results = {k: [] for k in ks}
        temperature = 0.0 if num_samples == 1 else 0.8
        for i, row in enumerate(tqdm(rows, desc=benchmark, disable=not progress, leave=False)):
            conversation = {"messages": [{"role": "user", "content": row["prompt"]}]}
            replies = [
                engine.reply(
                    conversation, max_tokens=max_tokens, temperature=temperature, top_k=50, seed=i * num_samples + s
                )
                for s in range(num_samples)
            ]
            passed = 0
            for reply in replies:
                code = _code_of(reply)
                # a reply that writes the whole function is the solution; a body alone continues the prompt
                solution = code if f"def {row['entry_point']}" in code else humaneval_solution(row, code)
                passed += score_humaneval_solution(row, solution, unsafe_code_execution=unsafe_code_execution).passed
            for k in ks:
                results[k].append(pass_at_k(num_samples, passed, k))
        return {
            **{f"pass@{k}": sum(v) / max(len(v), 1) for k, v in results.items()},
            "accuracy": sum(results[1]) / max(len(rows), 1),
            "n": len(rows),
            "chance": 0.0,
            "sandbox": containment(),  # every result says whether a boundary held the code
            "unsafe_code_execution": unsafe_code_execution,
        }
    correct, examples = 0, []
    for row in tqdm(rows, desc=benchmark, disable=not progress, leave=False):
        reply = engine.reply(row["conversation"], max_tokens=max_tokens)
        got = extract_number(reply.split("####")[-1]) if "####" in reply else None
        correct += got is not None and got == row["reference"]
        if len(examples) < 3:
            examples.append({"question": row["conversation"]["messages"][0]["content"], "reply": reply})
    return {"accuracy": correct / max(len(rows), 1), "n": len(rows), "chance": 0.0, "examples": examples}


def chatcore(results: dict[str, dict[str, Any]]) -> float:
    """nanochat's ChatCORE: the mean over tasks of (accuracy - chance) / (1 - chance)."""
    centred = [(r["accuracy"] - r["chance"]) / (1 - r["chance"]) for r in results.values()]
    return sum(centred) / max(len(centred), 1)


def _rows(benchmark: str, data_dir: str | None, max_examples: int | None) -> list[dict[str, Any]]:
    if benchmark in ("arith", "letters"):
        from lapheads.data.synthetic import generated_items

        rows = [{"conversation": c, "reference": ref} for c, ref in generated_items(benchmark, "test")]
    else:
        rows, unusable = usable_rows(benchmark, load_task(benchmark, data_dir))
        if unusable:  # scored as wrong they would lower the accuracy without a word
            log.warning(f"lapheads: {benchmark}: {len(unusable)} item(s) with unusable ground truth left out")
        if benchmark == "gsm8k":
            rows = [
                {"conversation": gsm8k_conversation(r["question"], ""), "reference": extract_number(r["answer"])}
                for r in rows
            ]
    return rows[:max_examples]


def run_chat_evals(options: ChatEvalOptions, progress: bool = True) -> dict[str, Any]:
    """Evaluate a chat run's latest checkpoint on ``options.benchmarks`` (with its calculator unless
    ``options.no_tools``); writes RUN_DIR/report/eval_chat.json and returns its summary (tasks, ChatCORE)."""
    from lapheads.runs import RunDir, load_gpt_run
    from lapheads.sandbox import require_boundary

    benchmarks, max_examples, tools = options.benchmark_names, options.max_examples, not options.no_tools
    unknown = [b for b in benchmarks if b not in CHAT_BENCHMARKS]
    if unknown or not benchmarks:
        raise InputError(
            f"unknown chat benchmark(s) {', '.join(unknown) or '(none)'}; allowed: {', '.join(CHAT_BENCHMARKS)}"
        )
    if "humaneval" in benchmarks:  # before any data or model is read
        require_boundary(options.unsafe_code_execution, "HumanEval")
    rows = {t: _rows(t, options.data_dir, max_examples) for t in benchmarks}  # fail early on data
    _, model, tokenizer = load_gpt_run(options.run_dir, options.device)
    engine = ChatEngine(model, tokenizer, tools=tools)
    results: dict[str, Any] = {}
    for benchmark in benchmarks:
        if benchmark in CATEGORICAL:
            results[benchmark] = score_categorical(engine, benchmark, rows[benchmark], progress)
        else:
            results[benchmark] = score_generative(
                engine,
                benchmark,
                rows[benchmark],
                num_samples=options.num_samples,
                progress=progress,
                unsafe_code_execution=options.unsafe_code_execution,
            )
    summary = {"tasks": results, "chatcore": chatcore(results), "max_examples": max_examples, "tools": tools}
    RunDir(options.run_dir).write_report("eval_chat.json", summary)
    for task, result in results.items():
        log.info(f"{task}: accuracy {result['accuracy']:.4f} (n={result['n']}, chance {result['chance']:.2f})")
    log.info(f"ChatCORE {summary['chatcore']:.4f}")
    return summary
