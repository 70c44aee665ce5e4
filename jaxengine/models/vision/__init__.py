"""Vision encoders: preprocessed ``pixel_values`` -> the embeddings that replace a
prompt's image placeholder tokens in the decoder's input.

Pure Flax modules, applied as functions of their parameter trees, with parameter
names that follow the checkpoints (each encoder's static ``hf_param_path``, filled
by `loader.encoder_params`) and configs as frozen dataclasses (``from_hf``):

- `siglip`: the SigLIP vision transformer (patch embedding, learned positions,
  pre-LN encoder, post-LayerNorm) shared by the encoders below.
- `idefics3`: Idefics3 / SmolVLM (tiles, variable-resolution position buckets,
  pixel shuffle, ``modality_projection``).
- `gemma3`: Gemma 3 (average pooling to ``mm_tokens_per_image``, soft-embedding
  RMSNorm, ``mm_input_projection_weight``).
- `qwen2_5_vl`: Qwen2.5-VL (patch rows of any image shape, window and full attention
  by segment masks, 2-D rotary, patch merger); `qwen2_5_vl_inputs` is its host side
  (window layout, the decoder's M-RoPE positions; no jax).
- `qwen3_5`: Qwen3.5 (Qwen2.5-VL's patch projection, attention and rotary; LayerNorm
  blocks attending within each frame, a learned position table resampled bilinearly);
  `qwen3_5_inputs` is its host side (per-row layout; no jax).
- `gemma4`: Gemma 4 (patch rows at any aspect ratio, 2-D position table, axial rope,
  clippable linears, ``k x k`` pooling by patch coordinates, ``embed_vision``).

Nothing here imports the engine; the engine's image path calls these modules.
"""
