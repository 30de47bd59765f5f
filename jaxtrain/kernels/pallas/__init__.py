"""The Pallas providers: our FlashAttention-2 kernels, ``model.attention=pallas``.

``pallas_gpu`` (:mod:`.gpu`): the Triton lowering (:mod:`.flash_gpu`) on GPU, run in interpret mode on a
CPU (slow; for tests). ``pallas_tpu`` (:mod:`.tpu`): the Mosaic lowering (:mod:`.flash_tpu`) on TPU. Both
share the tiling and the online softmax (:mod:`.flash_common`). The Pallas front ends take ~0.1 s to
import, which a run that never calls them does not pay: the kernels are imported on first call.
"""
