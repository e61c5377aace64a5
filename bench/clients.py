"""python -m bench.clients: a running cluster's HTTP API driven by off-the-shelf clients, next to
the same load through our own gRPC client: what the HTTP layer costs, as a ratio.

Per concurrency N (a closed loop of N clients, each sending its next request when its last ends):
- **aiperf** (NVIDIA's benchmark, streaming /v1/completions with its synthetic prompts of the same
  lengths). It pins prometheus-client 0.23 and more, so it runs from its own venv
  (``--aiperf-venv``, made and filled from PyPI on first use). Its TTFT/ITL include the CPU its
  own ~10 processes take from the cluster on a small machine: read them as what aiperf sees.
- **http**: the ``openai`` SDK's async client, streaming /v1/completions with the seeded token-id
  prompts that **grpc** (``router.client``, one thread per client) sends too. ``http_vs_grpc``
  compares these two: same prompts, same lengths, same client machine, one protocol apart.

::

    splitserve up --http-port 8000 &   # then:
    python -m bench.clients --json bench/results/clients.json
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.report import BenchError, arg_parser, emit_report, machine, percentile, positive, progress, run
from bench.workload import BenchRequest, random_workload, variant
from router.client import SplitServeClient

AIPERF = "aiperf==0.13.0"
"""The aiperf its venv gets (and the version the report names)."""
DRIVERS = ("aiperf", "http", "grpc")


@dataclass(frozen=True)
class Timing:
    """One streamed request as its client saw it."""

    ttft_s: float
    itl_s: float
    """(last token's arrival - first's) / (tokens - 1): aiperf's definition, so the drivers agree."""
    num_tokens: int


def timing(t0: float, arrivals: list[float], num_tokens: int) -> Timing:
    itl = (arrivals[-1] - arrivals[0]) / (num_tokens - 1) if num_tokens > 1 else 0.0
    return Timing(arrivals[0] - t0, itl, num_tokens)


def grpc_call(client: SplitServeClient, req: BenchRequest) -> Timing:
    t0, arrivals, num_tokens = time.monotonic(), [], 0
    for response in client.generate(list(req.prompt_token_ids), max_tokens=req.num_output_tokens, temperature=0, ignore_eos=True):
        if response.token_ids:
            arrivals.append(time.monotonic())
            num_tokens += len(response.token_ids)
    return timing(t0, arrivals, num_tokens)


def run_grpc(address: str, token: str | None, workload: list[BenchRequest], concurrency: int) -> tuple[float, list[Timing]]:
    with SplitServeClient(address, token=token) as client, ThreadPoolExecutor(concurrency) as pool:
        start = time.monotonic()
        timings = list(pool.map(lambda req: grpc_call(client, req), workload))
        return time.monotonic() - start, timings


def run_http(base_url: str, token: str | None, model: str, workload: list[BenchRequest], concurrency: int) -> tuple[float, list[Timing]]:
    import openai

    async def clients() -> list[Timing]:
        sdk = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=token or "none", max_retries=0)
        slots = asyncio.Semaphore(concurrency)

        async def one(req: BenchRequest) -> Timing:
            async with slots:
                t0, arrivals, usage = time.monotonic(), [], None
                stream = await sdk.completions.create(
                    model=model, prompt=list(req.prompt_token_ids), max_tokens=req.num_output_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                )
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].text:
                        arrivals.append(time.monotonic())
                    usage = chunk.usage or usage
                return timing(t0, arrivals, usage.completion_tokens)

        try:
            return await asyncio.gather(*(one(req) for req in workload))
        finally:
            await sdk.close()

    start = time.monotonic()
    timings = asyncio.run(clients())
    return time.monotonic() - start, timings


def summary(wall_s: float, timings: list[Timing]) -> dict:
    ms = lambda values, q: round(1000 * percentile(values, q), 2)  # noqa: E731
    ttft, itl = [t.ttft_s for t in timings], [t.itl_s for t in timings]
    return {
        "num_requests": len(timings),
        "output_tok_per_s": round(sum(t.num_tokens for t in timings) / wall_s, 2),
        "ttft_ms_mean": round(1000 * statistics.fmean(ttft), 2), "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p90": ms(ttft, 90),
        "itl_ms_mean": round(1000 * statistics.fmean(itl), 2), "itl_ms_p50": ms(itl, 50), "itl_ms_p90": ms(itl, 90),
    }


def aiperf_venv(venv: Path) -> Path:
    """The aiperf executable of ``venv``, making the venv and installing aiperf there first if needed."""
    exe = venv / "bin" / "aiperf"
    if exe.exists():
        return exe
    progress("clients", f"first use: installing {AIPERF} into {venv} (a few minutes)")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", AIPERF], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        shutil.rmtree(venv, ignore_errors=True)
        raise BenchError(f"cannot install {AIPERF} into {venv}: {(e.stderr or str(e)).strip().splitlines()[-1]}") from None
    return exe


def hf_home_with(tokenizer_dir: Path, name: str) -> Path:
    """A private HF_HOME whose hub cache holds ``tokenizer_dir`` as repo ``name``: aiperf 0.13
    loads a local tokenizer only by repo id from the cache (a plain path fails offline)."""
    home = Path(tempfile.mkdtemp(prefix="bench-clients-hf-"))
    repo = home / "hub" / f"models--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json", "special_tokens_map.json"):
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, snapshot / f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return home


def run_aiperf(exe: Path, hf_home: Path, base_url: str, token: str | None, model: str, concurrency: int, num_requests: int, prompt_len: int, output_len: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-clients-aiperf-") as out:
        command = [
            str(exe), "profile", "--model", model, "--url", base_url, "--endpoint-type", "completions", "--streaming",
            "--concurrency", str(concurrency), "--request-count", str(num_requests),
            "--prompt-input-tokens-mean", str(prompt_len), "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(output_len), "--prompt-output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--tokenizer", "splitserve/tokenizer",
            "--random-seed", str(concurrency), "--output-artifact-dir", out, "--ui", "none", "--no-auto-plot",
        ] + (["--api-key", token] if token else [])
        env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        export = Path(out) / "profile_export_aiperf.json"
        if done.returncode != 0 or not export.exists():
            raise BenchError(f"aiperf failed (exit {done.returncode}): {(done.stdout + done.stderr).strip().splitlines()[-1:]}")
        metrics = json.loads(export.read_text())
    pick = lambda name, stat: round(metrics[name][stat], 2)  # noqa: E731
    return {
        "num_requests": int(metrics["request_count"]["avg"]),
        "output_tok_per_s": pick("output_token_throughput", "avg"),
        "ttft_ms_mean": pick("time_to_first_token", "avg"), "ttft_ms_p50": pick("time_to_first_token", "p50"), "ttft_ms_p90": pick("time_to_first_token", "p90"),
        "itl_ms_mean": pick("inter_token_latency", "avg"), "itl_ms_p50": pick("inter_token_latency", "p50"), "itl_ms_p90": pick("inter_token_latency", "p90"),
    }


def check_cluster(address: str, http_address: str, token: str | None) -> tuple[str, int]:
    """The served model and its vocabulary size; BenchError naming what is not up."""
    try:
        with SplitServeClient(address, token=token) as client:
            [info] = client.list_models()[:1] or [None]
    except grpc.RpcError as e:
        raise BenchError(f"no splitserve router answers gRPC at {address} ({e.code().name}); start one with `splitserve up --http-port 8000`") from None
    if info is None:
        raise BenchError(f"the router at {address} serves no model yet")
    try:
        urllib.request.urlopen(f"http://{http_address}/v1/models", timeout=10).read()
    except OSError as e:  # URLError is one
        raise BenchError(f"no HTTP API answers at {http_address} ({e}); start the cluster with `splitserve up --http-port 8000`") from None
    return info.id, info.vocab_size


def versus(driver: dict, grpc_row: dict) -> dict:
    """A driver's figures over the gRPC client's: > 1 is slower (latency) or faster (throughput)."""
    ratios = {f"{key}_ratio": round(driver[key] / grpc_row[key], 3) if grpc_row[key] else None for key in ("output_tok_per_s", "ttft_ms_p50", "itl_ms_p50")}
    return ratios | {"ttft_ms_p50_added": round(driver["ttft_ms_p50"] - grpc_row["ttft_ms_p50"], 2)}


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--address", default="127.0.0.1:50051", help="gRPC address of a router (default: 127.0.0.1:50051)")
    parser.add_argument("--http-address", default="127.0.0.1:8000", help="HTTP address of the same router (default: 127.0.0.1:8000)")
    parser.add_argument("--drivers", nargs="+", default=list(DRIVERS), choices=DRIVERS)
    parser.add_argument("--concurrency", type=positive, nargs="+", default=[1, 4, 8])
    parser.add_argument("--num-requests", type=positive, help="per driver and concurrency (default: 2 x N, at least 4)")
    parser.add_argument("--prompt-len", type=positive, default=128)
    parser.add_argument("--output-len", type=positive, default=32)
    parser.add_argument("--aiperf-venv", type=Path, default=Path("~/.cache/splitserve/venv-aiperf").expanduser())
    parser.add_argument("--token-file", type=Path, help="file holding the router's bearer token, if it wants one")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    token = args.token_file.read_text().strip() if args.token_file else None
    if args.output_len < 2:
        parser.error("--output-len: needs >= 2 tokens for an inter-token latency")
    progress("clients", f"checking the cluster at {args.address} (gRPC) and {args.http_address} (HTTP)")
    model, vocab_size = check_cluster(args.address, args.http_address, token)
    base_url = f"http://{args.http_address}"
    exe = hf_home = None
    if "aiperf" in args.drivers:
        from engine.bundled import resolve_model

        exe, hf_home = aiperf_venv(args.aiperf_venv), hf_home_with(resolve_model(args.model), "splitserve/tokenizer")
    rows, tag = [], 100
    try:
        for c in args.concurrency:
            n = args.num_requests or max(4, 2 * c)
            workload = random_workload(n, (args.prompt_len,) * 2, (args.output_len,) * 2, vocab_size, args.seed + c)
            row = {"concurrency": c}
            for driver in args.drivers:
                progress("clients", f"N={c}: {n} requests through {driver}")
                tag += 1
                if driver == "aiperf":
                    row[driver] = run_aiperf(exe, hf_home, base_url, token, model, c, n, args.prompt_len, args.output_len)
                else:
                    load = variant(workload, tag)  # fresh prompts: no run finds another's blocks cached
                    row[driver] = summary(*(run_http(base_url, token, model, load, c) if driver == "http" else run_grpc(args.address, token, load, c)))
                progress("clients", f"N={c} {driver}: {row[driver]['output_tok_per_s']} tok/s, TTFT p50 {row[driver]['ttft_ms_p50']} ms")
            for driver in ("http", "aiperf"):
                if driver in row and "grpc" in row:
                    row[f"{driver}_vs_grpc"] = versus(row[driver], row["grpc"])
            rows.append(row)
    finally:
        if hf_home is not None:
            shutil.rmtree(hf_home, ignore_errors=True)
    report = {
        "bench": "clients", "model": model, "machine": machine(), "address": args.address, "http_address": args.http_address,
        "aiperf": AIPERF if exe else None, "prompt_len": args.prompt_len, "output_len": args.output_len, "runs": rows,
    }
    emit_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(run("clients", main))
