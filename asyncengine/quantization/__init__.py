"""Weight-only quantized linear layers: checkpoints from GPTQ, AWQ, FP8 and compressed-tensors, and int8
at load time.

* config.py: `quantization_config` -> a frozen QuantConfig (torch-free: the engine checks it up front);
* context.py: the method the linear layers being built take their weights from (layers/linear.py);
* method.py: what every method shares: the parameters' shard layout, the canonical form, the GEMM;
* gptq.py, awq.py, fp8.py, compressed.py, int8.py: each format's tensors and how they unpack;
* packing.py: int32 bit packing as the reference tools write it (GPTQ, AWQ's interleave, ...);
* canonical.py: one layout for every format (groups made contiguous, act-order folded into a
  permutation of the input), which the kernels take: cpu/quant_gemm.py (fused C), cuda/triton_quant_gemm.py,
  and a PyTorch fallback.

Importing this package loads nothing (modules are imported on use).
"""
