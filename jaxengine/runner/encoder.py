"""The image encoder's compiled step, and the device rows its outputs live in.

A vision-language model's runner holds one ``[rows, hidden]`` array of image
embeddings (``images``, the encoder cache's device side). The scheduler
(`core.encoder_cache`) assigns each image its rows; a step's `EncoderInput`s run here
before its forward (one compiled call per image, its inputs padded to the smallest
unit bucket: Idefics3 tiles 1, 2, 4, ...), each writing its rows in place (the array
is donated; a padded unit's rows point past the end and are dropped). The model step
then reads ``images[md.image_rows]`` at the image tokens (`runner.step.make_step`).

The encoder's parameters are replicated on every device of the tensor group (a
SigLIP tower is small next to the decoder), and so are the rows.

A compile-only runner (``abstract``: ``jaxengine tpu-check``) holds both as placed
shapes (`jax.ShapeDtypeStruct`s with the replicated sharding), as the decoder's
parameters are there: its compile jobs compile the encoder call for each unit bucket
through the store, and nothing is allocated or run on the devices.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.runner.buckets import default_token_buckets
from jaxengine.runner.executables import ExecutableStore, compile_ahead
from jaxengine.runner.program import abstract_like


class EncoderRunner:
    """Encodes scheduled images into their rows of ``images`` (see module doc)."""

    def __init__(
        self,
        encoder: Any,
        params: Any,
        num_rows: int,
        max_units: int,
        dtype: Any,
        sharding: Any = None,
        store: ExecutableStore | None = None,
        both_ways: bool = False,
        abstract: bool = False,
    ) -> None:
        """``encoder``: the family's image encoder (`models.idefics3.Idefics3ImageEncoder`);
        ``num_rows``: the encoder cache's size in embeddings; ``max_units``: the most
        units (tiles) one image takes; ``sharding``: where params and rows live
        (replicated over the tensor group; None: the default device); ``both_ways``: an
        image's tokens attend to each other both ways (Gemma 3: `chunk_fields`);
        ``abstract``: a compile-only runner (module doc): ``params`` are shapes
        (`loader.encoder_params.abstract_params`), `run` is never called."""
        self.encoder = encoder
        self.both_ways = both_ways
        self.mrope = bool(getattr(encoder, "mrope", False))
        """The decoder takes M-RoPE positions (Qwen2.5-VL): every batch carries them."""
        self.num_rows = num_rows
        self.store = store
        self.unit_buckets = default_token_buckets(max_units)
        rows = jax.ShapeDtypeStruct((num_rows, encoder.hidden_size), dtype)  # [rows, hidden]
        if abstract:
            self.params = jax.tree_util.tree_map(lambda x: _placed(x, sharding), params)
            self.images = _placed(rows, sharding)
        else:
            self.params = params if sharding is None else jax.device_put(params, sharding)
            self.images = jax.jit(lambda: jnp.zeros(rows.shape, dtype), out_shardings=sharding)()
        self._write = jax.jit(self._encode_into, donate_argnums=(1,))
        self._compiled: dict[int, Any] = {}
        self._rows: dict[str, np.ndarray] = {}  # key -> its rows, as last encoded
        self._owners: list[str | None] = [None] * num_rows  # the key each row holds

    def _encode_into(self, params, images, inputs, rows):
        out = self.encoder.apply(params, inputs)
        return images.at[rows].set(out.astype(images.dtype), mode="drop")

    def bucket(self, units: int) -> int:
        i = bisect.bisect_left(self.unit_buckets, units)
        if i == len(self.unit_buckets):
            raise ValueError(f"an image of {units} units exceeds the largest bucket")
        return self.unit_buckets[i]

    def compile_jobs(self) -> list:
        """(key, job) per unit bucket: compiles the encoder call for it."""
        return [(("encode", b), lambda b=b: self._precompile(b)) for b in self.unit_buckets]

    def _precompile(self, units: int) -> None:
        inputs, rows = self._arrays(None, units, ())
        images = abstract_like(self.images)
        self._compiled[units] = compile_ahead(
            self.store,
            "encoder",
            units,
            lambda: self._write.lower(self.params, images, inputs, rows),
        )

    def _arrays(self, inputs: Any, units: int, rows: Sequence[int]):
        padded = self.encoder.pad(inputs, units)
        out_rows = np.full(units * self.encoder.embeds_per_unit, self.num_rows, np.int32)
        out_rows[: len(rows)] = rows
        return padded, out_rows

    def chunk_fields(
        self, images: Sequence[tuple], start: int, n: int, grids: Sequence[tuple] = ()
    ) -> dict:
        """A request chunk's image fields (`batch.SeqChunk`) for positions ``[start,
        start + n)``: ``image_rows``, with ``both_ways`` ``attend_until`` (each
        image token sees up to its image's last token, which the scheduler keeps in
        the same chunk), and with an M-RoPE model's ``grids`` (the images' token
        grids) ``mrope_positions``."""
        fields = {"image_rows": self.image_rows(images, start, n)}
        if self.mrope and grids:
            fields["mrope_positions"] = self.encoder.mrope_positions(images, grids, start, n)
        if self.both_ways and fields["image_rows"] is not None:
            ends = np.arange(start, start + n, dtype=np.int32)
            for _, positions in images:
                first, last = positions[0], positions[-1]
                if first < start + n and last >= start:
                    ends[max(first, start) - start : min(last, start + n - 1) - start + 1] = last
            fields["attend_until"] = ends
        return fields

    def image_rows(self, images: Sequence[tuple], start: int, n: int) -> np.ndarray | None:
        """Each of positions ``[start, start + n)``'s row of ``images`` (-1: a text
        token), for a request whose images are ``(key, positions)`` pairs; None when
        no image fills any of them."""
        rows = None
        for key, positions in images:
            if positions[-1] < start or positions[0] >= start + n:
                continue
            pos = np.asarray(positions)
            inside = (pos >= start) & (pos < start + n)
            rows = np.full(n, -1, np.int32) if rows is None else rows
            rows[pos[inside] - start] = self._rows[key][inside]
        return rows

    def _own(self, key: str, rows: Sequence[int]) -> None:
        """Records ``key``'s rows, forgetting the keys whose rows it takes over."""
        for old in {self._owners[r] for r in rows} - {None, key}:
            del self._rows[old]
            self._owners = [None if o == old else o for o in self._owners]
        for r in rows:
            self._owners[r] = key
        self._rows[key] = np.asarray(rows, np.int32)

    def run(self, scheduled: Sequence[Any], ensure: Callable[[Any], None]) -> None:
        """Encodes each `EncoderInput` of a step into its rows, in order."""
        for item in scheduled:
            self._own(item.key, item.rows)
            units = self.bucket(item.units)
            ensure(("encode", units))
            inputs, rows = self._arrays(item.inputs, units, item.rows)
            compiled = self._compiled.get(units)
            if compiled is not None:
                self.images = compiled(self.params, self.images, inputs, rows)
            else:  # --enforce-eager
                self.images = self._write(self.params, self.images, inputs, rows)


def _placed(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    """``x``'s shape and dtype placed with ``sharding`` (None: unplaced)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
