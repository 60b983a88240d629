"""Patch points for vLLM 0.33 (CUDA-like platforms; its CPU platform only in the stand-in tests).

The shared points (backend names, predicates, CUDA-graph decision, DeepEP managers, prepare/finalize
factory) are in patches_common; this release adds the communicator that builds the all2all manager.
"""

from typing import List

from .patch_points import PatchPoint
from .patches_common import BOUND_MODULES, common_points, communicator_builds_uccl_manager, has_parameter

__all__ = ["patch_points", "BOUND_MODULES"]

CUDA_COMMUNICATOR = "vllm.distributed.device_communicators.cuda_communicator"


def patch_points() -> List[PatchPoint]:
    return common_points() + [
        PatchPoint(f"{CUDA_COMMUNICATOR}:CudaCommunicator.__init__",
                   "chooses the All2AllManager by if/elif on the backend name and rejects unknown names",
                   apply=communicator_builds_uccl_manager, expect=has_parameter("use_all2all")),
    ]
