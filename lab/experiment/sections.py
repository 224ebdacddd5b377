"""The experiment file's sections (the schema, part 1): one pydantic model per section, each with the checks that
need only its own fields. The root model and the checks across sections are in lab/experiment/schema.py.

Every field is documented in docs/experiments.md. Unknown fields are errors (``extra="forbid"``); a check raises
``ValueError`` with a message that names the field and what was expected (pydantic adds the field path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from lab.costmodel.hardware import load_gpu_catalog, load_hardware, register_gpu
from lab.costmodel.model_arch import load_model
from lab.experiment.paths import default_data_dir, expand_path


class StrictModel(BaseModel):
    """The base of every section: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid")


class LengthSpec(StrictModel):
    """A token-length distribution (see lab/workload/synthetic.py)."""

    kind: Literal["constant", "uniform", "lognormal", "normal", "exponential"] = "lognormal"
    value: float = Field(0, ge=0)
    low: float = Field(1, ge=1)
    high: float = Field(1, ge=1)
    median: float = Field(512, gt=0)
    sigma: float = Field(0.8, ge=0)
    mean: float = Field(512, gt=0)
    std: float = Field(128, ge=0)
    min: int = Field(1, ge=1)
    max: int = Field(32768, ge=1)

    @model_validator(mode="after")
    def _ranges(self) -> "LengthSpec":
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        if self.kind == "uniform" and self.low > self.high:
            raise ValueError(f"uniform: low ({self.low}) must not exceed high ({self.high})")
        if self.kind == "constant" and not self.min <= self.value <= self.max:
            raise ValueError(f"constant: value ({self.value:g}) must lie in [min, max] = [{self.min}, {self.max}] "
                             "(it would be clamped silently)")
        return self


class ArrivalOverride(StrictModel):
    """Arrival times taken row by row from a CSV column (e.g. a measured run's ``arrival_rel_s``)."""

    path: str
    column: str = "arrival_rel_s"


_DEFAULT_TURNS = LengthSpec(kind="uniform", low=1, high=6, max=64)
_DEFAULT_TURN_TOKENS = LengthSpec(kind="lognormal", median=100, sigma=0.8, max=4096)


class WorkloadConfig(StrictModel):
    """Which requests arrive when.

    ``source`` picks the loader: ``synthetic`` (seeded generator), ``azure`` (Azure LLM inference 2023 CSV),
    ``mooncake`` (Mooncake JSONL with prefix hash_ids), ``llmservingsim`` (LLMServingSim workload JSONL with token
    ids), ``csv`` (arrival_time_s, prompt_tokens, output_tokens) or ``vllm_bench`` (a ``vllm bench serve``
    detailed result JSON).
    """

    source: Literal["synthetic", "sessions", "azure", "mooncake", "llmservingsim", "csv", "vllm_bench"] = "synthetic"
    path: str | None = None
    num_requests: int = Field(500, ge=1)
    rate: float = Field(5.0, gt=0, description="requests per second (synthetic); inf sends every request at t = 0, "
                        "as vllm bench serve --request-rate inf (with concurrency, the clients pace the sends)")
    cv: float = Field(1.0, gt=0, description="coefficient of variation of inter-arrival times (synthetic)")
    num_priorities: int = Field(1, ge=1)
    prompt_tokens: LengthSpec = LengthSpec(kind="lognormal", median=600, sigma=0.9, max=8192)
    output_tokens: LengthSpec = LengthSpec(kind="lognormal", median=200, sigma=0.8, max=2048)
    max_requests: int | None = Field(None, ge=1, description="keep only the first N requests of a trace")
    time_scale: float = Field(1.0, gt=0, description="multiply arrival times (0.5 = twice the rate)")
    jitter_s: float = Field(0.0, ge=0, description="spread quantised timestamps (mooncake)")
    arrival_times: ArrivalOverride | None = None
    concurrency: int | None = Field(None, ge=1, description="closed loop: at most this many requests in flight, "
                                    "the next sent when one completes (vllm bench serve --max-concurrency); with "
                                    "a synthetic source and no explicit rate, every request is ready at t = 0")
    think_time_s: float = Field(0.0, ge=0, description="closed loop: seconds between a completion and the next send")
    num_warmup: int = Field(0, ge=0, description="closed loop: extra copies of the first request sent first as a "
                            "warm-up and left out of the metrics (vllm bench serve --num-warmups); num_requests "
                            "are all measured")
    turns: LengthSpec = Field(_DEFAULT_TURNS,
                              description="sessions: turns per conversation (num_requests = sessions, rate = "
                              "sessions/s)")
    turn_tokens: LengthSpec = Field(_DEFAULT_TURN_TOKENS,
                                    description="sessions: new user tokens of each turn after the first")

    @model_validator(mode="after")
    def _path_needed(self) -> "WorkloadConfig":
        if self.source not in ("synthetic", "sessions") and not self.path:
            raise ValueError(f"source {self.source!r} needs 'path' (the trace file)")
        if self.source in ("synthetic", "sessions") and self.path:
            raise ValueError(f"path: source {self.source!r} generates its requests and reads no file; remove 'path' "
                             "or name the trace's format in 'source' (azure, mooncake, csv, ...)")
        if self.source == "sessions" and (self.concurrency is not None or self.num_warmup):
            raise ValueError("source 'sessions' is closed-loop per conversation: 'concurrency' and 'num_warmup' do "
                             "not apply (think_time_s does)")
        if self.source != "sessions" and (self.turns != _DEFAULT_TURNS or self.turn_tokens != _DEFAULT_TURN_TOKENS):
            raise ValueError("turns and turn_tokens are for source 'sessions'")
        if self.source not in ("synthetic", "sessions") and "num_requests" in self.model_fields_set:
            raise ValueError(f"num_requests is for generated workloads; source {self.source!r} replays every request "
                             "of its trace: use max_requests to keep the first N")
        if (self.think_time_s or self.num_warmup) and self.concurrency is None and self.source not in (
                "vllm_bench", "sessions"):
            raise ValueError("think_time_s and num_warmup are for closed-loop workloads: set 'concurrency' (or use "
                             "source 'sessions')")
        return self


DEFAULT_MODEL = "Llama-3.1-8B"


class ModelConfig(StrictModel):
    """The served model: a catalog name (``servelab catalog`` lists them) or a Hugging Face config.json.

    Without ``hf_config``, ``name`` is a catalog name (default :data:`DEFAULT_MODEL`). With it, ``name`` is only the
    label reports show; unset, the label comes from the config (lab/costmodel/model_arch.py ``hf_model_name``)."""

    name: str | None = Field(None, description="catalog name; with hf_config, the label (default: from the config)")
    hf_config: str | None = None
    dtype: Literal["bf16", "fp16", "fp8"] = "bf16"
    kv_cache_dtype: Literal["auto", "bf16", "fp16", "fp8"] = "auto"

    @model_validator(mode="after")
    def _known(self) -> "ModelConfig":
        if self.hf_config is None:  # a config.json names its own architecture; only a bare name must be known
            if self.name is None:
                self.name = DEFAULT_MODEL
            load_model(self.name)  # ValueError listing the catalog
        return self


class HardwareConfig(StrictModel):
    """The GPU of one instance and its parallelism (lab/costmodel/parallel.py; vLLM's argument names)."""

    # gpu_catalog comes first: validated before gpu, so gpu may name one of its GPUs
    gpu_catalog: str | None = Field(None, description="a YAML file of user GPUs (fields as lab/catalog/hardware.yaml), "
                                    "relative to the experiment file")
    gpu: str = Field("H100-SXM5-80GB", description="a GPU name (packaged, or from gpu_catalog), or a mapping that "
                     "describes one: name plus the fields of a lab/catalog/hardware.yaml entry")
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1, description="pipeline stages per instance")
    expert_parallel_size: int = Field(1, ge=1, description="GPUs the MoE experts are split over (= TP x DP)")
    data_parallel_size: int = Field(1, ge=1, description="attention DP ranks sharing the experts; one instance each")
    data_parallel_lock_step: bool | None = Field(
        None, description="DP ranks step together (slowest rank sets the pace, idle ranks run a dummy batch); "
        "default: on with expert parallelism (data_parallel_size > 1 and expert_parallel_size > 1), as vLLM does")
    all2all_backend: Literal["allgather_reducescatter", "naive", "deepep_high_throughput", "deepep_low_latency"] = Field(
        "allgather_reducescatter", description="vLLM --all2all-backend: how the MoE dispatch/combine moves tokens "
        "between the expert-parallel GPUs (lab/costmodel/comm.py ep_dispatch_combine); vLLM's default")
    link_gbps: float | None = Field(None, gt=0, description="override the catalog's per-GPU link bandwidth (GB/s)")
    link_latency_us: float = Field(10.0, ge=0, description="collective latency per call (µs)")

    @field_validator("gpu_catalog")
    @classmethod
    def _read_gpu_catalog(cls, v: str | None, info: ValidationInfo) -> str | None:
        """Register the file's GPUs (lab/costmodel/hardware.py ``load_gpu_catalog``); the path is kept absolute."""
        if v is None:
            return v
        ctx = info.context or {}
        path = expand_path(v, Path(ctx.get("data_dir") or default_data_dir()), Path(ctx.get("base_dir") or Path.cwd()),
                           "hardware.gpu_catalog")
        load_gpu_catalog(path)  # GPUCatalogError (a ValueError): one line naming the file, the GPU and the field
        return str(path)

    @field_validator("gpu", mode="before")
    @classmethod
    def _known_gpu(cls, v: Any, info: ValidationInfo) -> Any:
        """A name must be known (packaged or from gpu_catalog); a mapping describes a GPU (``name`` plus catalog
        fields), registered under its name, which the field then holds."""
        if isinstance(v, dict):
            name = v.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError("a GPU described here needs 'name' (and the fields of a lab/catalog/hardware.yaml "
                                 "entry)")
            source = (info.context or {}).get("source", "<experiment>")
            register_gpu(name, {k: x for k, x in v.items() if k != "name"}, "", f"{source} (hardware.gpu)")
            return name
        if isinstance(v, str) and "gpu_catalog" in info.data:  # (a bad catalog is reported on its own)
            load_hardware(v)  # ValueError listing the catalog
        return v


class CPUOverheadConfig(StrictModel):
    """CPU time of one engine step (scheduling, input preparation, sampling, output processing), seconds:
    base + per_seq · sequences + per_token · tokens + per_new_request · requests the step's schedule admits (new or
    resumed). Defaults: base and per_seq are a linear fit of Vidur's measured per-iteration CPU overheads
    (tests/test_engine_calibration.py refits them from the shared CSV); per_token and per_new_request have no
    measured figure and default to 0 (docs/fidelity.md, "Front-end and CPU overhead"). Under async scheduling the
    CPU time overlaps the step in flight and shows only when longer (lab/engine/instance.py ``price_step``)."""

    base_s: float = Field(8.9e-4, ge=0)
    per_seq_s: float = Field(3.75e-5, ge=0)
    per_token_s: float = Field(0.0, ge=0)
    per_new_request_s: float = Field(0.0, ge=0, description="per request admitted by the step's schedule")


class FrontendConfig(StrictModel):
    """The API server between the client and the engine (lab/cluster/frontend.py), seconds. ``request_s`` +
    ``per_prompt_token_s`` · prompt tokens pass between the client's send and the engine's queue entry (HTTP
    parsing, chat template, tokenization, the hop to the engine core); ``per_output_token_s`` passes between the
    engine emitting an output and the client receiving it (detokenization, the SSE chunk). Client TTFT = that
    time in + engine TTFT + ``per_output_token_s``. Unset: the public measurements of vLLM's API server for
    ``engine.vllm_version`` (lab/cluster/frontend.py ``FRONTEND_DEFAULTS``; docs/fidelity.md); the LLMServingSim
    validation runs measure from the engine's queue entry and set all three to 0."""

    request_s: float | None = Field(None, ge=0, allow_inf_nan=False, description="default: 0.0102 (vLLM PR #54628)")
    per_prompt_token_s: float | None = Field(None, ge=0, allow_inf_nan=False,
                                             description="default: 1e-5 (HF tokenizers, tt-inference-server #2173)")
    per_output_token_s: float | None = Field(None, ge=0, allow_inf_nan=False, description="default: 0")


class EngineConfig(StrictModel):
    """vLLM engine arguments (same names and defaults as vLLM 0.33's API server; the two batch limits default to
    vLLM's values for the experiment's GPU, see lab/experiment/resolve.py ``batch_defaults``)."""

    max_num_batched_tokens: int | None = Field(None, ge=1, description="default: vLLM's for the GPU")
    max_num_seqs: int | None = Field(None, ge=1, description="default: vLLM's for the GPU")
    max_model_len: int | None = Field(None, ge=2, description="default: the model's max_position_embeddings")
    block_size: int = Field(16, ge=1)
    num_gpu_blocks: int | None = Field(None, ge=2, description="measured block count; default: derived")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="default: 0.92 (0.33), 0.9 before")
    enable_chunked_prefill: bool | None = Field(
        None, description="default: true; vllm_version 0.6 (V0): true only above a 32K max_model_len")
    enable_prefix_caching: bool | None = Field(None, description="default: true; vllm_version 0.6 (V0): false")
    disable_hybrid_kv_cache_manager: bool = Field(
        False, description="vLLM --disable-hybrid-kv-cache-manager: a hybrid model's sliding-window and chunked "
        "layers keep KV for every token, as full attention (docs/hybrid_models.md)")
    long_prefill_token_threshold: int = Field(0, ge=0)
    max_num_partial_prefills: int = Field(
        1, ge=1, description="vLLM V0 (vllm_version 0.6): prompts in chunked prefill at once (1 = off); V1 never "
        "enforced it")
    max_long_partial_prefills: int = Field(
        1, ge=1, description="vLLM V0: of those, prompts longer than long_prefill_token_threshold (default then 4 % "
        "of max_model_len)")
    skip_blocked_waiting: int = Field(
        0, ge=0, description="waiting requests admission may pass over in one step when the one in front cannot be "
        "admitted; 0 = head-of-line blocking, as every vLLM and SGLang")
    priority_preemption: Literal["none", "max_num_seqs", "v0"] | None = Field(
        None, description="what a higher-priority waiting request does to running ones (policy.queue priority); "
        "default: v0 for vllm_version 0.6, none after")
    draft_slot_budget: Literal["per_request", "reserved"] | None = Field(
        None, description="how a draft model's extra slot per request is charged to the token budget; default: "
        "per_request (0.33), reserved (before)")
    scheduler_reserve_full_isl: bool | None = Field(None, description="default: True (0.19 and later)")
    watermark: float = Field(0.0, ge=0, lt=1)
    async_scheduling: bool | None = Field(None, description="default: True (0.19 and later)")
    cudagraph: bool = Field(True, description="pad steps to CUDA-graph capture sizes (vLLM default)")
    cudagraph_capture_sizes: list[int] | None = Field(None, description="default: vLLM's list up to "
                                                      "min(2 x max_num_seqs, 512)")

    @field_validator("cudagraph_capture_sizes")
    @classmethod
    def _positive_sizes(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(x < 1 for x in v):
            raise ValueError(f"every CUDA-graph capture size must be >= 1 (a token count)")
        return v
    cpu_overhead: CPUOverheadConfig = CPUOverheadConfig()
    vllm_version: Literal["0.33", "0.19", "0.11", "0.6"] = Field("0.33", description="behaviour set of this vLLM era "
                                                                 "(0.6: the V0 engine)")
    attention_backend: Literal["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLASH_ATTN_MLA", "FLASHMLA", "TRITON_MLA",
                               "CUTLASS_MLA", "FLASHINFER_MLA"] | None = Field(
        None, description="vLLM --attention-backend: the attention kernels the operator cost model prices "
        "(lab/costmodel/attention.py); default: the one vLLM of vllm_version picks for the GPU and model")
    moe_backend: Literal["triton", "deep_gemm", "cutlass", "flashinfer_cutlass", "flashinfer_trtllm"] | None = Field(
        None, description="vLLM --moe-backend: the fused-MoE kernels the operator cost model prices "
        "(lab/costmodel/moe_backends.py); default: vLLM's choice for the weight format, GPU and version")
    kv_offloading_size: float | None = Field(
        None, ge=0, description="GiB of CPU memory for KV blocks, over all GPUs of an instance (vLLM "
        "--kv-offloading-size); unset or 0 = no CPU tier (docs/kv_offloading.md)")
    kv_offloading_backend: Literal["native", "lmcache"] = Field(
        "native", description="native: vLLM's OffloadingConnector (vLLM --kv-offloading-backend)")

    @field_validator("kv_offloading_backend")
    @classmethod
    def _native_backend(cls, v: str) -> str:
        if v == "lmcache":
            raise ValueError("'lmcache' is not modelled: LMCache loads its hits synchronously, layer by layer, in "
                             "256-token chunks, which the native model would misstate; use 'native' (vLLM's "
                             "OffloadingConnector; docs/kv_offloading.md)")
        return v

    @field_validator("vllm_version", mode="before")
    @classmethod
    def _version_as_text(cls, v):
        return str(v) if isinstance(v, (int, float)) else v

    @model_validator(mode="after")
    def _partial_prefills(self) -> "EngineConfig":
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                             f"max_num_partial_prefills ({self.max_num_partial_prefills}), as vLLM requires")
        return self

    def prefix_caching(self) -> bool:
        """``enable_prefix_caching`` as in force: its value, else the era's default (off in V0, on in V1)."""
        if self.enable_prefix_caching is not None:
            return self.enable_prefix_caching
        return self.vllm_version != "0.6"

    def chunked_prefill(self, max_model_len: int) -> bool:
        """``enable_chunked_prefill`` as in force for a ``max_model_len``: its value, else on in V1 and, in V0 (vLLM
        0.6 ``EngineArgs.create_engine_config``), only for a ``max_model_len`` above 32K."""
        if self.enable_chunked_prefill is not None:
            return self.enable_chunked_prefill
        return self.vllm_version != "0.6" or max_model_len > 32768


class PreemptionConfig(StrictModel):
    """How a running request is preempted when KV runs out, who is chosen, and where it is requeued."""

    mode: Literal["recompute", "swap"] = "recompute"
    victim: Literal["auto", "last", "lowest_priority", "most_kv", "least_progress"] = "auto"
    requeue: Literal["auto", "head", "tail"] = "auto"
    swap_space_gb: float = Field(4.0, gt=0, description="CPU swap space per GPU (GiB; vLLM V0 swap_space)")


class PolicyConfig(StrictModel):
    """The scheduling policy (``servelab policies`` lists them), its queue order, preemption and options.

    ``options`` are the scheduler's own settings; each scheduler validates them (unknown keys are errors) and
    docs/policies.md lists them.
    """

    scheduler: str = "vllm_v1"
    queue: Literal["fcfs", "priority"] = "fcfs"
    preemption: PreemptionConfig = PreemptionConfig()
    options: dict[str, Any] = Field(default_factory=dict)


class EfficiencyConfig(StrictModel):
    """Overrides of the roofline's achievable fractions and latencies (lab/costmodel/roofline.py)."""

    gemm_compute: float | None = Field(None, gt=0, le=1)
    gemm_memory: float | None = Field(None, gt=0, le=1)
    attention_compute: float | None = Field(None, gt=0, le=1)
    attention_memory: float | None = Field(None, gt=0, le=1)
    elementwise_memory: float | None = Field(None, gt=0, le=1)
    link: float | None = Field(None, gt=0, le=1)
    kernel_launch_s: float | None = Field(None, ge=0)
    allreduce_latency_s: float | None = Field(None, ge=0)
    step_overhead_s: float | None = Field(None, ge=0)


class HandOffConfig(StrictModel):
    """Where a pool's requests go next, with their computed state (lab/cluster/cluster.py)."""

    to: str = Field(description="name of the target pool")
    after_output_tokens: int = Field(1, ge=1, description="output tokens produced in this pool before leaving")
    delay_s: float = Field(0.0, ge=0, description="seconds between leaving this pool and arriving in the next")


class _PoolSections(StrictModel):
    """What a pool (or a disaggregated role) changes: experiment sections merged over the experiment's own, and
    its router."""

    hardware: dict[str, Any] = Field(default_factory=dict)
    engine: dict[str, Any] = Field(default_factory=dict)
    policy: dict[str, Any] = Field(default_factory=dict)
    cost_model: dict[str, Any] = Field(default_factory=dict)
    router: str | None = Field(None, description="router among its instances (default: cluster.router)")
    router_options: dict[str, Any] | None = None


class PoolConfig(_PoolSections):
    """One pool of a multi-pool deployment: its instance count, where its requests go next, and the experiment
    sections it changes (each is merged over the experiment's own section of that name)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    num_instances: int = Field(1, ge=1)
    hand_off: HandOffConfig | None = None


class PDRoleConfig(_PoolSections):
    """The prefill or the decode side of a disaggregated deployment: how many instances, and the experiment
    sections it changes (merged over the experiment's own, as a pool's are)."""

    count: int = Field(1, ge=1, description="instances of this role")


class TransferConfig(StrictModel):
    """The KV transfer from P to D (lab/cluster/transfer.py; docs/disaggregation.md says where defaults come
    from)."""

    protocol: Literal["pull"] = Field("pull", description="pull: D reads P's pinned blocks (vLLM NIXL)")
    link: Literal["nvlink", "rdma", "pcie"] = Field("rdma", description="what carries the bytes: NVLink within a "
                                                    "node, an RDMA NIC per GPU between nodes, or PCIe")
    bandwidth_gbps: float | None = Field(None, gt=0, description="per-GPU link bandwidth (GB/s); default: the "
                                         "catalog's NVLink or PCIe figure, 50 GB/s (400 Gb/s) for RDMA")
    latency_us: float = Field(5.0, ge=0, description="one-way link latency")
    handshake_ms: float = Field(1.0, ge=0, description="per-request transfer setup and completion notice")
    per_block_us: float = Field(2.0, ge=0, description="per-block descriptor overhead")
    handover_ms: float = Field(20.0, ge=0, description="sequential router: P's output processing and the router's "
                               "turnaround before it dispatches to D")
    router: Literal["sequential", "parallel"] = Field(
        "sequential", description="sequential: the router sends the request to P, waits for P's response, then to "
        "D (vLLM's toy proxy); parallel: to P and D at once, P prefills after the P-D bootstrap and hands the KV "
        "straight to D (SGLang's router)")
    dispatch_ms: float = Field(0.0, ge=0, description="the router's hop to an instance, per dispatch (to P at "
                               "arrival; to D after P, sequential router)")
    bootstrap_ms: float = Field(0.0, ge=0, description="parallel router: the P-D bootstrap handshake a request "
                                "waits for before P may prefill it (SGLang's bootstrap queue)")
    first_token: Literal["decode_recomputes", "with_kv", "from_prefill"] = Field(
        "decode_recomputes", description="decode_recomputes: D recomputes the last prompt token and samples the "
        "first token, P's is discarded (vLLM NIXL); with_kv: P's first token travels with the KV and D emits it "
        "when the KV has arrived (SGLang); from_prefill: P's first token is the request's first output (DistServe)")
    kv_lease_s: float = Field(30.0, gt=0, description="P frees pinned blocks not read by then; D recomputes")
    transfer_drafter_kv: bool = Field(True, description="send the speculative drafter's KV too (vLLM does for "
                                      "EAGLE, EAGLE-3 and MTP)")

    def hand_off_s(self) -> float:
        """Seconds between P's last step and the request's arrival at D: the handover and the router's dispatch to
        D (sequential router), none with the parallel router (D already has the request)."""
        return (self.handover_ms + self.dispatch_ms) * 1e-3 if self.router == "sequential" else 0.0

    def entry_s(self) -> float:
        """Seconds between the request's arrival and its queue entry on P: the router's dispatch, and with the
        parallel router the P-D bootstrap."""
        return (self.dispatch_ms + (self.bootstrap_ms if self.router == "parallel" else 0.0)) * 1e-3


class DeploymentConfig(StrictModel):
    """Colocated (the default: ``cluster`` or ``pools``) or prefill/decode disaggregated."""

    mode: Literal["colocated", "disaggregated"] = "colocated"
    prefill: PDRoleConfig | None = None
    decode: PDRoleConfig | None = None
    transfer: TransferConfig = TransferConfig()

    @model_validator(mode="after")
    def _roles(self) -> "DeploymentConfig":
        if self.mode == "disaggregated" and (self.prefill is None or self.decode is None):
            raise ValueError("mode 'disaggregated' needs both 'prefill' and 'decode'")
        if self.mode == "colocated" and (self.prefill is not None or self.decode is not None):
            raise ValueError("'prefill' / 'decode' are for mode 'disaggregated'")
        return self


class ClusterConfig(StrictModel):
    """Several identical instances behind a router (one pool; ``pools`` describes several)."""

    num_instances: int = Field(1, ge=1)
    router: str = "round_robin"
    router_options: dict[str, Any] = Field(default_factory=dict)


class CostModelConfig(StrictModel):
    """Where step times come from: ``roofline`` (analytic), ``llmservingsim_profile`` (measured layer tables) or
    ``operator`` (per-operator: measured tables, fitted curves, roofline; see docs/costmodel.md)."""

    kind: Literal["roofline", "llmservingsim_profile", "operator"] = "roofline"
    profile_dir: str | None = None
    use_skew: bool = True
    efficiency: EfficiencyConfig = EfficiencyConfig()
    tables: list[str] = Field(default_factory=list, description="operator: measured profile folders of this GPU")
    coefficients: str | None = Field(None, description="operator: fitted-curve file (default: the shipped one)")
    moe_imbalance: float = Field(1.0, ge=1.0, description="operator: busiest / mean routed-expert load")
    cpu_launch_us: float = Field(6.0, ge=0, description="operator: host time per kernel launch in eager mode (µs)")

    @model_validator(mode="after")
    def _profile_needed(self) -> "CostModelConfig":
        if self.kind == "llmservingsim_profile" and not self.profile_dir:
            raise ValueError("kind 'llmservingsim_profile' needs 'profile_dir'")
        return self


class AcceptanceDistribution(StrictModel):
    """Per-request acceptance rates: each request draws its own i.i.d. rate (seeded)."""

    kind: Literal["beta", "uniform", "constant"] = "beta"
    mean: float = Field(0.7, gt=0, lt=1, description="beta: mean rate")
    concentration: float = Field(20.0, gt=0, description="beta: alpha + beta (larger = less spread)")
    low: float = Field(0.5, ge=0, le=1, description="uniform: lowest rate")
    high: float = Field(0.9, ge=0, le=1, description="uniform: highest rate")
    value: float = Field(0.7, ge=0, le=1, description="constant: the rate")

    @model_validator(mode="after")
    def _range(self) -> "AcceptanceDistribution":
        if self.kind == "uniform" and self.low > self.high:
            raise ValueError(f"low ({self.low}) must not exceed high ({self.high})")
        return self


class AcceptanceConfig(StrictModel):
    """How many drafts the target accepts (lab/core/speculation.py).

    ``default``: the published figures for the method and model (lab/experiment/speculative.py names the source);
    ``per_position``: conditional rates p_1..p_k (draft i accepted with p_i given 1..i-1 were); ``iid``: one rate
    for every position; ``per_request``: each request's own i.i.d. rate, from the trace's ``acceptance_rate``
    column when it has one, else drawn from ``distribution``.
    """

    kind: Literal["default", "per_position", "iid", "per_request"] = "default"
    rates: list[float] | None = Field(None, description="per_position: conditional acceptance of draft 1, 2, ...")
    rate: float | None = Field(None, ge=0, le=1, description="iid: acceptance of every draft")
    distribution: AcceptanceDistribution = AcceptanceDistribution()

    @model_validator(mode="after")
    def _needed(self) -> "AcceptanceConfig":
        if self.kind == "per_position":
            if not self.rates:
                raise ValueError("kind 'per_position' needs 'rates' (a list of probabilities)")
            bad = [p for p in self.rates if not 0 <= p <= 1]
            if bad:
                raise ValueError(f"rates must be probabilities in [0, 1], got {bad}")
        if self.kind == "iid" and self.rate is None:
            raise ValueError("kind 'iid' needs 'rate' (a probability)")
        return self


class SpeculativeConfig(StrictModel):
    """Speculative decoding, as vLLM's ``--speculative-config`` names it (docs/speculative.md)."""

    method: Literal["ngram", "eagle", "eagle3", "draft_model", "mtp"]
    num_speculative_tokens: int = Field(ge=1, le=64, description="k: drafts proposed per step")
    model: str | None = Field(None, description="draft_model: the draft model's catalog name")
    hf_config: str | None = Field(None, description="draft_model: a Hugging Face config.json instead of a name")
    draft_tensor_parallel_size: int | None = Field(None, ge=1, description="draft_model: default the target's TP")
    draft_vocab_size: int = Field(32000, ge=1, description="eagle3: vocabulary of the drafter's own LM head")
    prompt_lookup_min: int = Field(2, ge=1, description="ngram: shortest n-gram matched (recorded only)")
    prompt_lookup_max: int = Field(5, ge=1, description="ngram: longest n-gram matched (recorded only)")
    ngram_hit_probability: float | None = Field(None, ge=0, le=1, description="ngram: chance a step finds a "
                                                "match and proposes drafts (default: docs/speculative.md)")
    ngram_cpu_us_per_request: float = Field(20.0, ge=0, description="ngram: CPU lookup time per request per step")
    disable_padded_drafter_batch: bool = Field(
        False, description="vLLM's serial proposer: the host waits for the verify and launches each drafter pass "
        "(lab/costmodel/spec_step.py); turns async scheduling off, as vLLM does")
    acceptance: AcceptanceConfig = AcceptanceConfig()

    @field_validator("method", mode="before")
    @classmethod
    def _mtp_alias(cls, v: Any) -> Any:
        """vLLM rewrites ``deepseek_mtp`` and every other ``*_mtp`` name to ``mtp`` (config/speculative.py)."""
        return "mtp" if isinstance(v, str) and v.endswith("_mtp") else v

    @model_validator(mode="after")
    def _draft_model(self) -> "SpeculativeConfig":
        if self.method == "draft_model" and not (self.model or self.hf_config):
            raise ValueError("method 'draft_model' needs 'model' (a catalog name) or 'hf_config'")
        if self.method != "draft_model" and (self.model or self.hf_config):
            raise ValueError(f"'model' / 'hf_config' name a draft model; method {self.method!r} does not use one")
        if self.method == "ngram" and self.disable_padded_drafter_batch:
            raise ValueError("disable_padded_drafter_batch is for model drafters (eagle, eagle3, mtp, draft_model); "
                             "the n-gram proposer always works on the host")
        if self.method != "draft_model" and self.draft_tensor_parallel_size is not None:
            raise ValueError(f"draft_tensor_parallel_size is for method 'draft_model'; the {self.method} drafter "
                             "runs at the target's tensor_parallel_size")
        if self.model and not self.hf_config:
            load_model(self.model)  # ValueError listing the catalog
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        return self


class SimulationConfig(StrictModel):
    """Run control."""

    horizon_s: float | None = Field(None, gt=0, description="stop at this simulated time; the rest is unfinished")
    record_events: bool | None = Field(None, description="keep each request's lifecycle events; default: on up to "
                                       "200,000 requests")
    step_log: Literal["auto", "memory", "spill"] = Field("auto", description="where a full step log keeps its rows: "
                                                         "memory (all of them), or spill (auto, spill: the run "
                                                         "holds at most 1,048,576 rows, 65,536 or more per instance; "
                                                         "older ones go to an Arrow file)")
    fast_forward: bool = Field(True, description="advance stretches of identical decode steps in one exact jump")
    progress: bool = True


class ValidationConfig(StrictModel):
    """Measured per-request timings to compare with (``servelab validate``)."""

    measured: str
    format: Literal["llmservingsim", "vllm_bench"] = "llmservingsim"
    timeseries: str | None = Field(None, description="measured 1-s series; llmservingsim: default timeseries.csv "
                                   "beside the measured file")
    num_gpu_blocks: int | None = Field(None, ge=1, description="measured block count; llmservingsim: default from "
                                       "meta.json beside the measured file")


# Bounds above which an SLO in seconds was most likely typed in milliseconds (a TTFT of minutes, a TPOT of a second).
SLO_PLAUSIBLE_S = {"ttft_s": 60.0, "tpot_s": 1.0, "e2el_s": 3600.0}


def implausible_slo_bounds(slo: Any) -> list[str]:
    """Notes for SLO bounds that look like milliseconds typed into a seconds field, e.g. ``slo.ttft_s is 500 s``.

    Args:
        slo: an object with ``ttft_s``, ``tpot_s``, ``e2el_s`` (seconds or None).
    """
    return [f"slo.{name} is {getattr(slo, name):g} s (SLO bounds are in seconds: 0.5 = 500 ms)"
            for name, top in SLO_PLAUSIBLE_S.items()
            if getattr(slo, name, None) is not None and getattr(slo, name) > top]


class SLOConfig(StrictModel):
    """Service-level objectives for goodput and SLO attainment (seconds; unset = not checked)."""

    ttft_s: float | None = Field(None, gt=0)
    tpot_s: float | None = Field(None, gt=0)
    e2el_s: float | None = Field(None, gt=0)


PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


class OutputConfig(StrictModel):
    """What a run writes. ``percentile_metrics`` and ``metric_percentiles`` are ``vllm bench serve``'s options of
    the same names (comma-separated strings, as on its command line): which latency metrics get percentile keys
    (``p99_ttft_ms``, ...) in bench_result.json and the console block, and which percentiles. vLLM's own defaults
    are ``ttft,tpot,itl`` and ``99``; servelab's default is every metric at 50, 90 and 99 (a superset, so a
    dashboard that reads vLLM's keys finds them)."""

    dir: str | None = None
    plots: bool = True
    step_log: Literal["full", "summary"] = Field("full", description="full: one row per engine step (steps.parquet, "
                                                 "time-series plot); summary: no per-step rows, only the running "
                                                 "totals the summary needs (sweeps); every other output is identical")
    percentile_metrics: str = "ttft,tpot,itl,e2el"
    metric_percentiles: str = "50,90,99"
    save_detailed: bool = Field(False, description="bench_result.json with vllm bench serve --save-detailed's "
                                "per-request lists (ttfts, itls, ...); off: the aggregates only")

    @field_validator("percentile_metrics")
    @classmethod
    def _known_metrics(cls, v: str) -> str:
        names = [m.strip() for m in v.split(",") if m.strip()]
        bad = [m for m in names if m not in PERCENTILE_METRICS]
        if not names or bad:
            raise ValueError(f"expected a comma-separated subset of {','.join(PERCENTILE_METRICS)}, got {v!r}")
        return ",".join(names)

    @field_validator("metric_percentiles")
    @classmethod
    def _percentiles_in_range(cls, v: str) -> str:
        try:
            ps = [float(p) for p in v.split(",") if p.strip()]
        except ValueError:
            ps = []
        if not ps or any(not 0 < p < 100 for p in ps):
            raise ValueError(f"expected comma-separated percentiles strictly between 0 and 100, e.g. '50,90,99', "
                             f"got {v!r}")
        return v

    def percentiles(self) -> tuple[float, ...]:
        """``metric_percentiles`` as numbers, e.g. (50.0, 90.0, 99.0)."""
        return tuple(float(p) for p in self.metric_percentiles.split(",") if p.strip())

    def metrics(self) -> tuple[str, ...]:
        """``percentile_metrics`` as names, e.g. ("ttft", "tpot")."""
        return tuple(self.percentile_metrics.split(","))

