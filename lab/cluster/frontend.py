"""The API server in front of the engines: the time a request spends in the front-end before an engine sees it, and
the time from an engine emitting a token to the client receiving it.

vLLM V1 serves over two processes (vllm/v1/engine/async_llm.py ``AsyncLLM``, vllm/v1/engine/core.py
``EngineCoreProc``): the API server process parses the HTTP request, applies the chat template and tokenizes the
prompt (vllm/v1/engine/input_processor.py), and sends an ``EngineCoreRequest`` over ZMQ to the engine-core
process, whose input thread queues it; the engine core's ``add_request`` puts it in the scheduler's waiting queue
(the ``queued`` timestamp engine-side metrics count from). Each step's ``EngineCoreOutputs`` go back over ZMQ, the
API server's ``output_handler`` runs the ``OutputProcessor`` (vllm/v1/engine/output_processor.py: incremental
detokenization, stop strings, ``RequestOutput``) and the OpenAI server streams an SSE chunk per output.
``vllm bench serve`` measures at the client: TTFT from its send to the first streamed chunk, E2EL to the last one
(shared/specs/metrics.md).

The model here: a request sent at ``t`` reaches the engine's waiting queue at
``t + request_s + per_prompt_token_s · prompt tokens``, and every output the engine emits at ``e`` reaches the
client at ``e + per_output_token_s`` (one engine step's tokens of one request: one token without speculative
decoding). So client TTFT = front-end in + engine TTFT + ``per_output_token_s``, client E2EL = front-end in +
engine E2EL + ``per_output_token_s``, and TPOT and ITL are the engine's. The front-end is uncontended: its work does
not queue behind other requests' (the one-process asyncio loop that serialises it in vLLM, which
``--api-server-count`` spreads over processes, is not modelled). Zero settings leave every time as it was.

Defaults (:data:`FRONTEND_DEFAULTS`, by ``engine.vllm_version``), from public measurements of vLLM's API server:

- ``request_s`` 10.2 ms: vLLM PR #54628 scraped ``vllm:time_to_first_token_seconds`` (the server's TTFT, from the
  request's arrival in the API server) around ``vllm bench serve`` runs and found the client's TTFT 8.4 and 12.0 ms
  above it with the completions endpoint (``--backend openai``, what ``vllm bench serve`` uses by default; 8.4-12.2 ms
  over all five rows, chat and responses included), 512-token prompts at concurrency 8, vLLM 0.28.1rc1 on an RTX
  4070 laptop under WSL2 (a slower host than a data-centre server: an upper side). Their mean, 10.2 ms, is the
  HTTP hop, request parsing and the first output's way back; it is put on the way in (the engine's queue entry).
- ``per_prompt_token_s`` 10 µs: tokenization of the prompt before the engine sees it. tenstorrent/tt-inference-server
  issue #2173 timed the HF tokenizers library (the Rust tokenizer vLLM's fast tokenizers wrap) at 10.1-21.5 µs per
  token on 131-token chat prompts, 10.1-10.7 µs once warm; the warm figure is used.
- ``per_output_token_s`` 0: the way back of the first output is inside ``request_s``; no measurement isolates the
  per-chunk detokenization of the V1 output processor.

No measurement separates vLLM versions, so 0.11, 0.19 and 0.33 share these figures. The LLMServingSim validation
runs measure TTFT from the engine's queue entry and set all three to 0 in their experiment files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import simpy

from lab.core.request import Request
from lab.engine.window import delay_until


FRONTEND_DEFAULTS: dict[str, dict[str, float]] = {
    v: {"request_s": 0.0102, "per_prompt_token_s": 1.0e-5, "per_output_token_s": 0.0} for v in ("0.33", "0.19", "0.11")
}


@dataclass(frozen=True)
class FrontEndCost:
    """Front-end times (seconds; all >= 0).

    Attributes:
        request_s: per request, before the engine sees it: HTTP parsing, request validation, chat template, the
            ZMQ hop to the engine core and its ``add_request``.
        per_prompt_token_s: per prompt token, before the engine sees it: tokenization.
        per_output_token_s: per streamed output, after the engine emits it: the ZMQ hop back, detokenization and
            the SSE chunk (first token and every later one alike).

    Raises:
        ValueError: a negative or non-finite time (the message names the ``frontend`` field).
    """

    request_s: float = 0.0
    per_prompt_token_s: float = 0.0
    per_output_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("request_s", "per_prompt_token_s", "per_output_token_s"):
            v = getattr(self, name)
            if not v >= 0 or v == float("inf"):
                raise ValueError(f"frontend.{name} must be a finite number of seconds >= 0, got {v!r}")

    @property
    def is_zero(self) -> bool:
        return not (self.request_s or self.per_prompt_token_s or self.per_output_token_s)

    def time_in(self, request: Request) -> float:
        """Seconds from the client's send to the request entering an engine's waiting queue."""
        return self.request_s + self.per_prompt_token_s * request.prompt_len


class FrontEnd:
    """Delays each request by its front-end time before handing it to ``arrive``, and marks it with its send time
    and its stream delay (``Request.sent_time``, ``Request.stream_s``) for the client-side metrics.

    Args:
        env: the SimPy environment.
        cost: the front-end times.
        arrive: hands a request to the deployment (an instance's ``add_request`` or ``Cluster.arrive``).
    """

    def __init__(self, env: simpy.Environment, cost: FrontEndCost, arrive: Callable[[Request], None]) -> None:
        self.env = env
        self.cost = cost
        self.arrive = arrive

    def submit(self, request: Request) -> None:
        """The client sends ``request`` now (its ``arrival_time`` is the send time): it reaches the engine after its
        front-end time, with ``arrival_time`` rewritten to that exact moment (the engine's queue entry)."""
        request.stream_s = self.cost.per_output_token_s
        delay = self.cost.time_in(request)
        if not delay:
            self.arrive(request)
            return
        sent = request.arrival_time
        request.sent_time = sent
        request.arrival_time = sent + delay
        self.env.process(self._deliver(request))

    def _deliver(self, request: Request):
        yield self.env.timeout(delay_until(self.env.now, request.arrival_time))
        self.arrive(request)


def shift_to_engine(reqs: list[Request], cost: FrontEndCost) -> list[Request]:
    """An open-loop stream as the engines see it: each request marked as :meth:`FrontEnd.submit` marks it (its send
    time kept in ``sent_time``, ``arrival_time`` moved to its queue entry, ``stream_s`` set), in the order the
    engines receive them (stable by the new ``arrival_time``). Delivering this list at its arrival times is the same
    as sending the original one through a :class:`FrontEnd`, and the engines know their arrivals in advance (the
    fast-forward jumps through them, lab/engine/jump/)."""
    for r in reqs:
        r.stream_s = cost.per_output_token_s
        delay = cost.time_in(r)
        if delay:
            r.sent_time = r.arrival_time
            r.arrival_time = r.arrival_time + delay
    return sorted(reqs, key=lambda r: r.arrival_time)


def sent_time(request: Request) -> float:
    """When the client sent ``request`` (seconds): its ``sent_time``, else its ``arrival_time``."""
    s = request.sent_time
    return request.arrival_time if s is None else s


def received_time(request: Request, engine_time: float) -> float:
    """When the client receives an output the engine emitted at ``engine_time`` (seconds)."""
    return engine_time + request.stream_s
