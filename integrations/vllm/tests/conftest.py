"""Tests of the vLLM plugin; run in vLLM's own environment (integrations/vllm/ci.sh builds one).

vLLM picks its platform once, from the environment: these tests use its CPU platform.
"""

import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_DEEPEP_BUFFER_SIZE_MB", "1")   # the Buffer's NVLink-size buffer, unused on CPU
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # _ranks, _scenarios (also in spawned ranks)
