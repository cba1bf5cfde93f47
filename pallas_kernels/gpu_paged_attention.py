"""GPU (Pallas, Triton lowering) paged attention: flash-decoding and ragged chunked prefill.

The kernels live in ``gpu_decode`` and ``gpu_prefill`` (each under ~300 lines) and share the
tile loop in ``gpu_paged_common``; this module is the one place to import them from.
"""

from pallas_kernels.gpu_decode import paged_decode_attention_gpu
from pallas_kernels.gpu_prefill import ragged_paged_attention_gpu

__all__ = ["paged_decode_attention_gpu", "ragged_paged_attention_gpu"]
