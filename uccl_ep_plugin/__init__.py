"""uccl-ep-plugin: expert-parallel dispatch/combine with DeepEP's API on any GPU and NIC."""

import torch

from .buffer import Buffer
from .build_info import build_info
from .dispatch_config import Config
from .engines.reference import CommTimeoutError
from .event_overlap import EventOverlap
from .proxies import destroy_uccl, initialize_uccl

topk_idx_t = torch.int64

__all__ = ["Buffer", "Config", "EventOverlap", "CommTimeoutError", "build_info", "destroy_uccl", "initialize_uccl",
           "topk_idx_t"]
__version__ = "0.1.0"
