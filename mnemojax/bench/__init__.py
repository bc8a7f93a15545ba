"""Benchmarks and profiling tools (the logic behind `scripts/`): they measure the engine, the server and
the kernels; nothing in the engine imports them."""
import os
import platform
import sys


def parse_with_small(parser, argv, small: dict):
    """`parser.parse_args(argv)`; with `--small`, every option the command line left at its default takes its value
    from `small` (tiny shapes that run on a CPU)."""
    args = parser.parse_args(argv)
    if args.small:
        for k, v in small.items():
            if getattr(args, k) == parser.get_default(k):
                setattr(args, k, v)
    return args


def print_header(argv) -> None:
    """Prints the command line (`argv`, None: the process's) and the hardware, as every benchmark's output begins."""
    import jax

    print("command: " + " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])))
    print(f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; jax {jax.__version__} "
          f"on {jax.devices()[0].platform} ({len(jax.devices())} devices)")
