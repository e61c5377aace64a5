"""A thin Python client for product backends.

::

    client = SplitServeClient("localhost:50051")
    for response in client.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=64):
        print(response.text, end="", flush=True)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import grpc.experimental

from proto import splitserve_pb2 as pb
from proto import splitserve_pb2_grpc as pb_grpc


_CHANNEL_OPTIONS = [(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]
"""A stream's messages are read on the thread that iterates it, not handed over from the
channel's polling thread: one thread wake-up less per message. The first token of a request on
an idle local cluster arrived ~0.4 ms sooner (measured 2026-11-23 on the 2-core dev machine)."""


class SplitServeClient:
    """Blocking client over one channel; safe to share between threads. A ``generate`` stream
    makes progress only while its caller iterates it (or cancels it)."""

    def __init__(
        self,
        address: str,
        *,
        tls_ca_file: Path | None = None,
        client_cert_file: Path | None = None,
        client_key_file: Path | None = None,
        token: str | None = None,
    ) -> None:
        if tls_ca_file is not None or client_cert_file is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=Path(tls_ca_file).read_bytes() if tls_ca_file else None,
                private_key=Path(client_key_file).read_bytes() if client_key_file else None,
                certificate_chain=Path(client_cert_file).read_bytes() if client_cert_file else None,
            )
            self._channel = grpc.secure_channel(address, credentials, options=_CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.generation = pb_grpc.GenerationStub(self._channel)
        self.admin = pb_grpc.AdminStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> SplitServeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompt: str | Sequence[int] | None = None, *, timeout_s: float | None = None, **fields) -> Iterator[pb.GenerateResponse]:
        """Stream responses; ``fields`` are ``build_generate_request``'s keywords (messages,
        max_tokens, temperature, ...). Raises grpc.RpcError with the server's status and message."""
        request = build_generate_request(prompt, **fields)
        return self.generation.Generate(request, timeout=timeout_s, metadata=self._metadata)

    def tokenize(self, prompt: str, model: str = "") -> list[int]:
        response = self.generation.Tokenize(pb.TokenizeRequest(model=model, prompt=prompt), metadata=self._metadata)
        return list(response.token_ids)

    def list_models(self) -> list[pb.ModelInfo]:
        return list(self.generation.ListModels(pb.ListModelsRequest(), metadata=self._metadata).models)

    def cluster_status(self) -> pb.ClusterStatus:
        return self.admin.GetClusterStatus(pb.GetClusterStatusRequest(), metadata=self._metadata)


def build_generate_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[dict[str, str]] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    model: str = "",
    request_id: str = "",
    tenant_salt: str = "",
) -> pb.GenerateRequest:
    """A GenerateRequest from keyword arguments; None leaves a field unset (server default)."""
    request = pb.GenerateRequest(model=model, request_id=request_id, tenant_salt=tenant_salt)
    if isinstance(prompt, str):
        request.prompt = prompt
    elif prompt is not None:
        request.prompt_token_ids.extend(prompt)
    for m in messages or ():
        request.messages.add(role=m["role"], content=m["content"])
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed)):
        if value is not None:
            setattr(request.sampling, name, value)
    if max_tokens is not None:
        request.stop.max_tokens = max_tokens
    request.stop.stop.extend(stop)
    request.stop.stop_token_ids.extend(stop_token_ids)
    request.stop.ignore_eos = ignore_eos
    return request
