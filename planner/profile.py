"""``python -m planner.profile``: measure a running cluster's per-replica costs for the planner.

Against the router of a cluster with one prefill and one decode replica (or one aggregated decode
replica), it measures what the planner's perf model needs (planner/perf_model.py):

- prefill: the time to first token of one prompt alone, per prompt length (median of
  ``--repeats``, each prompt new so nothing is cached), through the whole serving path;
- decode: seconds per token of each stream when ``b`` streams decode together, per batch size b
  (each stream's (last token - first token) / (tokens - 1), median over the streams).

It writes the profile JSON ``load_profile`` reads: ``{"source", "prefill": [[tokens, s]], "decode":
[[batch, itl_s]]}``; the planner then sizes pools in replicas like the one measured.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

EXIT_USAGE = 2


def _ints(text: str) -> list[int]:
    values = sorted({int(part) for part in text.split(",")})
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive whole numbers")
    return values


def _prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(32, vocab_size) for _ in range(length)]


def prefill_s(client, prompt: list[int]) -> float:
    start = time.perf_counter()
    for _ in client.generate(prompt, max_tokens=1, temperature=0, ignore_eos=True):
        pass
    return time.perf_counter() - start


def stream_itl_s(client, prompt: list[int], num_tokens: int) -> float:
    """Seconds per token of one stream after its first token."""
    first = last = None
    count = 0
    for response in client.generate(prompt, max_tokens=num_tokens, temperature=0, ignore_eos=True):
        now = time.perf_counter()
        first = first or now
        last = now
        count += len(response.token_ids)
    return (last - first) / max(1, count - 1)


def profile(client, prompt_lengths: list[int], batches: list[int], decode_tokens: int, repeats: int, seed: int = 0) -> dict:
    [model] = client.list_models()[:1]
    rng = random.Random(seed)
    prefill = []
    for length in prompt_lengths:
        if length >= model.max_model_len:
            raise ValueError(f"prompt length {length} does not fit the model's context of {model.max_model_len} tokens")
        times = [prefill_s(client, _prompt(rng, length, model.vocab_size)) for _ in range(repeats)]
        prefill.append([length, round(statistics.median(times), 6)])
        print(f"profile: prefill of {length} tokens: {prefill[-1][1]:.4f} s", file=sys.stderr, flush=True)
    decode = []
    for batch in batches:
        prompts = [_prompt(rng, 8, model.vocab_size) for _ in range(batch)]
        with ThreadPoolExecutor(batch) as pool:
            itls = list(pool.map(lambda p: stream_itl_s(client, p, decode_tokens), prompts))
        decode.append([batch, round(statistics.median(itls), 6)])
        print(f"profile: decode at batch {batch}: {1000 * decode[-1][1]:.2f} ms per token", file=sys.stderr, flush=True)
    return {"source": f"planner.profile of {model.id} through the router", "prefill": prefill, "decode": decode}


def main(argv: list[str] | None = None) -> int:
    from router.client import SplitServeClient

    parser = argparse.ArgumentParser(prog="python -m planner.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--addr", default="localhost:50051", help="router address HOST:PORT (default: %(default)s)")
    parser.add_argument("--json", type=Path, required=True, help="where to write the profile")
    parser.add_argument("--prompt-lengths", type=_ints, default=[64, 256, 1024, 4096])
    parser.add_argument("--batches", type=_ints, default=[1, 4, 16, 32])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.decode_tokens < 2 or args.repeats < 1:
        print("python -m planner.profile: --decode-tokens must be at least 2 and --repeats at least 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        with SplitServeClient(args.addr) as client:
            result = profile(client, args.prompt_lengths, args.batches, args.decode_tokens, args.repeats)
    except grpc.RpcError as e:
        print(f"python -m planner.profile: the router at {args.addr} answered {e.code().name}: {e.details()}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as e:
        print(f"python -m planner.profile: {e}", file=sys.stderr)
        return EXIT_USAGE
    args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
