"""Grouped matmuls of quantized MoE experts (`reference`: the experts dequantized
whole, then `ragged_dot`; `tpu`: one Mosaic kernel that dequantizes each expert in
VMEM, so the quantized weights are read once a step and never widened in HBM): MXFP4
(gpt-oss) and block-scaled fp8 (DeepSeek-V3, Kimi K2), which differ only in the
decoding."""
