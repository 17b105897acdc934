"""A GGUF file into a model: converted once, then read back from the conversion cache
(conversion_cache.py); with `keep_quantized`, its quantized matmul weights stay in their blocks
(kept_quantized/gguf_kept.py), read from the file on every load, and the cache holds the other
parameters."""
from __future__ import annotations

import contextlib
import itertools
import logging
import time

import numpy as np
from jax.sharding import Mesh

from xlaserve.model.config.encoder_config import model_config_from_hf
from xlaserve.model.registry import model_class_check
from xlaserve.server_args import public_name
from xlaserve.weights.formats import gguf_file
from xlaserve.weights.kept_quantized import gguf_kept
from xlaserve.weights.conversion_cache import ConversionCache, ParamsWriter
from xlaserve.weights.param_layout import convert
from xlaserve.weights.placement import expected_parameters, place_model
from xlaserve.weights.tokenizer_files import load_tokenizer

logger = logging.getLogger(__name__)


def load_gguf(path: str, cache: ConversionCache | None, *, dtype, mesh: Mesh, progress: bool,
               tokenizer_path: str | None, need_tokenizer: bool, keep_quantized: bool,
               activations: str = "float32"):
    """(config, model, tokenizer) of a GGUF file: from its conversion cache entry, or converted
    (and cached, with the file's own tokenizer, when `cache` is given). `keep_quantized`: its
    quantized matmul weights stay in their blocks (kept_quantized/gguf_kept.py), read from the
    file on every load; the cache then holds the other parameters only. `activations`:
    gguf_kept.kept_weights'."""
    start = time.perf_counter()
    variant = gguf_kept.CACHE_VARIANT if keep_quantized else ""
    entry = cache.lookup(path, dtype, variant) if cache is not None else None
    if entry is not None:
        tokenizer = None
        if need_tokenizer:
            tokenizer = load_tokenizer(tokenizer_path or (entry.directory if entry.has_tokenizer
                                                          else path))
        tensors = entry.tensors()
        if keep_quantized:
            kept = gguf_kept.kept_weights(entry.config, gguf_file.GGUFSource(path), activations)
            tensors = itertools.chain(tensors, gguf_kept.placed(kept, mesh).items())
        model = place_model(entry.config, tensors, dtype=dtype, mesh=mesh, progress=progress)
        # INFO names the file, DEBUG says where things are on this machine (--log-level debug).
        logger.info("Loaded converted weights from cache: %s (%.1f s)", public_name(path),
                    time.perf_counter() - start)
        logger.debug("Conversion cache entry of %s: %s", path, entry.directory)
        return entry.config, model, tokenizer
    hf_config = gguf_file.load_hf_config(path)
    config = model_config_from_hf(hf_config, model_class_check(hf_config))
    # The tokenizer before the weights: a missing one fails at once, not after minutes of loading.
    # The file's own is converted for the cache even when another is used (it costs ~3 s once).
    own_tokenizer = None
    if cache is not None or (need_tokenizer and tokenizer_path is None):
        try:
            own_tokenizer = gguf_file.load_tokenizer(path)
        except Exception:  # noqa: BLE001 - some files carry none that transformers converts
            if need_tokenizer and tokenizer_path is None:
                raise
    tokenizer = None
    if need_tokenizer:
        tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else own_tokenizer
    source = gguf_file.GGUFSource(path)
    kept = gguf_kept.kept_weights(config, source, activations) if keep_quantized else {}
    tensors = convert(config, source, skip=frozenset(kept))
    kept_tensors = gguf_kept.placed(kept, mesh).items()
    if cache is None:
        model = place_model(config, itertools.chain(tensors, kept_tensors), dtype=dtype,
                            mesh=mesh, progress=progress)
        logger.info("Converted GGUF %s in %.1f s (conversion cache disabled)",
                    public_name(path), time.perf_counter() - start)
        return config, model, tokenizer
    abstract = expected_parameters(config, dtype, mesh)
    cached_shapes = {p: s.shape for p, s in abstract[1].items() if p not in kept}
    with cache.writing(path, dtype, config, variant) as directory, (
            contextlib.nullcontext() if directory is None else
            ParamsWriter(directory, cached_shapes, dtype)) as writer:
        if writer is not None:
            if own_tokenizer is not None:
                own_tokenizer.save_pretrained(directory)
            tensors = tee(tensors, writer, dtype)
        model = place_model(config, itertools.chain(tensors, kept_tensors), dtype=dtype,
                            mesh=mesh, progress=progress, abstract=abstract)
    logger.info("Converted GGUF %s in %.1f s; %s", public_name(path), time.perf_counter() - start,
                "not cached" if directory is None else "cached in the conversion cache")
    if directory is not None:
        logger.debug("Conversion cache entry of %s: %s", path,
                     cache.entry_dir(path, dtype, variant))
    return config, model, tokenizer


def tee(tensors, writer: ParamsWriter, dtype):
    """`tensors` in `dtype`, each written to the cache entry on its way to the device (as one
    contiguous copy, which both the file and the device take faster than a transposed view)."""
    for path, array in tensors:
        array = np.ascontiguousarray(array, dtype=dtype)
        writer.write(path, array)
        yield path, array
