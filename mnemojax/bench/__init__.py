"""Benchmarks and profiling tools (the logic behind `scripts/`): they measure the engine, the server and
the kernels; nothing in the engine imports them."""


def parse_with_small(parser, argv, small: dict):
    """`parser.parse_args(argv)`; with `--small`, every option the command line left at its default takes its value
    from `small` (tiny shapes that run on a CPU)."""
    args = parser.parse_args(argv)
    if args.small:
        for k, v in small.items():
            if getattr(args, k) == parser.get_default(k):
                setattr(args, k, v)
    return args
