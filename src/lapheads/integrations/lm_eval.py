"""lm-evaluation-harness for lapheads runs and nanochat checkpoints (``pip install 'lapheads[lm-eval]'``).

Design choices:

* **A ``TemplateLM`` registered as "lapheads"**: lm-eval tokenises context/continuation pairs (its own rules for
  trailing spaces) and calls :meth:`LapheadsLM._loglikelihood_tokens`; lapheads adds BOS in front of every
  sequence, as the models were trained, scores a right-padded batch at once and reports (sum of log-probabilities,
  whether greedy decoding would produce the continuation). Contexts longer than the model keep their last tokens.
* **Rolling log-likelihood** in lm-eval's disjoint windows of ``sequence_len`` tokens (perplexity tasks).
* **generate_until** greedy (or sampled when a task asks) with the model's KV cache, cut at the task's stop strings.
* **Both ways of scoring ARC are kept**: the harness scores continuation likelihood (acc / acc_norm); ``lapheads eval
  lm`` scores the answer letter as nanochat does.
* **Task YAMLs for local files**: ``lapheads_{arc_easy,arc_challenge,mmlu,gsm8k,hellaswag}`` read
  ``DATA_DIR/<task>.jsonl`` (or ``.parquet``) in the hub's schema; :func:`task_dir` writes them with the data
  folder filled in, for ``TaskManager(include_path=...)``. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.resources
import json
import logging
import re
from pathlib import Path
from typing import Any

# lm-eval fills its model registry on first use only while it is empty: "lapheads" registered first would hide
# "local-completions", "hf", ... from everyone in the process, so the registry is filled before registering
import lm_eval.models  # noqa: F401
import torch
import torch.nn.functional as F
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from lapheads.data.tokenizers import CHAT_TOKENS
from lapheads.distributed import resolve_device
from lapheads.errors import InputError
from lapheads.evals.options import HarnessOptions

log = logging.getLogger(__name__)

__all__ = ["HARNESS_TASKS", "LapheadsLM", "evaluate_harness", "task_dir"]

HARNESS_TASKS = ("arc_easy", "arc_challenge", "mmlu", "gsm8k", "hellaswag")

#: the generation arguments :meth:`LapheadsLM.generate_until` honours, as transformers' ``generate`` reads them
#: (lm-eval's own ``until`` and ``max_gen_toks`` beside them); ``num_beams`` only as 1 (no beam search here); a task
#: or ``--gen_kwargs`` asking for anything else is refused
GENERATION_KWARGS = (
    "until", "max_gen_toks", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
    "num_beams",
)  # fmt: skip


def _check_generation_kwargs(gen_kwargs: dict[str, Any]) -> None:
    """Refuse, in one line, a generation argument :meth:`LapheadsLM.generate_until` would otherwise ignore."""
    unknown = sorted(set(gen_kwargs) - set(GENERATION_KWARGS))
    if unknown:
        raise InputError(f"lm-eval generation argument {unknown[0]!r}; allowed: {', '.join(GENERATION_KWARGS)}")
    bounds = {
        "num_beams": (lambda v: v == 1, "1 (no beam search here)"),
        "top_k": (lambda v: v is None or (isinstance(v, int) and v >= 0), "an integer >= 0 (0: all tokens)"),
        "top_p": (lambda v: v is None or 0 < v <= 1, "a number in (0, 1]"),
        "repetition_penalty": (lambda v: v > 0, "a number > 0 (1: none)"),
        "temperature": (lambda v: v >= 0, "a number >= 0 (0: greedy)"),
    }
    for name, (fits, allowed) in bounds.items():
        if name in gen_kwargs and not fits(gen_kwargs[name]):
            raise InputError(f"lm-eval generation argument {name}={gen_kwargs[name]!r}; allowed: {allowed}")


@register_model("lapheads")
class LapheadsLM(TemplateLM):
    """A lapheads LM run (``run_dir``) or a nanochat checkpoint (``nanochat``) for lm-eval.

    Args:
        run_dir: an lm, mid or sft run directory.
        nanochat, step, tokenizer_dir: a nanochat checkpoint folder instead (see ``lapheads.evals.lm.load_lm``).
        device: "cpu", "cuda", "cuda:0", ... (lm-eval passes strings); None or "auto": CUDA where there is one,
            else the CPU (lm-eval's own CLI passes no device unless told).
        batch_size: sequences scored at once.
        max_gen_toks: generation length when a task does not set it.
    """

    def __init__(
        self,
        run_dir: str | None = None,
        nanochat: str | None = None,
        step: int | None = None,
        tokenizer_dir: str | None = None,
        device: str | None = "cpu",
        batch_size: int | str | None = 8,
        max_gen_toks: int = 256,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        from lapheads.evals.lm import load_lm

        lm = load_lm(
            run_dir,
            nanochat=nanochat,
            step=None if step is None else int(step),
            tokenizer_dir=tokenizer_dir,
            device="cpu",
        )
        self._device = resolve_device("auto" if device in (None, "") else device)
        self.report_dir = lm.report_dir  # where results of this model go (a nanochat checkpoint's: runs/<name>/report)
        self.model, self.lapheads_tokenizer = lm.model.to(self._device).eval(), lm.tokenizer
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8  # "auto" / None: 8
        self._chat = False  # set by apply_chat_template: prompts then hold the run's chat tokens
        self._chat_split = "(" + "|".join(re.escape(token) for token in CHAT_TOKENS) + ")"
        self.max_length, self.max_gen_toks = self.model.config.sequence_len, int(max_gen_toks)

    # -- what TemplateLM needs --------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.lapheads_tokenizer.bos_id  # the document boundary the models were trained with

    @property
    def device(self) -> torch.device:
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        if not self._chat:  # special-token strings inside a task's text are text, never control tokens
            return self.lapheads_tokenizer.encode(string)
        ids = []  # a chat-templated prompt: its chat tokens (written by apply_chat_template) are the real ones
        for piece in re.split(self._chat_split, string):
            if piece in CHAT_TOKENS:
                ids.append(self.lapheads_tokenizer.special_id(piece))
            elif piece:
                ids.extend(self.lapheads_tokenizer.encode(piece))
        return ids

    # -- chat templates (lm-eval's --apply_chat_template): the conversation format the run was trained on -----

    @property
    def tokenizer_name(self) -> str:
        tokenizer = self.lapheads_tokenizer
        return f"lapheads-{tokenizer.kind}-{tokenizer.vocab_size}"

    def chat_template(self, chat_template: bool | str = False) -> str:
        return "lapheads/nanochat: <|user_start|>...<|user_end|><|assistant_start|>...<|assistant_end|>"

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt of ``chat_history`` as the run's chat turns (``render_for_completion``, as lapheads' chat evals
        prompt a mid / SFT model), written as text whose chat tokens ``tok_encode`` reads back as themselves; the
        BOS is left out (every request starts with one). Without ``add_generation_prompt`` the last message is the
        assistant's started answer, continued inside its turn."""
        from lapheads.data.conversations import render_for_completion

        self._chat = True
        messages = [dict(m) for m in chat_history]
        prefix = ""
        if not add_generation_prompt and messages and messages[-1]["role"] == "assistant":
            prefix = messages.pop()["content"]
        ids = render_for_completion(self.lapheads_tokenizer, {"messages": messages})[1:]  # BOS: added per request
        specials = {self.lapheads_tokenizer.special_id(token): token for token in CHAT_TOKENS}
        text, run = [], []
        for token in [*ids, None]:
            if token is None or token in specials:
                if run:  # ordinary ids between chat tokens: byte-level BPE decodes and re-encodes them exactly
                    text.append(self.lapheads_tokenizer.decode(run))
                    run = []
                if token is not None:
                    text.append(specials[token])
            else:
                run.append(token)
        return "".join(text) + prefix

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(input ids, target ids scored at the last len(targets) positions) -> (log-prob sum, greedy?)."""
        out = []
        for start in range(0, len(pairs), self.batch_size):
            chunk = pairs[start : start + self.batch_size]
            length = max(len(ids) for ids, _ in chunk)
            batch = torch.full((len(chunk), length), self.eot_token_id, dtype=torch.long)
            for row, (ids, _) in enumerate(chunk):
                batch[row, : len(ids)] = torch.tensor(ids)
            logprobs = F.log_softmax(self.model(batch.to(self.device)).float(), dim=-1)
            for row, (ids, targets) in enumerate(chunk):
                n = len(targets)
                positions = logprobs[row, len(ids) - n : len(ids)]
                wanted = torch.tensor(targets, device=self.device)
                total = positions.gather(-1, wanted[:, None]).sum()
                out.append((float(total), bool((positions.argmax(-1) == wanted).all())))
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        pairs = []
        for _, context, continuation in requests:
            if not continuation:
                raise InputError("lm-eval asked to score an empty continuation")
            whole = [self.eot_token_id, *context, *continuation][-(self.max_length + 1) :]
            pairs.append((whole[:-1], continuation[-len(whole) + 1 :]))
        return self._score(pairs)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        results = []
        for request in tqdm(requests, disable=disable_tqdm, desc="rolling loglikelihood"):
            tokens = self.tok_encode(request.args[0])
            windows = [
                utils.make_disjoint_window(w)
                for w in utils.get_rolling_token_windows(tokens, self.eot_token_id, self.max_length, 1)
            ]
            pairs = [(context + targets[:-1], targets) for context, targets in windows]  # context: BOS at first
            results.append(sum(score for score, _ in self._score(pairs)))
        return results

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation, to its first stop string (cut there), the end of an assistant turn or of a
        document, or its length; ``batch_size`` requests decoded together (``lapheads.apps.batching``: each text is
        the one it gets alone). Greedy, or with ``do_sample`` sampled at its temperature (and ``top_k``, ``top_p``
        where a task sets them) from a generator seeded by its place among the requests (lm-eval's repeats of one
        context differ; a rerun gives the same); a task's ``repetition_penalty`` applies either way, as in
        transformers' ``generate``. Any other generation argument is refused in one line (:data:`GENERATION_KWARGS`),
        never silently ignored."""
        from lapheads.apps.batching import Generation, generate_together
        from lapheads.apps.detokenize import IncrementalText
        from lapheads.apps.penalties import Penalties
        from lapheads.data.tokenizers import TokenizerError

        try:  # the end of an assistant turn ends a generation, as the server's chat engine stops there (issue 72)
            ends = frozenset({self.eot_token_id, self.lapheads_tokenizer.special_id("<|assistant_end|>")})
        except TokenizerError:  # a tokenizer without chat tokens: its end of text alone
            ends = frozenset({self.eot_token_id})
        jobs: list[tuple[Generation, list[str]]] = []
        for seed, request in enumerate(requests):
            context, gen_kwargs = request.args
            _check_generation_kwargs(gen_kwargs)
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            # a task's max_new_tokens wins over max_gen_toks, as transformers' generate lets it win in lm-eval's hf
            max_new = int(gen_kwargs.get("max_new_tokens") or gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            sampled = bool(gen_kwargs.get("do_sample"))  # as transformers' generate: top-k / top-p only when sampling
            temperature = float(gen_kwargs.get("temperature", 0.0)) if sampled else 0.0
            top_k = int(gen_kwargs.get("top_k") or 0) if sampled else 0
            top_p = float(gen_kwargs.get("top_p", 1.0)) if sampled else 1.0
            # the repetition penalty also applies when greedy, as transformers' logits processor does
            penalties = Penalties(repetition=float(gen_kwargs.get("repetition_penalty", 1.0)))
            ids = [self.eot_token_id, *self.tok_encode(context)][-(self.max_length - 1) :]
            steps = max(0, min(max_new, self.max_length - len(ids)))
            generation = Generation(tuple(ids), steps, temperature, top_k or None, top_p, seed, ends, penalties)
            jobs.append((generation, until))
        decode = self.lapheads_tokenizer.decode
        out = []
        with tqdm(total=len(jobs), disable=disable_tqdm, desc="generate_until") as progress:
            for start in range(0, len(jobs), self.batch_size):
                chunk = jobs[start : start + self.batch_size]
                texts = [IncrementalText(decode) for _ in chunk]  # a few tokens decoded a token, not the whole text

                def on_token(index: int, token: int, logits: torch.Tensor) -> bool:
                    text = texts[index]
                    return not text.completes_stop(text.add(token), chunk[index][1])  # False: stop here

                generate_together(self.model, [generation for generation, _ in chunk], on_token)
                for (_, until), generated in zip(chunk, texts):
                    text = decode(generated.ids)
                    out.append(text[: min([text.find(stop) for stop in until if stop in text] or [len(text)])])
                progress.update(len(chunk))
        return out


def task_dir(data_dir: str | Path, out: str | Path) -> Path:
    """Write the shipped task YAMLs into ``out`` with ``data_dir`` filled in; returns ``out`` (an include path)."""
    data_dir, out = Path(data_dir).resolve(), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for task in HARNESS_TASKS:
        local = next((p for p in (data_dir / f"{task}.jsonl", data_dir / f"{task}.parquet") if p.is_file()), None)
        text = importlib.resources.files("lapheads.integrations").joinpath(f"lm_eval_tasks/{task}.yaml").read_text()
        if local is not None:
            text = text.replace("__BUILDER__", "json" if local.suffix == ".jsonl" else "parquet")
            (out / f"lapheads_{task}.yaml").write_text(text.replace("__DATA_FILE__", str(local)))
    return out


def evaluate_harness(options: HarnessOptions) -> dict[str, Any]:
    """Run lm-eval's ``simple_evaluate`` on ``options.harness`` (task names of the harness, of
    ``options.include_path`` or, with ``options.data_dir``, the shipped ``lapheads_*`` tasks) for the run or nanochat
    checkpoint ``options`` names; returns its "results" (with lm-eval's standard errors, from ``bootstrap_iters``
    resamples) and writes them into the model's report folder (eval_harness.json). lm-eval's own results JSON (and,
    with ``log_samples``, its per-sample files) go to ``options.output_path`` (default: that folder / "lm_eval")
    through lm-eval's ``EvaluationTracker``, as its CLI writes them.

    The options named as lm-eval's (num_fewshot, batch_size, bootstrap_iters, log_samples, gen_kwargs, limit,
    apply_chat_template, fewshot_as_multiturn, system_instruction) mean what they mean there; the chat template is
    the run's own chat turns (what mid / SFT runs were trained on); ``max_examples`` is the limit when ``limit`` is
    not set.
    """
    import tempfile

    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    from lapheads.io import atomic_write_text

    tasks, include_path, data_dir = options.task_names, options.include_path, options.data_dir
    if not tasks:
        raise InputError("--harness is empty; allowed: a comma list of lm-eval task names")
    if include_path:
        log.warning(
            f"lapheads eval: --include-path {include_path}: its YAMLs run their !function Python and Jinja "
            "templates unsandboxed (lm-eval's design); only use folders you trust"
        )
    limit = options.limit if options.limit is not None else options.max_examples
    paths = [include_path] if include_path else []
    with tempfile.TemporaryDirectory(prefix="lapheads-harness-") as tmp:
        if data_dir:
            paths.append(str(task_dir(data_dir, tmp)))
        manager = TaskManager(include_path=paths or None)
        unknown = [t for t in tasks if t not in manager.all_tasks]
        if unknown:
            shipped = ", ".join(f"lapheads_{t}" for t in HARNESS_TASKS)
            ours = [t for t in unknown if t.removeprefix("lapheads_") in HARNESS_TASKS]  # shipped, data missing
            files = ", ".join(f"{t.removeprefix('lapheads_')}.jsonl (or .parquet)" for t in ours)
            if ours and not (data_dir and Path(data_dir).is_dir()):
                where = f"--data-dir {data_dir} does not exist" if data_dir else "no --data-dir was given"
                raise InputError(
                    f"harness task(s) {', '.join(ours)} read their items from --data-dir, and {where}; allowed: a "
                    f"folder holding {files}"
                )
            if ours:
                raise InputError(
                    f"--data-dir {data_dir} lacks {files} for {', '.join(ours)}; allowed: a folder holding each "
                    "task's items in the hub's schema"
                )
            raise InputError(
                f"unknown harness task(s) {', '.join(unknown)}; allowed: lm-eval's tasks, those of "
                f"--include-path, or with --data-dir holding <task>.jsonl: {shipped}"
            )
        lm = LapheadsLM(
            options.run_dir,
            nanochat=options.nanochat,
            step=options.step,
            tokenizer_dir=options.nanochat_tokenizer,
            device=str(resolve_device(options.device)),
            batch_size=options.batch_size,
        )
        out = lm.report_dir / "eval_harness.json"
        tracker = EvaluationTracker(output_path=str(options.output_path or out.parent / "lm_eval"))
        result = simple_evaluate(
            model=lm,
            tasks=tasks,
            task_manager=manager,
            limit=limit,
            num_fewshot=options.num_fewshot,
            bootstrap_iters=options.bootstrap_iters,
            log_samples=options.log_samples,
            gen_kwargs=options.gen_kwargs,
            evaluation_tracker=tracker,
            apply_chat_template=options.apply_chat_template,
            fewshot_as_multiturn=options.fewshot_as_multiturn,
            system_instruction=options.system_instruction,
        )
        samples = result.pop("samples", None) if options.log_samples else None
        tracker.save_results_aggregated(results=result, samples=samples)
        for task in samples or {}:
            tracker.save_results_samples(task_name=task, samples=samples[task])
    results = result["results"]
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"results": results, "limit": limit, "num_fewshot": options.num_fewshot,
              "bootstrap_iters": options.bootstrap_iters, "apply_chat_template": options.apply_chat_template,
              "fewshot_as_multiturn": options.fewshot_as_multiturn}  # fmt: skip
    atomic_write_text(out, json.dumps(record, indent=1, default=str) + "\n")
    for task, metrics in results.items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
        log.info(f"{task}: {shown}")
    return results
