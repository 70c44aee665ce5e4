"""Images in: the host side of vision-language models (no JAX).

A prompt with images goes through the model's own transformers processor
(`processor.ImageProcessor`: resizing, tiling, normalisation and the expansion of
each image's placeholder into its tokens are transformers'), which gives the prompt's
token ids and one `ImageItem` per image: its content hash, the prompt positions its
embeddings fill, and the encoder's inputs. The scheduler (`core.encoder_cache`)
decides when each image is encoded and where its embeddings live on the device; the
runner (`runner.encoder`) encodes them and the step reads them at those positions.

- `items`: `ImageItem`, image normalisation and content hashing.
- `processor`: the model's processor and each family's split of its outputs.
- `media`: images from URLs (data:, file:// under --allowed-local-media-path, http).
"""
