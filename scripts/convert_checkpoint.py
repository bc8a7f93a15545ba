"""Converts a Hugging Face Llama-3 checkpoint (safetensors) into a mnemojax Orbax checkpoint.

    python scripts/convert_checkpoint.py --hf_dir DIR --output_dir OUT [--dtype auto|bfloat16|float32|float16]
        [--kvp 1 --spp 1 --tp 1] [--overwrite]

Reads the weights with `models.checkpoint.load_hf_params` onto the (kvp, spp, tp) mesh (the default 1x1x1 mesh
is one device; a larger mesh spreads the host memory of a big model over devices), writes them with
`models.orbax_io.save_params` together with `config.json`, and copies the tokenizer and generation files. The
result loads on any mesh with `models.orbax_io.restore_params`, or with `LLM(model=OUT)`.
`--dtype auto` (the default) keeps the checkpoint's own dtype when all its tensors share one.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from models.checkpoint import load_hf_params, stored_dtype  # noqa: E402
from models.config import LlamaConfig  # noqa: E402
from models.orbax_io import copy_tokenizer_files, save_params  # noqa: E402
from models.params import param_shapes  # noqa: E402
from shardings.mesh import make_mesh  # noqa: E402
from shardings.specs import ShardingTable  # noqa: E402

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "float16": np.dtype(np.float16)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf_dir", required=True, help="Hugging Face checkpoint directory (config.json, safetensors)")
    p.add_argument("--output_dir", required=True, help="new (or empty) directory for the Orbax checkpoint")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="stored parameter dtype; auto = the HF tensors' dtype (float32 if they differ)")
    p.add_argument("--kvp", type=int, default=1, help="mesh degree along kvp while converting")
    p.add_argument("--spp", type=int, default=1, help="mesh degree along spp while converting")
    p.add_argument("--tp", type=int, default=1, help="mesh degree along tp while converting")
    p.add_argument("--overwrite", action="store_true", help="replace an existing mnemojax checkpoint at output_dir")
    return p.parse_args(argv)


def even_spec(spec: P, shape: tuple[int, ...], mesh) -> P:
    """`spec` with the mesh axes that do not divide their dimension dropped (replicated there instead): the
    mesh here only spreads the conversion's memory, the checkpoint does not depend on it."""
    return P(*(axis if axis is None or shape[dim] % mesh.shape[axis] == 0 else None
               for dim, axis in enumerate(spec)))


def main(argv=None) -> str:
    """Runs the conversion for command-line `argv` (None: `sys.argv[1:]`); returns the output directory."""
    args = parse_args(argv)
    start = time.perf_counter()
    config = LlamaConfig.from_pretrained(args.hf_dir)
    dtype_name = stored_dtype(args.hf_dir) if args.dtype == "auto" else args.dtype
    mesh = make_mesh(args.kvp, args.spp, args.tp)
    specs = ShardingTable().params(config.tie_word_embeddings)
    shardings = jax.tree.map(lambda spec, shape: NamedSharding(mesh, even_spec(spec, shape, mesh)), specs,
                             param_shapes(config), is_leaf=lambda s: isinstance(s, P))

    params = load_hf_params(args.hf_dir, config, DTYPES[dtype_name], shardings)
    out = save_params(params, args.output_dir, config, overwrite=args.overwrite)
    copied = copy_tokenizer_files(args.hf_dir, out)

    count = sum(x.size for x in jax.tree.leaves(params))
    print(f"Converted {args.hf_dir} -> {out} in {time.perf_counter() - start:.1f} s: {count:,} parameters "
          f"({config.num_layers} layers, tie_word_embeddings={config.tie_word_embeddings}) stored as "
          f"{dtype_name}, saved from mesh kvp={args.kvp} x spp={args.spp} x tp={args.tp}")
    for name in sorted(os.listdir(out)):
        full = os.path.join(out, name)
        if os.path.isdir(full):
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(full) for f in files)
            print(f"  {name}/  {size:,} bytes")
        else:
            note = "  (copied)" if name in copied else ""
            print(f"  {name}  {os.path.getsize(full):,} bytes{note}")
    return out


if __name__ == "__main__":
    main()
