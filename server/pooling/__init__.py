"""A pooling model's APIs: /v1/embeddings, /pooling, Cohere's /v2/embed, /score,
/rerank and /classify (request bodies, handlers, routes)."""
