"""The short bench of scripts/gpu_check.sh: plain vs speculative tokens/s, host reads per
round, and greedy identity, on one device; then batches of 8 prompts.

    python scripts/gpu_check.py --device cuda --target smollm2-135m --tokens 64

Prints one line per (dtype, drafter), a line per batched method (float32, ngram: 8
prompts one after another on ``pipe.generate`` against ``generate_batch`` at batch 8,
plain and speculative) and a last line ``gpu_check bench: ok`` when every greedy
speculative output and every batched row equals single-request plain decoding token for
token (in float32; bfloat16 is ``approximate`` and only reported). Exit status 1 on a
float32 mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from specgen.bench.host_reads import counting_reads

PROMPT = "Write a short story about a robot who learns to paint. Repeat the title at the end."


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def reads_per_round(pipe, prompt_ids: list[int], gamma: int, rounds: int = 5) -> float:
    from specgen.engine.round import speculative_round

    request, ctx = pipe.open_request(prompt_ids, max_new_tokens=gamma * (rounds + 3) + 8, seed=0)
    speculative_round(request, ctx, gamma)
    total = 0
    for _ in range(rounds):
        with counting_reads() as count:
            speculative_round(request, ctx, gamma)
        total += count[0]
    return total / rounds


def timed(pipe, prompt_ids: list[int], tokens: int, speculative: bool, device: str) -> tuple[float, list[int]]:
    _synchronize(device)
    start = time.perf_counter()
    gen = pipe.generate(prompt_ids=prompt_ids, max_new_tokens=tokens, seed=0, speculative=speculative)
    _synchronize(device)
    return len(gen.token_ids) / (time.perf_counter() - start), gen.token_ids


def batched(pipe, prompts: list[list[int]], tokens: int, device: str) -> bool:
    """Batch 8 against one at a time, plain and speculative; -> every greedy row equal."""
    rows = [{"prompt_ids": ids, "seed": 0} for ids in prompts]
    pipe.generate_batch(rows[:2], batch_size=2, max_new_tokens=4)  # warm-up (batched kernels)
    _synchronize(device)
    start = time.perf_counter()
    single = [list(pipe.generate(**row, max_new_tokens=tokens, speculative=False).token_ids) for row in rows]
    _synchronize(device)
    one = sum(map(len, single)) / (time.perf_counter() - start)
    ok = True
    for speculative in (False, True):
        _synchronize(device)
        start = time.perf_counter()
        gens = pipe.generate_batch(rows, batch_size=8, max_new_tokens=tokens, speculative=speculative)
        _synchronize(device)
        rate = sum(len(g.token_ids) for g in gens) / (time.perf_counter() - start)
        same = [list(g.token_ids) for g in gens] == single
        ok &= same
        print(f"{device} batch 8 {'speculative' if speculative else 'plain':11s} {rate:7.1f} tokens/s "
              f"(x{rate / one:.2f} plain one at a time, {one:.1f} tokens/s)  rows = single: {same}", flush=True)
    return ok


def bench(target: str, drafters: list[str], device: str, dtypes: list[str], tokens: int, gamma: int) -> bool:
    import specgen

    ok = True
    for dtype in dtypes:
        for drafter in drafters:
            pipe = specgen.pipeline(f"target={target}", f"drafter={drafter}", f"device={device}", f"dtype={dtype}",
                                    f"drafter.num_tokens={gamma}", "sampling.temperature=0", "threads=auto",
                                    progress=False)
            ids = pipe.encode(PROMPT) if target != "tiny" else [1, 2, 3, 4, 1, 2, 3, 4]
            timed(pipe, ids, 8, True, device)  # warm-up (kernels, caches)
            plain, plain_ids = timed(pipe, ids, tokens, False, device)
            spec, spec_ids = timed(pipe, ids, tokens, True, device)
            same = spec_ids == plain_ids
            reads = {}
            for read_once in (True, False):  # the device's default first (Pipeline.read_once), then the CPU's
                pipe.read_once = read_once
                reads[read_once] = reads_per_round(pipe, ids, gamma)
            pipe.read_once = torch.device(device).type != "cpu"
            if dtype == "float32" and not same:
                ok = False
            print(f"{device} {dtype:8s} {drafter:7s} plain {plain:7.1f} tokens/s  speculative {spec:7.1f} tokens/s "
                  f"(x{spec / plain:.2f})  reads/round {reads[True]:.1f} (read_once; CPU rounds {reads[False]:.1f})  "
                  f"greedy identical: {same}  [{pipe.guarantee}]",
                  flush=True)
            if dtype == "float32" and drafter == "ngram":
                prompts = [ids + ids[: 1 + i] for i in range(8)]  # ragged lengths
                ok &= batched(pipe, prompts, tokens, device)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--target", default="smollm2-135m", help="a conf/target name; tiny when it cannot load")
    parser.add_argument("--drafters", default="ngram,eagle")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    args = parser.parse_args(argv)
    from specgen.errors import SpecgenError

    target, drafters = args.target, args.drafters.split(",")
    if target != "tiny":
        try:
            import specgen

            specgen.pipeline(f"target={target}", "drafter=none", f"device={args.device}", progress=False)
        except SpecgenError as exc:
            print(f"gpu_check bench: target={target} cannot load ({exc}); using target=tiny", flush=True)
            target = "tiny"
    if target == "tiny":
        drafters = [d for d in drafters if d in ("ngram", "tiny")] or ["ngram"]
    ok = bench(target, drafters, args.device, args.dtypes.split(","), args.tokens, args.gamma)
    print(f"gpu_check bench: {'ok' if ok else 'FLOAT32 GREEDY MISMATCH'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
