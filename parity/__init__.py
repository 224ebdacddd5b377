"""Parity with the real vLLM scheduler (issue 43): vLLM's own ``Scheduler`` beside servelab's ``vllm_v1`` policy and
paged KV cache, step for step, on random traces (docs/vllm_parity.md). Only ``parity.vllm_side`` imports vLLM."""
