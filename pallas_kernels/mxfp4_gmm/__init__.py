"""The MXFP4 grouped matmul of gpt-oss's experts (`reference`; `tpu`: dequantized in
VMEM, so the 4-bit weights are read once a step and never widened in HBM)."""
