"""nanoGPT's train step at the GPT-2 124M shape, timed the way `benchmarks/bench.py` times ours.

    python benchmarks/nanogpt_step.py --nanogpt DIR [--batch 12] [--steps 20] [--warmup 3]
        [--json PATH]

The peer of `python -m benchmarks.bench configs/gpt2-124m.yaml` on the same GPU: it needs PyTorch
with CUDA and a checkout of nanoGPT (github.com/karpathy/nanoGPT; DIR holds its `model.py`), and
imports nothing of jaxpar. Nothing is installed or copied: nanoGPT's own `GPT` and
`configure_optimizers` are used as its `train.py` uses them for GPT-2 124M (12 layers, 12 heads,
768 wide, vocab 50304, context 1024, no dropout, no biases), with `torch.compile`, bfloat16
autocast, fused AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1) and gradient clipping at 1.0.

Timing as bench.py: random tokens, a fresh batch per step already on the GPU; W warm-up steps
(the first one compiles); then N steps, each ended by `torch.cuda.synchronize()`, so a step time
is one step's device time plus one host round trip. Prints one JSON object: median / mean / min /
max step time, tokens/s from the median and from the mean, peak memory allocated, versions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", required=True, help="a nanoGPT checkout (its model.py)")
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="also write the result here")
    return parser.parse_args(argv)


def build(nanogpt: str):
    """nanoGPT's GPT-2 124M and its optimizer, compiled, on the GPU."""
    import torch

    sys.path.insert(0, nanogpt)
    from model import GPT, GPTConfig  # nanoGPT's model.py

    config = GPTConfig(
        block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, dropout=0.0, bias=False
    )
    model = GPT(config).to("cuda")
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cuda")
    return torch.compile(model), optimizer


def timed_steps(model, optimizer, batch: int, steps: int, warmup: int) -> list[float]:
    """Seconds of each timed step (after `warmup` untimed ones)."""
    import torch

    seq = 1024  # the GPT-2 context, as in build()
    generator = torch.Generator(device="cuda").manual_seed(0)

    def tokens():
        return torch.randint(0, 50304, (batch, seq + 1), device="cuda", generator=generator)

    times = []
    for i in range(warmup + steps):
        row = tokens()
        x, y = row[:, :-1].contiguous(), row[:, 1:].contiguous()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True  # as nanoGPT's train.py sets them
    torch.backends.cudnn.allow_tf32 = True
    model, optimizer = build(args.nanogpt)
    start = time.perf_counter()
    times = timed_steps(model, optimizer, args.batch, args.steps, args.warmup)
    tokens = args.batch * 1024
    median, mean = statistics.median(times), statistics.fmean(times)
    result = {
        "what": "nanoGPT (torch.compile, bf16 autocast, fused AdamW)",
        "batch": args.batch,
        "seq_len": 1024,
        "steps": args.steps,
        "warmup": args.warmup,
        "step_ms": {
            k: round(1e3 * v, 2)
            for k, v in {"median": median, "mean": mean, "min": min(times), "max": max(times)}.items()
        },
        "tokens_per_sec": round(tokens / median),
        "tokens_per_sec_mean": round(tokens / mean),
        "wall_s": round(time.perf_counter() - start, 1),
        "peak_memory_bytes": torch.cuda.max_memory_allocated(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
