"""Benchmark: requests decoded together (``lapheads.apps.batching``) against one after another, as an engine and
as ``lapheads serve`` under concurrent clients.

Models of ``--depth`` 4 and 8 (width 64 x depth: the chat-cpu preset's d4 and a 25.5M-parameter d8; half their heads
Laplacian, sequence_len 512, random weights), 64 sampled tokens per request, each its own seed: every request runs
to its length (the engine's have no stop token; the server's send vLLM's ``ignore_eos``, as its ``benchmark_serving``
does for random prompts), and tokens are counted from the replies. For each model:

1. The engine: N requests (prompts of 24-40 tokens) decoded as one batch against one at a time, interleaved in one
   process (``lapheads.bench.time_interleaved``), at N = 1, 4, 8.
2. The server: N clients at once share a list of N x 4 chat requests, each taking the next when its reply has ended
   (vLLM's ``benchmark_serving --max-concurrency N``; OpenAI's chat completions over HTTP, streamed, the clients in
   their own process, uvicorn in this one), against the same server with ``max_num_seqs`` 1 (one reply after
   another: what the server did before it batched) and 16, rounds alternating; tokens counted from the replies'
   usage chunks. The model runs on the threads ``lapheads serve`` gives it (``model_threads``: the CPUs less the one
   the HTTP side keeps).

Throughput = generated tokens / wall seconds; the ratio is batched over serial. The replies are the same either way
(the same seeds: tests/apps/test_batching.py, tests/apps/test_serve.py).

3. Where a served round's time goes, from the server's own ``GET /metrics`` (``lapheads:step_seconds{phase}``,
   read by the clients just before and just after their timed requests, summed over the rounds): the steps, the
   rows a step decodes, and the phases as shares of the wall time: the worker's ``decode`` (the forwards),
   ``sample`` (sampling, text, the readers' queues) and ``prefill`` (a batch's first prompts), and the rest, the
   worker waiting (for requests, and for the CPU the HTTP side and the clients share with it); beside them the
   joiners' prefills, which run on their own thread while the worker steps.
4. What the clients waited for, as vLLM's ``benchmark_serving`` reports it: each reply's time to first token
   (TTFT: from sending the request to its first streamed text), its time per output token after the first (TPOT:
   the rest of its time over its other tokens) and every inter-token latency (ITL: the gap between two chunks of
   text), median and p99 (``np.percentile``) over every reply of the rounds: what batching costs each reply
   beside what it buys the server.

    python benchmarks/serving.py                                   # ~4 minutes on 2 cores, machine otherwise idle
    python benchmarks/serving.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import statistics

import torch


def _requests(n: int, vocab: int, max_tokens: int):
    from lapheads.apps.batching import Generation

    g = torch.Generator().manual_seed(n)
    lengths = torch.randint(24, 41, (n,), generator=g).tolist()
    return [
        Generation(tuple(torch.randint(1, vocab, (length,), generator=g).tolist()), max_tokens, 0.8, 50, None, seed)
        for seed, length in enumerate(lengths)
    ]


def _tokenizer():
    from lapheads.data.tokenizers import Tokenizer

    return Tokenizer.char("abcdefghijklmnopqrstuvwxyz ?.")


def _counters(http, url: str) -> dict[str, float]:
    """The server's counters now (``GET /metrics``): each phase's seconds and count (``decode_sum``,
    ``decode_count``, ...), the tokens of every forward (``forwarded``) and of the prompts (``prompts``)."""
    from prometheus_client.parser import text_string_to_metric_families

    counters = {"forwarded": 0.0, "prompts": 0.0}
    for family in text_string_to_metric_families(http.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name in ("lapheads:step_seconds_sum", "lapheads:step_seconds_count"):
                counters[f"{sample.labels['phase']}_{sample.name.rsplit('_', 1)[1]}"] = sample.value
        if family.name == "lapheads:iteration_tokens_total":
            counters["forwarded"] = next(s.value for s in family.samples if s.name.endswith("_sum"))
        elif family.name == "lapheads:prompt_tokens":
            counters["prompts"] = family.samples[0].value
    return counters


def _load(url: str, clients: int, requests: int, max_tokens: int) -> tuple[int, float, dict[str, float], dict]:
    """(tokens, seconds, the server's counters' change, the replies' latencies) of ``requests`` streamed chat
    requests sent by ``clients`` clients at once, each taking the next when its reply has ended (vLLM's
    ``benchmark_serving --max-concurrency``); run in its own process, as a server's clients are, so they do not
    share the server's interpreter lock. The latencies are vLLM's, read where the client reads the text: each
    reply's time to its first text (``ttft``), its time per token after the first (``tpot``: the rest of its time
    over its other tokens), and every gap between two chunks of text (``itl``), in seconds."""
    import json
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    latencies: dict[str, list[float]] = {"ttft": [], "tpot": [], "itl": []}
    with httpx.Client(timeout=600) as http:

        def ask(seed: int, record: bool = True) -> int:
            body = {"messages": [{"role": "user", "content": "what is the capital of france?"}],
                    "max_tokens": max_tokens, "seed": seed, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            sent, arrivals, tokens = time.perf_counter(), [], 0
            with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        arrivals.append(time.perf_counter())
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            if record and arrivals:  # list.append is atomic: the clients' threads share these lists
                latencies["ttft"].append(arrivals[0] - sent)
                if tokens > 1:
                    latencies["tpot"].append((arrivals[-1] - arrivals[0]) / (tokens - 1))
                latencies["itl"].extend(b - a for a, b in zip(arrivals, arrivals[1:]))
            return tokens

        ask(10**6, record=False)  # warm-up
        before = _counters(http, url)
        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            tokens = sum(pool.map(ask, range(requests)))
        seconds = time.perf_counter() - start
        after = _counters(http, url)
        return tokens, seconds, {key: after[key] - before.get(key, 0.0) for key in after}, latencies


def _served_rate(
    model, clients: int, per_client: int, max_tokens: int, max_num_seqs: int
) -> tuple[int, float, dict[str, float], dict]:
    """(tokens, seconds, the server's counters' change: :func:`_counters`, the latencies: :func:`_load`) of
    ``clients`` clients at once against ``lapheads serve``'s app with ``max_num_seqs``; the clients are this script
    again (``--load``), in its own process."""
    import json
    import subprocess
    import sys

    from lapheads.apps.chat import ChatEngine
    from lapheads.apps.serve import create_app, served
    from lapheads.apps.serving import ServeLimits

    engine = ChatEngine(model, _tokenizer(), tools=False)
    app = create_app(engine, "bench", ServeLimits(max_tokens=max_tokens, max_num_seqs=max_num_seqs), 0.8)
    with served(app) as url:
        load = [url, str(clients), str(clients * per_client), str(max_tokens)]
        done = subprocess.run([sys.executable, __file__, "--load", *load], capture_output=True, text=True, check=True)
    tokens, seconds, counters, latencies = json.loads(done.stdout.splitlines()[-1])
    return tokens, seconds, counters, latencies


def _model(depth: int):
    """A GPT of ``depth`` (width 64 x depth, heads of 64, half of them Laplacian) speaking the tokenizer's ids, with
    random non-zero weights (so generation is not a constant)."""
    from lapheads.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    shape = dict(depth=depth, vocab_size=_tokenizer().vocab_size, sequence_len=512, head_dim=64)
    model = GPT(GPTConfig(**shape, laplacian_heads=GPTConfig(**shape).n_head // 2)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def _engine_rows(model, args: argparse.Namespace) -> list[str]:
    """N requests decoded together against one by one, interleaved, at each N of ``--clients``."""
    from lapheads.apps.batching import generate_together
    from lapheads.bench import time_interleaved

    rows = []
    for n in args.clients:
        requests = _requests(n, model.config.vocab_size, args.max_tokens)
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
    return rows


def _served_rows(model, args: argparse.Namespace) -> tuple[list[str], list[str], list[str]]:
    """The serial and the batched server under N clients at each N of ``--clients``, rounds alternating: the
    throughput rows, the rows of where their time went (the counters summed over the rounds) and the latency rows
    (every reply of every round)."""
    rows, profile, latency = [], [], []
    for n in args.clients:
        rates: dict[int, list[float]] = {1: [], 16: []}
        spent: dict[int, dict[str, float]] = {1: {}, 16: {}}
        waited: dict[int, dict[str, list[float]]] = {1: {}, 16: {}}
        for _ in range(args.repeats):  # rounds alternate the two servers, so drift hits both alike
            for seqs in rates:
                tokens, seconds, counters, latencies = _served_rate(
                    model, n, args.requests_per_client, args.max_tokens, seqs
                )
                rates[seqs].append(tokens / seconds)
                for key, value in {**counters, "wall": seconds}.items():
                    spent[seqs][key] = spent[seqs].get(key, 0.0) + value
                for key, values in latencies.items():
                    waited[seqs].setdefault(key, []).extend(values)
        serial, batched = statistics.median(rates[1]), statistics.median(rates[16])
        rows.append(f"| {n} | {tokens} | {serial:.0f} | {batched:.0f} | {batched / serial:.2f} |")
        print(rows[-1], flush=True)
        for seqs, name in ((1, "serial"), (16, "batched")):
            profile.append(_profile_row(n, name, spent[seqs], args.repeats))
            latency.append(_latency_row(n, name, waited[seqs]))
            print(profile[-1], latency[-1], sep="\n", flush=True)
    return rows, profile, latency


def _latency_row(clients: int, server: str, latencies: dict[str, list[float]]) -> str:
    """One server's row of vLLM's latencies in ms: time to first token (median, p99), time per output token
    (median, p99) and inter-token latency (median, p99), over every reply of its rounds."""

    import numpy as np

    def at(key: str, percentile: float) -> str:  # np.percentile, as benchmark_serving computes them
        values = latencies.get(key)
        return f"{1e3 * float(np.percentile(values, percentile)):.1f}" if values else "-"

    cells = [at(key, percentile) for key in ("ttft", "tpot", "itl") for percentile in (50, 99)]
    return f"| {clients} | {server} | {len(latencies.get('ttft', []))} | {' | '.join(cells)} |"


def _profile_row(clients: int, server: str, spent: dict[str, float], rounds: int) -> str:
    """One server's row of where the time went: steps a round, rows a step, ms a step of decode and of sample,
    and each phase's share of the wall time."""
    steps = spent.get("decode_count", 0.0)
    rows = (spent.get("forwarded", 0.0) - spent.get("prompts", 0.0)) / max(steps, 1.0)
    share = lambda phase: f"{100 * spent.get(f'{phase}_sum', 0.0) / spent['wall']:.0f} %"  # noqa: E731
    per_step = lambda phase: f"{1e3 * spent.get(f'{phase}_sum', 0.0) / max(steps, 1.0):.2f}"  # noqa: E731
    rest = 1 - sum(spent.get(f"{phase}_sum", 0.0) for phase in ("decode", "sample", "prefill")) / spent["wall"]
    return (
        f"| {clients} | {server} | {steps / rounds:.0f} | {rows:.1f} | {per_step('decode')} | {per_step('sample')} | "
        f"{share('decode')} | {share('sample')} | {share('prefill')} | {100 * rest:.0f} % | "
        f"{share('prefill_joining')} |"
    )


def main(argv: list[str] | None = None) -> str:
    from lapheads.apps.serve import model_threads
    from lapheads.bench import cpu_description, write_section

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--depth", type=int, nargs="+", default=[4, 8], help="models: the chat-cpu preset's, larger")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument(
        "--model-threads", type=int, default=None, help="the served model's threads (default: as lapheads serve)"
    )
    parser.add_argument("--write", default=None)
    parser.add_argument("--load", nargs=4, help=argparse.SUPPRESS)  # URL CLIENTS REQUESTS MAX_TOKENS: the clients
    args = parser.parse_args(argv)
    if args.load:
        import json

        url, clients, requests, max_tokens = args.load
        return json.dumps(_load(url, int(clients), int(requests), int(max_tokens)))
    engine_threads = torch.get_num_threads()
    served_threads = args.model_threads or model_threads(engine_threads)  # as lapheads serve runs the model
    lines = [
        f"`python benchmarks/serving.py`: GPTs of depth {', '.join(map(str, args.depth))} (width 64 x depth, heads "
        f"of 64, half of them Laplacian, {_tokenizer().vocab_size} tokens), random weights, {args.max_tokens} "
        f"sampled tokens per request at most, fp32. CPU: {cpu_description()}.",
        "",
        f"The engine (no HTTP, {engine_threads} threads): N requests decoded together against the same N one after "
        f"another, median of {args.repeats} interleaved rounds. `lapheads serve` (the model on {served_threads} "
        f"thread(s){'' if args.model_threads else ', as the server runs it'}; a character tokenizer, no calculator): "
        f"N clients at once sharing N x {args.requests_per_client} chat requests, each taking the next when its "
        "reply has ended (the clients in their own process): batched (--max-num-seqs 16) against the same server "
        f"decoding one reply after another (serial: --max-num-seqs 1); median of {args.repeats} rounds alternating "
        "the two (the same seeds: the same tokens either way).",
    ]
    for depth in args.depth:
        model = _model(depth)
        config = model.config
        torch.set_num_threads(engine_threads)
        engine = _engine_rows(model, args)
        torch.set_num_threads(served_threads)
        served, profile, latency = _served_rows(model, args)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        lines += [
            "",
            f"d{depth} ({config.n_embd} wide, {config.n_head // 2} of {config.n_head} heads Laplacian, "
            f"{params:.1f}M parameters):",
            "",
            "| requests | tokens | engine one by one, tokens/s | engine together, tokens/s | together / one by one |",
            "|---|---|---|---|---|",
            *engine,
            "",
            "| clients | tokens | serial server, tokens/s | batched server, tokens/s | batched / serial |",
            "|---|---|---|---|---|",
            *served,
            "",
            f"Where the served rounds' time went (the server's `/metrics`, summed over the {args.repeats} rounds; "
            "the shares are of the wall time: the worker's phases, the rest it waited, and beside them the joiners' "
            "prefills on their own thread):",
            "",
            "| clients | server | steps a round | rows a step | decode ms a step | sample ms a step | decode | "
            "sample | prefill | rest | joiners' prefill |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *profile,
            "",
            "What the clients waited for (vLLM's `benchmark_serving` latencies, read where each client read the "
            "streamed text, over every reply of the rounds; ms): the time to a reply's first text (TTFT), its time "
            "per token after the first (TPOT) and each gap between two chunks of text (ITL):",
            "",
            "| clients | server | replies | TTFT median | TTFT p99 | TPOT median | TPOT p99 | ITL median | ITL p99 |",
            "|---|---|---|---|---|---|---|---|---|",
            *latency,
        ]
    torch.set_num_threads(engine_threads)
    return write_section("serving.py", lines, args.write)


if __name__ == "__main__":
    print(main())
