"""Profile N engine steps: device time per kernel, launches per step, device busy against wall time.

Builds an `LLMEngine` (random weights of a preset), compiles every step shape, brings `--batch` requests with
`--context`-token prompts to decoding (or, with `--prefill_chunk`, keeps one request in chunked prefill at that
context), then records `--steps` steps of `LLMEngine.step` with `jax.profiler` and reads the trace with jax's
`ProfileData` (no TensorBoard needed):

    python scripts/profile_step.py --model llama3.2-1b --dtype bfloat16 --batch 32 --context 4096 --steps 20
    python scripts/profile_step.py --model llama3-8b --dtype bfloat16 --batch 1 --context 4096
    python scripts/profile_step.py --model tiny --batch 4 --context 64 --steps 5      # anywhere, a CPU included

On a GPU the kernels are the events of the device's streams (`/device:GPU:0`); on a CPU, XLA's thunks on its
client threads. Prints the command and the device, a table of the kernels by time (name, calls per step, ms per
step, share of device time), and per step: kernel launches, device busy time (the union of the kernels'
intervals), the step's wall time, and busy / wall.
"""
from __future__ import annotations

import argparse
import shlex
import sys

from mnemojax.bench.trace import StepProfile, profile_calls
from models.kernels import ATTENTION_IMPLS


def profile_steps(engine, steps: int, trace_dir: str | None = None) -> StepProfile:
    """Records `steps` calls of `engine.step()` and summarises the trace."""
    import jax

    def idle():  # a step without a sampled token returns before its work is done: wait for the last step's cache
        jax.block_until_ready((engine.executor.k_cache, engine.executor.v_cache))

    return profile_calls(engine.step, steps, idle, trace_dir)


def build_engine(args):
    """The engine of the workload, compiled, its requests past their prompts (or one request mid-prefill)."""
    from mnemojax.engine.llm_engine import EngineConfig, LLMEngine
    from mnemojax.scheduling.sampling_params import SamplingParams

    page = args.page_size
    if args.prefill_chunk:  # one request whose prompt is still being prefilled, `context` tokens in
        steps_room = args.steps + 8
        total = args.context + args.prefill_chunk * (args.steps + 4)
        batch, budget, chunk = 1, args.prefill_chunk, args.prefill_chunk
    else:  # the first requests decode while the later ones prefill: room for those steps too
        batch, budget, chunk = args.batch, max(args.batch, min(args.context, 4096)), min(args.context, 4096)
        steps_room = args.steps + 8 + -(-batch * args.context // (budget - batch + 1))
        total = args.context + steps_room
    pages = batch * -(-total // page) + 2
    config = EngineConfig(model=args.model, dtype=args.dtype, attention=args.attention, page_size=page,
                          num_pages=pages, max_model_len=-(-total // page) * page, max_num_seqs=max(batch, 8),
                          max_num_batched_tokens=budget, chunk_size=chunk, precompile=True)
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=steps_room if not args.prefill_chunk else 1, temperature=0, ignore_eos=True)
    vocab = min(engine.model_config.vocab_size, 256)
    for i in range(batch):
        engine.add_request([(i * 7 + j) % vocab for j in range(total - steps_room if not args.prefill_chunk
                                                               else total - 1)], params)
    # Decode: run the prompts through. Prefill: bring the request to `context` computed tokens.
    while True:
        reqs = list(engine.scheduler.running)
        if args.prefill_chunk and reqs and reqs[0].num_computed >= args.context:
            break
        if not args.prefill_chunk and len(reqs) == batch and all(r.output_token_ids for r in reqs):
            engine.step()  # one more: every request has a token in flight
            break
        engine.step()
    return engine


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--attention", default="auto", choices=ATTENTION_IMPLS)
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens of each sequence")
    p.add_argument("--prefill_chunk", type=int, default=0,
                   help="profile one request prefilling chunks of this many tokens at `context` instead")
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=25, help="kernels listed")
    p.add_argument("--trace_dir", default=None, help="keep the trace here (default: a temporary folder)")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    import jax

    from mnemojax.bench.attention import hardware

    print("command: " + " ".join(["python", "scripts/profile_step.py"]
                                 + [shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])]))
    print(*hardware(), sep="\n")
    engine = build_engine(args)
    workload = (f"one request prefilling {args.prefill_chunk}-token chunks at {args.context} tokens"
                if args.prefill_chunk else f"{args.batch} sequences decoding at {args.context} tokens")
    print(f"{args.model} {args.dtype}, attention {engine.executor.spec.attention}, {workload}, {args.steps} steps "
          f"(jax {jax.__version__})")
    print(profile_steps(engine, args.steps, args.trace_dir).table(args.top))
